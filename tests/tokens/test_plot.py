"""``hpcx plot`` and the notice when TensorBoard is missing (issue 21, item 6)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from click.testing import CliRunner

from hpc.cli import cli
from tests.extras import extra


def fake_run(root: Path, name: str, steps: int, lr: float) -> Path:
    """A run folder as the trainer leaves it, as far as plotting goes: resolved.json and metrics.jsonl."""
    run = root / name
    run.mkdir(parents=True)
    (run / "resolved.json").write_text("{}")
    lines = [{"step": s, "loss": 6 * math.exp(-s / 20), "lr": lr, "tokens_per_s": 1000.0 + s} for s in range(1, steps + 1)]
    lines += [{"step": s, "eval_loss": 6.2 * math.exp(-s / 20), "eval_perplexity": 1.0} for s in range(10, steps + 1, 10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in sorted(lines, key=lambda r: r["step"])))
    return run


def test_plot_draws_several_runs_into_one_png(tmp_path):
    extra("matplotlib")
    a, b = fake_run(tmp_path, "a", 40, 1e-3), fake_run(tmp_path, "b", 30, 3e-3)
    out = tmp_path / "cmp.png"
    result = CliRunner().invoke(cli, ["plot", str(a), str(b), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"{out}: a, b" in result.output


def test_plot_series_separates_train_and_eval_lines(tmp_path):
    from hpc.cli.plot import series

    run = fake_run(tmp_path, "a", 20, 1e-3)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert series(records, "eval_loss")[0] == [10, 20]
    assert series(records, "loss")[0] == list(range(1, 21))


def test_plot_series_draws_the_last_value_of_a_step_a_restart_recomputed():
    from hpc.cli.plot import series

    first = [{"step": s, "loss": 10.0 - s, "start": 0} for s in range(1, 8)]  # killed after step 7
    again = [{"step": s, "loss": 20.0 - s, "start": 1} for s in range(6, 10)]  # resumed from step 5
    assert series(first + again, "loss") == ([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5, 14, 13, 12, 11])


def test_plot_of_a_run_without_metrics_is_a_user_error(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    (run / "resolved.json").write_text("{}")
    result = CliRunner().invoke(cli, ["plot", str(run), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2 and "no metrics.jsonl lines yet" in result.output
    assert not (tmp_path / "x.png").exists()


def test_missing_tensorboard_is_said_once(tmp_path, monkeypatch):
    import builtins

    from trainer import metrics

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("no tensorboard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    metrics.log.addHandler(handler)
    level = metrics.log.level
    metrics.log.setLevel(logging.INFO)  # setLevel, not the attribute: it clears the logger's isEnabledFor cache
    try:
        writer = metrics.MetricsWriter(tmp_path, enabled=True)
        writer.write({"step": 1, "loss": 1.0})
        writer.close()
        metrics.MetricsWriter(tmp_path, enabled=False).close()  # other ranks open no writer and say nothing
    finally:
        metrics.log.removeHandler(handler)
        metrics.log.setLevel(level)
    assert len([m for m in seen if "TensorBoard is not installed" in m]) == 1
    assert "pip install 'hpcx[tensorboard]'" in seen[0]
