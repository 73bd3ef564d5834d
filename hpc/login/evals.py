"""A task's eval metrics as a run's eval record and summary hold them: a leaf both ``hpcx status`` (its fast
path imports no more than it must) and the submit side's summaries read."""

from __future__ import annotations

EVAL_NOT_METRICS = ("eval_loss", "eval_perplexity", "eval_tokens", "eval_samples", "eval_s", "eval_metrics")


def eval_metrics(record: dict) -> dict[str, float]:
    """A task's metrics in an eval record or summary (``eval_accuracy``: ``trainer.tasks``), also under
    ``eval_metrics`` (status)."""
    found = {k: v for k, v in record.items() if k.startswith("eval_") and k not in EVAL_NOT_METRICS
             and isinstance(v, (int, float))}
    return {**found, **(record.get("eval_metrics") or {})}
