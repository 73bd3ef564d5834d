"""The one requeue per start of a job (``hpc.core.requeue``): claims, failure reports, and the batch script's
check after srun deciding from the run folder. Real files, real processes; the granted ``scontrol
requeue`` itself is exercised on the sandbox (tests/slurm/test_failure_slurm.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from hpc.core import requeue, runs
from hpc.schedulers.local.scheduler import LocalJobSide
from hpc.schedulers.slurm.requeue import after_srun
from hpc.schedulers.slurm.scheduler import SlurmJobSide

JOB = "424242"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    write_spec(run)
    return run


def write_spec(run: Path, max_requeues: int = 3, resume: bool = True) -> None:
    doc = {"spec": {"job": {"max_requeues": max_requeues}, "checkpoint": {"resume": resume}},
           "launch": {"world_size": 4}}
    (run / "resolved.json").write_text(json.dumps(doc))


def start(step: int, restart: int = 1, job: str = JOB) -> dict:
    return {"event": "start", "step": step, "job_id": job, "slurm_restart_count": restart}


def write_ledger(run: Path, lines: list[dict]) -> None:
    (run / "ledger.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def _claim(args: tuple[str, int]) -> bool:
    folder, who = args
    return requeue.claim(Path(folder), "77.0", f"process {who}", "failed")


def test_exactly_one_of_many_processes_takes_the_requeue(run_dir):
    with multiprocessing.get_context("spawn").Pool(8) as pool:
        won = pool.map(_claim, [(str(run_dir), i) for i in range(32)])
    assert won.count(True) == 1
    assert requeue.claim(run_dir, "77.1", "next start", "failed")  # another incarnation has its own


def test_a_second_request_in_one_incarnation_is_refused(run_dir, monkeypatch):
    monkeypatch.setenv("SUBMITIT_LOCAL_JOB_ID", "5150")
    side = LocalJobSide()  # the local controller grants any requeue: exit status 144
    assert requeue.request(side, run_dir, side.incarnation(0), "rank 0", "preempted") is None
    why = requeue.request(side, run_dir, side.incarnation(0), "batch script", "failed")
    assert why == "this start (5150.0) was already requeued by another party"
    assert requeue.request(side, run_dir, side.incarnation(1), "rank 0", "preempted") is None
    states = runs.RunDir(run_dir).read_states()
    assert [(s["state"], s["by"], s["incarnation"]) for s in states] == [("REQUEUED", "rank 0", "5150.0"),
                                                                         ("REQUEUED", "rank 0", "5150.1")]


def test_slurm_incarnations_are_named_by_slurms_restart_count(slurm_side):
    assert slurm_side.incarnation(7) == f"{JOB}.1" and slurm_side.decides_failures
    os.environ.pop("HPCX_REQUEUE_CHECK")
    assert not SlurmJobSide().decides_failures  # a plain srun in a script of the user's: rank 0 decides


def test_nothing_to_decide_after_srun_when_rank_0_recorded_the_stop(run_dir, slurm_side):
    for reason in ("completed", "preempted", "terminated"):
        write_ledger(run_dir, [start(0, 0), {"event": "stop", "reason": "preempted", "step": 5}, start(5),
                               {"event": "stop", "reason": reason, "step": 9, "job_id": JOB}])
        assert after_srun(run_dir, 1, slurm_side) is None
        assert len(runs.RunDir(run_dir).read_ledger()) == 4


def test_rank_0_killed_without_a_word_is_recorded_from_the_metrics(run_dir, slurm_side):
    write_ledger(run_dir, [start(0, 0), {"event": "stop", "reason": "preempted", "step": 10}, start(10)])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 18)))
    line = after_srun(run_dir, 137, slurm_side)
    assert line["reason"] == "failed" and line["step"] == 17 and line["by"] == "batch script"
    assert "status 137" in line["error"] and "no rank reported" in line["error"]
    assert line["failed_ranks"] == [] and line["started"] is True and line["slurm_restart_count"] == 1
    # the policy allowed it, so the claim was taken; scontrol then found no such running job
    assert not line["requeued"] and f"job {JOB} is" in line["not_requeued"]
    assert (run_dir / "requeue" / f"{JOB}.1.requeued").exists()
    assert runs.RunDir(run_dir).read_ledger()[-1] == line


def test_the_first_rank_to_fail_names_the_failure(run_dir, slurm_side):
    write_ledger(run_dir, [start(0)])
    requeue.report_failure(run_dir, f"{JOB}.1", 3, step=12, error="CUDA error: an illegal memory access")
    requeue.report_failure(run_dir, f"{JOB}.1", 0, step=12, error="RuntimeError: Connection reset by peer",
                           save_s=4.5, saves=2)
    requeue.report_failure(run_dir, f"{JOB}.0", 1, step=3, error="from an earlier start")
    line = after_srun(run_dir, 1, slurm_side)
    assert line["error"] == "CUDA error: an illegal memory access" and line["failed_ranks"] == [3]
    assert line["reported_ranks"] == [0, 3]  # rank 0 only lost its connection to rank 3: not a failed rank
    assert line["step"] == 12 and line["srun_status"] == 1


@pytest.mark.parametrize("ledger,spec,words", [
    ([start(0, 0), {"event": "stop", "reason": "failed", "step": 4}, start(3)], {},
     "failed twice at step 4 without progress"),
    ([start(0, 0), {"event": "stop", "reason": "preempted", "step": 4}, start(4)], {"max_requeues": 1},
     "job.max_requeues = 1 reached"),
    ([start(0)], {"resume": False}, "checkpoint.resume = false"),
])
def test_the_check_applies_the_same_policy_as_rank_0(run_dir, slurm_side, ledger, spec, words):
    write_spec(run_dir, **spec)
    write_ledger(run_dir, ledger)
    if "without progress" in words:
        requeue.report_failure(run_dir, f"{JOB}.1", 2, step=4, error="ValueError: bad batch")
    line = after_srun(run_dir, 1, slurm_side)
    assert not line["requeued"] and words in line["not_requeued"]
    assert not (run_dir / "requeue" / f"{JOB}.1.requeued").exists()  # refused before claiming


def test_a_start_that_never_wrote_its_start_line_is_still_recorded_and_counted(run_dir, slurm_side, monkeypatch):
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    write_ledger(run_dir, [start(0, 0), {"event": "stop", "reason": "preempted", "step": 6, "job_id": JOB}])
    line = after_srun(run_dir, 1, SlurmJobSide())
    assert line["started"] is False and line["step"] == 6
    assert line["not_requeued"].startswith("job.max_requeues = 3 reached (3 restarts")


def test_the_check_is_a_command_the_script_runs(run_dir, slurm_side):
    import subprocess
    import sys

    write_ledger(run_dir, [start(0), {"event": "stop", "reason": "completed", "step": 9, "job_id": JOB}])
    out = subprocess.run([sys.executable, "-m", "hpc.requeue", str(run_dir), "1"], capture_output=True, text=True,
                         timeout=60, env=os.environ)
    assert out.returncode == 0 and "nothing to decide" in out.stderr
    bad = subprocess.run([sys.executable, "-m", "hpc.requeue", str(run_dir)], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
