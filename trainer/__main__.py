"""``python -m trainer RUN_DIR``: one rank, under torchrun or as a single process.

    torchrun --nproc_per_node=2 --no-python hpcx-rank ~/hpcx-runs/tiny-ddp-…/
    hpcx-rank RUN_DIR                  # strategy none/dp, or a 1-rank ddp/fsdp
    python -m trainer RUN_DIR          # the same, where the current folder holds no trainer of its own

Rank 0 prints the summary as one JSON line on stdout.
"""

from __future__ import annotations

import json
import os
import sys

from trainer.preemption import PreemptionFlag


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from trainer.train import run_rank  # lazy: torch

    result = run_rank(argv[0], preemption=PreemptionFlag().install())
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Work done and flushed: skip native teardown, where gloo sometimes aborts (see trainer.task).
    os._exit(code)
