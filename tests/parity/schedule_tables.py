"""torch.distributed.pipelining's own tables for trainscope's schedule names, without processes: for each
(name, pp, microbatches, stages per rank) on the command line, every rank's computation actions in order
in torch's notation ("0F1"), as its schedule class builds them (the empty slots dropped). One JSON object
on stdout: {"name/p/m/v": [rank 0's actions, rank 1's, ...]}.

The multi-stage classes keep the table they run (pipeline_order); they are built on mock stages as
torch's _schedule_visualizer.get_schedule_ops builds them, here also with one stage per rank, which
ScheduleInterleavedZeroBubble takes (its table is then ZB-H1's). Usage:
  schedule_tables.py zb-1p/2/4/1 interleaved-1f1b/4/8/2 ...
"""
import json
import sys
from unittest import mock

from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import PipelineStage

CLASSES = {"interleaved-1f1b": schedules.ScheduleInterleaved1F1B, "zb-1p": schedules.ScheduleInterleavedZeroBubble}


def table(name, p, m, v):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    order = CLASSES[name]([stage] * v, m).pipeline_order
    return [" ".join(str(a) for a in order[r] if a is not None) for r in range(p)]


def main(argv):
    out = {}
    for spec in argv:
        name, p, m, v = spec.split("/")
        out[spec] = table(name, int(p), int(m), int(v))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
