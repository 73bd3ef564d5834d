"""`hpcx dryrun` wall time and peak RSS at full world size, against a process that only imports it.

    python bench/dryrun/run.py

Runs, each in a fresh process: the baseline (`import torch` and the trainer modules dryrun uses),
`hpcx dryrun jobs/gpt-13b-auto.toml --site dgx-h100` (4 nodes × 8 = 32 ranks, hsdp) and the 70b
preset on 16 × 8 = 128 ranks of dgx-h100 (fsdp and hsdp, last rank). Prints seconds and peak RSS
(VmHWM of the child, from wait4's rusage) and both as ratios to the baseline measured in the same
run. Goal: under 2 minutes and under 4 GB each, on a 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIG = str(REPO / "jobs" / "gpt-13b-auto.toml")
SEVENTY = ["--set", "model.size='70b'", "--set", "job.nodes=16", "--set", "train.global_batch=1024"]
CASES = {
    "baseline (import torch + trainer)": [sys.executable, "-c", "import torch, trainer.train, hpc.dryrun"],
    "13b, dgx-h100 4 x 8 (auto: hsdp)": [sys.executable, "-m", "hpc.cli", "dryrun", BIG, "--site", "dgx-h100"],
    "70b, dgx-h100 16 x 8, fsdp, rank 127": [sys.executable, "-m", "hpc.cli", "dryrun", BIG, "--site", "dgx-h100",
                                             *SEVENTY, "--set", "parallel.strategy='fsdp'", "--rank", "127"],
    "70b, dgx-h100 16 x 8, hsdp 8, rank 127": [sys.executable, "-m", "hpc.cli", "dryrun", BIG, "--site", "dgx-h100",
                                               *SEVENTY, "--set", "parallel.strategy='hsdp'", "--rank", "127"],
}


def run(cmd: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RSS bytes, exit code) of ``cmd`` in a fresh process."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    return seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    base_s = base_rss = 0.0
    for name, cmd in CASES.items():
        seconds, rss, code = run(cmd)
        if not base_s:
            base_s, base_rss = seconds, rss
        print(f"{name:<40} {seconds:6.1f} s ({seconds / base_s:4.1f}x baseline)  peak RSS {rss / 2**30:5.2f} GiB "
              f"({rss / base_rss:4.2f}x baseline)  exit {code}", flush=True)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
