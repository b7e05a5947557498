"""DeepSpeed's ZeRO engine as a second reference for trainscope's zero1/zero2/zero3 cells.

The same model, weights and batches through `deepspeed.initialize` with the matching ZeRO stage, on the
cell's ranks over Gloo (DeepSpeed's CPU accelerator falls back to Gloo without oneCCL). The settings
that would make DeepSpeed train something else are pinned: `gradient_clipping: 0.0` (DeepSpeed's default
is 1.0 since 0.18), a torch SGD (its own optimizers are JIT-compiled fused kernels), no overlap and no
bucketing of our own. Compared: the parameters after K steps, the loss at each step, each rank's
model-state bytes by part, and the bytes per step through each collective.
"""
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

deepspeed = None  # imported on first use: every spawned rank of the other rows imports this module


def set_environment():
    """What DeepSpeed reads when it is imported: the CPU accelerator, and where the shared-memory op it
    compiles at start-up was built into the environment by the set-up."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch-extensions"))


def _load():
    """Imports DeepSpeed once; None when the package is missing (its rows are skipped, never a crash)."""
    global deepspeed
    if deepspeed is None:
        set_environment()
        try:
            import deepspeed as ds
            from deepspeed.utils import logger
        except ImportError:
            return None
        logger.setLevel(logging.WARNING)
        deepspeed = ds
    return deepspeed


STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


def available():
    return _load() is not None


def compares(cfg):
    """Whether a zero cell gets a DeepSpeed row: every precision but bf16-master with fp32 reduction (its
    reference is FSDP2; DeepSpeed's bf16 reduces in bf16, which the reduce_dtype = "bf16" cells compare)."""
    return cfg.get("precision") != "bf16-master" or cfg.get("reduce_dtype", "fp32") == "bf16"


def is_bf16(cfg):
    """DeepSpeed runs its bf16 ("bf16": {"enabled": true}) for trainscope's bf16-mixed and bf16-master."""
    return cfg.get("precision") in ("bf16-mixed", "bf16-master")


def version():
    return _load().__version__


def config(stage, micro_batch, bucket_mb, bf16=False):
    # The cell's bucket cap, as PyTorch's DDP gets it. DeepSpeed's default (5e8 elements) allocates a
    # 2 GB fp32 gradient bucket per rank in stages 1-2 whatever the model's size (measured: 2.0 GB above
    # the start on gpt-tiny, 120k parameters).
    bucket = int(bucket_mb * 2**20 / 4)
    zero = {"stage": stage, "overlap_comm": False, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    if stage == 3:
        # trainscope's zero3 partitions every parameter and gathers it for forward and again for backward.
        # DeepSpeed's defaults keep parameters under 1e5 elements whole on every rank (all of gpt-tiny's)
        # and reuse gathered ones: off. Its default memory-efficient linear replaces F.linear by
        # matmul + add, which rounds differently from addmm (measured: the loss 1 ulp off from step 0): off.
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0, stage3_max_reuse_distance=0,
                    stage3_prefetch_bucket_size=0, memory_efficient_linear=False)
    out = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,  # SGD: the optimizer both sides run the same kernels of
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if bf16:
        # DeepSpeed's bf16: the module cast to bf16 (weights, activations, gradients), fp32 master
        # weights in the optimizer. A bf16-mixed cell meets it here, which is the comparison people make.
        out["bf16"] = {"enabled": True}
    return out


def _rank_main(rank, world, cell, dump_path, lib, out_dir):
    """One DeepSpeed rank (reference.py's model, dump and accounting helpers)."""
    import reference as ref
    _load()
    acc = ref.Accounting(lib)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    comm = ref.CommCounter()  # before DeepSpeed captures torch.distributed's functions
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "store"), rank=rank, world_size=world)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        cfg = cell["config"]
        threads = int(cell.get("threads") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        dump = ref.load_dump(dump_path)
        stage = STAGES[cfg["parallel"]]
        inputs, targets = dump["inputs"], dump["targets"]
        batch = inputs.shape[1] // world
        model = ref.build_model(cell, float(cfg.get("dropout", 0.0)))
        ref.load_named(model, dump["initial"])
        wrapped = ref.LossModule(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=float(cfg.get("lr", 1e-3)), momentum=0.9,
                              weight_decay=float(cfg.get("weight_decay", 0.0)), foreach=False)
        bf16 = is_bf16(cfg)
        engine, optimizer, _, _ = deepspeed.initialize(model=wrapped, optimizer=opt,
                                                       config=config(stage, batch, float(cfg.get("bucket_mb", 25.0)), bf16))
        warmup = int(cfg.get("warmup_steps", 0))
        times, losses, peak, start = [], [], 0, acc.current()
        for s in range(inputs.shape[0]):
            x = inputs[s].narrow(0, rank * batch, batch).contiguous()
            y = targets[s].narrow(0, rank * batch, batch).contiguous()
            if s == 0:
                torch.set_rng_state(dump["rng_state"])
            comm.measuring = s >= warmup
            acc.reset_peak()
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            if start is not None:
                peak = max(peak, acc.peak() - start)
            if s >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(loss.detach().to(torch.float64))
        comm.measuring = False
        state = model_state(engine, optimizer, stage)
        final = gathered_parameters(engine, stage, ref)
        masters = {}
        if bf16:  # the fp32 master weights, gathered whole (the module holds their bf16 copies)
            from deepspeed.utils import safe_get_full_fp32_param
            masters = {k: safe_get_full_fp32_param(q).detach().clone() for k, q in ref.trainscope_parameters(engine.module)}
        loss_t = torch.stack(losses)
        dist.all_reduce(loss_t)
        loss_t /= world
        torch.save({"final": masters or final, "module_params": final, "losses": loss_t.tolist(), "model_state": state,
                    "peak_above_start_bytes": peak if start is not None else None,
                    "step_time_p50_s": statistics.median(times) if times else None,
                    "comm_bytes_per_step": comm.per_step(inputs.shape[0] - warmup),
                    "comm_calls": {k: v / max(inputs.shape[0] - warmup, 1) for k, v in comm.calls.items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gathered_parameters(engine, stage, ref):
    """Full parameters by trainscope name (ZeRO-3 gathers its partitions first)."""
    if stage == 3:
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            return {k: p.detach().clone() for k, p in ref.trainscope_parameters(engine.module)}
    return {k: p.detach().clone() for k, p in ref.trainscope_parameters(engine.module)}


def model_state(engine, optimizer, stage):
    """Model-state bytes of this rank by part, counted as trainscope counts its own (unique storages):
    the module's parameters (ZeRO-3: this rank's partitions), the gradients DeepSpeed keeps between steps,
    the torch optimizer's state, and DeepSpeed's fp32 master partition, which it keeps even in fp32."""
    from reference import storage_bytes
    if stage == 3:
        params = [p.ds_tensor for p in engine.module.parameters()]
        masters = list(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    else:
        params = list(engine.module.parameters())
        masters = list(getattr(optimizer, "single_partition_of_fp32_groups", []))
    grads = [p.grad for p in engine.module.parameters()] + [m.grad for m in masters]
    inner = getattr(optimizer, "optimizer", optimizer)
    states = [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(states),
            "fp32_master": storage_bytes(masters)}


class _Identity(torch.autograd.Function):
    """What DeepSpeed's stage-3 hooks put around every module's tensors (PostBackwardFunctionModule on its
    inputs, PreBackwardFunctionForModule on its outputs): x.detach() forward, the gradient unchanged back."""

    @staticmethod
    def forward(x):
        return x.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        return grads


def _identity_all(value):
    """DeepSpeed's apply_to_tensors_only: every tensor in tuples, lists and dicts (in place), others as they are."""
    if isinstance(value, (tuple, list)):
        return value.__class__([_identity_all(v) for v in value])
    if isinstance(value, dict):
        for k in value.keys():
            value[k] = _identity_all(value[k])
        return value
    return _Identity.apply(value) if isinstance(value, torch.Tensor) else value


def module_hooks(model):
    """DeepSpeed's stage-3 autograd nodes without DeepSpeed: every module's inputs and outputs through an
    identity Function. They change no value, only the graph, and so the order in which autograd sums the
    gradients of a tensor that several operations consume."""
    for m in model.modules():
        m.register_forward_pre_hook(lambda m, inputs: _identity_all(inputs))
        m.register_forward_hook(lambda m, inputs, output: _identity_all(output))


def train_ranks(cell, dump_path, lib):
    import reference as ref
    world = int(cell["config"].get("world_size", 1))
    return ref.spawn_ranks(_rank_main, lambda tmp: (world, cell, str(dump_path), lib, tmp), world, cell["name"])


def row(cell, dump, dump_path, lib):
    """The DeepSpeed reference row of one zero cell, in reference.py's row format."""
    import reference as ref
    kind = cell["config"]["parallel"]
    out = {"engine": "deepspeed", "reference": f"DeepSpeed {version()} ZeRO stage {STAGES[kind]} "
           "(deepspeed.initialize, torch SGD, gradient_clipping 0.0, Gloo)", "technique": kind}
    runs = train_ranks(cell, dump_path, lib)
    if runs[0].get("attempts", 1) > 1:
        out["reference_attempts"] = runs[0]["attempts"]
    checks = ref.compare_training(cell, dump, runs, kind)
    if kind == "zero3" and any(c["verdict"] == "differs" for c in checks):
        checks = autograd_order_checks(cell, dump, dump_path, runs, checks, ref)
    bf16 = is_bf16(cell["config"])
    master = cell["config"].get("precision") == "bf16-master"
    if master:
        out["reference"] += ", with its bf16 enabled at its defaults (bf16 weights, fp32 masters, gradients reduced in bf16)"
        checks += master_checks(cell, dump, runs, ref)
    elif bf16:
        out["reference"] += ", with its bf16 enabled (bf16 weights, fp32 masters)"
        checks += bf16_checks(cell, dump, runs, ref)
    world = len(runs)
    psi = sum(t.numel() * t.element_size() for t in dump["initial"].values())  # 4Ψ bytes: fp32 parameters
    rd = 2 if cell["config"].get("reduce_dtype", "fp32") == "bf16" else 4
    ranks = cell.get("ranks") or []
    for r in range(world):
        ours = (ranks[r] if r < len(ranks) else {}).get("model_state_parts") or {}
        theirs = runs[r]["model_state"]
        for part in ("params", "grads", "optimizer"):
            checks.append(ref.value_check(f"rank {r} {part} bytes", ours.get(part), theirs[part],
                                          design=memory_design(kind, part, ours.get(part), theirs[part], psi, world, bf16,
                                                               master, rd)))
        fp32_master = theirs["fp32_master"]
        why = ("its bf16 design: the fp32 master weights of its partition, which the optimizer updates before the bf16 "
               "copy is taken" if bf16 else "DeepSpeed keeps an fp32 copy of its partition even when training in fp32")
        where = ("trainscope's master slice is counted in its params row" if master
                 else "trainscope updates its fp32 parameters in place")
        checks.append(ref.value_check(f"rank {r} fp32 master partition bytes", 0, fp32_master,
                                      design=f"{why}, 4Ψ/N = {fp32_master} B; {where}"
                                             if fp32_master * world == psi else None))
    checks += comm_checks(cell, runs[0], kind, psi, world, ref, bf16, master)
    if kind in ("zero2", "zero3"):
        checks.append(estimator_check(cell, kind, runs[0], world, ref, bf16))
    ours_t = (cell["metrics"].get("timing", {}).get("step_time_s") or {}).get("p50")
    theirs_t = runs[0]["step_time_p50_s"]
    out["step_time_s"] = {"trainscope": ours_t, "pytorch": theirs_t,
                          "ratio": ours_t / theirs_t if ours_t and theirs_t else None}
    out["model_state_bytes"] = runs[0]["model_state"]
    out["peak_above_start_bytes"] = runs[0]["peak_above_start_bytes"]
    out["comm_bytes_per_step"] = runs[0]["comm_bytes_per_step"]
    out["comm_calls_per_step"] = runs[0]["comm_calls"]
    out["checks"] = checks
    out["verdict"] = "differs" if any(c["verdict"] == "differs" for c in checks) else "pass"
    return out


def autograd_order_checks(cell, dump, dump_path, runs, checks, ref):
    """Stage 3 hooks every module (to gather its parameters before forward and backward): each module's
    inputs and outputs pass through an identity autograd Function. Where a tensor feeds several
    operations inside one module and more outside it (Llama's residual stream: HF's RMSNorm reads it twice,
    for the variance and the product, and the residual add once more), autograd then sums the three
    gradients in another order: a last-bit difference. The replica, PyTorch's FSDP2 with the same
    identity Functions (module_hooks), must be DeepSpeed bit for bit; then the difference is that design."""
    replica = ref.train_ranks({**cell, "deepspeed_module_hooks": True}, dump_path, "zero3", len(runs), None)
    same = [ref.tensor_check("parameters after the steps: PyTorch's FSDP2 with an identity autograd Function on every "
                             "module's inputs and outputs (left) against DeepSpeed", replica[0]["final"], runs[0]["final"]),
            ref.value_check("loss at every step: the same replica (left) against DeepSpeed", replica[0]["losses"], runs[0]["losses"])]
    if all(c["verdict"] == "exact" for c in same):
        for c in checks:
            if c["verdict"] == "differs":
                c["verdict"] = "design-difference"
                c["note"] = ("DeepSpeed's stage 3 passes every module's inputs and outputs through identity autograd Functions "
                             "(its parameter hooks), which changes the order in which autograd sums the gradients of a tensor "
                             "read by several operations (the residual stream at each RMSNorm); the replica below reproduces "
                             "DeepSpeed bit for bit")
    return checks + same


def master_checks(cell, dump, runs, ref):
    """DeepSpeed's bf16 against trainscope's bf16-master with reduce_dtype = "bf16": the same recipe (bf16
    copies of fp32 masters, no autocast, bf16 gradients reduced in bf16 and averaged, the fp32 masters
    stepped) but for where the masters start: DeepSpeed casts the module to bf16 before it makes its
    masters (fp32(bf16(w0))), trainscope's masters are the fp32 initial weights. The cell starts from
    weights that bf16 represents exactly (another cell's bf16 weights), so both start from the same
    masters; this checks that it did. Division: DeepSpeed divides each bf16 gradient by N before its bf16
    sum, trainscope sums and divides; at N = 2 both are one rounding of (a + b) / 2, the same bits."""
    r0 = runs[0]
    initial = dict(dump["initial"])
    return [ref.tensor_check("trainscope's initial fp32 masters against the same weights rounded to bf16 and back "
                             "(DeepSpeed's masters at its start)", initial,
                             {k: v.to(torch.bfloat16).to(v.dtype) for k, v in initial.items()}),
            ref.tensor_check("DeepSpeed's fp32 masters rounded to bf16 (left) against its module's weights",
                             {k: v.to(torch.bfloat16) for k, v in r0["final"].items()}, r0["module_params"])]


def bf16_checks(cell, dump, runs, ref):
    """What DeepSpeed's bf16 is, checked: its module holds bf16 copies of fp32 master weights (after every
    step, the masters rounded to bf16, bit for bit), and its forward is bf16-true's (step 0's loss equals
    the same weights cast to bf16 in PyTorch, bit for bit), where trainscope's bf16-mixed keeps fp32
    weights and runs autocast (layer norm, softmax, the residual stream in fp32)."""
    import reference as ref_
    r0 = runs[0]
    checks = [ref.tensor_check("DeepSpeed's fp32 masters rounded to bf16 (left) against its module's weights",
                               {k: v.to(torch.bfloat16) for k, v in r0["final"].items()}, r0["module_params"])]
    model = ref.build_model(cell)
    ref.load_named(model, dump["initial"])
    model = ref_.LossModule(model.to(torch.bfloat16))
    x, y = dump["inputs"][0], dump["targets"][0]
    world = len(runs)
    batch = x.shape[0] // world
    with torch.no_grad():  # each rank's half, averaged as the DeepSpeed rows average the ranks' losses
        losses = [model(x.narrow(0, r * batch, batch), y.narrow(0, r * batch, batch)).to(torch.float64) for r in range(world)]
    bf16_true = float(sum(losses) / world)
    checks.append(ref.value_check("step 0 loss: the initial weights cast to bf16 in PyTorch (left, bf16-true's forward) "
                                  "against DeepSpeed's", bf16_true, r0["losses"][0]))
    checks[-1]["note"] = (f"trainscope's bf16-mixed step 0 loss: {float(dump['step_losses'][0]):.7g} (fp32 weights under "
                          "autocast: the GEMMs in bf16, the rest in fp32)")
    return checks


def memory_design(kind, part, ours, theirs, psi, world, bf16=False, master=False, rd=4):
    """A model-state difference that DeepSpeed's design predicts to the byte, or None. psi: 4Ψ (fp32 bytes
    of the model); master: a bf16-master cell whose gradients are reduced in rd-byte elements."""
    if ours is None or theirs is None:
        return None
    if master:
        n, sharded = psi // 4, psi // world
        if part == "params" and kind != "zero3" and ours - theirs == sharded and theirs == 2 * n:
            return (f"trainscope counts its fp32 master slice (4Ψ/N = {sharded} B) with the parameters, beside the bf16 "
                    f"copy both sides keep whole (2Ψ = {theirs} B); DeepSpeed's fp32 master partition is its own row below")
        if part == "params" and kind == "zero3" and ours == sharded and theirs * 2 == ours:
            return (f"trainscope's zero3 holds the fp32 shard (4Ψ/N = {ours} B), the master itself, and casts it to bf16 "
                    f"for each gather; DeepSpeed holds a bf16 partition (2Ψ/N = {theirs} B) and its fp32 master "
                    "partition (the row below)")
        held = (rd * n + (sharded if rd == 2 else 0)) if kind == "zero1" else sharded
        if part == "grads" and theirs == 0 and ours == held:
            return ("DeepSpeed frees the gradients once its step has consumed them; trainscope keeps its gradient "
                    "buffers between steps: " + (f"zero1's full {rd}-byte buffer ({rd * n} B, Megatron's layout)"
                                                 + (f" and the fp32 gradient of its master slice ({sharded} B)" if rd == 2 else "")
                                                 if kind == "zero1" else f"the fp32 gradient of its master slice, 4Ψ/N = {ours} B"))
        return None
    if bf16 and part == "params" and kind != "zero3" and theirs * 2 == ours:
        return (f"DeepSpeed's bf16 holds the weights in bf16, 2Ψ = {theirs} B (its fp32 masters are the row below); "
                f"trainscope's bf16-mixed keeps fp32 weights, 4Ψ = {ours} B, and casts them for each GEMM")
    sharded = psi // world
    if part == "grads" and theirs == 0 and ours == (psi if kind == "zero1" else sharded):
        return ("DeepSpeed frees the gradients once its step has consumed them (zero_grad to None); trainscope keeps "
                f"its gradient buffer allocated between steps: {'4Ψ' if kind == 'zero1' else '4Ψ/N'} = {ours} B")
    return None


def comm_checks(cell, run, kind, psi, world, ref, bf16=False, master=False):
    """Bytes per measured step through each collective (rank 0), nccl-tests' sizes on both sides; a
    difference passes only where DeepSpeed's code predicts it to the byte."""
    ours = ref.comm_per_step(cell)
    theirs = run["comm_bytes_per_step"] or {}
    # One-element all-reduces: the squared gradient norm (fp32 in stages 1-2, fp64 in stage 3), every
    # step, to find inf/NaN and to report the norm, also with clipping off.
    # In bf16 also a one-byte flag (uint8): whether any rank overflowed.
    sizes = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "bool": 1}
    scalars = sum(int(calls) * sizes.get(k.rsplit(" ", 1)[-1], 4) for k, calls in (run.get("comm_calls") or {}).items()
                  if k.startswith("all-reduce 1 x"))
    grad_bytes = 2 if bf16 else 1  # trainscope's fp32 gradients against DeepSpeed's bf16 ones: twice the bytes
    root = ref.root_bytes(cell)
    if master:  # bf16-master: trainscope reduces in reduce_dtype and gathers bf16, as DeepSpeed's bf16
        grad_bytes = 1 if cell["config"].get("reduce_dtype", "fp32") == "bf16" else 2
        root //= 2
    allreduce_stages = ("zero1", "zero2") if master else ("zero2",)
    checks = []
    for op in sorted(set(ours) | set(theirs)):
        a, b = ours.get(op, 0), theirs.get(op, 0)
        design = None
        if op == "all-reduce" and kind not in allreduce_stages and b - a == scalars > 0:
            design = (f"{scalars} B per step: DeepSpeed all-reduces the squared gradient norm (one scalar) every "
                      "step to look for inf/NaN and to report it, also with gradient clipping off")
        elif kind in allreduce_stages and op == "all-reduce" and (b - scalars) * grad_bytes == ours.get("reduce-scatter") and a == 0:
            design = (f"DeepSpeed's stage {STAGES[kind]} reduces each gradient bucket with an all-reduce and keeps its partition "
                      + ("(use_multi_rank_bucket_allreduce, on by default)" if kind == "zero2" else "(at the step's boundary)")
                      + f", plus the {scalars} B gradient norm" + (" and overflow flag" if bf16 else "")
                      + ("; its gradients are bf16, half of trainscope's fp32 bytes" if bf16 and grad_bytes == 2 else "")
                      + ("; the same bf16 gradient bytes as trainscope's reduce_dtype = bf16" if master and grad_bytes == 1 else "")
                      + "; trainscope reduce-scatters: twice the bus traffic per byte, 2(N-1)/N against (N-1)/N")
        elif kind in allreduce_stages and op == "reduce-scatter" and b == 0 and a == (theirs.get("all-reduce", 0) - scalars) * grad_bytes:
            design = f"DeepSpeed's stage {STAGES[kind]} all-reduces these gradients instead (the all-reduce row)"
        elif bf16 and kind != "zero3" and op == "all-gather" and b * 2 == a:
            design = (f"DeepSpeed gathers the updated weights in bf16 ({b} B), trainscope its fp32 parameters ({a} B)")
        elif kind == "zero3" and op == "all-gather" and b - a == root:
            design = (f"{root} B per step, the root's {'bf16 ' if master else ''}parameters (embeddings, final norm, tied head): DeepSpeed "
                      "(reuse and prefetch off) gathers them again for backward; trainscope's zero3 keeps them "
                      "gathered until backward ends")
        checks.append(ref.value_check(f"{op} bytes per step (rank 0)", a, b, design=design))
    return checks


def estimator_check(cell, kind, run, world, ref, bf16=False):
    """DeepSpeed's model-state estimator (GPU bytes per rank, no offload) beside what its engine held in
    this run: the estimator assumes fp16 weights with fp32 Adam, 2 + 18/N bytes per parameter at stage 2
    and 18/N plus the largest layer's fp32 weights at stage 3; this run is fp32 with SGD's momentum, so
    DeepSpeed held 4 + 8/N (stage 2: the weights whole, its fp32 master partition and the momentum) or
    12/N bytes per parameter (stage 3); in bf16 2 + 8/N at stage 2 and 10/N at stage 3. Neither counts the gradient bucket (reduce_bucket_size x 4 B, 2 GB
    at DeepSpeed's default) nor activations."""
    model = ref.build_model(cell)
    n = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    held = sum(run["model_state"].values())
    if kind == "zero2":
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        estimate = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=world, cpu_offload=False)[1]
        # bf16: the weights in bf16 (2 bytes), the fp32 master partition and the momentum as in fp32.
        recipe, expected = ("2 + 8/N", 2 * n + 8 * n // world) if bf16 else ("4 + 8/N", 4 * n + 8 * n // world)
        assumed = "2 + 18/N bytes per parameter"
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        estimate = estimate_zero3_model_states_mem_needs(n, largest, num_gpus_per_node=world, cpu_offload=False,
                                                         cpu_offload_params=False)[1]
        # bf16: a bf16 partition (2/N) where fp32 training holds an fp32 one (4/N); its fp32 master and the
        # momentum as in fp32 (4/N each).
        recipe, expected = ("10/N", 10 * n // world) if bf16 else ("12/N", 12 * n // world)
        assumed = f"18/N bytes per parameter plus the largest layer's fp32 weights, 4 x {largest} B"
    check = ref.value_check(f"model-state bytes per rank: DeepSpeed held (left) against estimate_{kind}_model_states_mem_needs",
                            held, estimate)
    if held == expected:
        check["verdict"] = "design-difference"
        check["note"] = (f"the estimator assumes fp16 weights and fp32 Adam ({assumed}; {n} parameters, N = {world}); "
                         f"this {'bf16' if bf16 else 'fp32'} SGD-momentum run held {recipe} bytes per parameter = {expected} B; it leaves out the "
                         "gradient bucket (reduce_bucket_size x 4 B: 2 GB at DeepSpeed's default) and activations")
    return check
