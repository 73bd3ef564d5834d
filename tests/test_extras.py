"""tests/extras.py: a missing test extra skips, and fails where HPCX_REQUIRE_HF=1 (scripts/test-all)."""

from __future__ import annotations

import json

import pytest

from tests.extras import REQUIRE_ENV, extra


def test_a_present_extra_is_the_module():
    assert extra("json") is json


def test_a_missing_extra_skips_unless_required(monkeypatch):
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no_such_extra_hpcx does not import"):
        extra("no_such_extra_hpcx")
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="HPCX_REQUIRE_HF=1"):
        extra("no_such_extra_hpcx")


def test_test_all_requires_the_extras():
    from tests.conftest import REPO

    pytest_line = next(line for line in (REPO / "scripts" / "test-all").read_text().splitlines()
                       if "-m pytest" in line)
    assert f"{REQUIRE_ENV}=1" in pytest_line and "HPCX_REQUIRE_SLURM=1" in pytest_line
