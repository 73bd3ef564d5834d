"""``hpcx drill``: rehearse a preemption by sending the job's tasks the preemption signal.

The run's scheduler sends it (``hpc.schedulers``: on Slurm ``scancel --signal=USR2 JOBID``, which
reaches the srun tasks and not the batch shell; locally, the task processes under submitit's
controller).

Before sending, the drill waits until the job runs *and its current incarnation has started
training* (the ledger's last line is a ``start``; on Slurm, of the current restart count): before
that, the trainer's flag handler may not be installed yet. With ``--at-step N`` it also waits until
``metrics.jsonl`` shows step ≥ N. Torch-free.
"""

from __future__ import annotations

import time
import typing as tp
from pathlib import Path

from hpc.core import runs
from hpc import schedulers
from hpc.core.config import ConfigError
from hpc.login.submit import job_state

SIGNAL = "USR2"  # what the rendered script asks Slurm to send (--signal=USR2@LEAD)


def last_step(run_dir: Path) -> int | None:
    steps = [step for r in runs.RunDir(run_dir).read_metrics() if (step := r.get("step")) is not None]
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
    starts = [e for e in runs.RunDir(run_dir).read_ledger() if e.get("event") in ("start", "stop")]
    started = bool(starts) and starts[-1]["event"] == "start"
    state = job_state(run_dir).state
    if state == "RUNNING" and started:  # of the scheduler's current incarnation of the job
        restarts = schedulers.get(info["scheduler"]).restarts(str(info["job_id"]))
        started = starts[-1].get("slurm_restart_count", 0) == restarts
    return started and state == "RUNNING", state


def wait_until_ready(run_dir: Path, info: dict, at_step: int | None, poll_s: float,
                     on_wait: tp.Callable[[str], None]) -> int | None:
    """Block until the job trains (and has reached ``at_step``); the step it had then."""
    said = ""
    while True:
        ready, state = training(run_dir, info)
        step = last_step(run_dir)
        if state in schedulers.TERMINAL:
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


def send(info: dict, run_dir: Path) -> list[str]:
    """Send the preemption signal through the run's scheduler; the targets, for the report."""
    return schedulers.get(info["scheduler"]).signal(str(info["job_id"]), SIGNAL, run_dir)


def drill(run_dir: Path, at_step: int | None, poll_s: float = 0.5,
          on_wait: tp.Callable[[str], None] = lambda message: None) -> dict[str, tp.Any]:
    """Wait until the job trains (and reached ``at_step``), then send the preemption signal."""
    info = runs.RunDir(run_dir).read_job()
    if not info:
        raise ConfigError([f"{run_dir}: no job.json: this run was never submitted"])
    step = wait_until_ready(run_dir, info, at_step, poll_s, on_wait)
    targets = send(info, run_dir)
    return {"run_dir": str(run_dir), "job_id": str(info["job_id"]), "scheduler": info["scheduler"],
            "signal": SIGNAL, "step": step, "targets": targets, "time": time.time()}
