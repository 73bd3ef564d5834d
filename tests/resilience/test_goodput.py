"""Goodput by cause (``hpc.core.goodput``): where a run's time went, from its ledger and metrics, as
``hpcx status RUN`` words and ``hpcx plot``'s panel."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc.cli import cli
from hpc.core.goodput import by_cause, words
from hpc.login.status import goodput_text
from tests.extras import extra

LEDGER = [
    {"event": "start", "step": 0, "queue_wait_s": 5.0, "startup_s": 10.0, "restore_s": 0.0, "steps_recomputed": 0},
    {"event": "stop", "reason": "failed", "step": 6, "save_s": 2.0, "hang": {"ranks": [1], "lost_s": 25.0}},
    {"event": "start", "step": 4, "queue_wait_s": 11.0, "startup_s": 15.0, "restore_s": 1.0, "steps_recomputed": 2},
    {"event": "stop", "reason": "completed", "step": 20, "save_s": 3.0},
]
METRICS = [{"step": s, "loss": 1.0, "step_time_s": 2.0 if s != 1 else 9.0} for s in range(1, 21)]


def test_each_cause_is_counted_once_and_the_first_starts_queue_and_start_up_are_not_lost():
    found = by_cause(LEDGER, METRICS)
    assert found["seconds"] == {"productive": 40.0, "recomputed": 4.0, "saves": 5.0, "queue": 11.0, "startup": 15.0,
                                "restore": 1.0, "hangs": 25.0, "preflight": 0.0}
    assert found["steps_kept"] == 20 and found["steps_recomputed"] == 2
    assert found["goodput"] == pytest.approx(40 / 101, abs=1e-4)


def test_a_start_a_failed_preflight_check_threw_away_counts_as_preflight():
    failed = {"event": "stop", "reason": "failed", "step": 0, "preflight": {"nodes": ["n1"], "lost_s": 30.0}}
    found = by_cause([failed, *LEDGER], METRICS)  # the first start line, after it, is a restart (queue 5, start-up 10)
    assert found["seconds"]["preflight"] == 30.0 and found["seconds"]["queue"] == 16.0
    assert found["seconds"]["startup"] == 25.0 and found["goodput"] == pytest.approx(40 / 146, abs=1e-4)
    assert words(found).endswith("hangs 25 s, preflight 30 s)")
    alone = by_cause([failed, LEDGER[0], LEDGER[-1]], METRICS)  # as the sandbox writes it: no start line before
    assert alone["seconds"] | {"productive": 0} == {"productive": 0, "recomputed": 0.0, "saves": 3.0, "queue": 5.0,
                                                     "startup": 10.0, "restore": 0.0, "hangs": 0.0, "preflight": 30.0}


def test_a_run_without_restarts_loses_only_its_saves():
    found = by_cause(LEDGER[:1] + [{"event": "stop", "reason": "completed", "step": 20, "save_s": 10.0}], METRICS)
    assert found["goodput"] == pytest.approx(0.8) and words(found) == "goodput 80.0% (lost: saves 10 s)"


def test_no_timed_step_no_goodput():
    assert by_cause(LEDGER, [{"step": 3, "loss": 1.0}])["goodput"] is None
    assert by_cause([], [])["goodput"] is None and words(by_cause([], [])) == ""
    assert goodput_text({}) == "" and goodput_text({"goodput": by_cause([], [])}) == ""


def test_status_words_name_each_lost_cause():
    text = goodput_text({"goodput": by_cause(LEDGER, METRICS)})
    assert text == ("  goodput 39.6% (lost: recomputed 4 s, saves 5 s, queue 11 s, start-up 15 s, restore 1 s, "
                    "hangs 25 s)")


def png_width(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[16:20])[0]


def test_plot_adds_a_panel_of_time_by_cause_when_steps_were_timed(tmp_path):
    extra("matplotlib")
    runs = []
    for name, metrics in (("timed", METRICS), ("untimed", [{k: v for k, v in r.items() if k != "step_time_s"}
                                                           for r in METRICS])):
        run = tmp_path / name
        run.mkdir()
        (run / "resolved.json").write_text("{}")
        (run / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in LEDGER))
        (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "lr": 1e-3, "tokens_per_s": 5.0}) + "\n"
                                                   for r in metrics))
        runs.append(run)
    widths = []
    for run in runs:
        out = tmp_path / f"{run.name}.png"
        result = CliRunner().invoke(cli, ["plot", str(run), "--out", str(out)])
        assert result.exit_code == 0, result.output
        widths.append(png_width(out))
    assert widths == [2000, 1500]  # four panels of 5 inches at 100 dpi, or the three curves alone
