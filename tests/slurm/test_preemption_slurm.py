"""Preemption on the real two-node Slurm sandbox: a drill, the time-limit signal, and a cancel.

Each requeue costs ~11–17 s in the queue (cred_expire=10) plus the restart's torch start-up.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import (checkpoint_steps, ledger, losses_by_step, same_checkpoint_tensors,
                                             submit, token_file, wait_state)

HSDP = str(REPO / "jobs" / "tiny-hsdp-2node.toml")
STEPS = 40
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


@pytest.fixture(scope="module")
def tokens(sandbox) -> Path:
    folder = sandbox / "preemption-test-data"
    folder.mkdir(exist_ok=True)
    return token_file(folder / "tokens.bin", samples=100)  # 8 per step: a new, reshuffled epoch every 12.5 steps


def sets(tokens: Path, name: str, *extra: str) -> list[str]:
    return [f"job.name={name!r}", f"data.source={json.dumps(str(tokens))}", "data.shuffle=true", "model.dropout=0.1",
            "train.log_every=1", "checkpoint.interval_steps=10", *extra]


def run(*sets_: str) -> Path:
    return submit(HSDP, *sets_, site="sandbox")


def submitit_saw_no_signal(run_dir: Path) -> bool:
    """submitit's own USR2 handler logs "Caught signal"; the trainer's flag handler replaced it."""
    return not any("Caught signal" in p.read_text() for p in (run_dir / "submitit").glob("*_log.*"))


def test_drill_at_a_random_step_requeues_resumes_and_equals_an_uninterrupted_run(tokens):
    at_step = random.Random().randint(3, 12)
    reference = run(*sets(tokens, "pre-reference", f"train.steps={STEPS}"))
    drilled = run(*sets(tokens, "pre-drilled", f"train.steps={STEPS}"))
    out = hpcx("drill", str(drilled), "--at-step", str(at_step), "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    sent = json.loads(out.stdout)
    assert sent["step"] >= at_step and sent["scheduler"] == "slurm"

    for folder in (reference, drilled):
        final = wait_state(folder, TERMINAL, timeout=300)
        assert final["state"] == "COMPLETED", f"{folder}: {final}"
    start0, stop0, start1, stop1 = ledger(drilled)
    stopped_at = stop0["step"]
    assert at_step <= stopped_at < STEPS, f"drill at step {at_step} stopped at {stopped_at}"
    assert stop0["reason"] == "preempted" and stop0["requeued"] and stop0["job_id"] == sent["job_id"]
    assert start1["restart"] == 1 and start1["slurm_restart_count"] == 1 and start1["step"] == stopped_at
    assert start1["checkpoint"] == f"step-{stopped_at:07d}" and start1["steps_recomputed"] == 0
    assert start1["queue_wait_source"] == "scontrol" and start1["queue_wait_s"] >= 5
    assert stop1["reason"] == "completed" and stop1["step"] == STEPS

    assert losses_by_step(drilled) == losses_by_step(reference), f"drilled at step {at_step}"
    final = f"step-{STEPS:07d}"
    assert same_checkpoint_tensors(drilled / "checkpoints" / final, reference / "checkpoints" / final) == []
    assert checkpoint_steps(drilled) == [30, 40]
    assert submitit_saw_no_signal(drilled)
    status = json.loads(hpcx("status", str(drilled), "--json").stdout)
    assert status["restarts"] == 1 and status["ledger"]["starts"] == 2


def wait_for(condition, what: str, timeout: float):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_time_limit_signal_from_slurm_saves_requeues_and_resumes(tokens):
    # Slurm sends USR2 when the job is within LEAD s of its limit, but "up to 60 s earlier" (sbatch(1));
    # 2 min with LEAD 30 puts it 30-90 s in, after start-up (seen: 78 s). It would train far longer: once the
    # requeued run has resumed and trained a few steps, it is cancelled.
    folder = run(*sets(tokens, "pre-timelimit", "train.steps=100000", "job.time_limit_min=2",
                       "job.signal_lead_s=30", "checkpoint.interval_steps=0"))
    starts = lambda: [e for e in ledger(folder) if e["event"] == "start"]  # noqa: E731
    wait_for(lambda: len(starts()) >= 2, "the restart after the time-limit signal", timeout=600)  # hang guards
    resumed_at = starts()[1]["step"]
    wait_for(lambda: max(losses_by_step(folder)) >= resumed_at + 3, "steps after the resume", timeout=300)
    assert hpcx("cancel", str(folder)).returncode == 0
    wait_state(folder, TERMINAL, timeout=120)

    start0, stop0, start1 = ledger(folder)[:3]
    assert stop0["reason"] == "time_limit" and stop0["requeued"] and stop0["step"] > 0  # not a preemption
    assert start1["step"] == stop0["step"] and start1["checkpoint"] == f"step-{stop0['step']:07d}"
    assert start1["slurm_restart_count"] == 1 and start1["steps_recomputed"] == 0
    steps = sorted(losses_by_step(folder))  # raises if a step was logged twice with different losses
    assert steps == list(range(1, steps[-1] + 1))
    assert submitit_saw_no_signal(folder)  # with timeout_min=2 submitit's handler would count timeouts


def test_cancel_is_not_a_preemption(tokens):
    folder = run(*sets(tokens, "pre-cancel", "train.steps=100000"))
    deadline = time.time() + 600  # a hang guard
    while not checkpoint_steps(folder):  # trained, and saved once (step 10)
        assert time.time() < deadline, "never saved"
        time.sleep(0.5)
    saved_before = checkpoint_steps(folder)
    out = hpcx("cancel", str(folder))
    assert out.returncode == 0 and "stop at their next step boundary" in out.stdout, out.stderr
    assert wait_state(folder, TERMINAL, timeout=120)["state"].startswith("CANCELLED")
    time.sleep(20)  # longer than a requeue takes to show
    status = json.loads(hpcx("status", str(folder), "--json").stdout)
    assert status["state"].startswith("CANCELLED") and status["restarts"] == 0
    start, stop = ledger(folder)  # the ranks stopped at a step boundary and said so
    assert stop["reason"] == "terminated" and stop["by"] == "rank 0" and not stop["requeued"]
    assert stop["saves"] >= 1 and stop["save_s"] > 0 and status["ledger"]["save_s"] == stop["save_s"]
    # a cancel saves nothing of its own: what came after is interval saves (every 10 steps), none past the
    # stop; how many depends on how soon Slurm delivered the SIGTERM, which no test should count on
    new = [s for s in checkpoint_steps(folder) if s not in saved_before]
    assert all(s % 10 == 0 and s <= stop["step"] for s in new), f"saved after the cancel: {new}, stop {stop['step']}"
    again = hpcx("cancel", str(folder))
    assert again.returncode == 2 and "already ended (CANCELLED" in again.stderr
