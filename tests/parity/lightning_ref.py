"""Lightning's Trainer as a second reference for trainscope's ddp cells (and its zero3 cell).

`Trainer(accelerator="cpu", devices=2, strategy="ddp", precision=...)`, the line people copy from
guides, trains a LightningModule around the same parity model from the same weights on the same
per-rank batches (the cell's precision: 32-true or bf16-mixed). The ranks are started here, one
process each with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* set, so Lightning joins them (its
environment sees processes created outside it) instead of re-running this script. Compared: the
parameters after K steps and the loss at each step; the row also says what `accelerator="auto"`
resolves to on this machine. A zero3 cell meets Lightning's `ModelParallelStrategy` (its `fsdp`
strategy refuses a CPU) with FSDP2's `fully_shard` per block and at the root in `configure_model`,
as its documentation shows it.
"""
import os
import socket
import statistics
import time
import warnings

import torch

lightning = None  # imported on first use: every spawned rank of the other rows imports this module


def _load():
    """Imports Lightning once; None when the package is missing (its rows are skipped, never a crash)."""
    global lightning
    if lightning is None:
        try:
            import lightning.pytorch  # noqa: F401  (the Trainer lives here)
            import lightning as module
        except ImportError:
            return None
        lightning = module
    return lightning


def available():
    return _load() is not None


def version():
    return _load().__version__


def quiet():
    import logging
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_utilities"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(cell, dump, rank, world, ref, sharded=False):
    cfg = cell["config"]

    class Module(_load().pytorch.LightningModule):
        def configure_model(self):
            if not sharded:
                return
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for b in ref.blocks_of(self.model.model):
                fully_shard(b, mesh=mesh, reshard_after_forward=True)
            fully_shard(self.model, mesh=mesh, reshard_after_forward=True)

        def __init__(self):
            super().__init__()
            self.model = ref.build_model(cell, float(cfg.get("dropout", 0.0)))
            ref.load_named(self.model, dump["initial"])
            if sharded:  # the loss behind __call__, so that the root unit's FSDP2 hooks gather its parameters
                self.model = ref.LossModule(self.model)
            self.losses, self.times, self._t0 = [], [], None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x[0], y[0]) if sharded else self.model.loss(x[0], y[0])

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 0:
                torch.set_rng_state(dump["rng_state"])  # the dropout masks trainscope's step 0 drew
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx >= int(cfg.get("warmup_steps", 0)):
                self.times.append(time.perf_counter() - self._t0)
            self.losses.append(outputs["loss"].detach().to(torch.float64))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=float(cfg.get("lr", 1e-3)), momentum=0.9,
                                   weight_decay=float(cfg.get("weight_decay", 0.0)), foreach=False)

        def train_dataloader(self):
            batch = dump["inputs"].shape[1] // world
            xs = dump["inputs"].narrow(1, rank * batch, batch)
            ys = dump["targets"].narrow(1, rank * batch, batch)
            # One step's rank-local batch per item, in order (no sampler of Lightning's own).
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=1, shuffle=False)

    return Module()


def _rank_main(rank, world, cell, dump_path, port, out_dir, precision, sharded=False):
    import reference as ref
    quiet()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    threads = int(cell.get("threads") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    dump = ref.load_dump(dump_path)
    module = _module(cell, dump, rank, world, ref, sharded)
    strategy = "ddp"
    if sharded:
        from lightning.pytorch.strategies import ModelParallelStrategy
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    trainer = _load().pytorch.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision=precision,
                      max_steps=int(dump["inputs"].shape[0]), logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                      num_sanity_val_steps=0)
    try:
        trainer.fit(module)
        losses = torch.stack(module.losses)
        torch.distributed.all_reduce(losses)
        losses /= world
        # Sharded parameters are DTensors: gathered whole (a collective, every rank in the same order).
        final = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                 for k, p in ref.trainscope_parameters(module.model)}
        torch.save({"final": final, "losses": losses.tolist(),
                    "step_time_p50_s": statistics.median(module.times) if module.times else None,
                    "resolved": {"strategy": type(trainer.strategy).__name__,
                                 "accelerator": type(trainer.accelerator).__name__,
                                 "precision": type(trainer.precision_plugin).__name__,
                                 "backend": torch.distributed.get_backend()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.barrier()  # no rank tears its process group down while another still talks to it
    finally:
        # Lightning leaves the process group up after fit; Gloo's threads alive at exit abort the process.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def auto_resolves_to():
    """What `Trainer(accelerator="auto")` picks on this machine (one process, nothing trained)."""
    quiet()
    t = _load().pytorch.Trainer(accelerator="auto", devices="auto", logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False)
    return {"accelerator": type(t.accelerator).__name__, "strategy": type(t.strategy).__name__,
            "devices": t.num_devices, "precision": type(t.precision_plugin).__name__}


def row(cell, dump, dump_path, lib):
    """The Lightning reference row of one ddp (or zero3) cell, in reference.py's row format."""
    import reference as ref
    cfg = cell["config"]
    precision = cfg.get("precision", "32-true")
    world = int(cfg.get("world_size", 1))
    kind = cfg.get("parallel", "ddp")
    sharded = kind == "zero3"
    strategy = (f"ModelParallelStrategy(data_parallel_size={world}, tensor_parallel_size=1) with fully_shard per block "
                "and at the root in configure_model" if sharded else "'ddp'")
    out = {"engine": "lightning", "technique": kind,
           "reference": f"Lightning {version()} Trainer(accelerator='cpu', devices={world}, strategy={strategy}, "
                        f"precision='{precision}')"}
    runs = ref.spawn_ranks(_rank_main, lambda tmp: (world, cell, str(dump_path), free_port(), tmp, precision, sharded),
                           world, cell["name"])
    if runs[0].get("attempts", 1) > 1:
        out["reference_attempts"] = runs[0]["attempts"]
    out["checks"] = ref.compare_training(cell, dump, runs, kind)
    out["resolved"] = runs[0]["resolved"]
    if not sharded:
        out["auto_resolves_to"] = auto = auto_resolves_to()
        out["reference"] += (f"; accelerator='auto' resolves to {auto['accelerator']} with {auto['strategy']} and "
                             f"{auto['devices']} device(s) on this machine")
    ours_t = (cell["metrics"].get("timing", {}).get("step_time_s") or {}).get("p50")
    theirs_t = runs[0]["step_time_p50_s"]
    out["step_time_s"] = {"trainscope": ours_t, "pytorch": theirs_t,
                          "ratio": ours_t / theirs_t if ours_t and theirs_t else None}
    out["verdict"] = "differs" if any(c["verdict"] == "differs" for c in out["checks"]) else "pass"
    return out
