"""One rank of a torchrun launch that checks the step-boundary vote and the collective timeouts.

    torchrun --nproc_per_node=2 tests/trainer/collective_worker.py OUT_DIR

Each rank writes OUT_DIR/rank-R.json: at which boundary each vote was agreed, and how the collectives
fared under the long and the short timeout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.dist import CollectiveTimeouts, detect_rank_env, init_distributed
from trainer.preemption import BoundaryVote

BOUNDARIES = 8


def votes(rank: int) -> dict[str, list[int]]:
    """Rank 1 raises flag 0 at boundary 3; rank 0 raises flag 1 at boundary 5 and lowers it again."""
    vote, seen = BoundaryVote(), {"flag0": [], "flag1": []}
    for boundary in range(1, BOUNDARIES + 1):
        flags = [int(rank == 1 and boundary >= 3), int(rank == 0 and boundary == 5)]
        time.sleep(0.05 * rank)  # ranks reach their boundaries at different times
        agreed = vote.exchange(flags, last=boundary == BOUNDARIES)
        for i, name in enumerate(seen):
            if agreed[i]:
                seen[name].append(boundary)
    vote.close()
    return seen


def timed_all_reduce(delay: float, waiting: Path) -> dict:
    """All-reduce a one, rank 1 ``delay`` s after rank 0 said it is waiting (the file ``waiting``: so rank 0
    waits at least that long however slow either rank is); what happened on this rank."""
    if dist.get_rank() == 1:
        while not waiting.exists():
            time.sleep(0.01)
        time.sleep(delay)
    tic = time.monotonic()
    if dist.get_rank() == 0:
        waiting.touch()
    try:
        one = torch.ones(1)
        dist.all_reduce(one)
        return {"ok": True, "value": float(one), "waited_s": time.monotonic() - tic}
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc)[:1000], "waited_s": time.monotonic() - tic}


def main(out: Path) -> None:
    env = detect_rank_env()
    init_distributed(env, "gloo", 60)
    report: dict = {"votes": votes(env.rank)}
    timeouts = CollectiveTimeouts(long_s=60, short_s=2)
    timeouts.shorten(torch.nn.Linear(2, 2))
    report["groups"] = len(timeouts.groups)
    with timeouts.lengthened():
        report["late_in_a_save"] = timed_all_reduce(4.0, out / "waiting-1")  # 4 s late is fine, timeout long
    report["late_mid_run"] = timed_all_reduce(8.0, out / "waiting-2")  # … and not once it is short again
    (out / f"rank-{env.rank}.json").write_text(json.dumps(report))
    sys.stdout.flush()
    import os

    os._exit(0)  # the timed-out group is broken: skip its teardown


if __name__ == "__main__":
    main(Path(sys.argv[1]))
