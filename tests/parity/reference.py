"""PyTorch's own implementations, run on what trainscope ran: the parity references.

    python reference.py --report RESULTS/report.json --out RESULTS/parity.json [--accounting LIB]

For every ok cell of the report that left a parity dump (`parity_dump = true`: initial weights, the
global batch of every step, the CPU generator's state before step 0, the final weights, the step
losses, the loss-scale trajectory, the block output dtypes), this script trains the same model from
the same weights on the same data with PyTorch's implementation of the cell's technique and writes
the comparison: each compared quantity with both sides' values, the difference, the tolerance and a
verdict (exact | within | design-difference | differs), plus both step times and their ratio.

Memory is counted the way trainscope counts it: `--accounting` is trainscope's accounting allocator
(libtrainscope_accounting.so), installed here as torch's CPU allocator, so both sides' bytes are bytes
live in CPU tensor storage counted by the same code; model-state bytes are the unique storages behind
the parameters, gradients and optimizer states (local shards where sharded).

A tensor-parallel cell (config tp > 1, with or without sequence_parallel, alone or under FSDP over the
data-parallel group) is replayed by DTensor TP on as many ranks and by a one-process emulation of the same
arithmetic, trainscope's numbers compared against both (tp_ref.py).

Zero and ddp cells get one more row each from the systems people name (`engines`): DeepSpeed's ZeRO
engine (deepspeed_ref.py) and Lightning's Trainer (lightning_ref.py). An SSL cell's row compares its
objectives with lightly's losses on the fixed tensors its dump carries (ssl_ref.py). A row whose
package is missing is skipped with one line.

Only the wheel's torch and the reference packages installed into its environment are used. Exit
status: 0 when every comparison passes, 1 when one differs, 2 on bad input (one line on stderr).
"""
import argparse
import ctypes
import faulthandler
import gc
import inspect
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.jit._pickle  # noqa: F401  (the type-tag global of LibTorch-written dumps)
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import blocks_of, make_model, CheckpointPolicy, PRESETS  # noqa: E402
import hf_llama  # noqa: E402
import deepspeed_ref  # noqa: E402
import lightning_ref  # noqa: E402
import ssl_ref  # noqa: E402
import tp_ref  # noqa: E402
import pp_ref  # noqa: E402


def is_llama(cell):
    return (cell.get("model") or {}).get("shape", {}).get("family") == "llama"


def build_model(cell, dropout=0.0):
    """The Python side of a cell's model: the mirror in models.py, or HF's LlamaForCausalLM for llama."""
    if is_llama(cell):
        shape = cell["model"]["shape"]
        return hf_llama.HfLlama(shape, shape.get("attention", "eager"))
    return make_model(cell["config"]["model"], dropout)


def trainscope_parameters(module):
    """(trainscope's name, parameter) pairs: HF's names mapped (hf_llama.trainscope_name), others as they are."""
    for k, p in module.named_parameters():
        k = re.sub(r"^(module\.)?(model\.)?", "", k)
        if k.startswith("lm."):
            k = hf_llama.trainscope_name(k[3:])
        yield k, p


class InputError(Exception):
    pass


# ---- the accounting allocator ---------------------------------------------------------------------
class Accounting:
    """trainscope's accounting allocator through its C interface; a no-op when not given."""

    def __init__(self, path):
        self.lib = None
        if path:
            self.lib = ctypes.CDLL(path)
            for f in ("current", "peak"):
                getattr(self.lib, f"trainscope_accounting_{f}").restype = ctypes.c_int64
            self.lib.trainscope_accounting_install()

    def current(self):
        return self.lib.trainscope_accounting_current() if self.lib else None

    def peak(self):
        return self.lib.trainscope_accounting_peak() if self.lib else None

    def reset_peak(self):
        if self.lib:
            self.lib.trainscope_accounting_reset_peak()


def storage_bytes(tensors):
    """Bytes of the unique storages behind `tensors` (suites/parallel/strategies.cpp's storage_bytes)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() not in seen and s.nbytes() > 0:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


# ---- comparisons ----------------------------------------------------------------------------------
def tensor_check(name, ours, theirs, tolerance=0.0, why_tolerance=None):
    """Named tensors on both sides: bit-for-bit, or the largest absolute difference against `tolerance`."""
    missing = sorted(set(ours) ^ set(theirs))
    if missing:
        return {"name": name, "verdict": "differs", "note": "names on one side only: " + ", ".join(missing[:5])}
    worst, worst_name, equal = 0.0, None, True
    for k in ours:
        a, b = ours[k].to(torch.float64), theirs[k].to(torch.float64)
        if a.shape != b.shape:
            return {"name": name, "verdict": "differs", "note": f"{k}: shape {list(a.shape)} against {list(b.shape)}"}
        if not torch.equal(ours[k], theirs[k].to(ours[k].dtype)):
            equal = False
            d = (a - b).abs().max().item()
            if d > worst or worst_name is None:
                worst, worst_name = d, k
    count = f"{len(ours)} tensors, {sum(t.numel() for t in ours.values())} values"
    out = {"name": name, "tensors": len(ours), "trainscope": count, "pytorch": count}
    if equal:
        out.update(verdict="exact", difference=0.0, tolerance=0.0)
        return out
    out.update(difference=worst, worst=worst_name, tolerance=tolerance,
               verdict="within" if worst <= tolerance else "differs")
    if why_tolerance:
        out["tolerance_from"] = why_tolerance
    return out


def value_check(name, ours, theirs, tolerance=0.0, design=None, relative=False):
    """Two numbers (or lists): exact, within `tolerance`, or a stated design difference."""
    out = {"name": name, "trainscope": ours, "pytorch": theirs}
    if ours == theirs:
        out.update(verdict="exact", difference=0)
        return out
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        diff = abs(ours - theirs) / (abs(theirs) if relative and theirs else 1.0)
        out["difference"] = diff
        out["ratio"] = ours / theirs if theirs else None
        if diff <= tolerance:
            out.update(verdict="within", tolerance=tolerance)
            return out
    out["verdict"] = "design-difference" if design else "differs"
    if design:
        out["note"] = design
    return out


def named(module):
    """name -> detached CPU tensor, with wrapper prefixes (DDP's `module.`, ours `model.`) removed."""
    out = {}
    for k, p in trainscope_parameters(module):
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[k] = t.detach().clone()
    return out


def load_named(model, state):
    missing = [k for k, _ in trainscope_parameters(model) if k not in state]
    if missing:
        raise InputError("the parity dump has no tensor " + missing[0])
    with torch.no_grad():
        for k, p in trainscope_parameters(model):
            if tuple(state[k].shape) != tuple(p.shape):
                raise InputError(f"{k}: shape {list(state[k].shape)} in the dump, {list(p.shape)} here")
            p.copy_(state[k])


class LossModule(torch.nn.Module):
    """The model's loss behind __call__, so that DDP's and FSDP2's forward hooks run."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model.loss(x, y)


# ---- one training run, as Trainer::step does it ---------------------------------------------------
def train(cell, dump, strategy, rank=0, world=1, accounting=None):
    cfg = cell["config"]
    threads = int(cell.get("threads") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    model = build_model(cell, float(cfg.get("dropout", 0.0)))
    load_named(model, dump["initial"])
    if is_llama(cell):  # HF's model: trainscope's policies applied per decoder layer (hf_llama.py)
        model.set_checkpoint(cfg.get("checkpoint", "none"))
    else:
        model.policy = CheckpointPolicy(cfg.get("checkpoint", "none"))
    dtypes = {}
    recording = [True]

    def boundary(name, x):
        if recording[0]:
            dtypes[name] = str(x.dtype).replace("torch.", "")
        return x

    model.boundary = boundary
    if cell.get("deepspeed_module_hooks"):  # the replica of DeepSpeed's stage 3 (deepspeed_ref.module_hooks)
        deepspeed_ref.module_hooks(model)
    wrapped = LossModule(model)
    comm = CommCounter() if world > 1 else None
    lr, wd = float(cfg.get("lr", 1e-3)), float(cfg.get("weight_decay", 0.0))
    if cfg.get("optimizer", "adamw") != "sgd":
        raise InputError("the parity references replay optimizer = sgd (PyTorch's AdamW updates through lerp_, "
                         "LibTorch's C++ AdamW through mul_/add_: the same maths, not the same bits)")
    for key, plain in (("lr_schedule", "constant"), ("grad_clip", 0.0), ("augment", False)):
        if cfg.get(key, plain) != plain:
            raise InputError(f"the parity references replay {key} = {plain!r} only, not {cfg.get(key)!r}")
    if not str(cell.get("device", "cpu")).startswith("cpu"):
        raise InputError(f"the parity references run on CPU; this cell ran on {cell.get('device')}")
    # momentum: 0.9 as trainscope's SGD; a replica row may override it (bf16_true_checks)
    sgd = dict(lr=lr, momentum=float(cell.get("reference_momentum", 0.9)), weight_decay=wd, foreach=False)
    precision = cfg.get("precision", "32-true")
    master = precision == "bf16-master"
    if precision == "bf16-true":  # the model cast to bf16: no fp32 copy anywhere
        model.to(torch.bfloat16)
    if precision == "bf16-master":
        wrapped = bf16_master(cfg, model, wrapped, strategy, world)
    elif strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        wrapped = DDP(wrapped, bucket_cap_mb=float(cfg.get("bucket_mb", 25.0)), gradient_as_bucket_view=True,
                      broadcast_buffers=False)
    elif strategy in ("zero2", "zero3"):
        from torch.distributed.fsdp import fully_shard
        reshard = strategy == "zero3"
        for b in blocks_of(model):
            fully_shard(b, reshard_after_forward=reshard)
        fully_shard(wrapped, reshard_after_forward=reshard)
    elif strategy == "hsdp":
        # HSDP as FSDP2 does it: a 2-D mesh, sharded along "shard" (trainscope's shard group: consecutive
        # ranks), replicated along "replicate"; 0 means one node's ranks, and local ranks share one node.
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        shard = int(cfg.get("hsdp_shard_size", 0)) or world
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        for b in blocks_of(model):
            fully_shard(b, mesh=mesh, reshard_after_forward=True)
        fully_shard(wrapped, mesh=mesh, reshard_after_forward=True)
    if strategy == "zero1" and precision != "bf16-master":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(wrapped.parameters(), optimizer_class=torch.optim.SGD, **sgd)
    else:
        opt = torch.optim.SGD(wrapped.parameters(), **sgd)

    if precision == "bf16-mixed":
        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    elif precision in ("32-true", "bf16-true", "bf16-master"):  # bf16-master: FSDP2 casts, no autocast
        autocast = nullcontext
    else:
        raise InputError(f"no training reference for precision {precision} (the scaler row replays its pattern)")
    multiplier = float(cfg.get("loss_multiplier", 1.0))
    warmup = int(cfg.get("warmup_steps", 0))
    inputs, targets = dump["inputs"], dump["targets"]
    total = inputs.shape[0]
    batch = inputs.shape[1] // world
    acc = accounting or Accounting(None)
    times, losses, activation, first_grads = [], [], 0, None
    run_start, run_peak = acc.current(), 0
    # Each phase's peak over the step's start (forward with zero_grad, backward with the reductions
    # the strategy runs in it, the optimizer's step), the largest over the steps as the activation bytes
    # are, and the absolute phase peaks as trainscope's memory probe records them (phase_peak_bytes).
    phases = {"forward": 0, "backward": 0, "optimizer": 0}
    absolute = {"forward": 0, "backward": 0, "optimizer": 0}
    per_step = []
    # No cyclic garbage collection inside the steps: a collection in the middle of a step would free
    # garbage of earlier rows (or steps) and move the peaks by whatever it held.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for s in range(total):
            x = inputs[s].narrow(0, rank * batch, batch).contiguous()
            y = targets[s].narrow(0, rank * batch, batch).contiguous()
            if s == 0:
                torch.set_rng_state(dump["rng_state"])  # dropout masks from the state trainscope's step 0 saw
            if comm:
                comm.measuring = s >= warmup
            t0 = time.perf_counter()
            if master:  # FSDP2's zero_grad frees the gradients: before the step's start, so that every step
                opt.zero_grad(set_to_none=True)  # starts as step 0 does (trainscope's stay allocated, zeroed)
            start = acc.current()
            acc.reset_peak()
            if not master:
                opt.zero_grad(set_to_none=strategy not in ("ddp", "zero1"))
            with autocast():
                loss = wrapped(x, y)
            peaks = {}
            if start is not None:
                peaks["forward"] = acc.peak()
                activation = max(activation, peaks["forward"] - start)
                acc.reset_peak()
            (loss * multiplier if multiplier != 1.0 else loss).backward()
            if start is not None:
                peaks["backward"] = acc.peak()
                acc.reset_peak()
            if s == 0 and world == 1:
                first_grads = {k: p.grad.detach().clone() for k, p in trainscope_parameters(model) if p.grad is not None}
            opt.step()
            elapsed = time.perf_counter() - t0
            if start is not None:
                peaks["optimizer"] = acc.peak()
                run_peak = max(run_peak, max(peaks.values()) - run_start)
                for k, v in peaks.items():
                    absolute[k] = max(absolute[k], v)
                    phases[k] = max(phases[k], v - start)
                per_step.append({"start": start, **{k: v - start for k, v in peaks.items()}})
            recording[0] = False
            if s >= warmup:
                times.append(elapsed)
            losses.append(loss.detach().to(torch.float64))
            if master:  # not alive into the next step's start (every step then starts as step 0)
                del loss
    finally:
        if collecting:
            gc.enable()
    if comm:
        comm.measuring = False
    state = model_state(wrapped, opt, strategy)
    final = named(wrapped)  # FSDP2: full_tensor() gathers, on every rank
    loss_t = torch.stack(losses)
    if world > 1:
        dist.all_reduce(loss_t)
        loss_t /= world
    return {"final": final, "losses": loss_t.tolist(), "first_grads": first_grads, "dtypes": dtypes,
            "step_time_p50_s": statistics.median(times) if times else None, "activation_bytes": activation
            if acc.lib else None, "model_state": state,
            "comm_bytes_per_step": comm.per_step(total - warmup) if comm else None,
            "peak_above_start_bytes": run_peak if acc.lib else None,
            "phase_peak_over_step_start": phases if acc.lib else None,
            "phase_peak_bytes": absolute if acc.lib else None,
            "phase_peak_mode": {k: statistics.mode(m[k] for m in per_step) for k in phases} if per_step else None,
            "per_step_memory": per_step if os.environ.get("TRAINSCOPE_PARITY_STEP_MEMORY") else None}


def reduce_dtype_of(cfg):
    return torch.bfloat16 if cfg.get("reduce_dtype", "fp32") == "bf16" else torch.float32


def bf16_master(cfg, model, wrapped, strategy, world):
    """bf16-master as PyTorch trains it: FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=the cell's reduce_dtype) per block and at the root (the fp32 shards cast to bf16 and
    gathered in bf16; forward and backward in bf16 with no autocast; the bf16 gradients copied into a
    reduce_dtype buffer and reduced with AVG; the optimizer steps the fp32 shards). ddp is FSDP2's
    replicate (torch.distributed._composable.replicate_with_fsdp) with the same policy; zero1 and zero2
    are fully_shard(reshard_after_forward=False), whose numerics do not depend on resharding (one
    micro-batch per step); zero3 and hsdp take the cell's reshard_after_forward for the blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if world < 2:
        raise InputError("the bf16-master references run on 2 or more ranks (FSDP2's MixedPrecisionPolicy)")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype_of(cfg))
    units = list(blocks_of(model)) + [wrapped]
    if strategy == "ddp":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("replicate",))
        for u in units:
            replicate(u, mesh=mesh, mp_policy=mp)
        return wrapped
    how = str(cfg.get("reshard_after_forward", "true"))
    reshard = {"true": True, "false": False}.get(how)
    if reshard is None:
        reshard = int(how)
    if strategy in ("zero1", "zero2"):
        reshard = False
    if strategy == "hsdp":
        shard = int(cfg.get("hsdp_shard_size", 0)) or world
        mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for b in blocks_of(model):
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    # The root at FSDP2's default (None: its lazy init keeps the root gathered from forward to the end of
    # backward), which is trainscope's root unit; zero1/zero2 keep everything gathered until backward.
    fully_shard(wrapped, mesh=mesh, reshard_after_forward=None if reshard is not False else False, mp_policy=mp)
    return wrapped


def model_state(wrapped, opt, strategy):
    params = list(wrapped.parameters())
    states = []
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer's local optimizer
    for st in inner.state.values():
        states.extend(v for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return {"params": storage_bytes(params), "grads": storage_bytes([p.grad for p in params]),
            "optimizer": storage_bytes(states)}


class CommCounter:
    """Bytes through torch.distributed's collectives per measured step, with nccl-tests' sizes (the
    full buffer: the output of an all-gather, the input of a reduce-scatter), as trainscope's comm
    probe records them. DDP's reducer calls the process group from C++, out of this counter's sight."""

    def __init__(self):
        self.measuring, self.bytes, self.calls = False, {}, {}
        for op, arg in (("all_gather_into_tensor", "output_tensor"), ("reduce_scatter_tensor", "input"),
                        ("all_reduce", "tensor"), ("broadcast", "tensor")):
            self._wrap(op, arg)

    def _wrap(self, op, arg):
        real = getattr(dist, op)
        signature = inspect.signature(real)
        name = {"all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
                "all_reduce": "all-reduce", "broadcast": "broadcast"}[op]

        def counted(*args, **kwargs):
            if self.measuring:
                t = signature.bind(*args, **kwargs).arguments[arg]
                self.bytes[name] = self.bytes.get(name, 0) + t.numel() * t.element_size()
                key = f"{name} {t.numel()} x {str(t.dtype).replace('torch.', '')}"
                self.calls[key] = self.calls.get(key, 0) + 1
            return real(*args, **kwargs)

        setattr(dist, op, counted)

    def per_step(self, steps):
        return {k: v / max(steps, 1) for k, v in self.bytes.items()}


def load_dump(path):
    """A dump written by LibTorch's pickle_save: plain containers and tensors, plus the type tags
    TorchScript's pickler adds to typed dicts (the one global allowed beyond the defaults)."""
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        return torch.load(path, weights_only=True)


def _rank_main(rank, world, cell, dump_path, strategy, lib, out_dir):
    faulthandler.enable()  # a rank that aborts says where
    acc = Accounting(lib)  # before any tensor of this process
    # A file store in the run's own folder: no port to find free and race for.
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "store"), rank=rank,
                            world_size=world)
    try:
        dump = load_dump(dump_path)
        result = train(cell, dump, strategy, rank, world, acc)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears its process group down while another still talks to it
    finally:
        dist.destroy_process_group()


def spawn_ranks(main, args_for, world, name):
    """`main(rank, *args_for(tmp))` on `world` local processes; each leaves rank<r>.pt in tmp, returned
    in rank order. One retry: Gloo on a loaded 2-core machine has aborted a rank at start-up now and
    then ("terminate called without an active exception"); runs[0]["attempts"] says when it was needed.
    The ranks are forked from a server that imported this module (and torch) once, before any thread
    started: a fresh interpreter per rank spent ~1.5 s of a 2-core machine importing torch again."""
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.start_processes(main, args=args_for(tmp), nprocs=world, start_method="forkserver")
            except mp.ProcessExitedException as e:
                if attempt == 2:
                    raise
                print(f"{name}: reference rank died ({e}); retrying once", file=sys.stderr, flush=True)
                continue
            runs = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(world)]
            runs[0]["attempts"] = attempt
            return runs


def train_ranks(cell, dump_path, strategy, world, lib):
    """The reference on `world` local ranks over Gloo."""
    return spawn_ranks(_rank_main, lambda tmp: (world, cell, str(dump_path), strategy, lib, tmp), world, cell["name"])


# ---- the rows of the parity table -----------------------------------------------------------------
REFERENCES = {
    "single": "the same modules in PyTorch, torch.optim.SGD(foreach=False)",
    "ddp": "torch.nn.parallel.DistributedDataParallel (same bucket_cap_mb, gradient_as_bucket_view=True)",
    "zero1": "DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer(SGD)",
    "zero2": "FSDP2 fully_shard(reshard_after_forward=False) per block and at the root",
    "zero3": "FSDP2 fully_shard(reshard_after_forward=True) per block and at the root",
    "hsdp": "FSDP2 fully_shard on a 2-D DeviceMesh (replicate x shard) per block and at the root",
    "checkpoint": "torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True) per checkpointed block",
    "scaler": "torch.amp.GradScaler('cpu') driven through trainscope's inf/NaN pattern",
    "bf16-mixed": "torch.autocast('cpu', dtype=torch.bfloat16)",
    "bf16-true": "the same modules cast to bf16 (model.to(torch.bfloat16)), torch.optim.SGD(foreach=False) on the bf16 parameters",
    "ssl": "lightly's SSL losses on the same tensors",
    "tp": ("torch.distributed.tensor.parallel.parallelize_module on a DeviceMesh ('tp', or ('dp', 'tp') with tp innermost): "
           "embedding RowwiseParallel(input_layouts=Replicate()) (vocabulary-parallel), one PrepareModuleInput per "
           "attention and per MLP, q/k/v and gate/up ColwiseParallel, o_proj and down_proj RowwiseParallel, lm_head "
           "ColwiseParallel(output_layouts=Shard(-1)) into F.cross_entropy under loss_parallel(); with sequence_parallel "
           "the norms SequenceParallel and the boundaries on Shard(1); on the 2-D mesh FSDP2 fully_shard per decoder "
           "layer and at the root on 'dp' after TP (torchtitan's order); gradients to their parameters' placements "
           "before torch.optim.SGD(foreach=False); beside it, the one-process emulation of the same arithmetic "
           "(tp_ref.emulate_tp)"),
    "pp": ("torch.distributed.pipelining's schedule of the same name (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, "
           "scale_grads=True) over PipelineStage modules of HF's layers cut as trainscope cuts them, on pp Gloo ranks, "
           "torch.optim.SGD(foreach=False) on each rank's stages (pp_ref.py)"),
}

# bf16-master (fp32 masters, bf16 compute copies, gradients reduced in reduce_dtype): FSDP2's
# MixedPrecisionPolicy on every strategy (bf16_master()).
MASTER_REFERENCES = {
    "ddp": "FSDP2's replicate (torch.distributed._composable.replicate_with_fsdp) per block and at the root",
    "zero1": "FSDP2 fully_shard(reshard_after_forward=False) per block and at the root (the same numerics at one micro-batch per step)",
    "zero2": "FSDP2 fully_shard(reshard_after_forward=False) per block and at the root",
    "zero3": "FSDP2 fully_shard per block (reshard_after_forward=True) and at the root (FSDP2's default: kept gathered until backward ends)",
    "hsdp": "FSDP2 fully_shard on a 2-D DeviceMesh (replicate x shard) per block and at the root (FSDP2's default)",
}

# The checkpoint policies beyond full and every:k.
CHECKPOINT_REFERENCES = {
    "selective-op": ("torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True, early_stop=False) per block with "
                     "torchtitan 0.3.0's SelectiveAC policy through create_selective_checkpoint_contexts (its save list "
                     "and every-second-mm rule, plus aten._scaled_dot_product_flash_attention_for_cpu for a CPU: sac.py)"),
    "selective": ("torch.utils.checkpoint(use_reentrant=False, preserve_rng_state=True) around the attention core "
                  "(HF's attention implementation, from the rotated query, key and value to the heads' output)"),
}


def reference_of(cfg, kind):
    if cfg.get("precision") == "bf16-master" and kind in MASTER_REFERENCES:
        rd = cfg.get("reduce_dtype", "fp32")
        return (MASTER_REFERENCES[kind] + ", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch."
                + ("bfloat16" if rd == "bf16" else "float32") + "), torch.optim.SGD(foreach=False) on the fp32 shards")
    if kind == "checkpoint" and cfg.get("checkpoint") in CHECKPOINT_REFERENCES:
        return CHECKPOINT_REFERENCES[cfg["checkpoint"]]
    return REFERENCES[kind]


def kind_of(cfg):
    if cfg.get("method", "supervised") != "supervised":
        return "ssl"
    if cfg.get("precision") in ("16-mixed",):
        return "scaler"
    if int(cfg.get("tp", 1) or 1) > 1:  # TP alone, or the 2-D row (parallel = zero3 over the dp group)
        return "tp"
    if int(cfg.get("pp", 1) or 1) > 1:
        return "pp"
    if cfg.get("parallel", "single") != "single":
        return cfg["parallel"]
    if cfg.get("checkpoint", "none") != "none":
        return "checkpoint"
    if cfg.get("precision") in ("bf16-mixed", "bf16-true"):
        return cfg["precision"]
    return "single"


def compare_training(cell, dump, runs, kind):
    """What every training row compares: the parameters after K steps and the loss curve."""
    r0 = runs[0]
    steps = dump["inputs"].shape[0]
    checks = []
    ours_final = dict(dump["final"])
    bf16 = cell["config"].get("precision") == "bf16-mixed"
    if bf16:
        # Both sides run the same autocast kernels; where they agree to the bit the tolerance is moot. It
        # is one bf16 rounding (2^-8 relative) of an update of size lr*|g| per step, summed over K steps.
        tol = steps * float(cell["config"].get("lr", 1e-3)) * 2.0 ** -8
        why = f"K={steps} steps x lr x 2^-8 (one bf16 rounding of a unit-size update per step)"
    else:
        tol, why = 0.0, None
    checks.append(tensor_check(f"parameters after {steps} steps", ours_final, r0["final"], tol, why))
    ours_losses = dump["step_losses"].tolist()
    loss_tol = 2.0 ** -7 * max(abs(v) for v in ours_losses) if bf16 else 0.0
    diff = max(abs(a - b) for a, b in zip(ours_losses, r0["losses"])) if len(ours_losses) == len(r0["losses"]) else None
    row = {"name": f"loss at each of {steps} steps", "trainscope": [round(v, 6) for v in ours_losses],
           "pytorch": [round(v, 6) for v in r0["losses"]], "difference": diff}
    if diff == 0:
        row["verdict"] = "exact"
    elif diff is not None and diff <= loss_tol:
        row.update(verdict="within", tolerance=loss_tol,
                   tolerance_from="2^-7 x the largest loss: two bf16 roundings (2^-8 each) of the logits' scale")
    else:
        row.update(verdict="differs", tolerance=loss_tol)
    checks.append(row)
    return checks


def memory_checks(cell, runs, kind):
    """Per-rank model-state bytes, trainscope's against PyTorch's, counted the same way. A difference
    passes as a design difference only where its arithmetic is the stated one."""
    ranks = cell.get("ranks") or [{"rank": 0, "model_state_parts": cell["metrics"]["memory"].get("model_state_bytes")}]
    ours = [((ranks[r] if r < len(ranks) else {}).get("model_state_parts") or {}) for r in range(len(runs))]
    theirs = [run["model_state"] for run in runs]
    world = len(runs)
    master = cell["config"].get("precision") == "bf16-master"
    psi = sum(p.numel() for p in build_model(cell).parameters())
    psi_pad = -(-psi // world) * world  # trainscope's flat buffers: padded to equal slices
    rd = 2 if cell["config"].get("reduce_dtype", "fp32") == "bf16" else 4

    def explained(part):
        a = [o.get(part) for o in ours]
        b = [t[part] for t in theirs]
        if None in a:
            return None
        if master:
            return master_state_design(kind, part, a, b, psi_pad, rd)
        if kind == "zero1" and part == "optimizer" and sum(a) == sum(b):
            return ("ZeroRedundancyOptimizer gives each rank whole parameters (greedy, by size), so the optimizer "
                    "state splits unevenly; trainscope slices one flat buffer into equal shards; the sum over "
                    f"the ranks is the same ({sum(a)} B)")
        if kind == "zero2" and part == "params" and all(x == y * world for x, y in zip(a, b)):
            return ("FSDP2 shards the parameters between steps even with reshard_after_forward=False (it keeps them "
                    "gathered only from forward to backward): 1/N of trainscope's zero2, which is DeepSpeed's "
                    "stage 2 (full parameters on every rank, gradients and optimizer state sharded)")
        return None

    checks = []
    for part in ("params", "grads", "optimizer"):
        why = explained(part)
        for r in range(world):
            checks.append(value_check(f"rank {r} {part} bytes", ours[r].get(part), theirs[r][part], design=why))
    return checks


def master_state_design(kind, part, ours, theirs, psi_pad, rd):
    """bf16-master's model state per rank against FSDP2's (fp32 shards, fp32 shard gradients, SGD momentum
    on the shards): a difference that trainscope's layout predicts to the byte, or None."""
    world = len(ours)
    diff = {o - t for o, t in zip(ours, theirs)}
    if len(diff) != 1:
        return None
    d = diff.pop()
    if kind in ("zero1", "zero2") and part == "params" and d == 2 * psi_pad:
        return (f"trainscope's {kind} keeps the whole model's bf16 compute copy between steps, 2 B x Ψ = {d} B (DeepSpeed's "
                "and Megatron's layout: the slice's fp32 master beside it), and updates it by an all-gather after the "
                "step; FSDP2 (reshard_after_forward=False) holds only the fp32 shards at rest and gathers the bf16 copy "
                "again at each forward")
    if kind == "zero1" and part == "grads":
        full = rd * psi_pad  # the full reduce_dtype gradient buffer; in fp32 the slice's gradient is its view
        if d == full - (4 * psi_pad // world if rd == 4 else 0):
            return (f"trainscope's zero1 keeps a full gradient buffer in reduce_dtype between steps, {rd} B x Ψ = {full} B "
                    "(Megatron's distributed optimizer: 6Ψ + 12Ψ/N with Adam); FSDP2 holds only the fp32 gradient of "
                    "its shards")
    return None


def activation_check(cell, run):
    """The forward's peak over the step's start, both sides counted by the accounting allocator.

    One difference is known to the byte: `scores / math.sqrt(Dh)` in Python dispatches aten::div.Tensor
    with the number wrapped in a 0-dim float64 tensor, which autograd saves for backward (8 bytes per
    attention block that records autograd: every block, also under non-reentrant checkpointing); C++'s
    operator/ dispatches aten::div.Scalar, which saves the number itself."""
    cfg = cell["config"]
    ours, theirs = cell["metrics"]["memory"].get("activation_bytes"), run["activation_bytes"]
    name = "activation bytes (forward peak over the step's start)"
    if is_llama(cell):
        return llama_activation_check(cell, ours, theirs, name)
    family, _, _, layers, *_ = PRESETS[cfg["model"]]
    return wrapped_scalar_check(name, ours, theirs, layers if family == "gpt" else 0, "blocks",
                                "Python passes the attention's 1/sqrt(Dh) as a 0-dim float64 tensor (aten::div.Tensor) "
                                "that autograd saves; C++ dispatches aten::div.Scalar")


def llama_block_lifetime_checks(cell, dump, lib, checks):
    """Under full or op-level checkpointing the forward's peak is transient: it falls inside a block, while
    the block computes (or, below it, at the loss). suites/models/llama.cpp's LlamaBlock keeps each
    intermediate in a named local until the block returns (C++ lifetimes); HF's decoder layer rebinds
    hidden_states, so Python frees each intermediate after its last use. Without checkpointing autograd
    holds them all anyway (the llama rows' bytes are equal); under a checkpoint trainscope's forward peaks
    higher. The replica: PyTorch's same checkpoint over trainscope's block as written
    (hf_llama.block_as_trainscope, on HF's weights, inside HF's model) must train bit for bit and peak at
    trainscope's bytes plus HF's position ids ([1, S] int64, alive in LlamaModel.forward while its layers
    run; trainscope's rope_tables frees its positions when it returns)."""
    act = next((c for c in checks if c["name"].startswith("activation bytes")), None)
    if act is None or act["verdict"] != "differs":
        return checks
    original = hf_llama.HfLlama.set_checkpoint
    hf_llama.HfLlama.set_checkpoint = lambda model, text: original(model, text, as_trainscope=True)
    try:
        replica = train(cell, dump, "single", accounting=Accounting(lib))
    finally:
        hf_llama.HfLlama.set_checkpoint = original
    positions = 8 * cell["model"]["shape"]["seq_len"]
    ours = cell["metrics"]["memory"].get("activation_bytes")
    same = [tensor_check("parameters after the steps: trainscope's block as written (hf_llama.block_as_trainscope) under "
                         "the same checkpoint (right) against trainscope", dict(dump["final"]), replica["final"]),
            value_check("activation bytes: trainscope's block as written under the same checkpoint (right) against "
                        "trainscope", ours, replica["activation_bytes"],
                        design=f"{positions} B: HF's position ids ([1, S] int64), alive in LlamaModel.forward while its "
                               "layers run; trainscope's rope_tables frees its positions when it returns"
                        if replica["activation_bytes"] == ours + positions else None)]
    if all(c["verdict"] in ("exact", "design-difference") for c in same):
        act["verdict"] = "design-difference"
        act["note"] = (f"{act['trainscope'] - act['pytorch']} B more at trainscope's forward peak, which falls inside a "
                       "checkpointed block: trainscope's LlamaBlock holds each intermediate in a named local until the "
                       "block returns, HF's decoder layer frees each after its last use; PyTorch's checkpoint over "
                       "trainscope's block as written reproduces trainscope's bytes (below)")
    return checks + same


def bf16_true_checks(cell, dump, lib, checks):
    """bf16-true trains bf16 parameters with a bf16 momentum buffer. LibTorch's C++ SGD updates it with
    buf.mul_(momentum) on a Scalar, which a bf16 tensor's mul_(Scalar) applies as the momentum rounded to
    bf16 (0.9 -> 0.8984375); PyTorch's SGD, buf.mul_(0.9) from Python, multiplies by 0.9 in fp32
    arithmetic. The first step (no momentum yet) agrees; from the second the updates differ. The replica,
    PyTorch's SGD with momentum = bf16(0.9) = 0.8984375 (exact in fp32), must be trainscope bit for bit;
    then the difference is that rounding."""
    momentum = float(torch.tensor(0.9, dtype=torch.bfloat16))
    replica = train({**cell, "reference_momentum": momentum}, dump, "single", accounting=Accounting(None))
    same = [tensor_check(f"parameters after the steps: PyTorch's SGD with momentum = bf16(0.9) = {momentum} (right) "
                         "against trainscope", dict(dump["final"]), replica["final"]),
            value_check("loss at every step: the same replica (right) against trainscope",
                        dump["step_losses"].tolist(), replica["losses"])]
    if all(c["verdict"] == "exact" for c in same):
        for c in checks:
            if c["verdict"] == "differs" and c["name"].startswith(("parameters after", "loss at each")):
                c["verdict"] = "design-difference"
                c["note"] = (f"LibTorch's C++ SGD multiplies the bf16 momentum buffer by the momentum as a bf16 scalar "
                             f"({momentum}), PyTorch's SGD by 0.9 in fp32 arithmetic; from the second step on the updates "
                             "differ; PyTorch's SGD with the momentum rounded to bf16 reproduces trainscope bit for bit (below)")
    return checks + same


def phase_checks(cell, run, kind):
    """bf16-master: the forward's and the backward's peak over the step's start, rank 0, trainscope's against
    FSDP2's, each difference predicted to the byte by what each side holds at that peak.

    trainscope's memory probe reports each phase's absolute peak (phase_peak_bytes: live bytes, the largest
    over the steps) and the forward's rise over the step's start (activation_bytes). Its gradients and
    optimizer state stay allocated between steps, so each step's rise is the same and the live bytes at
    the start of the step with the largest forward peak are phase_peak_bytes.forward - activation_bytes;
    the backward's rise over that start follows. PyTorch's side is measured per step directly, FSDP2's
    zero_grad(set_to_none=True) before each step's start (so that every step starts as step 0, without
    gradients), and the rise most steps reach is taken: Gloo's worker threads let go of a finished
    collective's tensors at their own pace, so a step now and then peaks higher by a buffer not yet
    released (one block's bf16 size, 99,968 B on gpt-tiny, in the runs measured); the largest over the
    steps is kept beside it (largest_over_steps).
    The optimizer's phase is left out: trainscope reports no per-step rise for it, and its largest absolute
    peak falls on another step than the forward's (the step that creates the momentum)."""
    mem = cell["metrics"]["memory"]
    absolute, act = mem.get("phase_peak_bytes") or {}, mem.get("activation_bytes")
    theirs = run.get("phase_peak_over_step_start") or {}
    if act is None or not absolute or not theirs:
        return []
    start = absolute["forward"] - act
    mode = run.get("phase_peak_mode") or theirs
    checks = []
    for phase, ours_v, theirs_v in (("forward", act, mode["forward"]), ("backward", absolute["backward"] - start, mode["backward"])):
        name = ("activation bytes (forward peak over the step's start)" if phase == "forward"
                else "backward peak over the step's start (rank 0)")
        c = value_check(name, ours_v, theirs_v, design=phase_design(cell, kind, phase, ours_v, theirs_v))
        c["largest_over_steps"] = theirs[phase] if phase == "backward" else run["activation_bytes"]
        checks.append(c)
    return checks


def phase_design(cell, kind, phase, ours, theirs):
    """What FSDP2 and trainscope hold at the forward's peak (the loss) and at the backward's (its start),
    each term from the model's sizes: a difference equal to their sum is the stated design, else None.
      - FSDP2 keeps the last all-gather's flat output buffer (the last block's bf16 parameters, 2 B x its
        numel) in its communication context until the next gather's copy-out; trainscope gathers into
        the parameters' own storage (zero1, zero2, zero3, hsdp; in the forward only for zero1/zero2).
      - trainscope allocates the root unit's bf16 gradient buffer (2 B x the root's numel) before the
        forward (zero3, hsdp, ddp); FSDP2 makes the root's gradients in backward.
      - Python's 1/sqrt(Dh): a 0-dim float64 tensor autograd saves, 8 B per GPT block.
    zero1/zero2: FSDP2 gathers the bf16 parameters (2Ψ) in the forward and keeps them to backward;
    trainscope allocates its bf16 gradient buffer (2Ψ) in the step's zero_grad: the same bytes."""
    model = build_model(cell)
    blocks = blocks_of(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    last = 2 * sum(p.numel() for p in blocks[-1].parameters())
    root = 2 * sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    family = PRESETS.get(cell["config"]["model"], ("",))[0]
    scalars = 8 * len(blocks) if family == "gpt" else 0
    terms = [(scalars, f"{scalars} B: Python's 1/sqrt(Dh), a 0-dim float64 tensor autograd saves, 8 B per block")]
    if kind in ("zero3", "hsdp") or (kind in ("zero1", "zero2") and phase == "forward"):
        terms.append((last, f"{last} B: FSDP2's flat all-gather output of the last block (its bf16 parameters), kept "
                            "in its communication context until the next gather's copy-out; trainscope gathers into the "
                            "parameters' storage"))
    if kind in ("zero3", "hsdp", "ddp"):
        terms.append((-root, f"-{root} B: trainscope's root unit's bf16 gradient buffer, allocated and zeroed before the "
                             "forward (FSDP2 makes the root's gradients in backward)"))
    if theirs - ours == sum(t for t, _ in terms) and theirs != ours:
        return "PyTorch - trainscope = " + "; ".join(why for t, why in terms if t)
    return None


def wrapped_scalar_check(name, ours, theirs, count, unit, why):
    """Equal bytes, or PyTorch's side 8 B per `unit` above ours exactly: a Python number wrapped in a
    0-dim float64 tensor that autograd saves, where C++ passes the number itself."""
    if count and ours is not None and theirs == ours + 8 * count:
        return value_check(name, ours, theirs, design=f"{8 * count} B = 8 B x {count} {unit}: {why}")
    return value_check(name, ours, theirs)


def flop_checks(cell, dump):
    """Parameter counts and FLOPs against torch.utils.flop_counter.FlopCounterMode on one step."""
    from torch.utils.flop_counter import FlopCounterMode
    cfg = cell["config"]
    if is_llama(cell):
        return llama_flop_checks(cell, dump)
    model = make_model(cfg["model"], 0.0)
    load_named(model, dump["initial"])
    ours = cell["model"]
    n = sum(p.numel() for p in model.parameters())
    checks = [value_check("parameters", ours["parameters"], n),
              value_check("analytic parameters", ours["analytic_parameters"], n)]
    x, y = dump["inputs"][0], dump["targets"][0]
    counter = FlopCounterMode(display=False)
    with counter:
        model.loss(x, y).backward()
    measured = counter.get_total_flops() / x.shape[0]
    # FlopCounterMode counts matmuls and convolutions only, as they run. What 6·N leaves out or adds, per
    # sample, is known exactly from the shapes: the prediction below must equal the count to the FLOP.
    family, hidden, width, layers, heads, S, V = PRESETS[cfg["model"]]
    if family == "mlp":
        first = model.fc0
        predicted = ours["training_flops_per_sample"] - 2 * first.in_features * first.out_features
        why = ("the first layer's input gradient is never computed (the images need none); 6·N counts it: "
               "2·in·out per sample")
    elif family == "cnn":
        c = model.stem
        hw = x.shape[2] * x.shape[3]  # stride 1, padding 1: the stem's output is the input's size
        predicted = ours["training_flops_per_sample"] - 2 * c.in_channels * c.out_channels * 9 * hw
        why = "the stem's input gradient is never computed; 6·MACs counts it (2·MACs of the stem per sample)"
    else:
        D, L = width, layers
        # ours: 6·N·S + 12·L·D·S² (N with biases and LayerNorm; the full S×S attention: torchtitan's
        # convention); FlopCounterMode: matmuls only, the full S×S scores and values (2·2·S²·D forward,
        # twice that backward, per layer), no elementwise work.
        predicted = ours["training_flops_per_sample"] - 6 * S * (13 * D * L + 2 * D)
        why = "FlopCounterMode counts no elementwise work (biases and LayerNorm, 6·S·(13·L·D + 2·D) in 6·N·S)"
    checks.append(value_check("training FLOPs per sample", ours["training_flops_per_sample"], measured, design=why))
    checks.append(value_check("FlopCounterMode against the convention minus the stated terms", predicted, measured))
    return checks


def llama_activation_check(cell, ours, theirs, name):
    """Both forwards' peaks over the step's start, counted by the same allocator. Eager's one known
    difference, to the byte: HF's `matmul(q, kᵀ) * self.scaling` dispatches aten::mul.Tensor with the
    number wrapped in a 0-dim float64 tensor that autograd saves (8 B per decoder layer); C++'s
    operator* dispatches aten::mul.Scalar, which saves the number itself. SDPA takes the scale as an
    argument: no difference."""
    shape = cell["model"]["shape"]
    return wrapped_scalar_check(name, ours, theirs, shape["layers"] if shape.get("attention") != "sdpa" else 0,
                                "layers", "HF multiplies the scores by its scaling as a 0-dim float64 tensor "
                                "(aten::mul.Tensor) that autograd saves; C++ dispatches aten::mul.Scalar")


def llama_flop_checks(cell, dump):
    """HF's parameter count, and the two FLOP conventions against FlopCounterMode on one step (eager)."""
    from torch.utils.flop_counter import FlopCounterMode
    shape, ours = cell["model"]["shape"], cell["model"]
    model = build_model(cell)
    load_named(model, dump["initial"])
    n = sum(p.numel() for p in model.parameters())
    checks = [value_check("parameters (HF's LlamaForCausalLM)", ours["parameters"], n),
              value_check("analytic parameters", ours["analytic_parameters"], n)]
    x, y = dump["inputs"][0], dump["targets"][0]
    counter = FlopCounterMode(display=False)
    with counter:
        model.loss(x, y).backward()
    measured = counter.get_total_flops() / x.shape[0]
    D, L, S = shape["d_model"], shape["layers"], shape["seq_len"]
    HDh = shape["heads"] * shape["head_dim"]
    # FlopCounterMode counts matmuls as they run: the projections, the LM head, and with eager's
    # repeat_kv the full S x S scores and values of every head. N of the conventions also holds the
    # RMSNorm weights (elementwise: 6·S·(2·L·D + D) per sample), which no matmul multiplies.
    norms = 6 * S * (2 * L * D + D)
    masked_half = 6 * L * HDh * S * S
    full, causal = ours["training_flops_per_sample"], ours["causal_flops_per_sample"]
    checks.append(value_check("training FLOPs per sample (full-attention convention)", full, measured,
                              design="FlopCounterMode counts no elementwise work: the RMSNorm weights' "
                                     f"6·S·(2·L·D + D) = {norms} of 6·N·S"))
    checks.append(value_check("FlopCounterMode against the full-attention convention minus the RMSNorm weights",
                              full - norms, measured))
    checks.append(value_check("FlopCounterMode against the causal convention plus the masked half "
                              "(6·L·H·Dh·S²) minus the RMSNorm weights", causal + masked_half - norms, measured))
    return checks


def scaler_checks(cell, dump):
    """GradScaler through the same overflow pattern: every scale and every skipped step, identical."""
    cfg = cell["config"]
    found = [bool(v) for v in dump["found_inf"].tolist()]
    scaler = torch.amp.GradScaler("cpu", init_scale=float(cfg["scaler_init"]), growth_factor=float(cfg["scaler_growth"]),
                                  backoff_factor=float(cfg["scaler_backoff"]), growth_interval=int(cfg["scaler_interval"]))
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    scales, skipped = [], []
    for inf in found:
        scales.append(scaler.get_scale())
        opt.zero_grad()
        scaler.scale(p.sum() + 1.0).backward()  # the gradient is the scale itself
        if inf:
            p.grad.fill_(float("inf"))
        before = p.detach().clone()
        scaler.step(opt)
        skipped.append(bool(torch.equal(before, p.detach())))
        scaler.update()
    ours = dump["scales"].tolist()
    ours_skipped = [i for i, v in enumerate(found) if v]
    theirs_skipped = [i for i, v in enumerate(skipped) if v]
    overflow = cell["metrics"].get("overflow", {})
    return [value_check(f"loss scale at each of {len(found)} steps", ours, scales),
            value_check("skipped steps", ours_skipped, theirs_skipped),
            value_check("skipped steps in the overflow probe", overflow.get("skipped_steps"), len(theirs_skipped))]


def row(cell, dump_path, lib):
    cfg = cell["config"]
    kind = kind_of(cfg)
    if is_llama(cell) and not hf_llama.available():
        return {"verdict": "skipped", "checks": [],
                "reason": "transformers is not installed in this Python (scripts/reference-packages.txt): no llama reference"}
    dump = load_dump(dump_path)
    master = cfg.get("precision") == "bf16-master"
    out = {"reference": reference_of(cfg, kind), "technique": kind + ("/bf16-master" if master else ""), "torch": torch.__version__}
    if is_llama(cell):
        attention = cell["model"]["shape"].get("attention", "eager")
        out["reference"] = (f"transformers {hf_llama.transformers.__version__} LlamaForCausalLM "
                            f"(attn_implementation={attention}) under " + reference_of(cfg, kind))
        out["attention"] = {"trainscope": cell["model"].get("attention_backend"), "hf": attention}
    checks = []
    if kind == "ssl":
        # The objectives on fixed tensors against lightly's (the training itself is trainscope's).
        if not ssl_ref.available():
            return {"verdict": "skipped", "checks": [], "technique": "ssl-losses",
                    "reason": "lightly is not installed in this Python (scripts/reference-packages.txt): no SSL loss reference"}
        if "ssl_losses" not in dump:
            raise InputError("the SSL cell's parity dump has no ssl_losses")
        return ssl_ref.row(cell, dump, dump_path, lib)
    if kind == "tp":
        # trainscope against the one-process emulation (bit for bit) and against DTensor TP on world_size
        # ranks (bit for bit, else within the tolerance tp_ref.tolerance derives), plus model-state bytes
        out.update(tp_ref.row(cell, dump, dump_path, lib))
        out["technique"] = "tp" + ("+sp" if cfg.get("sequence_parallel") else "") + (
            f"/fsdp-dp{cfg.get('dp_shard')}" if int(cfg.get("dp_shard", 1)) > 1 else "")
        out["verdict"] = "differs" if any(c["verdict"] == "differs" for c in out["checks"]) else "pass"
        return out
    if kind == "pp":
        # trainscope's pipeline against torch.distributed.pipelining's schedule of the same name (pp_ref.py)
        out.update(pp_ref.row(cell, dump, dump_path, lib))
        cfg_schedule = cfg.get("pp_schedule", "1f1b")
        out["technique"] = f"pp{cfg.get('pp')}/{cfg_schedule}"
        out["verdict"] = "differs" if any(c["verdict"] == "differs" for c in out["checks"]) else "pass"
        return out
    if kind == "scaler":
        checks += scaler_checks(cell, dump)
    else:
        world = int(cfg.get("world_size", 1))
        if world > 1:
            runs = train_ranks(cell, dump_path, kind, world, lib)
        else:
            runs = [train(cell, dump, "single", accounting=Accounting(lib))]
        checks += compare_training(cell, dump, runs, kind)
        if kind == "single" and not (is_llama(cell) and cell["model"]["shape"].get("attention") == "sdpa"):
            checks += flop_checks(cell, dump)
        if kind == "checkpoint" or kind == "bf16-true":
            checks.append(tensor_check("gradients at step 0", dict(dump["first_grads"]), runs[0]["first_grads"]))
        if kind == "bf16-true":
            checks = bf16_true_checks(cell, dump, lib, checks)
        if kind in ("bf16-mixed", "bf16-true", "single") and not is_llama(cell):  # HF's model has no block hook
            ours = {k: CPP_DTYPES.get(v, v) for k, v in dict(dump["block_dtypes"]).items()}
            checks.append(value_check("block output dtypes", ours, runs[0]["dtypes"]))
        if lib:
            if world > 1 or kind in ("single", "checkpoint", "bf16-true"):
                checks += memory_checks(cell, runs, kind)
            if kind in ("checkpoint", "single", "bf16-true"):
                checks.append(activation_check(cell, runs[0]))
            if master:
                checks += phase_checks(cell, runs[0], kind)
            if kind == "checkpoint" and is_llama(cell) and cfg.get("checkpoint") in ("full", "selective-op"):
                checks = llama_block_lifetime_checks(cell, dump, lib, checks)
        if kind in ("zero2", "zero3", "hsdp") or master:
            checks += comm_checks(cell, runs[0], kind)
        if runs[0].get("attempts", 1) > 1:
            out["reference_attempts"] = runs[0]["attempts"]
        ours_t = (cell["metrics"].get("timing", {}).get("step_time_s") or {}).get("p50")
        theirs_t = runs[0]["step_time_p50_s"]
        out["step_time_s"] = {"trainscope": ours_t, "pytorch": theirs_t,
                              "ratio": ours_t / theirs_t if ours_t and theirs_t else None}
        if kind == "ddp" and not master:
            out["engines"] = [engine_row(lightning_ref, cell, dump, dump_path, lib)]
        if kind in deepspeed_ref.STAGES and deepspeed_ref.compares(cfg):
            out["engines"] = [engine_row(deepspeed_ref, cell, dump, dump_path, lib)]
            out["engines_table"] = engines_table(cell, kind, runs[0], out["engines"][0])
            if kind == "zero3" and not is_llama(cell) and not master:  # Lightning's ModelParallelStrategy + fully_shard
                out["engines"].append(engine_row(lightning_ref, cell, dump, dump_path, lib))
    out["checks"] = checks
    failed = [e for e in out.get("engines", []) if e["verdict"] in ("differs", "failed")]
    out["verdict"] = "differs" if any(c["verdict"] == "differs" for c in checks) or failed else "pass"
    return out


def engine_row(engine, cell, dump, dump_path, lib):
    """Another system's row for this cell (DeepSpeed, Lightning): skipped with one line when its package
    is missing, failed (never a crash) when it raises."""
    name = engine.__name__.replace("_ref", "")
    if not engine.available():
        return {"engine": name, "verdict": "skipped", "checks": [],
                "reason": f"{name} is not installed in this Python (scripts/reference-packages.txt)"}
    started = time.monotonic()
    try:
        r = engine.row(cell, dump, dump_path, lib)
    except Exception as e:  # noqa: BLE001  (the row says why; the other rows stand)
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        r = {"engine": name, "verdict": "failed", "checks": [], "reason": f"{type(e).__name__}: {lines[-1] if lines else ''}"}
    r["reference_wall_s"] = round(time.monotonic() - started, 2)
    return r


def engines_table(cell, kind, torch_run, ds):
    """trainscope's ZeRO stage beside PyTorch's and DeepSpeed's on the same model and machine, rank 0."""
    rank0 = (cell.get("ranks") or [{}])[0]
    mem = cell["metrics"]["memory"]
    ours_comm = sum(comm_per_step(cell).values())
    rows = [{"engine": f"trainscope {kind}", "step_time_p50_s": rank0.get("step_time_p50_s"),
             "model_state_bytes": rank0.get("model_state_bytes"),
             "peak_above_start_bytes": (rank0.get("peak_bytes") or 0) - (mem.get("baseline_bytes") or 0) or None,
             "comm_bytes_per_step": ours_comm},
            {"engine": reference_of(cell["config"], kind).split(" (")[0], "step_time_p50_s": torch_run["step_time_p50_s"],
             "model_state_bytes": sum(torch_run["model_state"].values()),
             "peak_above_start_bytes": torch_run.get("peak_above_start_bytes"),
             # DDP's reducer (under ZeroRedundancyOptimizer) calls Gloo from C++, out of the counter's sight
             "comm_bytes_per_step": None if kind == "zero1" and cell["config"].get("precision") != "bf16-master" else sum((torch_run["comm_bytes_per_step"] or {}).values())}]
    if ds.get("verdict") in ("pass", "differs"):
        rows.append({"engine": ds["reference"].split(" (")[0], "step_time_p50_s": ds["step_time_s"]["pytorch"],
                     "model_state_bytes": sum(ds["model_state_bytes"].values()),
                     "peak_above_start_bytes": ds.get("peak_above_start_bytes"),
                     "comm_bytes_per_step": sum(ds["comm_bytes_per_step"].values())})
    return rows


# c10's dtype names (what the dump holds) as torch spells them.
CPP_DTYPES = {"Float": "float32", "BFloat16": "bfloat16", "Half": "float16", "Double": "float64"}

def comm_per_step(cell):
    """trainscope's bytes per measured step through each collective (rank 0, nccl-tests' sizes)."""
    ours = {}
    comm = cell["metrics"].get("comm", {})
    steps = max(int(comm.get("steps") or 1), 1)
    for c in comm.get("collectives", []):
        ours[c["op"]] = ours.get(c["op"], 0) + c["bytes"] * c["count"] / steps
    return ours


def root_bytes(cell):
    """The root unit's parameter bytes: what no block owns (embeddings, final norm, head)."""
    model = build_model(cell)
    in_blocks = {id(p) for b in blocks_of(model) for p in b.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks)


def comm_checks(cell, run, kind):
    """Bytes per measured step through each collective, rank 0, nccl-tests' sizes on both sides."""
    ours = comm_per_step(cell)
    theirs = run["comm_bytes_per_step"] or {}
    # FSDP2 reshards the root unit after forward and gathers it again for backward; trainscope's zero3
    # keeps it gathered until backward ends.
    root = root_bytes(cell)
    checks = []
    for op in sorted(set(ours) | set(theirs)):
        a, b = ours.get(op, 0), theirs.get(op, 0)
        design = None
        if kind in ("zero3", "hsdp") and op == "all-gather" and b - a == root:
            design = (f"{root} B per step, the root unit's parameters: FSDP2 reshards the root after forward and "
                      "gathers it again for backward; trainscope's zero3 keeps it gathered until backward ends")
        checks.append(value_check(f"{op} bytes per step (rank 0)", a, b, design=design))
    return checks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", required=True, help="a results folder's report.json")
    ap.add_argument("--out", required=True, help="where the parity JSON goes")
    ap.add_argument("--accounting", default="", help="libtrainscope_accounting.so (memory rows need it)")
    ap.add_argument("--filter", default="", help="regular expression on cell names")
    a = ap.parse_args(argv)
    try:
        report = json.loads(Path(a.report).read_text())
        if not isinstance(report, dict) or not isinstance(report.get("cells"), list):
            raise InputError(f"{a.report}: not a trainscope report (no cells)")
    except (OSError, ValueError) as e:
        print(f"parity reference: error: {a.report}: {e}", file=sys.stderr)
        return 2
    except InputError as e:
        print(f"parity reference: error: {e}", file=sys.stderr)
        return 2
    if a.accounting and not Path(a.accounting).is_file():
        print(f"parity reference: error: no accounting library at {a.accounting}", file=sys.stderr)
        return 2
    cells_dir = Path(a.report).resolve().parent / "cells"
    mp.set_forkserver_preload(forkserver_preload([c for c in report["cells"] if re.search(a.filter, c["name"])]))
    rows, failed = {}, False
    for cell in report["cells"]:
        if cell.get("status") != "ok" or "parity_dump" not in cell or not re.search(a.filter, cell["name"]):
            continue
        started = time.monotonic()
        try:
            r = row(cell, cells_dir / cell["parity_dump"], a.accounting)
        except InputError as e:
            r = {"verdict": "failed", "reason": str(e), "checks": []}
        except Exception as e:  # a reference that crashes is this row's failure, never a lost report
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            r = {"verdict": "failed", "reason": f"{type(e).__name__}: {lines[-1] if lines else ''}", "checks": []}
        r["reference_wall_s"] = round(time.monotonic() - started, 2)
        rows[cell["name"]] = r
        failed = failed or r["verdict"] not in ("pass", "skipped")
        print(f"{cell['name']}: {r['verdict']}" + (f" ({r['reason']})" if "reason" in r else ""), flush=True)
    Path(a.out).write_text(json.dumps({"schema": "trainscope.parity/1", "torch": torch.__version__,
                                       "cells": rows}, indent=1))
    return 1 if failed else 0


def forkserver_preload(cells):
    """What spawn_ranks' ranks start from, imported once by the server they are forked from: this module
    (and torch), and the reference packages the multi-rank rows among `cells` import (HF's Llama
    modules, DeepSpeed): ~3 s of a 2-core machine per package and rank otherwise. A package that is
    missing is left to its rows, which say so."""
    ranked = [c for c in cells if int(c.get("world_size") or 1) > 1 and "parity_dump" in c]
    out = ["__main__"]
    if any(is_llama(c) for c in ranked):
        out.append("transformers.models.llama.modeling_llama")
    if any(c["config"].get("parallel") in deepspeed_ref.STAGES and deepspeed_ref.compares(c["config"]) for c in ranked):
        deepspeed_ref.set_environment()  # before the server starts: it takes this process's environment
        out.append("deepspeed")
    return out


if __name__ == "__main__":
    sys.exit(main())
