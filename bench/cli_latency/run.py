"""Wall time of hpcx login-node commands against `python -c pass`, measured in the same run.

The machine is shared and noisy, so absolute times drift; what is printed is the
median of N runs of each command, interleaved, and the difference and ratio to
the interpreter's own start-up. Goal: each hpcx command ≤ python -c pass + 0.3 s.

`hpcx status` (the list) is timed over a run root of 120 run folders (Slurm jobs, 5000-line
metrics files, the newest 20 not yet recorded as ended), twice: with the cluster up (the sandbox's
Slurm when it answers) and down (a slurm.conf whose slurmctld and slurmdbd listen nowhere, through
SLURM_CONF: the shared sandbox keeps running), each on its own copy of the run root, whose live runs'
states.jsonl are reset before every call (a call records the states it learns, and runs recorded as
ended are not asked again). Beside each wall time it prints the call's CPU seconds (user + system,
sacct and squeue included): what a loaded machine stretches, so the figure to compare across loads.

Each status scenario has its own cache folder (``XDG_CACHE_HOME``: each site profile's run root, the
scheduler queries of the last list), filled by the warm-up call and kept, as for a user who runs
`hpcx status` again and again; `--cold` empties it before every status call (the first call of a user,
or one after hpcx or a profile changed), `--cold queries` forgets only the queries (the first list after
a new submission: other job ids to ask), `--cold sites` only the profiles' run roots (the first list after
hpcx was upgraded or a profile edited).

hpcx runs as installed: with its bytecode cached (pip compiles it at install), also where the shell sets
PYTHONDONTWRITEBYTECODE (the warm-up run writes it); `--no-bytecode` keeps that setting, and every
command then compiles hpc/ from source.

`--only status` times just the two status calls against the baseline. `--hpcx COMMAND` runs another
hpcx than the installed console script, and `--compare COMMAND` times another one too, interleaved
with this one, in rows marked `(compare)`: a before/after on the same load, e.g., with OLD an older
commit's copy (`git archive REV | tar -x -C OLD`), `--compare 'env -C OLD /ABS/.venv/bin/python -c "from
hpc.entry import main; main()"'`. Run it in OLD (`env -C`): PYTHONPATH alone loses to the bench's own
working directory, which `python -c` puts first on sys.path.
`--load N` keeps N busy processes (plain Python loops, not niced) running while it measures, to see
a login node under load; the load average printed is the machine's at the end, and the runnable
processes are sampled before every call, other users' included.

    python bench/cli_latency/run.py [--runs 15] [--run-folders 120] [--no-bytecode] [--only status] [--cold [queries|sites]]
                                    [--load N] [--hpcx COMMAND] [--compare COMMAND]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
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
    for site in SITES:
        text = (REPO / "site" / f"{site}.toml").read_text().replace("\nrun_root", "\n# run_root")
        (sites / f"{site}.toml").write_text(text.rstrip() + f"\nrun_root = {json.dumps(str(root))}\n")
    return {"HPCX_SITE_PATH": str(sites), "HOME": str(tmp), "XDG_CACHE_HOME": str(tmp / f"cache-{name}")}


def cluster_down(tmp: Path) -> dict[str, str]:
    conf = tmp / "down.conf"
    conf.write_text("ClusterName=down\nSlurmctldHost=ctl(127.0.0.1)\nSlurmctldPort=1\n"
                    "AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                    "AccountingStoragePort=2\n")
    return {"SLURM_CONF": str(conf)}


Command = tuple[list[str], dict[str, str], Path | None]  # argv, environment, run root to reset first


def commands(tmp: Path, root: Path, hpcx_command: str | None = None) -> dict[str, Command]:
    hpcx = shlex.split(hpcx_command) if hpcx_command else \
        [shutil.which("hpcx") or str(Path(sys.executable).with_name("hpcx"))]
    down = tmp / "runs-down"
    shutil.copytree(root, down)
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], {}, None),
        "hpcx --help": ([*hpcx, "--help"], {}, None),
        "hpcx render": ([*hpcx, "render", str(REPO / "jobs/tiny-hsdp-2node.toml"), "--site", "sandbox"], {}, None),
        "hpcx plan": ([*hpcx, "plan", str(REPO / "jobs/gpt-13b-auto.toml"), "--site", "dgx-h100"], {}, None),
        "status, up": ([*hpcx, "status"], status_env(tmp, root, "up"), root),
        "status, down": ([*hpcx, "status"], {**status_env(tmp, down, "down"), **cluster_down(tmp)}, down),
    }


COLD_WORDS = {None: "kept between calls", "all": "emptied before every call",
              "queries": "kept, but the scheduler queries forgotten before every call",
              "sites": "kept, but the profiles' run roots forgotten before every call"}
BYTECODE = [True]  # False with --no-bytecode
COLD: list[str | None] = [None]  # --cold: "all" (status's caches emptied before every call) or "queries"


def environment(env: dict[str, str]) -> dict[str, str]:
    full = {**os.environ, **env}
    if BYTECODE[0]:
        full.pop("PYTHONDONTWRITEBYTECODE", None)
    return full


CPU: dict[str, list[float]] = {}  # command -> CPU seconds (user + system) of each call, its children included


def timed(cmd: list[str], env: dict[str, str], reset: Path | None = None, name: str = "") -> float:
    """Wall seconds of one call; its CPU seconds (the process and what it ran) go to CPU[name]."""
    if reset is not None:
        reset_live(reset)
        if COLD[0] == "all":
            shutil.rmtree(env["XDG_CACHE_HOME"], ignore_errors=True)
        elif COLD[0] in ("queries", "sites"):
            forgotten = "status-queries.json" if COLD[0] == "queries" else "site-roots.json"
            Path(env["XDG_CACHE_HOME"], "hpcx", forgotten).unlink(missing_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=environment(env))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.setdefault(name, []).append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall


def busy(count: int) -> list[subprocess.Popen]:
    """``count`` processes spinning at normal priority (the load of other users on a login node)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--run-folders", type=int, default=120)
    parser.add_argument("--no-bytecode", action="store_true", help="keep PYTHONDONTWRITEBYTECODE if set")
    parser.add_argument("--cold", nargs="?", const="all", choices=["all", "queries", "sites"],
                        help="empty status's caches before every status call (queries: only the last list's "
                        "scheduler queries, as after a new submission; sites: only the profiles' run roots, "
                        "as after an upgrade or a profile edited)")
    parser.add_argument("--only", choices=["status"], help="time only the status calls (and the baseline)")
    parser.add_argument("--load", type=int, default=0, metavar="N", help="N busy processes while measuring")
    parser.add_argument("--hpcx", metavar="COMMAND", help="how to run hpcx (default: the installed console script), "
                        "e.g. 'env -C OTHER python -m hpc.cli' (another checkout), to compare")
    parser.add_argument("--compare", metavar="COMMAND", help="also time the same calls through this hpcx "
                        "(e.g. 'env -C OLD python -m hpc.cli': run in OLD, whose hpc/ comes first), interleaved: "
                        "'(compare)' rows")
    args = parser.parse_args()
    BYTECODE[0] = not args.no_bytecode
    COLD[0] = args.cold
    with tempfile.TemporaryDirectory(prefix="hpcx-cli-bench-") as folder:
        tmp = Path(folder)
        root = tmp / "runs"
        make_run_root(root, args.run_folders, live=20)
        cmds = commands(tmp, root, args.hpcx)
        if args.compare:  # the same calls through another hpcx, interleaved with these: a fair before/after
            (tmp / "compare").mkdir()
            other = commands(tmp / "compare", root, args.compare)
            cmds.update({f"{k} (compare)": v for k, v in other.items() if k != "python -c pass"})
        if args.only:
            cmds = {k: v for k, v in cmds.items() if k == "python -c pass" or k.startswith(args.only)}
        spinning = busy(args.load)
        try:
            samples, shown = measure(cmds, args.runs)
        finally:
            for proc in spinning:
                proc.kill()
                proc.wait()
            load = os.getloadavg()
    report(samples, shown, load, args)


def runnable() -> int:
    """Processes running or ready to run right now (/proc/loadavg's fourth field), this bench's call included."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return -1


def measure(cmds: dict[str, Command], runs: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Median-ready samples of each command (interleaved), and what each status call printed; the
    machine's runnable processes are sampled before every command (``samples["runnable"]``)."""
    samples: dict[str, list[float]] = {name: [] for name in cmds}
    for name, (cmd, env, reset) in list(cmds.items()):  # warm the page cache; drop commands that fail here
        try:
            timed(cmd, env, reset)
        except subprocess.CalledProcessError:
            print(f"skipping {name!r}: it fails on this checkout", file=sys.stderr)
            del cmds[name], samples[name]
    queue: list[float] = []
    for _ in range(runs):
        for name, (cmd, env, reset) in cmds.items():  # interleaved so drift hits every command alike
            queue.append(runnable())
            samples[name].append(timed(cmd, env, reset, name))
    shown = {}
    for name in [n for n in cmds if n.startswith("status")]:
        cmd, env, reset = cmds[name]
        reset_live(reset)
        shown[name] = subprocess.run(cmd, capture_output=True, text=True, env=environment(env)).stdout
    samples["runnable"] = queue
    return samples, shown


def report(samples: dict[str, list[float]], shown: dict[str, str], load: tuple[float, float, float],
           args: argparse.Namespace) -> None:
    queue = samples.pop("runnable")
    base = statistics.median(samples["python -c pass"])
    bytecode = "cached" if BYTECODE[0] or not os.environ.get("PYTHONDONTWRITEBYTECODE") else "compiled every run"
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({args.load} busy processes of the bench's own); "
          f"{os.cpu_count()} CPUs; runnable processes before each call: median {statistics.median(queue):g}, "
          f"max {max(queue):g}; status lists 20 of {args.run_folders} run folders; bytecode {bytecode}; "
          f"status caches {COLD_WORDS[args.cold]}")
    cpu_base = statistics.median(CPU["python -c pass"])
    print(f"{'command':26} {'median s':>9} {'- base s':>9} {'ratio':>6}  {'CPU s':>6} {'- base':>6}  "
          "goal: ≤ base + 0.300 s")
    for name, values in samples.items():
        med, cpu = statistics.median(values), statistics.median(CPU[name])
        verdict = "" if name == "python -c pass" else ("ok" if med - base <= 0.3 else "OVER")
        print(f"{name:26} {med:9.3f} {med - base:9.3f} {med / base:6.2f}  {cpu:6.3f} {cpu - cpu_base:6.3f}  {verdict}")
    print("CPU s: user + system seconds of the call and what it ran (sacct, squeue), the load-independent part")
    for name, text in shown.items():
        lines = text.splitlines()
        print(f"{name} shows: {lines[0] if lines else '(nothing)'}")


if __name__ == "__main__":
    main()
