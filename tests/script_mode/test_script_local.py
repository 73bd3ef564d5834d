"""Script mode on the local site: a plain DDP script through ``[job] command``, its rank environment, a
drill it survives by its own checkpoint, and the records of each way a command can end."""

from __future__ import annotations

import json

import pytest

from hpc.core import health
from tests.conftest import hpcx
from tests.script_mode.script_lib import (final_weights, ledger, losses, same_weights, script_folder, seen,
                                          status, submit_in, wait_state)

pytestmark = pytest.mark.slow
STEPS = 16


def ddp(out: str, *extra: str) -> list[str]:
    return ["python", "ddp_script.py", out, str(STEPS), *extra]


def test_a_plain_ddp_script_sees_torchruns_environment(tmp_path, run_root, monkeypatch):
    # the defaults hpcx gives when nobody set them (a value the submitting shell exports wins; an in-process
    # test earlier in the session may have pinned TORCH_NCCL_ASYNC_ERROR_HANDLING, as trainer.dist does)
    for name in ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    spec = script_folder(tmp_path / "user", ddp("out"), name="env", run_root=run_root)
    run = submit_in(spec.parent, "--site", "local")
    assert wait_state(run)["state"] == "COMPLETED"
    out = spec.parent / "out"
    for rank in (0, 1):
        env = seen(out, 0, rank)
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0" and env["HPCX_RESTART"] == "0"
        assert env["MASTER_PORT"] == seen(out, 0, 0)["MASTER_PORT"] and int(env["MASTER_PORT"]) >= 20000
        assert env["OMP_NUM_THREADS"] == "1"  # the local site's 2 CPUs over 2 tasks
        # torchrun's agent variables (torch's LocalElasticAgent): no agent store, so init_process_group works
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert env["TORCHELASTIC_RUN_ID"] == ledger(run)[0]["job_id"] and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2" and env["TORCHELASTIC_ERROR_FILE"].endswith(f".error-rank-{rank}.json")
        # hpc.job.log is the script's step boundary: each rank's heartbeat, as a trainer rank's (hpcx drill aims at it)
        beat = health.read_beat(run, rank)
        assert beat["incarnation"] == env["HPCX_INCARNATION"] == f"{ledger(run)[0]['job_id']}.0"
        assert 1 <= beat["step"] <= STEPS and beat["host"] == env["hostname"]
    start, stop = ledger(run)
    assert start["by"] == "script" and start["command"] == ddp("out")
    assert stop["reason"] == "completed" and stop["command_status"] == 0 and stop["step"] == STEPS
    assert sorted(losses(run)) == list(range(1, STEPS + 1))
    shown = status(run)
    assert shown["step"] == STEPS and shown["loss"] == losses(run)[STEPS]


def test_a_drilled_script_saves_asks_requeues_and_ends_equal_to_an_uninterrupted_twin(tmp_path, run_root):
    twin = script_folder(tmp_path / "twin", ddp("out"), name="twin", run_root=run_root)
    drilled = script_folder(tmp_path / "drilled", ddp("out", "--hold-at", "5"), name="drilled", run_root=run_root)
    runs = [submit_in(s.parent, "--site", "local") for s in (twin, drilled)]
    sent = hpcx("drill", str(runs[1]), "--at-step", "5", "--json", timeout=300)
    assert sent.returncode == 0, sent.stderr
    for run in runs:
        assert wait_state(run)["state"] == "COMPLETED", run
    lines = ledger(runs[1])
    assert len(lines) == 4, lines  # start, stop (preempted), start, stop (completed)
    start0, stop0, start1, stop1 = lines
    assert stop0["reason"] == "preempted" and stop0["requeued"] and stop0["step"] == 5
    assert start1["restart"] == 1 and start1["step"] == 5
    assert stop1["reason"] == "completed" and stop1["step"] == STEPS
    assert seen(drilled.parent / "out", 1, 1)["HPCX_RESTART"] == "1"
    assert seen(drilled.parent / "out", 1, 1)["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert losses(runs[1]) == losses(runs[0])
    assert same_weights(final_weights(drilled.parent / "out"), final_weights(twin.parent / "out"))
    assert status(runs[1])["restarts"] == 1


def test_a_preempted_script_that_does_not_ask_is_not_requeued_and_says_why(tmp_path, run_root):
    # the script reads the flag and stops, but never calls hpc.job.requeue()
    spec = script_folder(tmp_path / "user", ddp("out", "--hold-at", "3"), name="noask", run_root=run_root)
    (spec.parent / "ddp_script.py").write_text((spec.parent / "ddp_script.py").read_text()
                                                .replace("job.requeue()", "pass"))
    run = submit_in(spec.parent, "--site", "local")
    assert hpcx("drill", str(run), "--at-step", "3", timeout=300).returncode == 0
    wait_state(run)
    start, stop = ledger(run)
    assert stop["reason"] == "preempted" and not stop["requeued"] and stop["step"] == 3
    assert "did not ask for a requeue" in stop["not_requeued"]


@pytest.mark.parametrize("body, words", [("raise SystemExit(3)", "exited with status 3"),
                                         ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
                                          "killed by SIGKILL")])
def test_a_failing_command_is_reported_requeued_once_then_not_again_without_progress(tmp_path, run_root, body, words):
    spec = script_folder(tmp_path / "user", ["python", "fail.py"], name="fails", run_root=run_root)
    (spec.parent / "fail.py").write_text(f"from hpc import job\njob.log(0)\n{body}\n")
    run = submit_in(spec.parent, "--site", "local")
    assert wait_state(run)["state"] == "FAILED"
    stops = [e for e in ledger(run) if e["event"] == "stop"]
    assert [s["reason"] for s in stops] == ["failed", "failed"]
    assert stops[0]["requeued"] and not stops[1]["requeued"]
    assert "without progress" in stops[1]["not_requeued"] and words in stops[1]["error"]


def test_rank_0_decides_once_every_rank_said_how_its_command_ended(tmp_path, run_root):
    # rank 0's command succeeds at once, rank 1's fails later: the stop line says failed, not completed
    spec = script_folder(tmp_path / "user", ["python", "fail.py"], name="onefails", run_root=run_root)
    (spec.parent / "fail.py").write_text("import os, time\nif os.environ['RANK'] == '1':\n    time.sleep(2)\n"
                                         "    raise SystemExit(4)\n")
    run = submit_in(spec.parent, "--site", "local")
    assert wait_state(run)["state"] == "FAILED"
    stops = [e for e in ledger(run) if e["event"] == "stop"]
    assert [s["reason"] for s in stops] == ["failed", "failed"] and stops[0]["requeued"]
    assert "exited with status 4 on rank 1" in stops[0]["error"] and stops[0]["command_status"] == 0


def test_a_cancelled_script_is_terminated_and_never_requeued(tmp_path, run_root):
    spec = script_folder(tmp_path / "user", ddp("out", "--hold-at", "2"), name="cancel", run_root=run_root)
    run = submit_in(spec.parent, "--site", "local")
    import time

    deadline = time.time() + 300  # a hang guard
    while not (run / "metrics.jsonl").exists() or 2 not in losses(run):
        assert time.time() < deadline
        time.sleep(0.5)
    assert hpcx("cancel", str(run)).returncode == 0
    final = wait_state(run)
    assert final["state"].startswith("CANCELLED"), final
    stops = [e for e in ledger(run) if e["event"] == "stop"]
    assert len(stops) == 1 and stops[0]["reason"] == "terminated" and not stops[0]["requeued"]
    assert [e["event"] for e in ledger(run)].count("start") == 1


def test_resume_of_a_cancelled_script_starts_it_again_in_its_folder(tmp_path, run_root):
    spec = script_folder(tmp_path / "user", ["python", "-c", "from hpc import job; job.log(job.restart())"],
                         name="resume", run_root=run_root)
    run = submit_in(spec.parent, "--site", "local")
    wait_state(run)
    out = hpcx("resume", str(run))
    assert out.returncode == 2 and "its command completed: nothing to resume" in out.stderr
    assert json.loads((run / "resolved.json").read_text())["workdir"] == str(spec.parent)


FIRST_FAILS = '''
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    dist.init_process_group("gloo")
    if dist.get_rank() == {first}:
        raise ValueError("a bad batch on this rank")
    dist.all_reduce(torch.ones(1))  # the other ranks wait here and fail when that one is gone


main()
'''


@pytest.mark.parametrize("first", [1, 0])
def test_the_rank_whose_command_failed_first_is_named_not_the_last_one_standing(tmp_path, run_root, first):
    spec = script_folder(tmp_path / "user", ["python", "first.py"], name="first", run_root=run_root,
                         extra="")
    (spec.parent / "first.py").write_text(FIRST_FAILS.replace("{first}", str(first)))
    run = submit_in(spec.parent, "--site", "local")
    assert wait_state(run)["state"] == "FAILED"
    stop = next(e for e in ledger(run) if e["event"] == "stop")
    assert stop["failed_ranks"] == [first] and stop["reported_ranks"] == [0, 1], stop
    assert f"exited with status 1 on rank {first}" in stop["error"]
    # torch's @record wrote the script's exception to TORCHELASTIC_ERROR_FILE: its words and line are named
    assert "(ValueError: a bad batch on this rank at " in stop["error"] and "first.py:11)" in stop["error"], stop


def test_wait_prints_the_trainers_summary_line_for_a_script(tmp_path, run_root):
    code = "from hpc import job; job.log(1, loss=2.0); job.log(2, loss=1.5); job.log(3, loss=1.25)"
    spec = script_folder(tmp_path / "user", ["python", "-c", code], name="wait", run_root=run_root)
    out = hpcx("submit", str(spec), "--site", "local", "--wait", cwd=spec.parent, timeout=300)
    assert out.returncode == 0, out.stderr
    line = [t for t in out.stdout.splitlines() if t.startswith("result: ")]
    assert line == ["result: 3 steps, loss 2.0000 -> 1.2500, 2 ranks, script"], out.stdout


def test_a_value_the_submitting_shell_exports_wins_over_hpcxs_defaults(tmp_path, run_root, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    spec = script_folder(tmp_path / "user", ddp("out"), name="exported", run_root=run_root)
    assert wait_state(submit_in(spec.parent, "--site", "local"))["state"] == "COMPLETED"
    for rank in (0, 1):
        env = seen(spec.parent / "out", 0, rank)
        assert env["OMP_NUM_THREADS"] == "2" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
