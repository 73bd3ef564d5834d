"""``hpcx drill``: rehearse a preemption by sending the job's tasks the preemption signal, or a fault
at one rank: ``--hang RANK`` (SIGSTOP: the hang watchdog names it), ``--slow RANK`` (stopped half of
each second for a while: a straggler), ``--fail-node`` (every rank on the node of the last rank killed:
a node failure, excluded on the requeue). Faults find the rank's host and pid in its heartbeat
(``hpc.core.health``) and run ``kill`` on its node through the scheduler (``Scheduler.on_node``: on
Slurm a step of its own, ``srun --jobid=J --overlap -w HOST``).

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

from hpc.core import health, runs
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


# ---------------------------------------------------------------- faults: a hung rank, a slow one, a failed node

FAULTS = ("hang", "slow", "fail_node")
SLOW_DUTY = 0.5  # --slow: the rank is stopped this share of each second (about twice as slow)
# --slow's loop on the rank's node: SIGSTOP / SIGCONT for SECONDS, and SIGCONT whatever ends it. A signal
# that ends the shell skips its EXIT trap, so TERM, INT and HUP continue the rank before leaving; the
# preemption signal is ignored (``scancel --signal`` reaches every step of the job, this one's too: the
# loop would die between its STOP and its CONT and leave the rank stopped, which the watchdog then kills)
SLOW_LOOP = ('pid=$1; end=$(($(date +%s) + $2)); cont() { kill -CONT "$pid" 2>/dev/null; }; trap cont EXIT; '
             f'trap "cont; exit 0" TERM INT HUP; trap "" {SIGNAL}; '
             'while [ "$(date +%s)" -lt "$end" ] && kill -STOP "$pid" 2>/dev/null; do '
             'sleep $3; cont; sleep $4; done')


def parse_rank(text: str | None, option: str, world: int) -> int | None:
    """``--hang RANK`` / ``--slow RANK`` as a rank of the run; ConfigError otherwise."""
    if text is None:
        return None
    if not text.isdigit() or int(text) >= world:
        raise ConfigError([f"{option} {text!r}: expected a rank of this run, 0 to {world - 1}"])
    return int(text)


def current_beats(run_dir: Path) -> dict[int, dict]:
    """The heartbeats of the current start (``hpc.core.health``): written since its ledger start line."""
    starts = [e for e in runs.RunDir(run_dir).read_ledger() if e.get("event") == "start"]
    since = float(starts[-1].get("time", 0.0)) - 1.0 if starts else float("inf")
    return {r: b for r, b in health.read_beats(run_dir).items() if float(b.get("time", 0.0)) >= since}


def fault_commands(fault: str, rank: int, beats: dict[int, dict], slow_s: float) -> list[tuple[str, list[str], bool]]:
    """(node, command, wait) for a fault at ``rank``: ``hang`` stops its process (SIGSTOP: its watchdog
    too), ``slow`` stops it ``SLOW_DUTY`` of each second for ``slow_s`` seconds (left running),
    ``fail_node`` kills (SIGKILL) every rank process on its node."""
    beat = beats[rank]
    host, pid = str(beat["host"]), str(beat["pid"])
    if fault == "hang":
        return [(host, ["kill", "-STOP", pid], True)]
    if fault == "slow":
        return [(host, ["sh", "-c", SLOW_LOOP, "hpcx-slow", pid, str(int(slow_s)), f"{SLOW_DUTY:g}",
                        f"{1 - SLOW_DUTY:g}"], False)]
    pids = sorted(str(b["pid"]) for b in beats.values() if b.get("host") == host)
    return [(host, ["kill", "-KILL", *pids], True)]


def drill_fault(run_dir: Path, fault: str, rank: int, at_step: int | None, slow_s: float = 120.0,
                poll_s: float = 0.5, on_wait: tp.Callable[[str], None] = lambda message: None) -> dict[str, tp.Any]:
    """Wait until the job trains (and reached ``at_step``) and ``rank`` has a heartbeat of this start,
    then cause ``fault`` there through the run's scheduler (``Scheduler.on_node``)."""
    info = runs.RunDir(run_dir).read_job()
    if not info:
        raise ConfigError([f"{run_dir}: no job.json: this run was never submitted"])
    step = wait_until_ready(run_dir, info, at_step, poll_s, on_wait)
    beats = _await_beat(run_dir, info, rank, poll_s, on_wait)
    scheduler = schedulers.get(info["scheduler"])
    done = [scheduler.on_node(str(info["job_id"]), host, argv, wait)
            for host, argv, wait in fault_commands(fault, rank, beats, slow_s)]
    return {"run_dir": str(run_dir), "job_id": str(info["job_id"]), "scheduler": info["scheduler"], "fault": fault,
            "rank": rank, "host": beats[rank]["host"], "step": step, "targets": done, "time": time.time()}


def _await_beat(run_dir: Path, info: dict, rank: int, poll_s: float,
                on_wait: tp.Callable[[str], None]) -> dict[int, dict]:
    """The current start's heartbeats once ``rank`` has one (its first step boundary)."""
    said = False
    while rank not in (beats := current_beats(run_dir)):
        if job_state(run_dir).state in schedulers.TERMINAL:
            raise ConfigError([f"{run_dir.name}: job {info['job_id']} ended before rank {rank} reached a step"])
        if not said:
            on_wait(f"waiting: rank {rank} has no heartbeat of this start yet (its first step boundary)")
            said = True
        time.sleep(poll_s)
    return beats
