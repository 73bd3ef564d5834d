"""Wall time of `hpcx --help` and `hpcx render` against `python -c pass`, measured in the same run.

The machine is shared and noisy, so absolute times drift; what is printed is the
median of N runs of each command, interleaved, and the difference and ratio to
the interpreter's own start-up. Goal: each hpcx command ≤ python -c pass + 0.3 s.

    python bench/cli_latency/run.py [--runs 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def commands() -> dict[str, list[str]]:
    hpcx = shutil.which("hpcx") or str(Path(sys.executable).with_name("hpcx"))
    return {
        "python -c pass": [sys.executable, "-c", "pass"],
        "hpcx --help": [hpcx, "--help"],
        "hpcx render": [hpcx, "render", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", "sandbox"],
        "hpcx plan": [hpcx, "plan", str(REPO / "jobs/gpt-13b-auto.toml"), "--site", "dgx-h100"],
        "hpcx status": [hpcx, "status", "--json"],
    }


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    cmds = commands()
    samples: dict[str, list[float]] = {name: [] for name in cmds}
    for name, cmd in list(cmds.items()):  # warm the page cache once; drop commands that fail here
        try:
            timed(cmd)
        except subprocess.CalledProcessError:
            print(f"skipping {name!r}: it fails on this checkout", file=sys.stderr)
            del cmds[name], samples[name]
    for _ in range(args.runs):
        for name, cmd in cmds.items():  # interleaved so drift hits every command alike
            samples[name].append(timed(cmd))
    base = statistics.median(samples["python -c pass"])
    print(f"{'command':16} {'median s':>9} {'- base s':>9} {'ratio':>6}  goal: ≤ base + 0.300 s")
    for name, values in samples.items():
        med = statistics.median(values)
        verdict = "" if name == "python -c pass" else ("ok" if med - base <= 0.3 else "OVER")
        print(f"{name:16} {med:9.3f} {med - base:9.3f} {med / base:6.2f}  {verdict}")


if __name__ == "__main__":
    main()
