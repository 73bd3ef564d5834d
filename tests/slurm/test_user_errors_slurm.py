"""On the real two-node Slurm sandbox: an error of the task's own code on rank 1 ends the job FAILED after one
attempt, naming rank 1 (not rank 0, which only lost its connection to it) and the file and line; in script
mode the rank whose command failed first is named, with the exception torch's ``@record`` wrote."""

from __future__ import annotations

import json
import secrets

import pytest

from tests.resilience.resilience_lib import ledger, submit, wait_state
from tests.script_mode import script_lib
from tests.script_mode.test_script_local import FIRST_FAILS


@pytest.fixture
def where(sandbox):
    folder = sandbox / "user-errors" / secrets.token_hex(4)  # a folder both nodes see
    folder.mkdir(parents=True)
    return folder


def test_an_error_in_the_tasks_code_on_rank_1_fails_once_naming_rank_1_and_its_line(where):
    job = where / "job.toml"
    job.write_text('[job]\nname = "user-error"\nnodes = 2\ntasks_per_node = 1\nmax_requeues = 2\n'
                   '[task]\ntarget = "tests.resilience.user_errors_task:Flaky"\n'
                   'kwargs = {fail = "value", at = 2, rank = 1}\n'
                   '[train]\nsteps = 6\nglobal_batch = 4\nmicro_batch = 2\nlog_every = 1\n'
                   '[checkpoint]\ninterval_steps = 2\n[parallel]\nstrategy = "ddp"\n')
    run = submit(str(job), site="sandbox")
    assert wait_state(run, ("COMPLETED", "FAILED"), timeout=600)["state"] == "FAILED"
    lines = ledger(run)
    assert [e["event"] for e in lines] == ["start", "stop"], lines  # one attempt
    stop = lines[1]
    assert stop["by"] == "batch script" and not stop["requeued"] and stop["failed_ranks"] == [1], stop
    assert stop["error"].startswith("ValueError: label out of range in call 3 (at ")
    assert "user_errors_task.py:" in stop["error"] and "in the job's own code at" in stop["not_requeued"]


def test_the_script_rank_that_failed_first_is_named_on_two_nodes(where):
    spec = script_lib.script_folder(where / "first", ["python", "first.py"], name="first", nodes=2, tasks=1)
    (spec.parent / "first.py").write_text(FIRST_FAILS.replace("{first}", "1"))
    run = script_lib.submit_in(spec.parent, "--site", "sandbox")
    assert script_lib.wait_state(run, timeout=600)["state"] == "FAILED"
    stop = next(e for e in script_lib.ledger(run) if e["event"] == "stop")
    assert stop["failed_ranks"] == [1], json.dumps(stop)
    assert "(ValueError: a bad batch on this rank at " in stop["error"] and "first.py:11)" in stop["error"]
