"""Shared test helpers."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# `hpcx submit` records run roots in $XDG_STATE_HOME/hpcx/run-roots: the tests' go to a folder of
# their own, never into the user's state (a test that checks the index sets its own).
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="hpcx-test-state-")
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], True)
RECORDED = REPO / "tests" / "data" / "recorded"  # verbatim tool outputs, sources in SOURCES.md


def hpcx(*args: str, env: dict | None = None, timeout: float = 120, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run the real `hpcx` entry point in a fresh interpreter."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=cwd, check=False)


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    root.mkdir()
    return root
