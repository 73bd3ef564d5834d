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
# ... and `hpcx status` records the scheduler queries it ran in $XDG_CACHE_HOME/hpcx: likewise.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="hpcx-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)
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


def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip cleanly where CUDA is absent (torch is imported only if such tests were collected)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
