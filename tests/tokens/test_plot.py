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


def task_records() -> list[dict]:
    """A task's metrics lines: train lines with its own scalars (``train_<name>``), eval lines with accuracy."""
    train = [{"step": s, "loss": 1.0 / s, "lr": 3e-4 * s, "tokens_per_s": 900.0, "mfu": None, "grad_norm": 1.0,
              "train_accuracy": 0.5 + s / 100, "train_margin": 2.0 * s, "counted_fraction": 0.75} for s in range(1, 9)]
    evals = [{"step": s, "eval_loss": 0.9 / s, "eval_accuracy": 0.6, "eval_perplexity": 3.0} for s in (4, 8)]
    return train + evals


def test_each_metric_is_on_the_axis_of_its_kind():
    from hpc.cli.plot import metric_kind, plotted_keys

    keys = plotted_keys(task_records())
    assert keys["loss"] == ["loss", "eval_loss"] and keys["lr"] == ["lr"] and keys["throughput"] == ["tokens_per_s"]
    assert keys["fraction"] == ["train_accuracy", "counted_fraction", "eval_accuracy"]
    assert keys["other"] == ["train_margin", "eval_perplexity"]
    assert metric_kind("eval_accuracy", [0.4]) == "fraction" and metric_kind("eval_top5_acc", [0.9]) == "fraction"
    assert metric_kind("train_aux_loss", [3.0]) == "loss" and metric_kind("samples_per_s", [10.0]) == "throughput"
    assert metric_kind("train_agreement", [0.2, 1.0]) == "fraction" and metric_kind("train_agreement", [2.0]) == "other"


def test_a_tasks_accuracy_is_never_drawn_on_the_learning_rate_axis(tmp_path):
    extra("matplotlib")
    from hpc.cli.plot import figure

    fig = figure([("a", task_records()), ("b", task_records())])
    lines = {ax.get_title(): [line.get_label() for line in ax.lines] for ax in fig.axes}
    assert lines["learning rate"] == ["a", "b"]
    assert lines["accuracy and fractions"] == ["a train_accuracy", "a counted_fraction", "a eval_accuracy",
                                               "b train_accuracy", "b counted_fraction", "b eval_accuracy"]
    assert lines["loss"] == ["a train", "a eval_loss", "b train", "b eval_loss"]
    assert lines["other metrics"][:2] == ["a train_margin", "a eval_perplexity"] and lines["throughput"] == ["a", "b"]
    plain = figure([("lm", [{"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 5.0}])])
    assert [ax.get_title() for ax in plain.axes] == ["loss", "learning rate", "throughput"]
