"""The GPU check's parts (bench/gpu_check/run.py) as tests, so that a lent machine running ``pytest -m gpu``
proves what the check proves. The check's own ``pytest`` part leaves this file out."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.gpu
PARTS = ("throughput", "resume", "staging", "strategies", "offload")


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check_run", REPO / "bench" / "gpu_check" / "run.py")
    check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = check  # its dataclasses look their module up
    spec.loader.exec_module(check)
    return check


@pytest.mark.parametrize("name", PARTS)
def test_the_check_part_passes(tmp_path, name):
    check = load_check()
    part = next(p for p in check.PARTS if p.name == name)
    rows = check.run_part(part, tmp_path, 2 * part.max_s)
    assert rows and all(r["status"] == "ok" for r in rows), check.table(rows)
