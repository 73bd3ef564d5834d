"""A time limit on the ``local`` site is neither a preemption nor a failure, as on Slurm.

submitit's local controller counts down from ``job.time_limit_min`` at each start of the tasks and sends
the preemption signal ``signal_lead_s`` before the end (never earlier); ``LocalJobSide.seconds_left``
knows that clock, so rank 0 records a stop at that signal as ``time_limit``, and a job with no requeue
left ends TIMEOUT (read off the ledger), not FAILED. A USR2 with time left (``hpcx drill``) is still a
preemption, and a failure still FAILED. Real local jobs of the tiny model, each a few seconds: a lead of
295 s on a five-minute limit brings the controller's signal five seconds after the start, and leaves
the job minutes to reach a step boundary after it, however slow its start (a loaded machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.core import runs
from hpc.schedulers.local.scheduler import LocalJobSide, local_state
from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import checkpoint_steps, ledger, submit, wait_state
from tests.resilience.test_failure_records import FakeSide, stopped_by_signal

JOB = str(REPO / "jobs" / "tiny-ddp.toml")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
SOON = ("job.time_limit_min=5", "job.signal_lead_s=295")  # the controller's signal 5 s after each start


def local_job(root: Path, name: str, *extra: str) -> Path:
    return submit(JOB, f"job.run_root={json.dumps(str(root))}", f"job.name={name}", "job.tasks_per_node=1",
                  'parallel.strategy="none"', "train.log_every=1", "train.global_batch=2", "train.micro_batch=2",
                  "checkpoint.interval_steps=0", *extra)


def stops(run: Path) -> list[dict]:
    return [e for e in ledger(run) if e["event"] == "stop"]


# ---------------------------------------------------------------- the local job side's clock (pure)


def test_seconds_left_is_the_controllers_limit_less_this_tasks_age(monkeypatch):
    started = time.time() - 30  # this task's start, injected: the test process's own may be long ago
    monkeypatch.setattr("hpc.schedulers.local.scheduler.process_start_time", lambda: started)
    monkeypatch.setenv("SUBMITIT_LOCAL_TIMEOUT_S", "120")
    before = time.time()
    left = LocalJobSide().seconds_left()
    after = time.time()
    assert 120 - (after - started) <= left <= 120 - (before - started) < 90.001  # bounds, not a speed
    monkeypatch.delenv("SUBMITIT_LOCAL_TIMEOUT_S")
    assert LocalJobSide().seconds_left() is None  # not under the local controller: nobody can tell


@pytest.mark.parametrize("left,since,early,reason", [
    (25, 5, 0, "time_limit"),  # the lead itself
    (40, 15, 0, "time_limit"),  # acted on 15 s after the signal, within the slack
    (40, 50, 0, "preempted"),  # 90 s before the end: the local controller is never that early
    (40, 50, 60, "time_limit"),  # ... Slurm may be (sbatch's 60 s)
    (70, 3, 0, "preempted"),  # a drill 73 s before the end, on a 30 s lead
])
def test_how_early_the_scheduler_may_signal_decides(tmp_path, left, since, early, reason):
    run = tmp_path / "run"
    run.mkdir()
    assert stopped_by_signal(run, FakeSide(left, early=early), since)["reason"] == reason


@pytest.mark.parametrize("left,reason", [(2.0, "time_limit"), (-1.0, "time_limit"), (500.0, "failed")])
def test_the_controllers_sigint_at_the_limit_is_a_time_limit(tmp_path, left, reason):
    """No step boundary came between the controller's signal and its limit: it ends the tasks with SIGINT
    (KeyboardInterrupt). At the limit that is the time limit, not requeued; elsewhere a cancel."""
    from hpc.core.spec import Checkpoint
    from trainer.resilience import LIMIT_REACHED, Resilience

    run = tmp_path / "run"
    run.mkdir()
    side = FakeSide(left, early=0)
    Resilience(run, Checkpoint(), 3, 0, rank=0, side=side, step=9, phase="train").failed(KeyboardInterrupt())
    stop = runs.RunDir(run).read_ledger()[-1]
    assert stop["reason"] == reason and not stop["requeued"] and side.asked == 0 and stop["step"] == 9
    assert stop["not_requeued"] == (LIMIT_REACHED if reason == "time_limit" else
                                    "KeyboardInterrupt is a cancel or an exit, not a failure")


@pytest.mark.parametrize("left", [2.0, -1.0, 25.0, 500.0])
def test_a_failure_is_a_failure_however_near_the_limit(tmp_path, left):
    """The time limit's clock injected (``seconds_left``): a RuntimeError at or past the limit, or within
    the signal's lead, is the failure it is; only the controller's SIGINT there is the limit's."""
    from hpc.core.spec import Checkpoint
    from trainer.resilience import Resilience

    run = tmp_path / "run"
    run.mkdir()
    Resilience(run, Checkpoint(), 0, 0, rank=0, side=FakeSide(left, early=0), step=2,
               phase="train").failed(RuntimeError("deterministic failure in forward call 3"))
    stop = runs.RunDir(run).read_ledger()[-1]
    assert (stop["reason"], stop["step"], stop["requeued"]) == ("failed", 2, False)
    assert stop["error"] == "RuntimeError: deterministic failure in forward call 3"


def write_stop(run: Path, job: str, **stop) -> None:
    (run / "ledger.jsonl").write_text(json.dumps({"event": "start", "step": 0, "job_id": job}) + "\n"
                                      + json.dumps({"event": "stop", "step": 7, "job_id": job, **stop}) + "\n")


def ended_pid() -> str:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return str(child.pid)


@pytest.mark.parametrize("stop,state", [
    ({"reason": "time_limit", "requeued": False}, "TIMEOUT"),
    ({"reason": "terminated", "requeued": False}, "CANCELLED"),
    ({"reason": "time_limit", "requeued": True}, "FAILED"),  # requeued, then the controller died: no result
    ({"reason": "preempted", "requeued": False}, "FAILED"),
])
def test_an_ended_local_job_is_judged_by_its_last_stop(tmp_path, stop, state):
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    job = ended_pid()
    write_stop(run, job, **stop)
    assert local_state(job, run).state == state
    write_stop(run, "1", **stop)  # another job's stop line (a reused folder): not this job's
    assert local_state(job, run).state == "FAILED"


# ---------------------------------------------------------------- real local jobs


def test_time_limit_with_no_requeue_left_ends_timeout_not_failed(run_root):
    run = local_job(run_root, "limit-none", *SOON, "train.steps=100000", "job.max_requeues=0")
    info = wait_state(run, ENDED, timeout=300)
    assert info["state"] == "TIMEOUT", (run / "logs" / "rank-0.log").read_text()[-3000:]
    (stop,) = stops(run)
    assert stop["reason"] == "time_limit" and not stop["requeued"] and stop["by"] == "rank 0"
    assert stop["not_requeued"].startswith("job.max_requeues = 0 reached") and stop["step"] > 0
    assert checkpoint_steps(run) == [stop["step"]]  # saved at the signal
    assert info["last_stop"]["words"].startswith(f"time limit at step {stop['step']} (not requeued")
    listed = hpcx("status", str(run))
    assert "TIMEOUT" in listed.stdout and "time limit at step" in listed.stdout and "FAILED" not in listed.stdout
    assert "Traceback" not in (run / "logs" / "rank-0.log").read_text()
    again = json.loads(hpcx("status", str(run), "--json").stdout)  # recorded, and stays so
    assert again["state"] == "TIMEOUT" and again["states"][-1] == "TIMEOUT"


def test_time_limit_is_requeued_while_requeues_are_left_then_ends_timeout(run_root):
    run = local_job(run_root, "limit-once", *SOON, "train.steps=100000", "job.max_requeues=1")
    info = wait_state(run, ENDED, timeout=300)
    assert info["state"] == "TIMEOUT", (run / "logs" / "rank-0.log").read_text()[-3000:]
    start0, stop0, start1, stop1 = ledger(run)
    assert (stop0["reason"], stop0["requeued"]) == ("time_limit", True)
    assert start1["restart"] == 1 and start1["step"] == stop0["step"] and start1["checkpoint"]
    assert (stop1["reason"], stop1["requeued"]) == ("time_limit", False) and stop1["step"] > stop0["step"]
    assert "max_requeues = 1 reached" in stop1["not_requeued"] and info["restarts"] == 1
    assert [s for s in info["states"] if s in ("REQUEUED", "TIMEOUT")] == ["REQUEUED", "TIMEOUT"]


def test_submit_wait_says_time_limit_and_exits_nonzero(run_root):
    out = hpcx("submit", JOB, "--wait", "--set", f"job.run_root={json.dumps(str(run_root))}", "--set",
               "job.tasks_per_node=1", "--set", 'parallel.strategy="none"', "--set", "train.global_batch=2",
               "--set", "train.micro_batch=2", "--set", "train.steps=100000", "--set", "job.max_requeues=0",
               *(a for s in SOON for a in ("--set", s)), timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr
    result = next(line for line in out.stdout.splitlines() if line.startswith("result: "))
    assert "(stopped at the time limit)" in result and "preemption" not in result


def test_a_drill_with_time_left_is_a_preemption_on_a_short_limit(run_root):
    """Ten minutes, one second of lead: a USR2 at step 2 has minutes left, far beyond lead + slack, however
    slow the start (the test's wait gives up first)."""
    run = local_job(run_root, "limit-drill", "job.time_limit_min=10", "job.signal_lead_s=1", "train.steps=100000",
                    "job.max_requeues=0")
    out = hpcx("drill", str(run), "--at-step", "2", timeout=120)
    assert out.returncode == 0, out.stderr
    info = wait_state(run, ENDED, timeout=300)
    assert info["state"] == "FAILED"  # preempted with no requeue left: not done, and not a time limit
    (stop,) = stops(run)
    assert stop["reason"] == "preempted" and not stop["requeued"] and stop["step"] >= 2
    assert info["last_stop"]["words"].startswith(f"preempted at step {stop['step']}")


def test_a_failure_on_a_short_limit_stays_a_failure(run_root):
    """A failure under the controller's countdown ends FAILED. The limit is past the test's own wait, so a
    slow start cannot bring the signal first (a time limit, TIMEOUT); a failure at or near the limit is
    ``test_a_failure_is_a_failure_however_near_the_limit``, with the clock injected."""
    run = local_job(run_root, "limit-fail", "job.time_limit_min=10",
                    'model.arch="tests.resilience.failing_model:build"',
                    "model.seq_len=8", "model.vocab_size=64", "model.kwargs={fail_after = 2}", "train.steps=50",
                    "job.max_requeues=0")
    info = wait_state(run, ENDED, timeout=300)
    assert info["state"] == "FAILED"
    (stop,) = stops(run)
    assert stop["reason"] == "failed" and "deterministic failure" in stop["error"] and stop["step"] == 2
    assert runs.RunDir(run).read_states()[-1]["state"] == "FAILED"


@pytest.mark.parametrize("stop,words", [
    ({"reason": "time_limit"}, "(stopped at the time limit)"),
    ({"reason": "preempted"}, "(stopped for a preemption)"),
    ({"reason": "terminated"}, "(cancelled)"),  # `hpcx cancel`: the trainer's summary said preempted before
])
def test_the_result_line_says_which_stop_it_was(stop, words):
    from hpc.cli import describe_result, format_result

    summary = {"final_loss": 2.5, "losses": [5.5, 2.5], "steps": 12, "tokens_per_s": 900.0, "world_size": 1,
               "strategy": "none", "preempted": True}
    line = format_result(describe_result(("success", summary), stop))
    assert line.startswith(f"12 steps {words}, loss 5.5000 -> 2.5000") and line.endswith("1 ranks, none")
    early = format_result(describe_result(("success", {**summary, "final_loss": None, "losses": []}), stop))
    assert early == f"12 steps {words}, no loss logged, 1 ranks, none"  # stopped before its first log line


@pytest.mark.parametrize("result", [None, "failure", "success"])
def test_a_local_job_cancelled_before_its_ranks_recorded_a_stop_is_cancelled_not_failed(tmp_path, result):
    """`hpcx cancel` at once after submit: the controller dies of the SIGTERM before any rank wrote a stop
    (no ledger, perhaps no result); the cancel's marker makes it CANCELLED. A job that completed stays
    COMPLETED; without the marker an ended job with no result is FAILED, as before."""
    import pickle

    from hpc.schedulers.local.scheduler import cancel_marker

    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    job = ended_pid()
    if result is not None:
        outcome = ("success", None) if result == "success" else ("error", "Traceback: killed")
        (run / "submitit" / f"{job}_0_result.pkl").write_bytes(pickle.dumps(outcome))
    assert local_state(job, run).state == ("COMPLETED" if result == "success" else "FAILED")
    cancel_marker(run, job).touch()
    assert local_state(job, run).state == ("COMPLETED" if result == "success" else "CANCELLED")
    other = ended_pid()  # another job's marker in a reused folder says nothing of this one
    assert local_state(other, run).state == "FAILED"


@pytest.mark.parametrize("reason,expected", [
    ("terminated", {"preempted": False, "cancelled": True}), ("preempted", {"preempted": True, "cancelled": False}),
    (None, {"preempted": True, "cancelled": False}),  # no resilience attached: the agreed preemption flag
])
def test_the_trainers_summary_tells_a_cancel_from_a_preemption(reason, expected):
    from types import SimpleNamespace

    from trainer.loop import stopped_how

    t = SimpleNamespace(resilience=SimpleNamespace(reason=reason) if reason else None, watch=None)
    assert stopped_how(t, True) == expected
    assert stopped_how(t, False) == {"preempted": False, "cancelled": False}
    t.watch = SimpleNamespace(stopped=True)  # an early stop (train.early_stop_patience) is neither
    assert stopped_how(t, True) == {"preempted": False, "cancelled": reason == "terminated"}
