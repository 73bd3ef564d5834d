"""End to end on the local site: ``hpcx drill --slow 1`` stops rank 1 of the tiny DDP job half of each
second, and the straggler report names it: ``hpcx status RUN``, rank 0's log, and the ledger's stop line of
the start (here a cancel's). The first interval (warm-up) is not judged; the ratio is the report's, the test
asserts only who is named. An interval is 50 steps (over a second here): the drill stops the rank half of
each second, and an interval shorter than that cycle can fall wholly in a running half and end the streak;
over whole cycles the slowed rank measured 1.5–2.4× the other here, so the factor is 1.3 (the status line
rounds the ratio to one decimal)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx
from tests.resilience.resilience_lib import ledger, submit, wait_state


def named_in_status(folder: Path, timeout: float) -> str:
    """The first ``hpcx status RUN`` line naming rank 1 a straggler ("" when none did in time)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = hpcx("status", str(folder))
        if "straggler: rank 1 " in out.stdout:
            return out.stdout
        time.sleep(2)
    return ""


@pytest.mark.slow
def test_a_rank_the_drill_slows_is_named_in_status_the_log_and_the_stop_line():
    folder = submit(str(REPO / "jobs" / "tiny-ddp.toml"), "job.name=local-straggler", "train.steps=100000",
                    "train.log_every=5", "health.straggler_every=50", "health.straggler_intervals=3",
                    "health.straggler_factor=1.3",
                    "checkpoint.interval_steps=100000", "job.time_limit_min=10")
    try:
        out = hpcx("drill", str(folder), "--at-step", "20", "--slow", "1", "--for", "60", timeout=300)
        assert out.returncode == 0 and "slow at rank 1" in out.stdout, out.stderr
        shown = named_in_status(folder, timeout=120)
        assert shown, (folder / "logs" / "rank-0.log").read_text()[-3000:]
        words = re.search(r"straggler: rank 1 on \S+, (\d+\.\d)× the median over the last (\d+) intervals", shown)
        assert words and float(words[1]) >= 1.3 and int(words[2]) >= 3, shown  # named once 3 in a row were over
    finally:
        hpcx("cancel", str(folder))
    wait_state(folder, ("CANCELLED", "COMPLETED", "FAILED"), timeout=300)
    stop = ledger(folder)[-1]
    assert stop["event"] == "stop" and 1 in [s["rank"] for s in stop["stragglers"]], stop
    assert "WARNING straggler: rank 1 on " in (folder / "logs" / "rank-0.log").read_text()
