"""Wall time of hpcx login-node commands against `python -c pass`, measured in the same run.

The machine is shared and noisy, so absolute times drift; what is printed is the
median of N runs of each command, interleaved, and the difference and ratio to
the interpreter's own start-up. Goal: each hpcx command ≤ python -c pass + 0.3 s.

`hpcx status` (the list) is timed over a run root of 100 run folders (Slurm jobs, 5000-line
metrics files, the newest 20 not yet recorded as ended), twice: with the cluster up (the sandbox's
Slurm when it answers) and down (a slurm.conf whose slurmctld and slurmdbd listen nowhere, through
SLURM_CONF: the shared sandbox keeps running), each on its own copy of the run root, whose live runs'
states.jsonl are reset before every call (a call records the states it learns, and runs recorded as
ended are not asked again).

hpcx runs as installed: with its bytecode cached (pip compiles it at install), also where the shell sets
PYTHONDONTWRITEBYTECODE (the warm-up run writes it); `--no-bytecode` keeps that setting, and every
command then compiles hpc/ from source.

    python bench/cli_latency/run.py [--runs 15] [--run-folders 100] [--no-bytecode]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SITES = ("local", "sandbox", "dgx-h100", "pcie-4gpu")


def recent_slurm_jobs(count: int) -> list[str]:
    """Ids of jobs the sandbox's accounting knows (so `cluster up` asks about real jobs), else none."""
    try:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID", "-S", "now-2days"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    ids = [line.split("_")[0] for line in out.stdout.split() if line.split("_")[0].isdigit()]
    return ids[-count:] if out.returncode == 0 else []


def make_run_root(root: Path, count: int, live: int) -> None:
    """``count`` run folders; the newest ``live`` are not recorded as ended (status asks about them)."""
    real = recent_slurm_jobs(live)
    resolved = resolved_text()
    metrics = "".join(json.dumps({"step": s, "loss": 2.0, "tokens_per_s": 1e5, "step_time_s": 0.1}) + "\n"
                      for s in range(1, 5001))
    for i in range(count):
        run = root / f"bench-{i:03d}"
        (run / "logs").mkdir(parents=True)
        newest = i >= count - live
        job = real[i - (count - live)] if newest and i - (count - live) < len(real) else str(900000 + i)
        (run / "resolved.json").write_text(resolved)
        (run / "job.json").write_text(json.dumps({"job_id": job, "scheduler": "slurm", "submitted_at": 1.0}))
        reset_states(run, ended=not newest)
        (run / "metrics.jsonl").write_text(metrics)
        (run / "ledger.jsonl").write_text(json.dumps({"event": "start", "step": 0, "restore_s": 0.0}) + "\n")
        stamp = time.time() - (count - i)
        os.utime(run, (stamp, stamp))


def resolved_text() -> str:
    """A real resolved.json (the sandbox's tiny HSDP job, ~3 KB): what status reads of every run it lists."""
    sys.path.insert(0, str(REPO))
    from hpc.core.resolve import resolved_document
    from hpc.core.site import load_site
    from hpc.core.spec import load_spec
    from hpc.plan.resolve import resolve

    spec, site = load_spec(str(REPO / "jobs/tiny-hsdp-2node.toml")), load_site("sandbox")
    return json.dumps(resolved_document(spec, site, resolve(spec, site), "/runs/RUN"), indent=2, sort_keys=True)


def reset_states(run: Path, ended: bool) -> None:
    states = ["SUBMITTED", "RUNNING"] + (["COMPLETED"] if ended else [])
    (run / "states.jsonl").write_text("".join(json.dumps({"state": s, "time": 1.0}) + "\n" for s in states))


def reset_live(root: Path, live: int = 20) -> None:
    """Forget what earlier calls recorded about the newest ``live`` runs."""
    for run in sorted(root.iterdir())[-live:]:
        reset_states(run, ended=False)


def status_env(tmp: Path, root: Path, name: str) -> dict[str, str]:
    """Every bundled site name shadowed by a copy whose run root is ``root``."""
    sites = tmp / f"sites-{name}"
    sites.mkdir()
    for name in SITES:
        text = (REPO / "site" / f"{name}.toml").read_text().replace("\nrun_root", "\n# run_root")
        (sites / f"{name}.toml").write_text(text.rstrip() + f"\nrun_root = {json.dumps(str(root))}\n")
    return {"HPCX_SITE_PATH": str(sites), "HOME": str(tmp)}


def cluster_down(tmp: Path) -> dict[str, str]:
    conf = tmp / "down.conf"
    conf.write_text("ClusterName=down\nSlurmctldHost=ctl(127.0.0.1)\nSlurmctldPort=1\n"
                    "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                    "AccountingStoragePort=2\n")
    return {"SLURM_CONF": str(conf)}


Command = tuple[list[str], dict[str, str], Path | None]  # argv, environment, run root to reset first


def commands(tmp: Path, root: Path) -> dict[str, Command]:
    hpcx = shutil.which("hpcx") or str(Path(sys.executable).with_name("hpcx"))
    down = tmp / "runs-down"
    shutil.copytree(root, down)
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], {}, None),
        "hpcx --help": ([hpcx, "--help"], {}, None),
        "hpcx render": ([hpcx, "render", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", "sandbox"], {}, None),
        "hpcx plan": ([hpcx, "plan", str(REPO / "jobs/gpt-13b-auto.toml"), "--site", "dgx-h100"], {}, None),
        "status, up": ([hpcx, "status"], status_env(tmp, root, "up"), root),
        "status, down": ([hpcx, "status"], {**status_env(tmp, down, "down"), **cluster_down(tmp)}, down),
    }


BYTECODE = [True]  # False with --no-bytecode


def environment(env: dict[str, str]) -> dict[str, str]:
    full = {**os.environ, **env}
    if BYTECODE[0]:
        full.pop("PYTHONDONTWRITEBYTECODE", None)
    return full


def timed(cmd: list[str], env: dict[str, str], reset: Path | None = None) -> float:
    if reset is not None:
        reset_live(reset)
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=environment(env))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--run-folders", type=int, default=100)
    parser.add_argument("--no-bytecode", action="store_true", help="keep PYTHONDONTWRITEBYTECODE if set")
    args = parser.parse_args()
    BYTECODE[0] = not args.no_bytecode
    with tempfile.TemporaryDirectory(prefix="hpcx-cli-bench-") as folder:
        tmp = Path(folder)
        root = tmp / "runs"
        make_run_root(root, args.run_folders, live=20)
        cmds = commands(tmp, root)
        samples: dict[str, list[float]] = {name: [] for name in cmds}
        for name, (cmd, env, reset) in list(cmds.items()):  # warm the page cache; drop commands that fail here
            try:
                timed(cmd, env, reset)
            except subprocess.CalledProcessError:
                print(f"skipping {name!r}: it fails on this checkout", file=sys.stderr)
                del cmds[name], samples[name]
        for _ in range(args.runs):
            for name, (cmd, env, reset) in cmds.items():  # interleaved so drift hits every command alike
                samples[name].append(timed(cmd, env, reset))
        shown = {}
        for name in ("status, up", "status, down"):
            cmd, env, reset = cmds[name]
            reset_live(reset)
            shown[name] = subprocess.run(cmd, capture_output=True, text=True, env=environment(env)).stdout
    base = statistics.median(samples["python -c pass"])
    bytecode = "cached" if BYTECODE[0] or not os.environ.get("PYTHONDONTWRITEBYTECODE") else "compiled every run"
    print(f"load average {os.getloadavg()[0]:.2f}; status lists 20 of {args.run_folders} run folders; "
          f"bytecode {bytecode}")
    print(f"{'command':16} {'median s':>9} {'- base s':>9} {'ratio':>6}  goal: ≤ base + 0.300 s")
    for name, values in samples.items():
        med = statistics.median(values)
        verdict = "" if name == "python -c pass" else ("ok" if med - base <= 0.3 else "OVER")
        print(f"{name:16} {med:9.3f} {med - base:9.3f} {med / base:6.2f}  {verdict}")
    for name, text in shown.items():
        lines = text.splitlines()
        print(f"{name} shows: {lines[0] if lines else '(nothing)'}")


if __name__ == "__main__":
    main()
