"""Script mode on the real two-node Slurm sandbox: a plain DDP script through ``[job] command`` on 2 nodes
× 2 tasks sees torchrun's environment per node, is drilled, asks for its requeue and resumes from its
own checkpoint, ending equal to an uninterrupted twin; a failing command is requeued by the batch
script's check after srun, as the trainer's failures are."""

from __future__ import annotations

import random
import secrets

import pytest

from tests.conftest import hpcx
from tests.script_mode.script_lib import (final_weights, ledger, losses, same_weights, script_folder, seen, status,
                                          submit_in, wait_state)

STEPS = 16


@pytest.fixture
def where(sandbox):
    folder = sandbox / "script-tests" / secrets.token_hex(4)  # a folder both nodes see
    folder.mkdir(parents=True)
    return folder


def ddp(*extra: str) -> list[str]:
    return ["python", "ddp_script.py", "out", str(STEPS), *extra]


def test_a_drilled_ddp_script_on_two_nodes_resumes_from_its_own_checkpoint(where):
    at = random.Random().randint(2, 10)
    twin = script_folder(where / "twin", ddp(), name="script-twin", nodes=2, tasks=2)
    drilled = script_folder(where / "drilled", ddp("--hold-at", str(at)), name="script-drilled", nodes=2, tasks=2)
    runs = [submit_in(s.parent, "--site", "sandbox") for s in (twin, drilled)]
    sent = hpcx("drill", str(runs[1]), "--at-step", str(at), "--json", timeout=300)
    assert sent.returncode == 0, sent.stderr
    for run in runs:
        assert wait_state(run, timeout=600)["state"] == "COMPLETED", run

    out = drilled.parent / "out"
    hosts = {rank: seen(out, 0, rank)["hostname"] for rank in range(4)}
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # node-major: ranks 0, 1 on one node, 2, 3 on the other
    for rank in range(4):
        env = seen(out, 0, rank)
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
            (str(rank), str(rank % 2), "4", "2", str(rank // 2))
        assert env["MASTER_ADDR"] == hosts[0] and env["MASTER_PORT"] == seen(out, 0, 0)["MASTER_PORT"]
        assert seen(out, 1, rank)["HPCX_RESTART"] == "1"

    start0, stop0, start1, stop1 = ledger(runs[1])
    assert stop0["reason"] == "preempted" and stop0["requeued"] and stop0["step"] == at
    assert start1["restart"] == 1 and start1["slurm_restart_count"] == 1 and start1["step"] == at
    assert stop1["reason"] == "completed" and stop1["step"] == STEPS
    assert losses(runs[1]) == losses(runs[0])
    assert same_weights(final_weights(out), final_weights(twin.parent / "out"))
    assert status(runs[1])["restarts"] == 1


def test_a_failing_command_on_the_sandbox_is_requeued_by_the_check_after_srun_once(where):
    spec = script_folder(where / "fails", ["python", "fail.py"], name="script-fails", nodes=2, tasks=1)
    (spec.parent / "fail.py").write_text("import os\nraise SystemExit(5 if os.environ['RANK'] == '1' else 0)\n")
    run = submit_in(spec.parent, "--site", "sandbox")
    assert wait_state(run, timeout=600)["state"] == "FAILED"
    stops = [e for e in ledger(run) if e["event"] == "stop"]
    assert [s["by"] for s in stops] == ["batch script", "batch script"], stops
    assert stops[0]["requeued"] and not stops[1]["requeued"] and "without progress" in stops[1]["not_requeued"]
    assert "exited with status 5" in stops[0]["error"]
