"""`hpcx cancel` and `hpcx logs` on runs that ended, never ran, or whose pid now belongs to someone else;
and a real local job cancelled mid-run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc.schedulers.local.scheduler import LocalScheduler, controller_alive, pid_identity
from tests.conftest import REPO, hpcx


def fake_run(root: Path, name: str, job: dict | None, world: int = 4) -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "resolved.json").write_text(json.dumps({"launch": {"world_size": world}}))
    if job is not None:
        (run / "job.json").write_text(json.dumps(job))
    return run


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # outlives a slow test


def test_a_reused_pid_is_not_the_job_and_is_never_signalled(tmp_path):
    other = sleeper()  # stands for whatever process got the pid after the job's controller ended
    try:
        run = fake_run(tmp_path, "reused", {"job_id": str(other.pid), "scheduler": "local",
                                            "pid_identity": "some-other-boot:12345"})
        assert not controller_alive(str(other.pid), run)
        assert LocalScheduler().states({str(other.pid): run})[str(other.pid)].state == "FAILED"
        assert not LocalScheduler().cancel(str(other.pid), run)
        out = hpcx("cancel", str(run))
        assert out.returncode == 2 and "already ended (FAILED)" in out.stderr, out.stderr
        time.sleep(0.2)
        assert other.poll() is None  # never signalled
    finally:
        other.kill()
        other.wait()


def test_the_recorded_identity_is_the_controllers(tmp_path):
    proc = sleeper()
    try:
        run = fake_run(tmp_path, "live", {"job_id": str(proc.pid), "scheduler": "local",
                                          **LocalScheduler().job_record(str(proc.pid))})
        assert pid_identity(proc.pid) and controller_alive(str(proc.pid), run)
        out = hpcx("cancel", str(run))
        assert out.returncode == 0 and "stop at their next step boundary" in out.stdout, out.stderr
        assert proc.wait(timeout=120) == -signal.SIGTERM  # SIGTERM: the controller forwards it to the tasks
    finally:
        proc.kill()


@pytest.mark.parametrize("job,words", [
    (None, "never submitted"),
    ({"job_id": "1", "scheduler": "local"}, "already ended (FAILED)"),  # pid 1 is init, no identity recorded…
])
def test_cancel_says_why_there_is_nothing_to_cancel(tmp_path, job, words):
    if job is not None:
        job["pid_identity"] = "not-init"  # … and recorded as another process: the job is gone
    run = fake_run(tmp_path, "gone", job)
    out = hpcx("cancel", str(run))
    assert out.returncode == 2 and out.stderr.startswith("error: ") and words in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1


def test_cancel_of_a_completed_run_names_its_state_and_step(tmp_path):
    run = fake_run(tmp_path, "done", {"job_id": "123", "scheduler": "slurm"})
    (run / "states.jsonl").write_text(json.dumps({"state": "COMPLETED", "time": 1}) + "\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 50, "loss": 2.0}) + "\n")
    out = hpcx("cancel", str(run))
    assert out.returncode == 2 and "job 123 already ended (COMPLETED at step 50): nothing to cancel" in out.stderr


@pytest.mark.parametrize("rank,ok", [(0, True), (3, True), (4, False), (7, False), (-1, False)])
def test_logs_of_a_rank_the_run_does_not_have(tmp_path, rank, ok):
    run = fake_run(tmp_path, "four", {"job_id": "123", "scheduler": "slurm"})
    (run / "states.jsonl").write_text(json.dumps({"state": "COMPLETED", "time": 1}) + "\n")
    (run / "logs" / "rank-3.log").write_text("rank 3/4 trained\n")
    out = hpcx("logs", str(run), "--rank", str(rank))
    if ok:
        assert out.returncode == 0
        assert ("rank 3/4 trained" in out.stdout) if rank == 3 else "has written no log yet (COMPLETED)" in out.stderr
    else:
        assert out.returncode == 2 and f"--rank {rank}: four has 4 ranks (0-3)" in out.stderr, out.stderr


def test_logs_counts_ranks_that_left_logs_beyond_the_resolved_world(tmp_path):
    """A folder resolved for 2 ranks and started by torchrun with 4 has logs of ranks 2 and 3."""
    run = fake_run(tmp_path, "refit", {"job_id": "123", "scheduler": "slurm"}, world=2)
    (run / "states.jsonl").write_text(json.dumps({"state": "COMPLETED", "time": 1}) + "\n")
    for r in range(4):
        (run / "logs" / f"rank-{r}.log").write_text(f"rank {r}\n")
    assert hpcx("logs", str(run), "--rank", "3").stdout == "rank 3\n"
    assert "has 2 ranks (0-3)" in hpcx("logs", str(run), "--rank", "5").stderr


@pytest.mark.slow
def test_a_local_job_cancelled_mid_run_stops_at_a_boundary_and_saves_nothing_new(run_root):
    from tests.resilience.resilience_lib import checkpoint_steps, ledger, submit, wait_state

    run = submit(str(REPO / "jobs" / "tiny-ddp.toml"), f"job.run_root={json.dumps(str(run_root))}",
                 "job.name=cancelled", "train.steps=100000", "train.log_every=1", "checkpoint.interval_steps=5")
    deadline = time.time() + 180
    while not checkpoint_steps(run):
        assert time.time() < deadline, (run / "logs" / "rank-0.log").read_text()[-2000:]
        time.sleep(0.2)
    out = hpcx("cancel", str(run))
    assert out.returncode == 0, out.stderr
    assert wait_state(run, ("CANCELLED", "FAILED", "COMPLETED"))["state"] == "CANCELLED"
    start, stop = ledger(run)
    assert stop["reason"] == "terminated" and not stop["requeued"] and "SIGTERM" in stop["not_requeued"]
    # a cancel saves nothing of its own: every checkpoint is an interval save (a multiple of 5), none past
    # the stop (how many came after `hpcx cancel` returned depends on how soon the controller forwarded
    # its SIGTERM to the tasks, which no test should count on)
    assert all(s % 5 == 0 and s <= stop["step"] for s in checkpoint_steps(run)), (checkpoint_steps(run), stop)
    assert stop["saves"] >= 1
    assert stop["save_s"] > 0
    status = json.loads(hpcx("status", str(run), "--json").stdout)
    assert status["state"] == "CANCELLED" and status["states"][-1] == "CANCELLED" and "RUNNING" in status["states"]
    again = hpcx("cancel", str(run))
    assert again.returncode == 2 and "already ended (CANCELLED" in again.stderr


@pytest.mark.parametrize("job,states,ledger,words", [
    (None, [], [], "this run was never submitted"),
    ({"job_id": "123", "scheduler": "slurm"}, ["COMPLETED"], [{"event": "stop", "reason": "completed", "step": 50}],
     "completed its 50 steps: nothing to resume"),
])
def test_resume_says_why_there_is_nothing_to_resume(tmp_path, job, states, ledger, words):
    run = fake_run(tmp_path, "done", job)
    (run / "states.jsonl").write_text("".join(json.dumps({"state": s, "time": 1}) + "\n" for s in states))
    (run / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ledger))
    before = sorted(p.name for p in run.rglob("*"))
    out = hpcx("resume", str(run))
    assert out.returncode == 2 and words in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert sorted(p.name for p in run.rglob("*")) == before
