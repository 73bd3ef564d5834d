"""A start's number, the one definition the trainer's rank 0, script mode's every rank and the batch script's
check share (``hpc.core.requeue.start_number``): the ledgers each kind of start can leave, read before and
after rank 0 wrote this start's own line, on Slurm (job id and restart count), locally (the controller keeps
its job id across restarts) and with no scheduler (torchrun)."""

from __future__ import annotations

import pytest

from hpc.core.requeue import start_line, start_number, started_here, stop_line
from hpc.schedulers.local.scheduler import LocalJobSide
from hpc.schedulers.slurm.scheduler import SlurmJobSide


def slurm(monkeypatch, restarts: int, job: str = "77") -> SlurmJobSide:
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    return SlurmJobSide()


def local(monkeypatch, job: str = "4242") -> LocalJobSide:
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", job)
    return LocalJobSide()


def start(side, step: int = 0, restart: int = 0) -> dict:
    return start_line(step, restart, side, "trainer", (None, "none"))


def stop(side, reason: str = "preempted") -> dict:
    return stop_line(5, reason, None, side, "rank 0")


def both_readings(ledger: list[dict], own: dict, side) -> tuple[int, int]:
    """(what rank 0 reads before writing its own line, what another rank reads after it)."""
    return start_number(ledger, side), start_number([*ledger, own], side, own_line_written=True)


@pytest.mark.parametrize("before", [0, 1, 2, 5])
def test_slurm_starts_that_each_stopped_agree_before_and_after_the_own_line(monkeypatch, before):
    ledger: list[dict] = []
    for n in range(before):
        side = slurm(monkeypatch, n)
        ledger += [start(side, restart=n), stop(side)]
    side = slurm(monkeypatch, before)
    assert both_readings(ledger, start(side, restart=before), side) == (before, before)
    assert start_number(ledger, side, own_line_written=True) == before  # another rank, before rank 0 wrote


def test_a_slurm_start_lost_with_its_node_counts_by_its_line_and_the_schedulers_count(monkeypatch):
    first = slurm(monkeypatch, 0)
    ledger = [start(first)]  # the node died with the batch script: no stop line; Slurm requeued the job
    side = slurm(monkeypatch, 1)
    assert both_readings(ledger, start(side, restart=1), side) == (1, 1)
    assert started_here(ledger, side) is None and started_here([*ledger, start(side)], side) == 1


def test_a_slurm_start_that_died_before_its_start_line_counts_by_its_stop_line(monkeypatch):
    first = slurm(monkeypatch, 0)
    ledger = [stop_line(0, "failed", None, first, "batch script")]  # it failed at load: only the check wrote
    side = slurm(monkeypatch, 1)
    assert both_readings(ledger, start(side, restart=1), side) == (1, 1)


def test_the_schedulers_count_wins_when_the_ledger_lost_both_lines(monkeypatch):
    side = slurm(monkeypatch, 3)
    assert both_readings([], start(side, restart=3), side) == (3, 3)


@pytest.mark.parametrize("before", [0, 1, 3])
def test_local_restarts_keep_the_job_id_and_still_count_from_the_stop_lines(monkeypatch, before):
    side = local(monkeypatch)
    ledger = [line for n in range(before) for line in (start(side, restart=n), stop(side))]
    assert both_readings(ledger, start(side, restart=before), side) == (before, before)
    # the newest start line is the last start's (same job id, count 0), but a stop follows it: not this one's
    assert start_number(ledger, side, own_line_written=True) == before


def test_torchrun_starts_killed_without_a_word_each_count(monkeypatch):
    ledger = [start(None), stop(None), start(None, restart=1)]  # the second was killed outright
    assert start_number(ledger, None) == 2  # rank 0 of the third start, before its own line


def test_another_jobs_start_line_is_never_taken_for_this_starts(monkeypatch):
    ledger = [start(slurm(monkeypatch, 0, job="1"))]  # the side reads the environment when asked
    side = slurm(monkeypatch, 0, job="2")
    assert started_here(ledger, side) is None
    assert start_number(ledger, side, own_line_written=True) == 1


def test_the_line_of_a_start_names_its_number_identity_and_wait(monkeypatch):
    side = slurm(monkeypatch, 2)
    line = start_line(40, 2, side, "script", (12.3456, "sacct"), command=["python", "t.py"])
    assert line["event"] == "start" and line["restart"] == 2 and line["step"] == 40 and line["by"] == "script"
    assert line["job_id"] == "77" and line["slurm_restart_count"] == 2 and line["command"] == ["python", "t.py"]
    assert line["queue_wait_s"] == 12.346 and line["queue_wait_source"] == "sacct"
    assert start_line(0, 0, None, "trainer", (None, "none"))["job_id"] is None


# ---------------------------------------------------------------- one requeue, asked the same way by both


class Side:
    """A scheduler's job side that grants (or refuses) a requeue, counting the asks."""

    def __init__(self, refuse: str | None = None, restarts: int = 0) -> None:
        self.refuse, self.restarts, self.asked = refuse, restarts, 0

    def restart_count(self) -> int:
        return self.restarts

    def requeue(self) -> str | None:
        self.asked += 1
        return self.refuse


def _ledger(tmp_path, *lines: dict) -> None:
    from hpc.core.runs import RunDir, append_jsonl

    for line in lines:
        append_jsonl(RunDir(tmp_path).ledger, line)


@pytest.mark.parametrize("lines,reason,step,restarts,why", [
    ([{"event": "start"}], "preempted", 5, 0, None),
    ([{"event": "start"}, {"event": "stop", "reason": "failed", "step": 5}, {"event": "start"}], "failed", 5, 1,
     "failed twice at step 5 without progress"),
    ([{"event": "start"}, {"event": "stop", "reason": "failed", "step": 5}, {"event": "start"}], "failed", 9, 1, None),
    ([{"event": "start"}] * 4, "preempted", 9, 0, "job.max_requeues = 3 reached (3 restarts so far)"),
    ([{"event": "start"}], "time_limit", 2, 3, "job.max_requeues = 3 reached (3 restarts so far)"),
])
def test_the_trainer_and_script_mode_ask_the_one_requeue_through_one_function(tmp_path, lines, reason, step,
                                                                               restarts, why):
    from hpc.core import requeue

    _ledger(tmp_path, *lines)
    side = Side(restarts=restarts)
    assert requeue.ask(side, tmp_path, "9.0", reason, step, 3) == why
    assert side.asked == (why is None)  # the scheduler is asked only when the policy allows
    if why is None:  # granted, recorded, and never granted twice for one start
        assert "REQUEUED" in (tmp_path / "states.jsonl").read_text()
        assert requeue.ask(side, tmp_path, "9.0", reason, step, 3) == \
            "this start (9.0) was already requeued by another party"
        assert side.asked == 1


def test_a_requeue_the_scheduler_refuses_or_no_scheduler_says_why(tmp_path):
    from hpc.core import requeue

    _ledger(tmp_path, {"event": "start"})
    assert requeue.ask(Side(refuse="scontrol requeue: job not requeueable"), tmp_path, "9.0", "preempted", 3, 3) == \
        "scontrol requeue: job not requeueable"
    assert requeue.ask(None, tmp_path, "single.0", "preempted", 3, 3) == requeue.NO_SCHEDULER
