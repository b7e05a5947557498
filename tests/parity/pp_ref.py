"""Pipeline parallelism (pp) of the llama rows: torch.distributed.pipelining's schedule of the same name on
the same stages, on pp Gloo ranks, trained on what the trainscope cell ran (reference.py's `row` for kind
"pp").

The cell: config pp (the world size), pp_schedule (gpipe, 1f1b, interleaved-1f1b, zb-1p), pp_virtual (stages
per rank; default 2 for interleaved-1f1b, else 1), pp_microbatches (default 2 x pp). zb-1p is torch's
ScheduleInterleavedZeroBubble at any number of stages per rank (its table with one stage per rank is
ZB-H1's), each backward split into the input's gradient (I) and the weights' (W). The stages cut the layers as
suites/parallel/pipeline.cpp does (core/pipeline.hpp's stage_layers: equal when the stages divide the
layers; the rows here divide them) and sit in a loop: rank r holds stages r, r + pp, ... The first stage
also runs the embedding, the last the final norm, the head and the loss. Each stage is made of HF's
LlamaForCausalLM's own modules (embed_tokens, the decoder layers, norm, lm_head) with the rotary tables the
model computes; the loss is trainscope's, the cross-entropy of the fp32 logits, a micro-batch's mean.

torch's schedules divide the accumulated gradients by m after the last backward (scale_grads); trainscope
scales each micro-batch's loss by 1/m before its backward. With m a power of two both are exact scalings
of the same sums, the same bits; the gradients accumulate micro-batch by micro-batch in the order the
schedule runs its backwards, on both sides.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
             "zb-1p": "ScheduleInterleavedZeroBubble"}
MULTI_STAGE = {"interleaved-1f1b", "zb-1p"}  # torch's classes that take a list of a rank's stages


def layout(cell):
    """(pp, stages per rank, micro-batches, schedule name) of a pp cell, checked against the contract."""
    import reference as ref
    cfg = cell["config"]
    pp = int(cfg.get("pp", 1))
    name = cfg.get("pp_schedule", "1f1b")
    v = int(cfg.get("pp_virtual", 0) or (2 if name == "interleaved-1f1b" else 1))
    m = int(cfg.get("pp_microbatches", 0) or 2 * pp)
    if not ref.is_llama(cell):
        raise ref.InputError("the pp references replay the llama family (HF's LlamaForCausalLM)")
    if cell["model"]["shape"].get("attention") != "sdpa":
        raise ref.InputError("the pp references run SDPA's causal kernel (a stage has no mask of its own)")
    if name not in SCHEDULES:
        raise ref.InputError(f"pp_schedule {name}: the references run {', '.join(SCHEDULES)}")
    if int(cfg.get("world_size", pp)) != pp:
        raise ref.InputError("the pp references run pp alone (world_size = pp)")
    if m & (m - 1):
        raise ref.InputError(f"pp_microbatches {m}: the references need a power of two (an exact 1/m on both sides)")
    layers = int(cell["model"]["shape"]["layers"])
    if layers % (pp * v):
        raise ref.InputError(f"{pp * v} stages do not divide the {layers} layers (the references cut evenly)")
    return pp, v, m, name


class Stage(torch.nn.Module):
    """Layers [first, last) of HF's model, with the embedding before the first layer and the norm and the
    head after the last: what trainscope's forward_layers(in, first, last) runs."""

    def __init__(self, lm, first, last):
        super().__init__()
        layers = len(lm.model.layers)
        self.embed = lm.model.embed_tokens if first == 0 else None
        self.layers = torch.nn.ModuleList(lm.model.layers[first:last])
        self.norm = lm.model.norm if last == layers else None
        self.head = lm.lm_head if last == layers else None
        self.rotary = lm.model.rotary_emb

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        positions = torch.arange(h.shape[1]).unsqueeze(0)
        cos, sin = self.rotary(h, positions)
        for layer in self.layers:
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
            h = out[0] if isinstance(out, tuple) else out
        return h if self.head is None else self.head(self.norm(h))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def train_pp(cell, dump, rank, world):
    """torch.distributed.pipelining on this rank; the final parameters of its stages and the step losses
    (the last stage's rank holds them)."""
    import reference as ref
    from torch.distributed import pipelining
    cfg = cell["config"]
    pp, v, m, name = layout(cell)
    threads = int(cell.get("threads") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    model = ref.build_model(cell)
    ref.load_named(model, dump["initial"])
    lm = model.lm
    layers = len(lm.model.layers)
    per = layers // (pp * v)
    mine = [s for s in range(pp * v) if s % pp == rank]
    stages = [pipelining.PipelineStage(Stage(lm, s * per, (s + 1) * per), s, pp * v, torch.device("cpu")) for s in mine]
    live = [0, 0]  # micro-batch stages forwarded and not yet released on this rank: now, at most
    for st in stages:
        count_in_flight(st, live)
    schedule_class = getattr(pipelining.schedules, SCHEDULES[name])
    schedule = schedule_class(stages if name in MULTI_STAGE else stages[0], n_microbatches=m, loss_fn=loss_fn)
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.SGD(params, lr=float(cfg.get("lr", 1e-3)), momentum=0.9, weight_decay=float(cfg.get("weight_decay", 0.0)),
                          foreach=False)
    last_rank = (pp * v - 1) % pp
    warmup = int(cfg.get("warmup_steps", 0))
    times, losses = [], []
    for s in range(dump["inputs"].shape[0]):
        x, y = dump["inputs"][s], dump["targets"][s]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        micro = []
        if rank == 0 and rank == last_rank:
            schedule.step(x, target=y, losses=micro)
        elif rank == 0:
            schedule.step(x)
        elif rank == last_rank:
            schedule.step(target=y, losses=micro)
        else:
            schedule.step()
        opt.step()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
        if micro:  # the micro-batches' mean as trainscope's pipeline takes it: summed in order, in fp32
            total = micro[0].detach()
            for loss in micro[1:]:
                total = total + loss.detach()
            losses.append((total / m).item())
    mine_ids = {id(p) for st in stages for p in st.submod.parameters()}
    held = {k: p.detach().clone() for k, p in ref.trainscope_parameters(model) if id(p) in mine_ids}
    return {"final": held, "losses": losses, "in_flight": live[1], "actions": actions_of(schedule, rank),
            "step_time_p50_s": statistics.median(times) if times else None}


def actions_of(schedule, rank):
    """The rank's computation actions in order, in torch's notation ("0F1"): the schedule's
    pipeline_order without its empty slots and its other actions (REDUCE_GRAD, the data-parallel
    gradient sync after the last backward); None where a schedule keeps no table."""
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(order, dict):
        return None
    return " ".join(str(a) for a in order[rank] if a is not None and a.computation_type.value in ("F", "B", "I", "W"))


def count_in_flight(stage, live):
    """Counts the stage's forwards up and its releases down in `live`, keeping the peak: a full backward
    releases a micro-batch, a split one (I then W) at its W, as trainscope's pipeline counts them."""
    forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def counted_forward(*args, **kwargs):
        live[0] += 1
        live[1] = max(live[1], live[0])
        return forward(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        out = backward(*args, **kwargs)
        if kwargs.get("full_backward", args[2] if len(args) > 2 else True):
            live[0] -= 1
        return out

    def counted_weight(*args, **kwargs):
        out = weight(*args, **kwargs)
        live[0] -= 1
        return out

    stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk = counted_forward, counted_backward, counted_weight


def _rank_main(rank, world, cell, dump_path, lib, out_dir):
    import faulthandler
    import reference as ref
    faulthandler.enable()
    dist.init_process_group("gloo", init_method="file://" + os.path.join(out_dir, "store"), rank=rank, world_size=world)
    try:
        dump = ref.load_dump(dump_path)
        torch.save(train_pp(cell, dump, rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def row(cell, dump, dump_path, lib):
    """The pp row: trainscope's pipeline against torch.distributed.pipelining's schedule of the same name,
    parameters and losses bit for bit (exact arithmetic on both sides: the same stages, exact transfers,
    the same accumulation order, an exact 1/m)."""
    import reference as ref
    pp, v, m, name = layout(cell)
    runs = ref.spawn_ranks(_rank_main, lambda tmp: (pp, cell, str(dump_path), lib, tmp), pp, cell["name"])
    theirs = {}
    for r in runs:
        theirs.update(r["final"])
    losses = next(r["losses"] for r in runs if r["losses"])
    steps = dump["inputs"].shape[0]
    what = f"{SCHEDULES[name]} over {pp} ranks, {pp * v} stages, {m} micro-batches"
    ours_losses = dump["step_losses"].tolist()
    checks = [ref.tensor_check(f"parameters after {steps} steps: torch.distributed.pipelining {what}", dict(dump["final"]), theirs),
              ref.value_check(f"loss at each of {steps} steps: torch.distributed.pipelining", ours_losses, losses)]
    # Rank 0's micro-batch stages in flight at once (what its activations scale with): the cell's metrics
    # are rank 0's.
    pipeline = cell["metrics"].get("timing", {}).get("pipeline", {})
    ours_live = (pipeline.get("in_flight_microbatches") or {}).get("measured")
    checks.append(ref.value_check("micro-batch stages in flight on rank 0, at most", ours_live, runs[0]["in_flight"]))
    # The table itself, where torch keeps one (its multi-stage classes): rank 0's actions in order.
    if runs[0]["actions"] is not None:
        checks.append(ref.value_check(f"rank 0's actions in order: {SCHEDULES[name]}'s pipeline_order", pipeline.get("actions"), runs[0]["actions"]))
    ours_t = (cell["metrics"].get("timing", {}).get("step_time_s") or {}).get("p50")
    theirs_t = runs[0]["step_time_p50_s"]
    return {"checks": checks,
            "step_time_s": {"trainscope": ours_t, "pytorch": theirs_t, "ratio": ours_t / theirs_t if ours_t and theirs_t else None}}
