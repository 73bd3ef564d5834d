"""Fixtures of the requeue-check tests: a run folder with a spec, and the job side of a Slurm task
started by the batch script's check after srun (a module may define its own of the same name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.schedulers.slurm.scheduler import SlurmJobSide
from tests.resilience.test_requeue import JOB, write_spec


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    write_spec(run)
    return run


@pytest.fixture
def slurm_side(monkeypatch) -> SlurmJobSide:
    """Inside a (no longer existing) Slurm job 424242, restart 1, under the rendered script's check."""
    monkeypatch.setenv("SLURM_JOB_ID", JOB)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("HPCX_REQUEUE_CHECK", "after-srun")
    return SlurmJobSide()
