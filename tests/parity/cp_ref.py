"""Context parallelism against torch's own ring-attention templates: `_templated_ring_attention` and
`_templated_ring_attention_backward` (torch/distributed/tensor/experimental/_context_parallel/_attention.py)
with the CPU flash kernel, on 2 Gloo ranks, on the same shards trainscope's ranks hold. torch 2.11's public
`context_parallel` has no CPU path (the CPU flash op has no sharding strategy); its templates run on Gloo.

usage: cp_ref.py IN.pt OUT_PREFIX
  IN.pt: a dict with q, k, v, dout over the whole sequence ([B, H, S, Dh], equal heads: the templates
  take no grouped-query keys). Writes OUT_PREFIX.<layout>-<rotation>.rank<r>.pt, a dict of that rank's
  out, lse, dq, dk, dv, for layout in (balanced, contiguous) and rotation in (allgather, alltoall).
"""
import os
import sys

import torch
import torch.jit._pickle  # the type tag LibTorch's pickle_save writes (see main)
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def positions(S, rank, world, balance):
    """context_parallel::positions: chunks rank and 2W-1-rank of 2W (head-tail), else the rank-th W-th."""
    if not balance:
        c = S // world
        return torch.arange(rank * c, (rank + 1) * c)
    h = S // (2 * world)
    return torch.cat([torch.arange(rank * h, (rank + 1) * h), torch.arange((2 * world - 1 - rank) * h, (2 * world - rank) * h)])


def run(rank, store, inputs, prefix):
    import functools
    import torch.distributed.tensor.experimental._context_parallel._attention as A
    # A file store beside the outputs: no port to find free and race for.
    dist.init_process_group("gloo", init_method="file://" + os.path.abspath(store), rank=rank, world_size=WORLD)
    pg = dist.group.WORLD
    aten = torch.ops.aten
    scale = inputs["q"].size(-1) ** -0.5
    for balance in (True, False):
        for rotation, method in (("allgather", A._RotateMethod.ALL_GATHER), ("alltoall", A._RotateMethod.ALL_TO_ALL)):
            A._cp_options.enable_load_balance = balance
            A._cp_options.rotate_method = method
            pos = positions(inputs["q"].size(2), rank, WORLD, balance)
            q, k, v, dout = (inputs[n].index_select(2, pos).contiguous() for n in ("q", "k", "v", "dout"))
            out, lse = A._templated_ring_attention(pg, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
                                                   is_causal=True, scale=scale)[:2]
            dq, dk, dv = A._templated_ring_attention_backward(
                pg, 2, functools.partial(aten._scaled_dot_product_flash_attention_for_cpu_backward, dropout_p=0.0),
                dout, "grad_out", q, k, v, out, lse, is_causal=True, scale=scale)[:3]
            name = ("balanced" if balance else "contiguous") + "-" + rotation
            torch.save({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}, f"{prefix}.{name}.rank{rank}.pt")
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()
    # Past this point the outputs are written: leave without the interpreter's teardown, where Gloo's
    # threads have aborted a rank ("terminate called without an active exception") under load.
    os._exit(0)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    # Written by LibTorch's pickle_save: tensors plus the type tag of its typed dict (reference.py's load_dump).
    with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
        inputs = torch.load(sys.argv[1], weights_only=True)
    mp.spawn(run, args=(sys.argv[2] + ".store", inputs, sys.argv[2]), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
