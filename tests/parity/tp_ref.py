"""Tensor parallelism (TP) and TP + sequence parallelism (SP) of the llama rows: PyTorch's DTensor TP and a
one-process emulation, each trained on what a trainscope cell ran (reference.py's `row` for kind "tp").

The cell: config tp (> 1), sequence_parallel, world_size = dp_shard x tp, parallel "single" (pure TP) or
"zero3" (FSDP over the data-parallel group, the 2-D row); the mesh is (dp, tp) with tp innermost
(rank = dp_rank * tp + tp_rank); TP group dp_rank trains rows [dp_rank*B/dp, (dp_rank+1)*B/dp) of each
step's global batch.

- train_tp: HF's LlamaForCausalLM under torch.distributed.tensor.parallel.parallelize_module on the "tp"
  mesh (Megatron's layout: q/k/v and gate/up ColwiseParallel behind one PrepareModuleInput per attention
  and per MLP, o_proj and down_proj RowwiseParallel, the embedding vocabulary-parallel, lm_head
  ColwiseParallel into loss_parallel; with SP the norms SequenceParallel and the boundaries on Shard(1)),
  then FSDP2's fully_shard per decoder layer and at the root on the "dp" mesh (torchtitan's order). Before
  the optimizer each gradient goes to its parameter's placement (finalize_grads).
- emulate_tp: the same arithmetic in one process (Megatron-style split-K partials; §2.2 of the research notes on TP): every rank's
  local GEMMs with the same shapes, the partials summed as the collectives sum them (2 ranks: a 2-term sum,
  whatever Gloo's order), and one autograd identity node per DTensor boundary, so that gradient
  contributions group as DTensor's graph groups them. Bit for bit DTensor's numbers at tp = 2, with and
  without SP, and at dp 2 x tp 2. For tp > 2 the emulation sums in rank order, which Gloo's ring does not
  (notes §1.1): bits then are not promised.

What the C++ side must do to match these bits is listed in the docstring of emulate_tp.
"""
import gc
import os
import statistics
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# Parameters split across the TP group, by trainscope name suffix: the dimension each is cut along.
_COLWISE = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_ROWWISE = ("o_proj.weight", "down_proj.weight")


def split_dim(name):
    """The dimension trainscope's TP cuts parameter `name` along (None: replicated on every TP rank)."""
    if name.endswith(_COLWISE) or name in ("embed_tokens.weight", "lm_head.weight"):
        return 0
    if name.endswith(_ROWWISE):
        return 1
    return None


def layout(cell):
    """(tp, sp, dp) of a TP cell, checked against the contract."""
    import reference as ref
    cfg = cell["config"]
    if not ref.is_llama(cell):
        raise ref.InputError("the TP references replay the llama family (HF's LlamaForCausalLM)")
    tp = int(cfg.get("tp", 1))
    world = int(cfg.get("world_size", tp))
    # The data-parallel degree: the ranks tp leaves (`parallel = zero3` over them, or dp_shard given).
    dp = max(world // tp, 1)
    if tp < 2 or world != dp * tp or int(cfg.get("dp_shard", 1)) not in (1, dp):
        raise ref.InputError(f"tp = {tp}, dp_shard = {dp}, world_size = {world}: the TP references need world_size = dp_shard x tp")
    parallel = cfg.get("parallel", "single")
    if (dp == 1 and parallel != "single") or (dp > 1 and parallel != "zero3"):
        raise ref.InputError(f"the TP references run parallel = single (dp_shard 1) or zero3 (dp_shard > 1), not {parallel!r} "
                             f"with dp_shard {dp}")
    if cfg.get("checkpoint", "none") != "none" or float(cfg.get("dropout", 0.0)) != 0.0:
        raise ref.InputError("the TP references run checkpoint = none and dropout = 0")
    if cfg.get("precision", "32-true") != "32-true" or cfg.get("optimizer", "adamw") != "sgd":
        raise ref.InputError("the TP references run precision = 32-true and optimizer = sgd")
    shape = cell["model"]["shape"]
    for key in ("heads", "kv_heads", "ffn", "vocab"):
        if shape[key] % tp:
            raise ref.InputError(f"{key} = {shape[key]} does not divide by tp = {tp}")
    if bool(cfg.get("sequence_parallel", False)) and shape["seq_len"] % tp:
        raise ref.InputError(f"seq_len = {shape['seq_len']} does not divide by tp = {tp} (sequence parallelism)")
    if shape.get("tied"):
        raise ref.InputError("the TP references shard an untied lm_head")
    return tp, bool(cfg.get("sequence_parallel", False)), dp


def sgd_kwargs(cfg):
    return dict(lr=float(cfg.get("lr", 1e-3)), momentum=0.9, weight_decay=float(cfg.get("weight_decay", 0.0)), foreach=False)


def dp_slice(dump, s, dp_rank, dp):
    x, y = dump["inputs"][s], dump["targets"][s]
    b = x.shape[0] // dp
    return x.narrow(0, dp_rank * b, b).contiguous(), y.narrow(0, dp_rank * b, b).contiguous()


# ---- DTensor TP ----------------------------------------------------------------------------------
def plan(layers, sp):
    """parallelize_module's plan for HF's LlamaForCausalLM: Megatron's layout (one input boundary per
    attention and per MLP, not one per column-parallel linear), torchtitan's Llama plan with SP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    seq = Shard(1) if sp else Replicate()
    p = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
         "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        p["model.norm"] = SequenceParallel()
    for i in range(layers):
        pre = f"model.layers.{i}."
        # HF's decoder layer calls self_attn(hidden_states=...) by keyword and mlp(x) positionally
        p[pre + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                  desired_input_kwarg_layouts={"hidden_states": Replicate()})
        p[pre + "mlp"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            p[pre + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            p[pre + name] = RowwiseParallel(output_layouts=seq)
        if sp:
            p[pre + "input_layernorm"] = SequenceParallel()
            p[pre + "post_attention_layernorm"] = SequenceParallel()
    return p


class TpLoss(torch.nn.Module):
    """HF's model and trainscope's loss (cross-entropy of the fp32 logits against the next tokens), the
    logits vocabulary-sharded DTensors (call under loss_parallel()). The position ids are passed: under SP
    the embedding's output holds S/tp positions, from which HF would count them."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        logits = self.model.lm(input_ids=x, position_ids=positions, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


class FuncolCounter(TorchDispatchMode):
    """Bytes through the functional collectives DTensor issues (torch.ops._c10d_functional), nccl-tests'
    sizes as reference.CommCounter (which sees torch.distributed's own calls: FSDP2's)."""

    NAMES = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
             "all_to_all_single": "all-to-all"}

    def __init__(self):
        super().__init__()
        self.bytes, self.calls = {}, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into collectives on local tensors first
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and func._overloadpacket.__name__ in self.NAMES:
            packet = func._overloadpacket.__name__
            t = args[0]
            n = t.numel() * t.element_size() * (int(args[1]) if packet == "all_gather_into_tensor" else 1)
            name = self.NAMES[packet]
            self.bytes[name] = self.bytes.get(name, 0) + n
            key = f"{name} {n // t.element_size()} x {str(t.dtype).replace('torch.', '')}"
            self.calls[key] = self.calls.get(key, 0) + 1
        return out


def train_tp(cell, dump, rank, world, accounting=None):
    """DTensor TP (2-D: TP then FSDP2 over dp) on this rank; the dict reference.train returns."""
    import reference as ref
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    cfg = cell["config"]
    tp, sp, dp = layout(cell)
    if world != tp * dp:
        raise ref.InputError(f"{world} ranks for dp {dp} x tp {tp}")
    threads = int(cell.get("threads") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    model = ref.build_model(cell)
    ref.load_named(model, dump["initial"])
    if dp == 1:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        tp_mesh, dp_mesh = mesh, None
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    layers = model.lm.model.layers
    parallelize_module(model.lm, tp_mesh, plan(len(layers), sp))
    wrapped = TpLoss(model)
    if dp_mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for layer in layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
        fully_shard(wrapped, mesh=dp_mesh, reshard_after_forward=True)
    opt = torch.optim.SGD(wrapped.parameters(), **sgd_kwargs(cfg))
    dp_rank = rank // tp
    comm = ref.CommCounter() if dp > 1 else None  # FSDP2 calls torch.distributed's collectives
    funcol = FuncolCounter()
    warmup = int(cfg.get("warmup_steps", 0))
    total = dump["inputs"].shape[0]
    acc = accounting or ref.Accounting(None)
    times, losses, activation = [], [], 0
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        for s in range(total):
            x, y = dp_slice(dump, s, dp_rank, dp)
            if s == 0:
                torch.set_rng_state(dump["rng_state"])
            measuring = s >= warmup
            if comm:
                comm.measuring = measuring
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            start = acc.current()
            acc.reset_peak()
            with (funcol if measuring else nullcontext()), loss_parallel():
                loss = wrapped(x, y)
                if start is not None:
                    activation = max(activation, acc.peak() - start)
                loss.backward()
                if dp_mesh is None:
                    finalize_grads(wrapped)
            opt.step()
            elapsed = time.perf_counter() - t0
            if measuring:
                times.append(elapsed)
            local = loss.to_local() if hasattr(loss, "to_local") else loss
            losses.append(local.detach().to(torch.float64))
    finally:
        if collecting:
            gc.enable()
    if comm:
        comm.measuring = False
    state = ref.model_state(wrapped, opt, "tp")
    final = ref.named(wrapped)  # full_tensor() on every parameter: every rank gathers
    loss_t = torch.stack(losses)
    if dp_mesh is not None:  # the TP ranks of a group hold the same loss: the mean over the dp group
        dist.all_reduce(loss_t, group=dp_mesh.get_group())
        loss_t /= dp
    steps = max(total - warmup, 1)
    per_step = {k: v / steps for k, v in funcol.bytes.items()}
    if comm:
        for k, v in comm.per_step(total - warmup).items():
            per_step[k] = per_step.get(k, 0) + v
    return {"final": final, "losses": loss_t.tolist(), "model_state": state,
            "step_time_p50_s": statistics.median(times) if times else None,
            "activation_bytes": activation if acc.lib else None,
            "comm_bytes_per_step": per_step,
            "comm_calls_per_step": {k: v / steps for k, v in funcol.calls.items()}}


def finalize_grads(module):
    """Each gradient to its parameter's placement before the optimizer: the SP norm weights' Partial
    gradients all-reduced over TP (Megatron's finalize_model_grads; FSDP2 does it on the 2-D mesh), and the
    embedding's gradient, which DTensor's embedding backward makes Replicate (the full vocabulary; no row-wise
    strategy), cut to the rank's Shard(0) rows (no communication) and copied out of the full buffer.
    Without it SGD keeps the norm weights' momentum Partial (each rank 0.9·buf_r + g_r, summed only at
    p.add_): the same maths, other bits; and each rank holds the whole embedding gradient and momentum."""
    from torch.distributed.tensor import DTensor
    for p in module.parameters():
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            g = g.redistribute(p.device_mesh, p.placements)
            local = g.to_local()
            if local.untyped_storage().nbytes() > local.numel() * local.element_size():
                g = DTensor.from_local(local.clone(), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            p.grad = g


def _rank_main(rank, world, cell, dump_path, lib, out_dir):
    import faulthandler
    import reference as ref
    faulthandler.enable()
    acc = ref.Accounting(lib)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "store"), rank=rank, world_size=world)
    try:
        dump = ref.load_dump(dump_path)
        result = train_tp(cell, dump, rank, world, acc)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def train_ranks(cell, dump_path, lib):
    import reference as ref
    world = int(cell["config"].get("world_size", 2))
    return ref.spawn_ranks(_rank_main, lambda tmp: (world, cell, str(dump_path), lib, tmp), world, cell["name"])


# ---- the one-process emulation ---------------------------------------------------------------------
class ParallelCE(torch.autograd.Function):
    """loss_parallel's cross-entropy (mean over the targets, no ignored index in trainscope's data) on the
    vocabulary shards, op for op torch/distributed/tensor/parallel/loss.py: _log_softmax (per shard amax,
    all-reduce MAX, x - max, per shard sum(exp), all-reduce SUM, log, shifted - log), _nll_loss_forward (the
    target's log-probability gathered on its shard, zero elsewhere, all-reduce SUM; -that; the sum over the
    tokens / their count) and the fused backward _nll_loss_and_log_softmax_backward
    ((onehot(-1) on the target's shard + exp(logp)) * (grad / count))."""

    @staticmethod
    def forward(ctx, target, *shards):
        ignore = -100
        x_max = None
        for s in shards:  # all-reduce MAX: exact in any order
            m = torch.amax(s, 1, keepdim=True)
            x_max = m if x_max is None else torch.maximum(x_max, m)
        shifted = [s - x_max for s in shards]
        sumexp = None
        for z in shifted:  # all-reduce SUM in rank order
            e = torch.sum(torch.exp(z), 1, keepdim=True)
            sumexp = e if sumexp is None else sumexp + e
        lse = torch.log(sumexp)
        logp = [z - lse for z in shifted]
        safe = torch.where(target != ignore, target, 0).unsqueeze(1)
        picked, offset = None, 0
        for lp in logp:
            n = lp.shape[1]
            mask = (safe < offset) | (safe >= offset + n)
            local = safe.clone() - offset
            local[mask] = 0
            g = torch.gather(lp, 1, local)
            g[mask] = 0.0
            picked = g if picked is None else picked + g
            offset += n
        result = -picked.squeeze(1)
        result = torch.where(target != ignore, result, 0)
        total_weight = (target != ignore).sum().to(logp[0])
        ctx.save_for_backward(target, total_weight, *logp)
        return result.sum() / total_weight

    @staticmethod
    def backward(ctx, grad_output):
        ignore = -100
        target, total_weight, *logp = ctx.saved_tensors
        grad_output = grad_output / total_weight
        target = target.unsqueeze(1)
        safe = torch.where(target != ignore, target, 0).squeeze(1).flatten()
        go = torch.where(target != ignore, grad_output, 0)
        out, offset = [], 0
        for lp in logp:
            n = lp.shape[1]
            mask = (safe < offset) | (safe >= offset + n)
            local = safe.clone() - offset
            local[mask] = 0
            grad_input = torch.zeros_like(lp)
            grad_input[torch.arange(local.shape[0]), local] = mask.to(grad_input.dtype) - 1.0
            out.append((grad_input + torch.exp(lp)) * go)
            offset += n
        return (None, *out)


def _rms(x, weight, eps):
    """HF's LlamaRMSNorm.forward on a given weight."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


class _Bound:
    """Per step, the largest elementwise |dY|^T |X| of any weight-gradient GEMM (the split-K bound's
    Σ_t |a_t b_t|, notes §2.3) and the number of tokens it sums; the 1-norm of all gradients."""

    def __init__(self):
        self.step_abs, self.tokens, self.grad_l1 = [], 0, []

    def begin(self):
        self.step_abs.append(0.0)

    def linear(self, x, w):
        y = F.linear(x, w)
        if y.requires_grad:
            xa = x.detach().reshape(-1, x.shape[-1]).abs().double()
            self.tokens = max(self.tokens, xa.shape[0])

            def hook(g, xa=xa):
                ga = g.detach().reshape(-1, g.shape[-1]).abs().double()
                self.step_abs[-1] = max(self.step_abs[-1], (ga.t() @ xa).max().item())
            y.register_hook(hook)
        return y


def emulate_tp(cell, dump, tp, sp, bound=None):
    """trainscope's TP (tp ranks; SP: sequence-sharded norms and residual stream) in one process, trained
    on the dump's steps with the same SGD; dp_shard > 1 runs each TP group on its slice and averages the
    gradients over the groups (FSDP2's reduce-scatter with AVG). Returns {"final", "losses"}.

    What a TP implementation must do to give these bits (tp = 2):
    - Embedding: each rank looks up its vocabulary rows (tokens outside the shard at local row 0, their
      rows zeroed), the partials summed (all-reduce; with SP reduce-scatter along the sequence).
    - One identity-forward / all-reduce-backward node before q, k, v (and one before gate, up): each rank
      adds the q, k and v input gradients locally, then the ranks' sums are added; with SP the node is the
      all-gather along the sequence, whose backward is the reduce-scatter of those per-rank sums.
    - Local GEMMs on local shapes: q/k/v [B*S, D] x [D, n/tp]; o_proj's input [B*S, H*hd/tp]; the
      row-parallel partials summed (all-reduce, or reduce-scatter along the sequence with SP).
    - Attention per rank on its heads (heads/tp query heads, kv_heads/tp KV heads, GQA groups unchanged).
    - SP: each rank's norm on its sequence shard behind its own identity node (so the two gradient terms
      from inside the norm are added before the residual's term: (a + b) + c); norm weights' gradients
      are the per-rank partial sums added (all-reduce over TP).
    - lm_head column-parallel by vocabulary; the loss ParallelCE above (amax / sumexp / target-logit
      reductions, backward (onehot + exp(logp)) * (1/N)); the loss is the mean over this TP group's
      B/dp x S tokens; the step's loss across dp is the mean of the groups' losses.
    - dp > 1: the parameter gradients averaged over the dp ranks ((g0 + g1) / 2), then SGD (momentum 0.9,
      dampening 0, no Nesterov) on each shard."""
    import reference as ref
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    cfg = cell["config"]
    dp = max(int(cfg.get("world_size", tp)) // tp, 1)
    model = ref.build_model(cell)
    ref.load_named(model, dump["initial"])
    lm = model.lm
    eps = lm.config.rms_norm_eps
    init = dict(dump["initial"])
    params = {}  # trainscope name -> list of tp leaves (sharded) or one leaf (replicated)
    for name, t in init.items():
        d = split_dim(name)
        if d is None:
            params[name] = t.detach().clone().requires_grad_(True)
        else:
            params[name] = [c.contiguous().clone().requires_grad_(True) for c in t.chunk(tp, d)]
    leaves = [p for v in params.values() for p in (v if isinstance(v, list) else [v])]
    opt = torch.optim.SGD(leaves, **sgd_kwargs(cfg))
    linear = bound.linear if bound is not None else F.linear
    P = params

    def sequence_chunks(t):
        return [c.contiguous() for c in t.chunk(tp, 1)]

    def forward_loss(x, y):
        B, S = x.shape
        positions = torch.arange(S).unsqueeze(0)
        # vocabulary-parallel embedding: per rank masked lookup, the partials summed
        emb = None
        for r, w in enumerate(P["embed_tokens.weight"]):
            lo, n = r * w.shape[0], w.shape[0]
            mask = (x < lo) | (x >= lo + n)
            local = x.clone() - lo
            local[mask] = 0
            part = F.embedding(local, w).masked_fill(mask.unsqueeze(-1), 0.0)
            emb = part if emb is None else emb + part
        cos, sin = lm.model.rotary_emb(emb, positions)
        h = sequence_chunks(emb) if sp else emb

        def gathered(norm_w, hs):
            """The column-parallel block's input: the boundary node(s) and each rank's own node."""
            if sp:
                normed = [_rms(t.view_as(t), norm_w, eps) for t in hs]  # SequenceParallel's from_local
                full = torch.cat(normed, 1)  # all-gather along the sequence
            else:
                full = _rms(hs, norm_w, eps).view_as(hs)  # PrepareModuleInput's from_local
            return [full.view_as(full) for _ in range(tp)]  # the ranks' local grads add up here first

        def row_out(parts, residual):
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            if sp:
                return [r_ + c for r_, c in zip(residual, sequence_chunks(total))]
            return residual + total

        for i, layer in enumerate(lm.model.layers):
            pre = f"block{i}."
            attn = layer.self_attn
            hd = attn.head_dim
            ins = gathered(P[pre + "input_layernorm.weight"], h)
            parts = []
            for r in range(tp):
                q = linear(ins[r], P[pre + "q_proj.weight"][r]).view(B, S, -1, hd).transpose(1, 2)
                k = linear(ins[r], P[pre + "k_proj.weight"][r]).view(B, S, -1, hd).transpose(1, 2)
                v = linear(ins[r], P[pre + "v_proj.weight"][r]).view(B, S, -1, hd).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                o, _ = sdpa_attention_forward(attn, q, k, v, None, dropout=0.0, scaling=attn.scaling)
                o = o.reshape(B, S, -1).contiguous()
                parts.append(linear(o, P[pre + "o_proj.weight"][r]))
            h = row_out(parts, h)
            ins = gathered(P[pre + "post_attention_layernorm.weight"], h)
            parts = []
            for r in range(tp):
                g = layer.mlp.act_fn(linear(ins[r], P[pre + "gate_proj.weight"][r]))
                u = linear(ins[r], P[pre + "up_proj.weight"][r])
                parts.append(linear(g * u, P[pre + "down_proj.weight"][r]))
            h = row_out(parts, h)
        if sp:
            normed = [_rms(t.view_as(t), P["norm.weight"], eps) for t in h]
            final = torch.cat(normed, 1)
        else:
            final = _rms(h, P["norm.weight"], eps).view_as(h)  # lm_head's from_local
        final = final[:, 0:, :]  # HF's logits_to_keep slice
        shards = [linear(final, w).reshape(B * S, -1) for w in P["lm_head.weight"]]
        return ParallelCE.apply(y.reshape(-1), *shards)

    steps = dump["inputs"].shape[0]
    losses = []
    for s in range(steps):
        if s == 0:
            torch.set_rng_state(dump["rng_state"])
        opt.zero_grad(set_to_none=True)
        if bound is not None:
            bound.begin()
        step_losses = []
        grads = None
        for d in range(dp):
            x, y = dp_slice(dump, s, d, dp)
            loss = forward_loss(x, y)
            loss.backward()
            step_losses.append(loss.detach().to(torch.float64))
            if dp > 1:  # each group's gradients kept apart, then averaged as FSDP2's reduce-scatter (AVG)
                mine = [p.grad.detach().clone() for p in leaves]
                grads = mine if grads is None else [a + b for a, b in zip(grads, mine)]
                opt.zero_grad(set_to_none=True)
        if dp > 1:
            for p, g in zip(leaves, grads):
                p.grad = g / dp
        if bound is not None:
            bound.grad_l1.append(sum(p.grad.double().abs().sum().item() for p in leaves))
        opt.step()
        total = step_losses[0]
        for v in step_losses[1:]:
            total = total + v
        losses.append((total / dp).item())
    final = {}
    with torch.no_grad():
        for name, v in params.items():
            final[name] = torch.cat([t.detach() for t in v], split_dim(name)) if isinstance(v, list) else v.detach().clone()
    return {"final": final, "losses": losses}


# ---- the tolerance from the arithmetic -----------------------------------------------------------
def tolerance(cell, bound, losses):
    """When two TP implementations sum the same products in other groupings (another split of K, another
    grouping of gradient contributions), each weight-gradient element of a GEMM over N tokens differs by at
    most 2·γ_N·(|dY|ᵀ|X|)_ij, γ_N = N·u/(1 − N·u), u = 2⁻²⁴ (Higham §3.1; notes §2.3), given identical
    inputs. Assumed, to first order: the inputs' own differences come from the same kind of reductions
    upstream, at most one per contraction on the longest backward chain (lm_head, then o_proj, q/k/v,
    down_proj, gate/up per layer: C = 1 + 4·L levels), and a parameter difference does not feed back into
    later gradients (lr·K small). Then with momentum μ = 0.9 (dampening 0), after K steps
        |Δp| ≤ lr · Σ_{k<K} Σ_{j≤k} μ^(k−j) · ε_j,   ε_j = C · 2γ_N · max(|dY|ᵀ|X|) at step j,
    and the loss at step k (first order in the parameters' differences) differs by at most
        |ΔL_k| ≤ C · 2γ_V · |L_k| + ‖g_k‖₁ · |Δp|_k    (V: the vocabulary, the longest forward reduction
    into the loss). Returns (parameter tolerance, loss tolerance, the text of the derivation)."""
    cfg = cell["config"]
    lr, mu = float(cfg.get("lr", 1e-3)), 0.9
    L = int(cell["model"]["shape"]["layers"])
    V = int(cell["model"]["shape"]["vocab"])
    u = 2.0 ** -24
    N = max(bound.tokens, 1)
    gamma = lambda n: n * u / (1 - n * u)  # noqa: E731
    C = 1 + 4 * L
    eps = [C * 2 * gamma(N) * a for a in bound.step_abs]
    buf, dp_, dps = 0.0, 0.0, []
    for e in eps:
        buf = mu * buf + e  # a bound on the momentum buffer's difference
        dp_ += lr * buf
        dps.append(dp_)
    loss_tol = max((C * 2 * gamma(V) * abs(l) + (bound.grad_l1[k] * (dps[k - 1] if k else 0.0))
                    for k, l in enumerate(losses)), default=0.0)
    why = (f"first order, no feedback: |Δp| ≤ lr·Σ_k Σ_(j≤k) 0.9^(k−j)·C·2γ_N·max(|dY|ᵀ|X|)_j with N = {N} tokens, "
           f"C = 1 + 4·L = {C} reductions on the backward chain, γ_N = N·2⁻²⁴/(1 − N·2⁻²⁴), |dY|ᵀ|X| measured per "
           f"weight-gradient GEMM of the emulation (Higham §3.1 split-K bound); loss: "
           f"C·2γ_V·|L_k| + ‖g_k‖₁·|Δp|_k, V = {V}")
    return dps[-1] if dps else 0.0, loss_tol, why


# ---- the row ------------------------------------------------------------------------------------
def loss_check(name, ours, theirs, tol=0.0, why=None):
    diff = max(abs(a - b) for a, b in zip(ours, theirs)) if len(ours) == len(theirs) else None
    row = {"name": name, "trainscope": [round(v, 6) for v in ours], "pytorch": [round(v, 6) for v in theirs],
           "difference": diff}
    if diff == 0 and all(a == b for a, b in zip(ours, theirs)):
        row["verdict"] = "exact"
    elif diff is not None and diff <= tol:
        row.update(verdict="within", tolerance=tol)
        if why:
            row["tolerance_from"] = why
    else:
        row.update(verdict="differs", tolerance=tol)
    return row


def row(cell, dump, dump_path, lib):
    """The TP row's checks: trainscope against the emulation (bit for bit) and against DTensor TP (bit for
    bit where it is, else within the derived tolerance); DTensor against the emulation; model-state bytes
    per rank."""
    import reference as ref
    tp, sp, dp = layout(cell)
    steps = dump["inputs"].shape[0]
    if dump["inputs"].shape[1] % dp:
        raise ref.InputError(f"the global batch ({dump['inputs'].shape[1]}) does not divide by dp_shard = {dp}")
    runs = train_ranks(cell, dump_path, lib)
    bound = _Bound()
    emu = emulate_tp(cell, dump, tp, sp, bound)
    p_tol, l_tol, why = tolerance(cell, bound, emu["losses"])
    ours_final = dict(dump["final"])
    ours_losses = dump["step_losses"].tolist()
    what = f"TP {tp}" + (" + SP" if sp else "") + (f", FSDP2 over dp {dp}" if dp > 1 else "")
    checks = [
        ref.tensor_check(f"parameters after {steps} steps: the one-process emulation of {what} (tp_ref.emulate_tp)",
                         ours_final, emu["final"]),
        loss_check(f"loss at each of {steps} steps: the emulation", ours_losses, emu["losses"]),
        ref.tensor_check(f"parameters after {steps} steps: DTensor {what}", ours_final, runs[0]["final"], p_tol, why),
        loss_check(f"loss at each of {steps} steps: DTensor", ours_losses, runs[0]["losses"], l_tol, why),
        ref.tensor_check(f"parameters after {steps} steps: the emulation (trainscope's column) against DTensor",
                         emu["final"], runs[0]["final"], p_tol, why),
    ]
    if lib:
        checks += ref.memory_checks(cell, runs, "tp")
    ours_t = (cell["metrics"].get("timing", {}).get("step_time_s") or {}).get("p50")
    theirs_t = runs[0]["step_time_p50_s"]
    out = {"checks": checks,
           "step_time_s": {"trainscope": ours_t, "pytorch": theirs_t,
                           "ratio": ours_t / theirs_t if ours_t and theirs_t else None},
           "comm_bytes_per_step": {"trainscope": ref.comm_per_step(cell), "pytorch": runs[0]["comm_bytes_per_step"]},
           "tolerance": {"parameters": p_tol, "loss": l_tol}}
    if runs[0].get("attempts", 1) > 1:
        out["reference_attempts"] = runs[0]["attempts"]
    return out
