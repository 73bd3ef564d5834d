"""``hpcx drill``: rehearse a preemption by sending the job's tasks the preemption signal.

Slurm: ``scancel --signal=USR2 JOBID``. Without ``--batch``/``--full``, scancel signals every job
step but not the batch step, which is exactly right: the srun tasks (the trainer ranks) must get
it, and the batch shell must not (bash dies of USR2, which would end the job). Local runs: the
signal goes straight to the task processes, the children of submitit's local controller (the
controller itself has no USR2 handler and would die of it).

Before sending, the drill waits until the job runs *and its current incarnation has started
training* (the ledger's last line is a ``start``; on Slurm, of the current restart count): before
that, the trainer's flag handler may not be installed yet. With ``--at-step N`` it also waits until
``metrics.jsonl`` shows step ≥ N. Torch-free.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import typing as tp
from pathlib import Path

from hpc import runs, scheduler
from hpc.config import ConfigError
from hpc.submit import job_state

SIGNAL = "USR2"  # what the rendered script asks Slurm to send (--signal=USR2@LEAD)


def last_step(run_dir: Path) -> int | None:
    steps = [r.get("step") for r in runs.read_jsonl(run_dir / "metrics.jsonl") if r.get("step") is not None]
    return max(steps) if steps else None


def parse_step(text: str | None) -> int | None:
    """``--at-step`` as an int ≥ 0; ConfigError otherwise."""
    if text is None:
        return None
    try:
        step = int(text)
    except ValueError:
        raise ConfigError([f"--at-step {text!r}: expected a step number (an integer ≥ 0)"]) from None
    if step < 0:
        raise ConfigError([f"--at-step {step}: expected a step number ≥ 0"])
    return step


def training(run_dir: Path, info: dict) -> tuple[bool, str]:
    """(the current incarnation has started training, the scheduler's state)."""
    starts = [e for e in runs.read_jsonl(run_dir / "ledger.jsonl") if e.get("event") in ("start", "stop")]
    started = bool(starts) and starts[-1]["event"] == "start"
    state = job_state(run_dir).state
    if info["scheduler"] == "slurm" and state == "RUNNING" and started:
        started = starts[-1].get("slurm_restart_count", 0) == scheduler.slurm_restarts(info["job_id"])
    return started and state == "RUNNING", state


def wait_until_ready(run_dir: Path, info: dict, at_step: int | None, poll_s: float,
                     on_wait: tp.Callable[[str], None]) -> int | None:
    """Block until the job trains (and has reached ``at_step``); the step it had then."""
    said = ""
    while True:
        ready, state = training(run_dir, info)
        step = last_step(run_dir)
        if state in scheduler.TERMINAL:
            where = f" at step {step}" if step is not None else ""
            raise ConfigError([f"{run_dir.name}: job {info['job_id']} ended ({state}){where} "
                               "before it could be drilled"])
        if ready and (at_step is None or (step is not None and step >= at_step)):
            return step
        message = f"waiting: job {info['job_id']} {state}, step {step if step is not None else '-'}"
        if message != said:
            on_wait(message)
            said = message
        time.sleep(poll_s)


def local_task_pids(controller_pid: int) -> list[int]:
    """The processes whose parent is the local controller (its task processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(controller_pid) and fields[0] != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def send(info: dict) -> list[str]:
    """Send the preemption signal; the targets, for the report."""
    job_id = str(info["job_id"])
    if info["scheduler"] == "slurm":
        cmd = ["scancel", f"--signal={SIGNAL}", job_id]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ConfigError([f"{' '.join(cmd)} failed: {exc}"]) from None
        if out.returncode != 0:
            raise ConfigError([f"{' '.join(cmd)} failed: {out.stderr.strip() or out.returncode}"])
        return [f"the steps of job {job_id} (scancel --signal={SIGNAL})"]
    pids = local_task_pids(int(job_id))
    if not pids:
        raise ConfigError([f"local job {job_id}: no task processes found under its controller"])
    for pid in pids:
        try:
            os.kill(pid, signal.Signals["SIG" + SIGNAL])
        except ProcessLookupError:
            continue
    return [f"task pid {pid}" for pid in pids]


def drill(run_dir: Path, at_step: int | None, poll_s: float = 0.5,
          on_wait: tp.Callable[[str], None] = lambda message: None) -> dict[str, tp.Any]:
    """Wait until the job trains (and reached ``at_step``), then send the preemption signal."""
    info = runs.read_json(run_dir / "job.json")
    if not info:
        raise ConfigError([f"{run_dir}: no job.json: this run was never submitted"])
    step = wait_until_ready(run_dir, info, at_step, poll_s, on_wait)
    targets = send(info)
    return {"run_dir": str(run_dir), "job_id": str(info["job_id"]), "scheduler": info["scheduler"],
            "signal": SIGNAL, "step": step, "targets": targets, "time": time.time()}
