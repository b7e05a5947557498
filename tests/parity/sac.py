"""torchtitan 0.3.0's op-level selective activation checkpointing (SelectiveAC with its default config),
written again over torch.utils.checkpoint for the parity references of `checkpoint = "selective-op"`.

What torchtitan does per transformer block (torchtitan/distributed/activation_checkpoint.py, 0.3.0):
wrap the block in a non-reentrant checkpoint (preserve_rng_state=True, early_stop=False) whose
context_fn is create_selective_checkpoint_contexts(policy), with a fresh policy per block call. The
policy keeps (MUST_SAVE) the outputs of the save set and recomputes everything else (PREFER_RECOMPUTE);
of the matrix products (aten.mm, aten.linear) it counts each pass separately (forward, recompute) and
recomputes every second one. The save set is torch's own list of compute-intensive ops
(torch._functorch.partitioners.get_default_op_list().compute_intensive_ops, their .default overloads:
mm, addmm, bmm, the CUDA SDPA kernels, convolution, _scaled_mm, ...) plus SDPA cudnn/math/overrideable,
aten.max, flex attention, aten.linear, aten.topk and the communication ops.

One addition, for a CPU: aten._scaled_dot_product_flash_attention_for_cpu, which is in neither list
(torchtitan runs on GPUs, whose flash kernel is in the first), so that attention is kept as it would be
on a GPU. trainscope's selective-op (suites/techniques/checkpoint.cpp) keeps the same outputs.
torchtitan's force-recompute-by-shape rule matches its default module name "moe.router.gate": no module
of these models has that name, so it never applies here.
"""
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten

# The matrix products the every-second rule counts.
MM_OPS = (aten.mm.default, aten.linear.default)


def _optional(root, dotted):
    """An op that exists only in some builds (None when this torch has no such op)."""
    obj = root
    try:
        for part in dotted.split("."):
            obj = getattr(obj, part)
    except (AttributeError, RuntimeError):
        return None
    return obj


def save_ops(cpu_attention=True):
    """torchtitan 0.3.0's default save set (with the CPU flash kernel unless cpu_attention is False)."""
    from torch._functorch.partitioners import get_default_op_list
    ops = {packet.default for packet in get_default_op_list().compute_intensive_ops}
    ops |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default, aten.linear.default,
            aten.topk.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default}
    for root, dotted in ((torch._higher_order_ops, "flex_attention"), (torch._higher_order_ops, "inductor_compiled_code"),
                         (torch.ops, "torch_attn._varlen_attn.default"), (torch.ops, "deepep.dispatch.default"),
                         (torch.ops, "deepep.combine.default"), (torch.ops, "hybridep.dispatch.default"),
                         (torch.ops, "hybridep.combine.default")):
        op = _optional(root, dotted)
        if op is not None:
            ops.add(op)
    if cpu_attention:
        ops.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
    return ops


_SAVE_OPS = None


def _save_set():
    """save_ops(), made once on first use (torch's op list imports the compiler's partitioner: a second)."""
    global _SAVE_OPS
    if _SAVE_OPS is None:
        _SAVE_OPS = save_ops()
    return _SAVE_OPS


def policy():
    """One block call's policy: its own mm counters, forward and recompute apart (as torchtitan's)."""
    count = {"forward": 0, "recompute": 0}
    keep = _save_set()

    def decide(ctx, func, *args, **kwargs):
        if (func == aten._to_copy.default and "cuda" in str(args[0].device)
                and str(kwargs.get("device", "")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE  # device-to-host results (MoE metadata); none on a CPU
        key = "recompute" if ctx.is_recompute else "forward"
        if func in MM_OPS:
            count[key] += 1
        if func in keep:
            if func in MM_OPS and count[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def context_fn():
    return create_selective_checkpoint_contexts(policy())


def run(fn, *args, **kwargs):
    """fn(*args, **kwargs) under torchtitan's SelectiveAC (its checkpoint_wrapper's arguments)."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, early_stop=False, context_fn=context_fn,
                      **kwargs)


def run_full(fn, *args, **kwargs):
    """fn(*args, **kwargs) under a plain non-reentrant checkpoint (torchtitan's FullAC)."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, early_stop=False, **kwargs)
