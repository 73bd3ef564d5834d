"""Cost of the step-boundary vote (preemption / SIGTERM / minutes-interval save) against no vote at all.

    python bench/step_vote/run.py [--steps 200] [--ranks 2] [--work-ms 20]

Two gloo ranks under torchrun (CPU, one thread each) run the same "step" (a matmul all-reduced over
the ranks, like a gradient) with, interleaved in rounds:

- ``none``: no vote;
- ``blocking``: the vote before this change: an all-reduce of the flags on the training group and two
  ``.item()`` per step (on a GPU each ``.item()`` is a host sync that waits for the whole step);
- ``async``: ``trainer.preemption.BoundaryVote``: the flags go out on a gloo side group in the
  background and are read one boundary later (no device tensor, no ``.item()`` of one).

Printed: median step time of each and its ratio to ``none``, and the median time the loop spent inside
the vote itself (blocked). On a shared CPU the step-time ratios are within the noise; what a GPU adds
(each ``.item()`` waits for the whole queued step) only a GPU shows: tests/gpu checks that the async
vote makes no host sync, and bench/gpu_check sizes per-step syncs (log_every 1 vs 20).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "blocking", "async")


def blocking_vote(flags: list[int]) -> tuple[bool, bool]:
    """The vote as it was: all-reduce on the default group, then one ``.item()`` per flag."""
    import torch
    import torch.distributed as dist

    votes = torch.tensor(flags)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX)
    return bool(votes[0].item()), bool(votes[1].item())


def measure(steps: int, work_ms: float) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from trainer.preemption import BoundaryVote

    size = 64
    while True:  # a matmul of about work_ms on this machine
        a = torch.randn(size, size)
        tic = time.perf_counter()
        a @ a
        if (time.perf_counter() - tic) * 1000 >= work_ms or size >= 4096:
            break
        size = int(size * 1.25)
    sizes = torch.tensor([size])
    dist.all_reduce(sizes, op=dist.ReduceOp.MIN)  # both ranks do the same work
    a = torch.randn(int(sizes.item()), int(sizes.item()))
    grad = torch.zeros(256 * 1024)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    times.update({f"{m} in vote": [] for m in MODES})
    for round_ in range(4):
        for mode in MODES if round_ % 2 == 0 else reversed(MODES):
            vote = BoundaryVote()
            for step in range(steps // 4):
                tic = time.perf_counter()
                a @ a
                dist.all_reduce(grad)  # the step's own collective
                in_vote = time.perf_counter()
                if mode == "blocking":
                    blocking_vote([0, 0])
                elif mode == "async":
                    vote.exchange([0, 0])
                toc = time.perf_counter()
                times[mode].append(toc - tic)
                times[f"{mode} in vote"].append(toc - in_vote)
            vote.close()
    return times


def worker(out: str, steps: int, work_ms: float) -> None:
    import torch

    from trainer.dist import detect_rank_env, init_distributed, shutdown

    torch.set_num_threads(1)
    env = detect_rank_env()
    init_distributed(env, "gloo", timeout_s=300)
    times = measure(steps, work_ms)
    if env.rank == 0:
        Path(out).write_text(json.dumps(times))
    shutdown(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--work-ms", type=float, default=20.0)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), float(args.worker[2]))
        os._exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               __file__, "--worker", str(out), str(args.steps), str(args.work_ms)]
        subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO)))
        times = json.loads(out.read_text())
    base = statistics.median(times["none"])
    print(f"load average {os.getloadavg()[0]:.2f}; {args.ranks} gloo ranks, {args.steps} steps per mode "
          f"(4 interleaved rounds), step ≈ {1000 * base:.1f} ms")
    print(f"{'vote':9s} {'step ms':>9s} {'ratio':>7s} {'in vote ms':>11s}  host syncs/step on a GPU")
    for mode, syncs in zip(MODES, ("0", "2 (.item()) + the all-reduce", "0")):
        med, blocked = statistics.median(times[mode]), statistics.median(times[f"{mode} in vote"])
        print(f"{mode:9s} {1000 * med:9.2f} {med / base:7.3f} {1000 * blocked:11.3f}  {syncs}")


if __name__ == "__main__":
    main()
