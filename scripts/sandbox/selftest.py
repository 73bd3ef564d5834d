"""Check that the sandbox cluster behaves like a real one for hpcx. Prints PASS/FAIL per check.

Run as root, with the project venv, after `scripts/slurm-sandbox up`:

    /work/main/.venv/bin/python scripts/sandbox/selftest.py [--skip-restart]

The last check restarts the cluster (`down`, then `up`); --skip-restart leaves it alone.
Exits 1 if any check failed.
"""
import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import submitit

SANDBOX = Path(__file__).resolve().parent.parent / "slurm-sandbox"
RUNS = Path("/var/lib/hpcx-sandbox/runs")
results = []


def check(name):
    """Decorator: run the check, record PASS/FAIL with the reason, never raise."""
    def wrap(fn):
        def run(*args):
            began = time.monotonic()
            try:
                detail = fn(*args) or ""
                ok = True
            except Exception as exc:  # noqa: BLE001 -- a self-test reports every failure
                detail, ok = f"{type(exc).__name__}: {exc}", False
            took = time.monotonic() - began
            results.append(ok)
            print(f"{'PASS' if ok else 'FAIL'} {name} ({took:.1f} s) {detail}", flush=True)
        return run
    return wrap


def cmd(*argv, timeout=120):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def executor(folder, nodes=2, tasks_per_node=2):
    ex = submitit.AutoExecutor(folder=folder, cluster="slurm")
    ex.update_parameters(slurm_partition="debug", nodes=nodes, tasks_per_node=tasks_per_node,
                         timeout_min=10)
    return ex


def wait_until(what, predicate, timeout):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout} s")
        time.sleep(0.5)


# --- functions that run inside the jobs ------------------------------------------------------------

def whoami():
    return socket.gethostname(), submitit.JobEnvironment().global_rank


def gloo_all_reduce():
    import torch
    import torch.distributed as dist
    env = submitit.JobEnvironment()
    port = 20000 + int(env.job_id) % 20000
    dist.init_process_group("gloo", init_method=f"tcp://{env.hostnames[0]}:{port}",
                            rank=env.global_rank, world_size=env.num_tasks)
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())


def sleep_forever():
    time.sleep(3600)


def count_starts_then_sleep(path):
    with open(path, "a") as f:
        f.write(f"{time.time()}\n")
    time.sleep(3600)


# --- checks ------------------------------------------------------------------------------------------

@check("srun -N2 -n4 hostname prints n1 and n2")
def check_srun():
    names = cmd("srun", "-N2", "-n4", "hostname").split()
    assert sorted(names) == ["n1", "n1", "n2", "n2"], names
    return str(names)


@check("submitit job on 2 nodes x 2 tasks returns both hosts and ranks 0-3")
def check_submitit(folder):
    job = executor(folder).submit(whoami)
    got = sorted(job.results())
    assert {h for h, _ in got} == {"n1", "n2"} and [r for _, r in got] == [0, 1, 2, 3], got
    return f"job {job.job_id}: {got}"


@check("gloo all_reduce across 4 tasks gives 4")
def check_gloo(folder):
    job = executor(folder).submit(gloo_all_reduce)
    got = job.results()
    assert got == [4, 4, 4, 4], got
    check_sacct(job.job_id)
    return f"job {job.job_id}: {got}"


@check("sacct -j ID shows the job")
def check_sacct(job_id):
    out = cmd("sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,State")
    assert out.startswith(f"{job_id}|"), out
    return out.strip()


@check("scancel of a running submitit job makes its state CANCELLED (no hang)")
def check_scancel(folder):
    job = executor(folder, nodes=1, tasks_per_node=1).submit(sleep_forever)
    wait_until("job not RUNNING", lambda: job.state == "RUNNING", 60)
    cmd("scancel", job.job_id)
    wait_until("state not CANCELLED", lambda: job.state.startswith("CANCELLED"), 60)
    raised = []
    waiter = threading.Thread(target=lambda: raised.append(job.exception()), daemon=True)
    waiter.start()
    waiter.join(60)
    assert not waiter.is_alive(), "job.exception() hung"
    return f"job {job.job_id}: {job.state}; exception: {type(raised[0]).__name__}"


@check("scontrol requeue of a running job makes it run again")
def check_requeue(folder):
    starts = Path(folder) / "starts.txt"
    job = executor(folder, nodes=1, tasks_per_node=1).submit(count_starts_then_sleep, str(starts))
    lines = lambda: starts.read_text().splitlines() if starts.exists() else []  # noqa: E731
    wait_until("job did not start", lambda: len(lines()) == 1, 60)
    requeued = time.monotonic()
    cmd("scontrol", "requeue", job.job_id)
    wait_until("job did not start again", lambda: len(lines()) == 2, 180)
    took = time.monotonic() - requeued
    cmd("scancel", job.job_id)
    return f"job {job.job_id} restarted {took:.1f} s after the requeue"


@check("down, then up again; status reports each")
def check_restart():
    subprocess.run([str(SANDBOX), "down"], check=True, capture_output=True, timeout=120)
    down_rc = subprocess.run([str(SANDBOX), "status"], capture_output=True).returncode
    assert down_rc != 0, "status exited 0 while the cluster was down"
    began = time.monotonic()
    subprocess.run([str(SANDBOX), "up"], check=True, capture_output=True, timeout=300)
    took = time.monotonic() - began
    up = subprocess.run([str(SANDBOX), "status"], capture_output=True, text=True)
    assert up.returncode == 0, up.stdout
    names = cmd("srun", "-N2", "-n2", "hostname").split()
    assert sorted(names) == ["n1", "n2"], names
    return f"status exit {down_rc} when down, 0 when up; up took {took:.1f} s"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-restart", action="store_true", help="do not run the down/up check")
    args = parser.parse_args()
    base = RUNS / f"selftest-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"submitit folders under {base}", flush=True)
    check_srun()
    check_submitit(base / "whoami")
    check_gloo(base / "gloo")
    check_scancel(base / "scancel")
    check_requeue(base / "requeue")
    if not args.skip_restart:
        check_restart()
    print(f"{results.count(True)} passed, {results.count(False)} failed")
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
