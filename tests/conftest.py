"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
