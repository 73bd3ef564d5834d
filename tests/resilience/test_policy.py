"""Fast checks of the resilience decisions and of `hpcx drill`'s input handling (no training)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.login.drill import parse_step
from hpc.schedulers.local.scheduler import task_pids as local_task_pids
from hpc.core.config import ConfigError
from hpc.core.spec import Checkpoint
from tests.conftest import hpcx
from trainer.preemption import PreemptionFlag
from hpc.schedulers.local.scheduler import LocalJobSide
from hpc.schedulers.slurm.scheduler import parse_scontrol, scontrol_seconds
from hpc.core.requeue import requeue_verdict
from trainer.resilience import Resilience, set_aside_untrusted, steps_recomputed

START = {"event": "start", "step": 0}


def stop(step: int, reason: str) -> dict:
    return {"event": "stop", "step": step, "reason": reason}


def test_requeues_are_bounded_by_max_requeues():
    assert requeue_verdict([START], "preempted", 5, 3) is None
    three_restarts = [START, stop(5, "preempted")] * 4
    assert "max_requeues = 3 reached (3 restarts" in requeue_verdict(three_restarts, "preempted", 9, 3)
    assert "max_requeues = 0" in requeue_verdict([START], "preempted", 5, 0)


def test_restarts_that_never_wrote_a_start_line_still_count():
    """Incarnations that died before their start line (import error, rendezvous) are counted by the
    scheduler's restart count, so a crash loop at start-up cannot requeue forever."""
    assert requeue_verdict([START], "failed", 0, 3, restarts=2) is None
    assert "3 restarts so far" in requeue_verdict([START], "failed", 0, 3, restarts=3)
    assert "3 restarts so far" in requeue_verdict([START, START, START, START], "failed", 9, 3, restarts=1)


def test_a_failure_at_the_same_step_as_the_last_failure_is_not_requeued():
    first = [START]
    assert requeue_verdict(first, "failed", 4, 3) is None
    again = [START, {**stop(4, "failed")}, {"event": "start", "step": 3}]
    assert requeue_verdict(again, "failed", 4, 3) == "failed twice at step 4 without progress"
    assert requeue_verdict(again, "failed", 6, 3) is None  # it got further: progress
    after_preemption = [START, stop(4, "preempted"), {"event": "start", "step": 4}]
    assert requeue_verdict(after_preemption, "failed", 4, 3) is None


@pytest.mark.parametrize("previous, requeued", [
    ({"node_fault": True, "failed_nodes": ["n1"], "excluded_nodes": ["n1"]}, True),  # it ran elsewhere since
    ({"node_fault": True, "failed_nodes": ["n1"], "excluded_nodes": ["n1", "n2"]}, True),
    ({"node_fault": True, "failed_nodes": ["n1"], "excluded_nodes": []}, False),  # none to spare: same nodes
    ({"node_fault": True, "failed_nodes": ["n1"]}, False),  # exclusion off (or a kind that has none)
    ({"node_fault": False, "failed_nodes": ["n1"]}, False),
    ({}, False),
])
def test_a_failure_at_the_same_step_after_the_last_failures_node_was_excluded_is_not_the_same_failure(
        previous, requeued):
    ledger = [START, {**stop(0, "failed"), **previous}]  # e.g. two pre-flight checks failing at step 0
    verdict = requeue_verdict(ledger, "failed", 0, 3)
    assert (verdict is None) == requeued, verdict
    assert "3 restarts so far" in requeue_verdict([*ledger, START, START, START], "failed", 0, 3)  # still bounded


def test_steps_recomputed_from_the_stop_line_or_the_metrics():
    assert steps_recomputed([], None, 0) == 0
    assert steps_recomputed([START, stop(17, "preempted")], 17, 17) == 0
    assert steps_recomputed([START, stop(17, "failed")], 17, 10) == 7
    assert steps_recomputed([START], 13, 10) == 3  # killed: no stop line, metrics tell


def test_scontrol_fields_and_times():
    fields = parse_scontrol("JobId=39 JobName=x JobState=RUNNING Restarts=1 SubmitTime=2026-11-29T18:37:30 "
                            "StartTime=2026-11-29T18:37:41 EndTime=Unknown")
    assert fields["JobState"] == "RUNNING" and fields["Restarts"] == "1"
    assert scontrol_seconds(fields["StartTime"]) - scontrol_seconds(fields["SubmitTime"]) == 11
    assert scontrol_seconds("Unknown") is None


def test_queue_wait_outside_slurm(tmp_path: Path, monkeypatch):
    """The wait is this process's start less the submission or the last stop: the start is injected (the
    test process may have started long before the test, under a long suite)."""
    started = 1_800_000_000.0
    monkeypatch.setattr("hpc.core.procs.process_start_time", lambda: started)
    (tmp_path / "job.json").write_text(json.dumps({"submitted_at": started - 3600}))
    assert LocalJobSide().queue_wait(tmp_path, []) == (3600.0, "job.json")
    after_stop = [START, {**stop(3, "preempted"), "time": started - 25}]
    assert LocalJobSide().queue_wait(tmp_path, after_stop) == (25.0, "ledger")
    wait, source = LocalJobSide().queue_wait(tmp_path, [START, {**stop(3, "preempted"), "time": started + 10}])
    assert source == "ledger" and wait == 0.0  # a stop after this start (clocks apart): no negative wait
    assert LocalJobSide().queue_wait(tmp_path, [START]) == (None, "unknown")  # the last run left no stop line


def test_minutes_interval_is_rank0s_clock():
    policy = Checkpoint(interval_minutes=10)
    rank0 = Resilience(Path("."), policy, 3, 0, rank=0)
    rank1 = Resilience(Path("."), policy, 3, 0, rank=1)
    assert rank0._votes() == (False, False, False)  # saved (started) just now: not due
    rank0.last_save_clock = rank1.last_save_clock = time.monotonic() - 601  # the last save, 10 min ago
    assert rank0._votes() == (False, False, True)  # one process: the vote is its own, at once
    assert rank1._votes() == (False, False, False)  # its clock is never asked
    assert Resilience(Path("."), Checkpoint(), 3, 0, rank=0)._votes() == (False, False, False)


def test_the_signal_flags_are_the_vote():
    flag = PreemptionFlag()
    guard = Resilience(Path("."), Checkpoint(), 3, 0, rank=0, preemption=flag)
    assert guard._votes() == (False, False, False)
    flag.terminated = True
    assert guard._votes() == (False, True, False)
    flag.requested = True
    assert guard._votes() == (True, True, False)


def test_flag_handler_sets_flags_and_notes_sigterm_without_acting():
    old_usr2, old_term = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    seen = []
    signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # stands in for submitit's bypass
    try:
        flag = PreemptionFlag().install()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.terminated and not flag.requested and seen == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.requested
    finally:
        signal.signal(signal.SIGUSR2, old_usr2)
        signal.signal(signal.SIGTERM, old_term)


def test_untrusted_newer_folders_are_set_aside(tmp_path: Path):
    for step in (2, 4):
        folder = tmp_path / "checkpoints" / f"step-{step:07d}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"")
    set_aside_untrusted(tmp_path, tmp_path / "checkpoints" / "step-0000002")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [".step-0000004.torn", "step-0000002"]


def test_drill_step_must_be_a_number():
    assert parse_step("12") == 12 and parse_step(None) is None
    for bad in ("x", "-1", "1.5"):
        with pytest.raises(ConfigError):
            parse_step(bad)


@pytest.mark.parametrize("args,message", [
    (["drill", "/nonexistent/run"], "not a run folder"),
    (["drill", "/nonexistent/run", "--at-step", "abc"], "--at-step 'abc'"),
])
def test_drill_bad_input_is_one_error_line(args, message):
    out = hpcx(*args)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr


def test_drill_refuses_a_run_never_submitted_or_finished(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved.json").write_text("{}")
    out = hpcx("drill", str(run))
    assert out.returncode == 2 and "never submitted" in out.stderr
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / "job.json").write_text(json.dumps({"job_id": str(dead.pid), "scheduler": "local"}))
    out = hpcx("drill", str(run), "--at-step", "3")
    assert out.returncode == 2 and "ended (FAILED)" in out.stderr, out.stderr


def test_local_task_pids_are_the_controllers_children():
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; "
                               "ps = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']) "
                               "for _ in range(2)]; print(' '.join(str(p.pid) for p in ps), flush=True); "
                               "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        children = sorted(int(p) for p in parent.stdout.readline().split())
        assert local_task_pids(parent.pid) == children
    finally:
        for pid in local_task_pids(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_drill_imports_no_torch(tmp_path: Path):
    from tests.test_cli import PROBE

    run = tmp_path / "run"
    run.mkdir()
    (run / "resolved.json").write_text("{}")
    out = subprocess.run([sys.executable, "-c", PROBE, "drill", str(run), "--at-step", "2"], capture_output=True,
                         text=True, timeout=60)
    assert "never submitted" in out.stderr and "HEAVY=\n" in out.stderr + "\n", out.stderr[-2000:]
