"""Failing the way a cluster fails, on the real two-node Slurm sandbox: a rank that raises, rank 0 killed
without a word, a USR2 before the trainer's handler exists. Each costs a requeue (~15 s in the queue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import ledger, losses_by_step, submit, wait_state

HSDP = str(REPO / "jobs" / "tiny-hsdp-2node.toml")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
HERE = str(Path(__file__).parent)


def run(*sets: str) -> Path:
    return submit(HSDP, "train.log_every=1", *sets, site="sandbox")


def task_pid(job_id: str, rank: int) -> int | None:
    """The pid of one task of a Slurm job (the sandbox's nodes share this machine's process table)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
            cmd = (entry / "cmdline").read_text()
        except OSError:
            continue
        argv0 = os.path.basename(cmd.split("\0", 1)[0])
        if (env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_PROCID") == str(rank) and "trainer.entry" in cmd
                and argv0.startswith("python")):  # the task's interpreter, not srun (its env has SLURM_PROCID=0)
            return int(entry.name)
    return None


def wait_for(condition, what: str, timeout: float):
    deadline = time.time() + timeout
    while not (value := condition()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


def states(folder: Path) -> list[str]:
    return [json.loads(line)["state"] for line in (folder / "states.jsonl").read_text().splitlines()]


def test_rank_0_killed_without_a_word_is_requeued_once_by_the_batch_script(sandbox):
    folder = run("job.name=fail-rank0", "train.steps=30")
    job_id = json.loads((folder / "job.json").read_text())["job_id"]
    wait_for(lambda: max(losses_by_step(folder), default=0) >= 7, "step 7", timeout=240)
    pid = wait_for(lambda: task_pid(job_id, 0), "rank 0's process", timeout=30)
    os.kill(pid, signal.SIGKILL)  # no Python exception, no report, no ledger line from rank 0
    final = wait_state(folder, TERMINAL, timeout=300)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-0.log").read_text()[-3000:]
    start0, stop0, start1, stop1 = ledger(folder)
    assert stop0["by"] == "batch script" and stop0["reason"] == "failed" and stop0["requeued"]
    assert stop0["failed_ranks"] == [0] and stop0["signal"] == "SIGKILL"  # from srun, not the survivors' reports
    assert "rank 0 on n1 was killed by SIGKILL" in stop0["error"] and stop0["saves"] >= 1
    assert stop0["srun_status"] != 0 and stop0["step"] >= 7
    assert start1["slurm_restart_count"] == 1 and start1["step"] % 5 == 0 and 5 <= start1["step"] <= stop0["step"]
    assert stop1["reason"] == "completed" and stop1["step"] == 30
    assert [p.name for p in (folder / "requeue").glob("*.requeued")] == [f"{job_id}.0.requeued"]
    history = states(folder)
    assert history.count("REQUEUED") == 1 and history.index("REQUEUED") < len(history) - 1
    assert sorted(losses_by_step(folder)) == list(range(1, 31))  # recomputed steps agree (losses_by_step checks)


def test_a_rank_that_raises_is_reported_and_requeued_once(sandbox):
    folder = run("job.name=fail-rank1", "train.steps=24", 'model.arch="flaky_model:build"',
                 "model.kwargs={fail_rank = 1, fail_after = 14}", f"env.set.PYTHONPATH={json.dumps(HERE)}",
                 "model.seq_len=64", "model.vocab_size=256")
    final = wait_state(folder, TERMINAL, timeout=400)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-1.log").read_text()[-3000:]
    start0, stop0, start1, stop1 = ledger(folder)
    assert stop0["by"] == "batch script" and stop0["requeued"] and 1 in stop0["failed_ranks"]
    assert "flaky rank 1: injected failure" in stop0["error"]
    assert start1["slurm_restart_count"] == 1 and stop1["reason"] == "completed" and stop1["step"] == 24
    assert states(folder).count("REQUEUED") == 1


def test_a_usr2_at_start_up_does_not_kill_the_tasks(sandbox):
    folder = run("job.name=early-usr2", "train.steps=12")
    job_id = json.loads((folder / "job.json").read_text())["job_id"]
    wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                                    text=True).stdout.strip() == "RUNNING", "RUNNING", timeout=180)
    wait_for(lambda: task_pid(job_id, 0), "the tasks", timeout=60)
    assert not any(e["event"] == "start" for e in ledger(folder)), "too late: the trainer had started"
    sent = subprocess.run(["scancel", "--signal=USR2", job_id], capture_output=True, text=True)
    assert sent.returncode == 0, sent.stderr
    final = wait_state(folder, TERMINAL, timeout=300)
    assert final["state"] == "COMPLETED", (folder / "logs" / "rank-0.log").read_text()[-3000:]
    stops = [e for e in ledger(folder) if e["event"] == "stop"]
    # held from the task's exec until the handler took it: a preemption at the first step boundaries
    assert [e["reason"] for e in stops] == ["preempted", "completed"] and stops[0]["step"] <= 2
    assert stops[0]["requeued"] and stops[-1]["step"] == 12


def test_logs_of_a_rank_the_job_does_not_have(sandbox):
    folder = run("job.name=logs-ranks", "train.steps=2")
    wait_state(folder, TERMINAL, timeout=300)
    out = hpcx("logs", str(folder), "--rank", "7")
    assert out.returncode == 2 and "--rank 7" in out.stderr and "has 4 ranks (0-3)" in out.stderr
    assert "rank 3/4" in hpcx("logs", str(folder), "--rank", "3").stdout
