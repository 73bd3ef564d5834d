"""Errors of the job's own code end it FAILED after one attempt, saying where (file and line); what looks
like the machine's failure (a rank killed) is requeued; the rank named is the one that failed first, not
rank 0 that only lost its connection to it. Real runs on the local site: 2 ranks, gloo, DDP, a small task
(tests/resilience/user_errors_task.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.resilience.resilience_lib import ledger, submit, wait_state

pytestmark = pytest.mark.slow
TASK = Path(__file__).with_name("user_errors_task.py")


def run_failing(tmp_path: Path, fail: str, rank: int = -1, at: int = 3, requeues: int = 2) -> tuple[Path, list]:
    job = tmp_path / "job.toml"
    job.write_text(f'[job]\nname = "{fail}"\nmax_requeues = {requeues}\nrun_root = {json.dumps(str(tmp_path))}\n'
                   '[task]\ntarget = "tests.resilience.user_errors_task:Flaky"\n'
                   f'kwargs = {{fail = "{fail}", at = {at}, rank = {rank}}}\n'
                   '[train]\nsteps = 8\nglobal_batch = 4\nmicro_batch = 2\nlog_every = 1\neval_every = 2\n'
                   '[checkpoint]\ninterval_steps = 2\n[parallel]\nstrategy = "ddp"\n')
    run = submit(str(job))
    info = wait_state(run, ("COMPLETED", "FAILED"), timeout=600)
    assert info["state"] == "FAILED", info
    return run, ledger(run)


@pytest.mark.parametrize("fail,rank,words,line", [
    ("value", 1, "ValueError: label out of range in call 4", "in loss"),
    ("forward", -1, "RuntimeError: mat1 and mat2 shapes cannot be multiplied", "in loss"),
    ("metric", -1, "NameError: name 'undefined_count' is not defined", "in metrics"),
])
def test_an_error_in_the_tasks_code_fails_once_naming_its_file_and_line(tmp_path, fail, rank, words, line):
    run, lines = run_failing(tmp_path, fail, rank)
    assert [e["event"] for e in lines] == ["start", "stop"], lines  # one attempt: never requeued
    stop = lines[1]
    assert stop["reason"] == "failed" and not stop["requeued"] and stop["step"] >= 1
    assert stop["error"].startswith(words) and f"(at {TASK}:" in stop["error"] and stop["error"].endswith(line + ")")
    assert len(stop["error"].splitlines()) == 1
    assert "in the job's own code at" in stop["not_requeued"] and "fail the same way" in stop["not_requeued"]
    # rank 1 failed first; rank 0 only lost its connection to it in the next collective
    assert stop["failed_ranks"] == ([1] if rank == 1 else stop["failed_ranks"]) and len(stop["failed_ranks"]) == 1


def test_a_loss_without_grad_fails_once_in_one_line(tmp_path):
    run, lines = run_failing(tmp_path, "nograd")
    assert [e["event"] for e in lines] == ["start", "stop"]
    error = lines[1]["error"]
    assert f"loss(model, batch) (defined at {TASK}:" in error and len(error.splitlines()) == 1
    assert error.endswith("returned a loss that does not require grad: computed without the model's parameters, "
                          "under no_grad, or detached") and not lines[1]["requeued"]


def test_a_rank_killed_by_a_signal_is_named_and_requeued_as_the_machines_failure(tmp_path):
    run, lines = run_failing(tmp_path, "kill", rank=1, requeues=1)
    stops = [e for e in lines if e["event"] == "stop"]
    assert len(stops) == 2 and stops[0]["requeued"] and not stops[1]["requeued"], stops
    assert stops[0]["failed_ranks"] == [1] and stops[0]["reported_ranks"] == [0]
    assert stops[0]["error"].startswith("rank 1 ended without a Python error"), stops[0]
    assert "rank 0 then lost the connection to it" in stops[0]["error"]
    assert stops[1]["not_requeued"].startswith("job.max_requeues = 1 reached")
