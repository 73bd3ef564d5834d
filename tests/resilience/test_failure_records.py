"""What the run folder records about a failed start: the rank that died and its signal (from srun's own
account in the batch log, not the survivors that lost their connection), the saves it committed (from
the run folder, not from a process that is gone), failures that would repeat (never requeued), and a
time-limit signal told from a preemption. Real files and the real policy code; no cluster."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hpc.core import failures, requeue, runs
from hpc.core.errors import ConfigError, UserError
from hpc.core.spec import Checkpoint
from hpc.schedulers.local.scheduler import LocalJobSide
from hpc.schedulers.slurm.requeue import after_srun
from hpc.schedulers.slurm.scheduler import (srun_task_ends, start_mark, task_end, task_ranks,
                                           this_start)
from tests.resilience.test_requeue import JOB, start, write_ledger

CONNECTION_RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                    "[10.200.0.11]:39812: Connection reset by peer. This is typically caused by a remote worker")
CONNECTION_CLOSED = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                     "peer [10.200.0.11]:54666")


def batch_log(*blocks: tuple[int, str]) -> str:
    """A batch log as the sandbox writes it: each start's mark (setup_lines), then what srun said."""
    return "".join(f"{start_mark(JOB, restart)}\n{text}" for restart, text in blocks)


def srun_says(first: str, *rest: str) -> str:
    """srun's lines (as recorded on the sandbox) for a step whose ``first`` task line ended it."""
    return ("[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: Connection closed by peer\n"
            f"srun: error: {first}\nsrun: launch/slurm: _step_signal: Terminating StepId={JOB}.0\n"
            f"slurmstepd-n1: error: *** STEP {JOB}.0 ON n1 CANCELLED AT 2026-12-01T09:02:43 ***\n"
            + "".join(f"srun: error: {line}\n" for line in rest) + f"srun: Force Terminated StepId={JOB}.0\n")


def write_batch_log(run: Path, text: str) -> None:
    (run / "submitit" / f"{JOB}_0_log.err").write_text(text)


def report(run: Path, rank: int, error: str, **fields) -> None:
    requeue.report_failure(run, f"{JOB}.1", rank, step=fields.pop("step", 28), error=error, terminated=False,
                           **fields)


# ---------------------------------------------------------------- srun's account (pure)


def test_srun_lines_name_the_task_that_ended_the_step_and_the_ones_srun_ended():
    ends = srun_task_ends(srun_says("n1: task 1: Killed", "n2: task 3: Terminated", "n1: task 0: Terminated",
                                    "n2: task 2: Exited with exit code 1"))
    assert [(e["ranks"], e["first"]) for e in ends] == [([1], True), ([3], False), ([0], False), ([2], False)]
    assert ends[0]["signal"] == "SIGKILL" and ends[0]["host"] == "n1" and ends[-1]["exit_code"] == 1


@pytest.mark.parametrize("what,expected", [
    ("Killed", {"signal": "SIGKILL"}), ("Segmentation fault", {"signal": "SIGSEGV"}),
    ("Segmentation fault (core dumped)", {"signal": "SIGSEGV"}), ("Aborted (core dumped)", {"signal": "SIGABRT"}),
    ("Bus error", {"signal": "SIGBUS"}), ("Terminated", {"signal": "SIGTERM"}),
    ("Exited with exit code 3", {"exit_code": 3}), ("Out Of Memory", {}),
])
def test_srun_words_for_how_a_task_ended(what, expected):
    assert task_end(what) == expected


def test_task_lists_in_srun_lines():
    assert task_ranks("0") == [0] and task_ranks("2-3") == [2, 3] and task_ranks("0,2-4") == [0, 2, 3, 4]
    (ends,) = srun_task_ends("srun: error: n2: tasks 2-3: Killed\n")
    assert ends["ranks"] == [2, 3] and ends["first"]  # no "Terminating": everything srun said is first


def test_only_this_starts_part_of_the_batch_log_counts():
    text = batch_log((0, srun_says("n2: task 3: Segmentation fault")), (1, srun_says("n1: task 0: Killed")))
    assert [e["ranks"] for e in srun_task_ends(this_start(text, JOB, 1)) if e["first"]] == [[0]]
    assert [e["ranks"] for e in srun_task_ends(this_start(text, JOB, 0))] == [[3]]  # up to the next start
    quiet = batch_log((0, srun_says("n2: task 3: Killed")), (1, "[rank0]: nothing from srun\n"))
    assert srun_task_ends(this_start(quiet, JOB, 1)) == []  # the previous start's lines are not this one's


# ---------------------------------------------------------------- the stop line after srun


@pytest.mark.parametrize("dead,host,words,signal", [
    (0, "n1", "Killed", "SIGKILL"), (1, "n1", "Killed", "SIGKILL"), (3, "n2", "Killed", "SIGKILL"),
    (2, "n2", "Segmentation fault (core dumped)", "SIGSEGV"), (1, "n1", "Aborted", "SIGABRT"),
])
def test_the_rank_that_died_is_named_with_its_signal_not_the_survivors(run_dir, slurm_side, dead, host, words,
                                                                       signal):
    write_ledger(run_dir, [start(0)])
    survivors = [r for r in range(4) if r != dead]
    write_batch_log(run_dir, batch_log((1, srun_says(f"{host}: task {dead}: {words}",
                                                     *(f"n1: task {r}: Terminated" for r in survivors)))))
    for rank in survivors[:2]:  # the survivors' collectives fail: they report a peer's loss
        report(run_dir, rank, CONNECTION_RESET if rank % 2 else CONNECTION_CLOSED, saves=3, save_s=1.5)
    line = after_srun(run_dir, 143, slurm_side)
    assert line["failed_ranks"] == [dead] and line["signal"] == signal
    assert line["reported_ranks"] == sorted(survivors[:2])
    assert f"rank {dead} on {host} was killed by {signal}" in line["error"]
    assert "lost their connection" in line["error"] and "Connection reset" not in line["error"]
    assert line["requeued"] is False and line["step"] == 28  # the claim was taken; no such job to requeue


def test_a_rank_that_raised_first_is_named_with_its_own_error(run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n1: task 1: Exited with exit code 1",
                                                     "n1: task 0: Terminated"))))
    report(run_dir, 0, CONNECTION_CLOSED)
    report(run_dir, 1, "ValueError: bad batch at step 28")
    line = after_srun(run_dir, 1, slurm_side)
    assert line["failed_ranks"] == [1] and line["exit_code"] == 1 and "signal" not in line
    assert line["error"] == "ValueError: bad batch at step 28"


def test_every_rank_failing_alike_is_named_by_the_first_that_srun_saw_end(run_dir, slurm_side):
    """Seen on the sandbox: every rank's model build raised ConnectionRefusedError; rank 3 exited first."""
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 3: Exited with exit code 1",
                                                     "n1: tasks 0-1: Exited with exit code 1"))))
    refused = "ConnectionRefusedError: [Errno 111] Connection refused: tokenizer service at 10.200.0.1:9"
    for rank in range(4):
        report(run_dir, rank, refused, step=0, phase="build", repeats=False)
    line = after_srun(run_dir, 1, slurm_side)
    assert line["failed_ranks"] == [3] and line["error"] == refused and line["exit_code"] == 1
    assert (run_dir / "requeue" / f"{JOB}.1.requeued").exists()  # a refused connection may not repeat


def test_a_rank_that_raised_is_named_although_a_peer_exited_first(run_dir, slurm_side):
    """Seen on the sandbox: rank 1 raised (its own error) but rank 3, whose collective broke, exited first."""
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n2: task 3: Exited with exit code 1",
                                                     "n1: tasks 0-1: Terminated", "n2: task 2: Exited with exit code 1"))))
    report(run_dir, 1, "RuntimeError: flaky rank 1: injected failure in forward call 14", step=13)
    report(run_dir, 3, CONNECTION_CLOSED, step=13)
    report(run_dir, 0, CONNECTION_CLOSED, step=13)
    line = after_srun(run_dir, 143, slurm_side)
    assert line["failed_ranks"] == [1] and line["reported_ranks"] == [0, 1, 3]
    assert line["error"] == "RuntimeError: flaky rank 1: injected failure in forward call 14"
    assert "exit_code" not in line and "signal" not in line  # srun's first line was about rank 3


def test_without_srun_lines_the_ranks_that_failed_on_their_own_are_named(run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])  # a batch script of an older hpcx: no mark, and srun said nothing
    report(run_dir, 2, CONNECTION_RESET)
    report(run_dir, 1, "RuntimeError: CUDA error: an illegal memory access")
    requeue.report_failure(run_dir, f"{JOB}.1", 3, step=28, error="KeyError: 'x'", terminated=True)
    line = after_srun(run_dir, 1, slurm_side)
    assert line["failed_ranks"] == [1] and line["reported_ranks"] == [1, 2, 3]
    assert line["error"] == "RuntimeError: CUDA error: an illegal memory access"


# ---------------------------------------------------------------- saves counted from the run folder


def commit(run: Path, *steps: int) -> None:
    for step in steps:
        folder = run / "checkpoints" / f"step-{step:07d}"
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(b"")


@pytest.mark.parametrize("committed,expected", [((20, 25), 5), ((15, 20), 4), ((), 4)])
def test_srun_killed_counts_the_saves_the_run_folder_holds(run_dir, slurm_side, committed, expected):
    """srun SIGKILLed: no rank reported, srun said nothing; rank 0 had recorded 5 saves, the last at step
    25. Rotation keeps 2 folders; the last save counts only when it was committed."""
    write_ledger(run_dir, [start(0)])
    failures.record_saves(run_dir, f"{JOB}.1", 5, 2.5, 25)
    commit(run_dir, *committed)
    line = after_srun(run_dir, 137, slurm_side)
    assert line["saves"] == expected and line["save_s"] == 2.5
    assert "srun ended with status 137 (SIGKILL)" in line["error"] and line["failed_ranks"] == []


def test_rank_0s_report_counts_when_it_has_one(run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])
    failures.record_saves(run_dir, f"{JOB}.1", 2, 1.0, 10)
    commit(run_dir, 5, 10)
    report(run_dir, 0, "ValueError: x", saves=3, save_s=1.7)
    line = after_srun(run_dir, 1, slurm_side)
    assert (line["saves"], line["save_s"]) == (3, 1.7)
    assert failures.saves_of(run_dir, "nothing.0") == (0, 0.0)


# ---------------------------------------------------------------- failures that would repeat


class DistNetworkError(RuntimeError):
    """Stands in for torch.distributed's (judged by class name: hpc imports no torch)."""


class OutOfMemoryError(RuntimeError):
    pass


@pytest.mark.parametrize("exc,phase,steps,repeats", [
    (ModuleNotFoundError("No module named 'mymodels'"), "build", 0, True),
    (ImportError("cannot import name 'LlamaForCausalLM'"), "build", 0, True),
    (UserError("module 'norm' (RMSNorm) owns weight but has no reset_parameters()"), "build", 0, True),
    (ConfigError(["resolved.json: `train.steps` = -1: must be ≥ 1"]), "load", 0, True),
    (ValueError("train.global_batch = 8 is not divisible by world_size × micro_batch"), "load", 0, True),
    (TypeError("forward() takes 2 positional arguments but 3 were given"), "train", 0, True),
    (AttributeError("'Tensor' object has no attribute 'logits'"), "train", 0, True),
    (FileNotFoundError("data/tokens.bin"), "build", 0, True),
    (KeyError("model.embed.weight"), "resume", 0, True),
    (TypeError("late bug"), "train", 3, False),  # it got past the first step: not a start-up failure
    (ValueError("bad MASTER_ADDR"), "join", 0, False),  # joining the job is the network's
    (ImportError("x"), "join", 0, False),
    (DistNetworkError("The client socket has timed out"), "join", 0, False),
    (ConnectionResetError("Connection reset by peer"), "build", 0, False),
    (ConnectionRefusedError(111, "Connection refused"), "build", 0, False),
    (TimeoutError("store"), "build", 0, False),
    (RuntimeError("NCCL error: unhandled system error"), "build", 0, False),
    (RuntimeError(CONNECTION_RESET), "train", 0, False),
    (ValueError("Connection closed by peer"), "train", 0, False),  # a peer's loss dressed as a ValueError
    (OutOfMemoryError("CUDA out of memory"), "build", 0, False),
    (MemoryError(), "build", 0, False),
    (OSError(5, "Input/output error"), "build", 0, False),
])
def test_which_start_up_failures_would_repeat(exc, phase, steps, repeats):
    assert failures.would_repeat(exc, phase, steps) is repeats


def test_a_repeating_failure_is_one_line_and_never_requeued_by_the_check(run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])
    write_batch_log(run_dir, batch_log((1, srun_says("n1: task 1: Exited with exit code 1",
                                                     "n1: task 0: Terminated"))))
    report(run_dir, 0, CONNECTION_CLOSED, step=0, phase="train", repeats=False)
    report(run_dir, 1, "ModuleNotFoundError: No module named 'mymodels'", step=0, phase="build", repeats=True)
    line = after_srun(run_dir, 1, slurm_side)
    assert not line["requeued"] and line["error"] == "ModuleNotFoundError: No module named 'mymodels'"
    assert line["not_requeued"] == ("ModuleNotFoundError on rank 1 while building the model, before the first "
                                    "step: it would fail the same way on a restart")
    assert not list((run_dir / "requeue").glob("*.requeued"))  # refused before claiming


def test_a_transient_start_up_failure_is_still_requeued(run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])
    report(run_dir, 0, "DistNetworkError: The client socket has timed out", step=0, phase="join", repeats=False)
    line = after_srun(run_dir, 1, slurm_side)
    assert (run_dir / "requeue" / f"{JOB}.1.requeued").exists()  # the policy allowed it: the claim was taken
    assert "would fail the same way" not in line.get("not_requeued", "")


def test_rank_0_decides_a_repeating_failure_where_no_check_runs(run_dir, monkeypatch):
    """Under submitit's local controller rank 0 writes the stop line: a repeating failure is not
    requeued (no exit with the requeue status), a transient one is."""
    from trainer.resilience import Resilience

    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "5150")
    write_ledger(run_dir, [{"event": "start", "step": 0, "job_id": "5150"}])
    guard = Resilience(run_dir, Checkpoint(), 3, 0, rank=0, side=LocalJobSide(), phase="build")
    guard.failed(ImportError("No module named 'mymodels'"))
    stop = runs.RunDir(run_dir).read_ledger()[-1]
    assert stop["reason"] == "failed" and not stop["requeued"] and "would fail the same way" in stop["not_requeued"]
    assert stop["error"] == "ImportError: No module named 'mymodels'"
    (report_,) = requeue.failure_reports(run_dir, "5150.0")
    assert report_["phase"] == "build" and report_["repeats"] is True


def test_another_ranks_repeating_report_stops_rank_0s_requeue(run_dir, monkeypatch):
    from trainer.resilience import Resilience

    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "5151")
    requeue.report_failure(run_dir, "5151.0", 1, step=0, error="TypeError: bad kwargs", phase="build",
                           repeats=True)
    guard = Resilience(run_dir, Checkpoint(), 3, 0, rank=0, side=LocalJobSide(), phase="build")
    guard.failed(RuntimeError(CONNECTION_CLOSED))
    stop = runs.RunDir(run_dir).read_ledger()[-1]
    assert not stop["requeued"] and stop["not_requeued"].startswith("TypeError on rank 1 while building")


# ---------------------------------------------------------------- a time limit is not a preemption


class FakeSide(LocalJobSide):
    """A job side whose time limit is ``left`` seconds away and whose signal may come ``early`` seconds
    before its lead (Slurm's 60 s by default); records the waits and requeues asked."""

    def __init__(self, left: float | None, early: float = 60.0):
        self.left, self.held, self.asked, self.signal_early_s = left, 0, 0, early

    def job_id(self) -> str:
        return "777"

    def seconds_left(self) -> float | None:
        return self.left

    def await_time_limit(self) -> None:
        self.held += 1

    def requeue(self) -> str | None:
        self.asked += 1
        return None

    def leave_for_requeue(self) -> None:
        pass


def stopped_by_signal(run: Path, side: FakeSide, since: float, max_requeues: int = 3) -> dict:
    from trainer.preemption import PreemptionFlag
    from trainer.resilience import Resilience

    flag = PreemptionFlag()
    flag.requested, flag.requested_at = True, time.time() - since
    guard = Resilience(run, Checkpoint(), max_requeues, 0, rank=0, preemption=flag, side=side, signal_lead_s=30,
                       step=12, reason="preempted")
    write_ledger(run, [{"event": "start", "step": 0, "job_id": "777"}])
    guard.stopped()
    return runs.RunDir(run).read_ledger()[-1]


@pytest.mark.parametrize("left,since,reason", [
    (25, 5, "time_limit"),  # the signal came 30 s before the limit: the lead itself
    (40, 50, "time_limit"),  # 90 s before: Slurm's 60 s leeway
    (3000, 5, "preempted"),  # a drill, or a preemption, long before the limit
    (400, 1, "preempted"),
])
def test_the_time_limit_signal_is_told_from_a_preemption(run_dir, left, since, reason):
    side = FakeSide(left)
    stop = stopped_by_signal(run_dir, side, since)
    assert stop["reason"] == reason and stop["requeued"] and side.asked == 1 and side.held == 0


def test_no_time_limit_means_a_preemption(run_dir):
    assert stopped_by_signal(run_dir, FakeSide(None), 1)["reason"] == "preempted"


def test_the_time_limit_with_no_requeue_left_holds_the_job_and_raises_nothing(run_dir):
    side = FakeSide(20)
    stop = stopped_by_signal(run_dir, side, 10, max_requeues=0)
    assert stop["reason"] == "time_limit" and not stop["requeued"] and "max_requeues = 0" in stop["not_requeued"]
    assert side.held == 1 and side.asked == 0


def test_a_preemption_with_no_requeue_left_still_fails(run_dir):
    with pytest.raises(RuntimeError, match="preempted at step 12"):
        stopped_by_signal(run_dir, FakeSide(5000), 1, max_requeues=0)


def test_the_check_leaves_a_time_limit_stop_to_rank_0(run_dir, slurm_side):
    write_ledger(run_dir, [start(0), {"event": "stop", "reason": "time_limit", "step": 9, "job_id": JOB}])
    assert after_srun(run_dir, 1, slurm_side) is None


def test_saves_are_recorded_as_they_happen(run_dir, monkeypatch):
    from trainer.resilience import Resilience

    guard = Resilience(run_dir, Checkpoint(), 3, 0, rank=0, side=FakeSide(None))
    for n, step in enumerate((5, 10, 15), 1):
        guard.saves, guard.save_s = n, 0.5 * n
        guard._record_saves(step)
    assert json.loads((run_dir / "requeue" / "777.0.saves.json").read_text()) == {"saves": 3, "save_s": 1.5,
                                                                                "last_step": 15}


def test_a_run_folder_the_trainer_cannot_read_is_reported_as_repeating(run_dir, slurm_side, monkeypatch):
    from trainer.resilience import report_unloadable

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")  # as the rendered script exports it

    report_unloadable(run_dir, 2, ConfigError(["resolved.json: `train.steps` = 0: expected at least 1"]))
    (found,) = requeue.failure_reports(run_dir, f"{JOB}.1")
    assert found["rank"] == 2 and found["phase"] == "load" and found["repeats"] is True
    write_ledger(run_dir, [])
    line = after_srun(run_dir, 1, slurm_side)
    assert not line["requeued"] and "while reading the run folder" in line["not_requeued"]
    assert line["error"].startswith("ConfigError: resolved.json")


def test_the_result_line_says_how_the_job_stopped_when_there_is_none():
    from hpc.cli import describe_result
    from hpc.login.submit import stop_summary

    stop = stop_summary({"reason": "time_limit", "step": 40, "requeued": False, "not_requeued": "max reached"})
    assert describe_result(None, stop) == ("no result (the job did not finish its work: time limit at step 40 "
                                           "(not requeued: max reached))")
    assert describe_result(None) == "no result (the job did not finish its work)"
