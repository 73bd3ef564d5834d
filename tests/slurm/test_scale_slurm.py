"""A weak-scaling study at 1 and 2 nodes on the sandbox cluster, from submission to report."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from hpc.core import runs
from hpc import scale
from hpc.core.site import load_site

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def per_rank_tokens(run_dir: Path, ranks: int, warmup: int) -> float:
    """Median tokens/s after warm-up from the run's own metrics.jsonl, per rank."""
    steady = [r["tokens_per_s"] for r in runs.read_jsonl(run_dir / "metrics.jsonl") if r["step"] > warmup]
    assert len(steady) == STEPS - warmup, f"{run_dir}: expected {STEPS - warmup} measured steps, got {len(steady)}"
    return statistics.median(steady) / ranks


def test_weak_scaling_study_1_and_2_nodes(sandbox, tmp_path):
    site = load_site("sandbox")
    study_dir = scale.start_study(REPO / "tests" / "data" / "tiny-scale.toml", site, ["job.tasks_per_node=2"], [1, 2],
                                  mode="weak", steps=STEPS)
    seen: list[tuple[int, str]] = []
    final = scale.follow_study(study_dir, lambda p, s: seen.append((p["nodes"], s)), poll_s=2, timeout_s=540)
    assert final == {1: "COMPLETED", 2: "COMPLETED"}, f"{study_dir}: states seen {seen}"

    report = scale.build_report(study_dir)
    one, two = report["points"]
    assert [(p["nodes"], p["ranks"], p["global_batch"]) for p in (one, two)] == [(1, 2, 8), (2, 4, 16)]
    warmup = report["warmup_metrics_steps"]
    base = per_rank_tokens(Path(one["run_dir"]), 2, warmup)
    assert one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx(per_rank_tokens(Path(two["run_dir"]), 4, warmup) / base)
    assert 0 < two["efficiency"] < 2

    files, _ = scale.write_report(report, study_dir)
    assert Path(files["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(Path(files["csv"]).read_text().splitlines()) == 3
    assert all(Path(p["run_dir"]).parent == study_dir for p in report["points"])
