"""Resume, preemption and requeue with real processes on this machine (gloo, no Slurm).

One uninterrupted reference run (FSDP on 2 ranks, dropout on, a shuffled token file that wraps
around an epoch) through `hpcx submit` on the local site; every interrupted run of the same spec
must give the same per-step losses and the same final parameters and optimizer state, bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.core import runs
from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import (checkpoint_steps, ledger, losses_by_step, same_checkpoint_tensors,
                                             submit, token_file, wait_state)
from tests.trainer.trainer_testlib import child_env

pytestmark = pytest.mark.slow

JOB = str(REPO / "jobs" / "tiny-ddp.toml")
STEPS = 100


def sets(root: Path, tokens: Path, *extra: str) -> list[str]:
    return [f"job.run_root={json.dumps(str(root))}", 'parallel.strategy="fsdp"',
            f"data.source={json.dumps(str(tokens))}",
            "data.shuffle=true", "model.dropout=0.1", f"train.steps={STEPS}", "train.log_every=1",
            "train.global_batch=16", "checkpoint.interval_steps=25", "checkpoint.keep=2", *extra]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resilience")
    return root / "runs", token_file(root / "tokens.bin", samples=120)  # 16 per step: a new epoch every 7.5 steps


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    root, tokens = workdir
    run = submit(JOB, *sets(root, tokens, "job.name=reference"))
    assert wait_state(run, ("COMPLETED", "FAILED"))["state"] == "COMPLETED", (run / "logs" / "rank-0.log").read_text()
    return run


def final(run: Path) -> Path:
    return run / "checkpoints" / f"step-{STEPS:07d}"


def test_uninterrupted_run_saves_by_steps_keeps_k_and_logs_one_start_and_stop(reference):
    assert sorted(losses_by_step(reference)) == list(range(1, STEPS + 1))
    assert checkpoint_steps(reference) == [75, 100]  # saves at 25, 50, 75, 100; the final one is the 100
    start, stop = ledger(reference)
    assert start["event"] == "start" and start["restart"] == 0 and start["step"] == 0 and start["checkpoint"] is None
    assert stop["event"] == "stop" and stop["reason"] == "completed" and stop["step"] == STEPS
    assert stop["saves"] == 4 and not stop["requeued"] and stop["save_s"] > 0


def test_drilled_local_run_requeues_resumes_and_matches(reference, workdir):
    root, tokens = workdir
    run = submit(JOB, *sets(root, tokens, "job.name=drilled", "checkpoint.async_save=true"))
    out = hpcx("drill", str(run), "--at-step", "4", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    drilled = json.loads(out.stdout)
    assert drilled["step"] >= 4 and len(drilled["targets"]) == 2
    info = wait_state(run, ("COMPLETED", "FAILED"))
    assert info["state"] == "COMPLETED", (run / "logs" / "rank-0.log").read_text()[-3000:]

    start0, stop0, start1, stop1 = ledger(run)
    preempted_at = stop0["step"]
    assert 4 <= preempted_at < STEPS, "the drill must land mid-run"
    assert stop0["reason"] == "preempted" and stop0["requeued"]
    assert start1["restart"] == 1 and start1["step"] == preempted_at and start1["steps_recomputed"] == 0
    assert start1["checkpoint"] == f"step-{preempted_at:07d}" and start1["restore_s"] > 0
    assert stop1["reason"] == "completed" and stop1["step"] == STEPS
    assert info["restarts"] == 1 and info["ledger"]["starts"] == 2

    assert losses_by_step(run) == losses_by_step(reference)
    assert same_checkpoint_tensors(final(run), final(reference)) == []
    assert checkpoint_steps(run) == [75, 100]


def test_a_cancelled_run_resumed_by_hpcx_resume_matches(reference, workdir):
    """`hpcx resume RUN`: the same folder, its newest committed checkpoint, a new start in the ledger;
    the steps recomputed since that checkpoint logged again, each line saying which start wrote it."""
    root, tokens = workdir
    run = submit(JOB, *sets(root, tokens, "job.name=cancelled"))
    deadline = time.time() + 180
    while not (run / "checkpoints" / "step-0000025" / ".metadata").exists():
        assert time.time() < deadline, (run / "logs" / "rank-0.log").read_text()[-2000:]
        time.sleep(0.05)
    running = hpcx("resume", str(run))
    assert running.returncode == 2 and "wait for it to end, or `hpcx cancel" in running.stderr, running.stderr
    assert hpcx("cancel", str(run)).returncode == 0
    assert wait_state(run, ("CANCELLED", "FAILED", "COMPLETED"))["state"] == "CANCELLED"
    first_job = json.loads((run / "job.json").read_text())["job_id"]

    out = hpcx("resume", str(run), "--json")
    assert out.returncode == 0, out.stderr
    resumed = json.loads(out.stdout)
    assert resumed["run_dir"] == str(run) and resumed["job_id"] != first_job
    info = wait_state(run, ("COMPLETED", "FAILED"))
    assert info["state"] == "COMPLETED", (run / "logs" / "rank-0.log").read_text()[-3000:]

    start0, stop0, start1, stop1 = ledger(run)
    assert stop0["reason"] == "terminated" and 25 <= stop0["step"] < STEPS
    assert start1["restart"] == 1 and start1["checkpoint"] == f"step-{start1['step']:07d}"
    assert start1["step"] % 25 == 0 and start1["steps_recomputed"] == stop0["step"] - start1["step"]
    assert stop1["reason"] == "completed" and stop1["step"] == STEPS
    job = json.loads((run / "job.json").read_text())
    assert job["job_id"] == resumed["job_id"] and [e["job_id"] for e in job["earlier"]] == [first_job]

    lines = [r for r in runs.read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in lines] == [*range(1, stop0["step"] + 1), *range(start1["step"] + 1, STEPS + 1)]
    assert {r["start"] for r in lines[:stop0["step"]]} == {0} and {r["start"] for r in lines[stop0["step"]:]} == {1}
    assert losses_by_step(run) == losses_by_step(reference)  # recomputed steps agree too (losses_by_step checks)
    assert same_checkpoint_tensors(final(run), final(reference)) == []

    again = hpcx("resume", str(run))
    assert again.returncode == 2 and f"completed its {STEPS} steps: nothing to resume" in again.stderr


def torchrun(run: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "trainer", str(run)]
    return subprocess.Popen(cmd, env=child_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen = losses_by_step(run) if (run / "metrics.jsonl").exists() else {}
        if seen and max(seen) >= step:
            return max(seen)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"{run}: step {step} not reached")


def workers(agent_pid: int) -> list[int]:
    from hpc.schedulers.local.scheduler import task_pids as local_task_pids

    return local_task_pids(agent_pid)


def test_torchrun_preempted_then_killed_then_resumed_matches(reference, tmp_path):
    run = tmp_path / "torchrun-run"
    run.mkdir()
    (run / "resolved.json").write_text((reference / "resolved.json").read_text())

    first = torchrun(run)  # preempted: saves, stops, exits 0 (nobody to requeue under torchrun)
    wait_for_step(run, 3, first)
    for pid in workers(first.pid):
        os.kill(pid, signal.SIGUSR2)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["preempted"] is True
    stop0 = ledger(run)[-1]
    assert stop0["reason"] == "preempted" and not stop0["requeued"] and "run the same command" in stop0["not_requeued"]

    second = torchrun(run)  # killed without a word past the next interval checkpoint
    killed_after = wait_for_step(run, max(stop0["step"], 25) + 3, second)
    for pid in workers(second.pid):  # the workers, then the agent (they are not in its process group)
        os.kill(pid, signal.SIGKILL)
    os.killpg(second.pid, signal.SIGKILL)
    second.communicate(timeout=60)

    third = torchrun(run)
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0, err[-3000:]
    starts = [e for e in ledger(run) if e["event"] == "start"]
    assert [s["restart"] for s in starts] == [0, 1, 2]
    assert starts[1]["step"] == stop0["step"] and starts[1]["steps_recomputed"] == 0
    last_seen = max(s for s in losses_by_step(run) if s <= killed_after + 2)  # it may have logged a bit more
    assert starts[2]["step"] % 25 == 0 and starts[2]["steps_recomputed"] >= killed_after - starts[2]["step"]
    assert starts[2]["steps_recomputed"] <= last_seen - starts[2]["step"] + 2
    assert ledger(run)[-1]["reason"] == "completed"
    assert losses_by_step(run) == losses_by_step(reference)  # recomputed steps agree too (losses_by_step checks)
    assert same_checkpoint_tensors(final(run), final(reference)) == []


def failing_run(root: Path, name: str, *sets: str) -> tuple[Path, list[dict]]:
    run = submit(JOB, f"job.run_root={json.dumps(str(root))}", f"job.name={name}", "job.tasks_per_node=1",
                 'parallel.strategy="none"', 'model.arch="tests.resilience.failing_model:build"',
                 "model.seq_len=8", "model.vocab_size=64", "train.global_batch=2", "train.micro_batch=2",
                 "train.steps=10", "train.log_every=1", "checkpoint.interval_steps=3", "job.max_requeues=5", *sets)
    info = wait_state(run, ("COMPLETED", "FAILED"))
    assert info["state"] == "FAILED"
    return run, ledger(run)


def test_a_failure_that_looks_like_the_machines_is_requeued_once_then_not_again(workdir):
    root, _ = workdir
    run, lines = failing_run(root, "failing", 'model.kwargs={fail_after = 4, words = "NCCL error: unhandled system error"}')
    assert [(e["event"], e["step"]) for e in lines] == [("start", 0), ("stop", 4), ("start", 3), ("stop", 4)]
    assert lines[1]["reason"] == "failed" and lines[1]["requeued"] and "NCCL error" in lines[1]["error"]
    assert lines[3]["reason"] == "failed" and not lines[3]["requeued"]
    assert lines[3]["not_requeued"] == "failed twice at step 4 without progress"
    assert lines[2]["steps_recomputed"] == 1


def test_an_error_raised_by_a_user_models_own_code_fails_after_one_attempt(workdir):
    root, _ = workdir
    run, lines = failing_run(root, "user-error", "model.kwargs={fail_after = 4}")
    assert [(e["event"], e["step"]) for e in lines] == [("start", 0), ("stop", 4)]
    assert not lines[1]["requeued"] and "in the job's own code at" in lines[1]["not_requeued"]
    assert lines[1]["error"].startswith("RuntimeError: deterministic failure in forward call 5 (at ")
    assert "failing_model.py:" in lines[1]["error"] and lines[1]["failed_ranks"] == [0]


def test_a_preemption_past_max_requeues_saves_and_fails_loudly(workdir):
    root, tokens = workdir
    run = submit(JOB, *sets(root, tokens, "job.name=no-requeue", "job.max_requeues=0", "job.tasks_per_node=1",
                            'parallel.strategy="none"'))
    out = hpcx("drill", str(run), "--at-step", "2", timeout=120)
    assert out.returncode == 0, out.stderr
    assert wait_state(run, ("COMPLETED", "FAILED"))["state"] == "FAILED"
    start, stop = ledger(run)
    assert stop["reason"] == "preempted" and not stop["requeued"]
    assert stop["not_requeued"].startswith("job.max_requeues = 0 reached")
    assert checkpoint_steps(run)[-1] == stop["step"]  # saved before giving up
    result = hpcx("status", str(run), "--json")
    assert json.loads(result.stdout)["restarts"] == 0
