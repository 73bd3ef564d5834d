"""Fixtures for tests on the real local Slurm cluster (`scripts/slurm-sandbox up`).

Without a cluster these tests are skipped, except where HPCX_REQUIRE_SLURM=1
(scripts/test-all and CI), where a missing cluster is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SANDBOX_RUNS = Path("/var/lib/hpcx-sandbox/runs")


def cluster_up() -> str | None:
    """None when the sandbox answers, else why not."""
    if shutil.which("sinfo") is None:
        return "sinfo not installed"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    states = dict(line.split() for line in out.stdout.strip().splitlines() if line.strip())
    if not {"n1", "n2"} <= set(states):
        return f"nodes n1, n2 not both present: {states}"
    return None


@pytest.fixture(scope="session")
def sandbox() -> Path:
    problem = cluster_up()
    if problem:
        if os.environ.get("HPCX_REQUIRE_SLURM"):
            pytest.fail(f"the Slurm sandbox is required but not up: {problem}")
        pytest.skip(f"no Slurm sandbox ({problem}); run scripts/slurm-sandbox up")
    return SANDBOX_RUNS


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/slurm/" in str(item.fspath):
            item.add_marker(pytest.mark.slurm)
