"""What the run folder records about failures, on the real two-node Slurm sandbox: the rank that died and
its signal (not the survivors that lost their connection), the saves of a start whose srun was killed,
start-up failures that would repeat (not requeued) beside one that would not (requeued), and a time
limit that is neither a preemption nor a failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import hpcx
from tests.resilience.resilience_lib import ledger, losses_by_step, wait_state
from tests.slurm.test_failure_slurm import HERE, TERMINAL, run, states, task_pid, wait_for


def job_of(folder: Path) -> str:
    return json.loads((folder / "job.json").read_text())["job_id"]


def kill_rank_at(folder: Path, rank: int, sig: signal.Signals, step: int, restart: int = 0) -> None:
    """Send ``sig`` to one task of the job once its start ``restart`` has logged ``step``."""
    job = job_of(folder)
    starts = lambda: [e for e in ledger(folder) if e["event"] == "start"]  # noqa: E731
    wait_for(lambda: len(starts()) > restart and max(losses_by_step(folder), default=0) >= starts()[restart]["step"]
             + step, f"step {step} of start {restart}", timeout=300)
    os.kill(wait_for(lambda: task_pid(job, rank), f"rank {rank}'s process", timeout=30), sig)


def sacct_state(job: str) -> str:
    out = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], capture_output=True, text=True)
    return out.stdout.split()[-1] if out.stdout.split() else ""


def test_the_rank_that_died_is_named_with_its_signal_in_each_start(sandbox):
    """Start 0: rank 2 dies of SIGSEGV (requeued); start 1: rank 1 of SIGKILL (no requeue left)."""
    folder = run("job.name=records-kill", "train.steps=100000", "job.max_requeues=1")
    kill_rank_at(folder, 2, signal.SIGSEGV, 6)
    kill_rank_at(folder, 1, signal.SIGKILL, 6, restart=1)
    final = wait_state(folder, TERMINAL, timeout=300)
    assert final["state"] == "FAILED"
    stops = [e for e in ledger(folder) if e["event"] == "stop"]
    assert [(s["failed_ranks"], s["signal"], s["requeued"]) for s in stops] == [([2], "SIGSEGV", True),
                                                                               ([1], "SIGKILL", False)]
    assert "rank 2 on n2 was killed by SIGSEGV" in stops[0]["error"]
    assert "rank 1 on n1 was killed by SIGKILL" in stops[1]["error"]
    assert all(s["by"] == "batch script" and 0 not in s["failed_ranks"] for s in stops)
    assert "killed by SIGKILL" in final["last_stop"]["words"] and "not requeued" in final["last_stop"]["words"]


def srun_pid(job: str) -> int | None:
    """The batch step's srun (the sandbox's nodes share this machine's process table)."""
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"srun") and f"SLURM_JOB_ID={job}\0".encode() in env:
            return int(entry.name)
    return None


def test_srun_killed_counts_the_saves_from_the_run_folder(sandbox):
    folder = run("job.name=records-srun", "train.steps=100000", "job.max_requeues=0", "checkpoint.interval_steps=5")
    wait_for(lambda: max(losses_by_step(folder), default=0) >= 27, "step 27: five saves", timeout=300)
    os.kill(wait_for(lambda: srun_pid(job_of(folder)), "srun", timeout=30), signal.SIGKILL)
    wait_state(folder, TERMINAL, timeout=300)
    start, stop = ledger(folder)
    assert stop["by"] == "batch script" and stop["reason"] == "failed" and stop["srun_status"] != 0
    assert stop["saves"] >= 5 and stop["save_s"] > 0, stop  # five committed (two kept by rotation)
    assert stop["saves"] == json.loads(next((folder / "requeue").glob("*.saves.json")).read_text())["saves"]


def test_start_up_failures_that_would_repeat_are_not_requeued(sandbox):
    sets = ("model.seq_len=64", "model.vocab_size=256", f"env.set.PYTHONPATH={json.dumps(HERE)}")
    folders = {name: run(f"job.name=records-{name.replace('_', '-')}", f'model.arch="startup_models:{name}"',
                         "train.steps=4", *sets)
               for name in ("missing_dependency", "no_reset_parameters", "refused_once")}
    words = {"missing_dependency": "ModuleNotFoundError: No module named 'hpcx_no_such_dependency'",
             "no_reset_parameters": "has no reset_parameters()"}
    for name, phrase in words.items():
        final = wait_state(folders[name], TERMINAL, timeout=300)
        assert final["state"] == "FAILED" and final["restarts"] == 0, final
        (stop,) = [e for e in ledger(folders[name]) if e["event"] == "stop"]
        assert not stop["requeued"] and "would fail the same way on a restart" in stop["not_requeued"]
        assert phrase in stop["error"] and stop["step"] == 0
        assert "REQUEUED" not in states(folders[name])
        assert phrase in hpcx("status", str(folders[name])).stdout
    final = wait_state(folders["refused_once"], ("COMPLETED", "FAILED", "CANCELLED"), timeout=400)
    assert final["state"] == "COMPLETED" and final["restarts"] == 1, final
    first, last = [e for e in ledger(folders["refused_once"]) if e["event"] == "stop"]
    assert first["requeued"] and "ConnectionRefusedError" in first["error"] and first["step"] == 0
    assert last["reason"] == "completed" and states(folders["refused_once"]).count("REQUEUED") == 1


def test_a_time_limit_with_no_requeue_left_ends_as_timeout_not_failed(sandbox):
    # USR2 comes 30-90 s before the 2-minute limit (sbatch's leeway); max_requeues = 0: nothing to requeue
    folder = run("job.name=records-timeout", "train.steps=100000", "job.time_limit_min=2", "job.signal_lead_s=30",
                 "job.max_requeues=0", "checkpoint.interval_steps=0")
    job = job_of(folder)
    final = wait_state(folder, TERMINAL, timeout=400)
    assert final["state"] == "TIMEOUT" and sacct_state(job) == "TIMEOUT", final
    start, stop = ledger(folder)
    assert stop["reason"] == "time_limit" and not stop["requeued"] and stop["by"] == "rank 0"
    assert "max_requeues = 0" in stop["not_requeued"] and stop["saves"] >= 1
    assert (folder / "checkpoints" / f"step-{stop['step']:07d}" / ".metadata").is_file()
    assert final["last_stop"]["words"].startswith(f"time limit at step {stop['step']} (not requeued")
    assert "Traceback" not in (folder / "logs" / "rank-0.log").read_text()


def test_a_task_that_cannot_be_unpickled_is_not_requeued(sandbox, tmp_path):
    """The task's class lives in a module only the submitting process can import: every task fails while
    submitit unpickles it, before the trainer runs and before any rank can report. The check after srun
    reads task 0's traceback from this start's part of the batch log and does not requeue."""
    from tests.resilience.test_loading_failures import submit_unloadable
    from tests.slurm.test_failure_slurm import HSDP

    folder = submit_unloadable(tmp_path / "login-only", HSDP, "job.name=records-unpickle", "train.steps=4",
                               "job.max_requeues=3", site="sandbox")
    final = wait_state(folder, TERMINAL, timeout=120)
    assert final["state"] == "FAILED" and final["restarts"] == 0, final
    (stop,) = ledger(folder)
    assert stop["by"] == "batch script" and not stop["requeued"] and stop["started"] is False
    assert stop["error"] == "ModuleNotFoundError: No module named 'hpcx_gone_task'"
    assert stop["module"] == "hpcx_gone_task" and stop["srun_status"] != 0
    assert stop["not_requeued"] == ("ModuleNotFoundError while unpickling the job's task, before the trainer "
                                    "started: it would fail the same way on a restart")
    assert "REQUEUED" not in states(folder) and not list((folder / "requeue").glob("*.requeued"))
    assert sacct_state(job_of(folder)) == "FAILED"
    assert "No module named 'hpcx_gone_task'" in hpcx("status", str(folder)).stdout
