"""How much an OCI container adds to a job's start, on the Slurm sandbox: the same job bare and in the image.

    python bench/container_start/run.py [--reps 3] [--nodes 2] [--tasks 2]

Each rep submits, in turn, the same script-mode job (``job.command`` is a one-line Python that writes the
time it started, then exits) to site ``sandbox`` (the nodes' own Python) and to ``sandbox-oci`` (every task
in the image scripts/sandbox-image built, run by runc on its node: the per-run bundle and overlay written
at submit, each task's configuration and devices added on its node, the image's Python). A start is the
time from just before ``hpcx submit`` to the moment the last rank's command runs, so it holds the
submit, the queue, the batch script, srun, and for ``sandbox-oci`` everything the container adds; each
job is waited for to end before the next is submitted (an empty queue for both).

Prints the median start of each, their difference (goal: the image adds ≤ 10 s per start, image cached)
and the ratio oci / bare. Needs the sandbox up (scripts/slurm-sandbox up) and its images built.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = Path("/var/lib/hpcx-sandbox/runs")  # the sandbox's run root: both nodes see it
IMAGE = Path("/var/cache/hpcx-sandbox/images/torch")
STARTED = "import sys, time; open(sys.argv[1] + '/start-' + __import__('os').environ['RANK'], 'w').write(repr(time.time()))"
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def hpcx(*args: str, cwd: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "hpc.cli", *args], capture_output=True, text=True, cwd=cwd,
                         timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"hpcx {' '.join(args)}: {(out.stdout + out.stderr).strip()[-2000:]}")
    return out.stdout


def one_start(site: str, folder: Path, nodes: int, tasks: int) -> float:
    """Seconds from submit to the last rank's command running, for one job on ``site``; waits for its end."""
    folder.mkdir(parents=True)
    (folder / "job.toml").write_text(f'[job]\nname = "bench-start"\nnodes = {nodes}\ntasks_per_node = {tasks}\n'
                                     f'command = {json.dumps(["python3", "-c", STARTED, str(folder)])}\n')
    began = time.time()
    run = Path(json.loads(hpcx("submit", "job.toml", "--site", site, "--json", cwd=folder))["run_dir"])
    while True:  # a hang guard, not a timing: the figure is the ranks' own clock
        state = json.loads(hpcx("status", str(run), "--json", cwd=folder)).get("state", "")
        if str(state).split()[:1] and str(state).split()[0] in ENDED:
            break
        time.sleep(0.5)
    marks = [float(p.read_text()) for p in folder.glob("start-*")]
    if str(state).split()[0] != "COMPLETED" or len(marks) != nodes * tasks:
        raise SystemExit(f"{site}: the job ended {state} with {len(marks)} of {nodes * tasks} ranks started ({run})")
    return max(marks) - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=2)
    args = parser.parse_args()
    if not (IMAGE / "config.json").exists():
        raise SystemExit(f"no sandbox image at {IMAGE}: run scripts/sandbox-image (after scripts/slurm-sandbox up)")
    here = RUNS / "bench-container-start" / secrets.token_hex(4)
    times: dict[str, list[float]] = {"sandbox": [], "sandbox-oci": []}
    for rep in range(args.reps):  # alternating, so that a slow spell of the machine hits both
        for site in times:
            times[site].append(one_start(site, here / f"{site}-{rep}", args.nodes, args.tasks))
            print(f"rep {rep} {site}: {times[site][-1]:.2f} s", flush=True)
    bare, oci = (statistics.median(times[s]) for s in ("sandbox", "sandbox-oci"))
    print(f"container start ({args.nodes} nodes x {args.tasks} tasks, median of {args.reps}): bare {bare:.2f} s, "
          f"oci {oci:.2f} s, the image adds {oci - bare:+.2f} s per start (goal: <= +10 s), ratio oci / bare "
          f"{oci / bare:.2f}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
