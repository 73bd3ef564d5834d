"""The watched evaluation metric: the best checkpoint (``checkpoint.keep_best``) and early stopping
(``train.early_stop_patience``), as Lightning's ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping``
and the HF Trainer's ``metric_for_best_model`` and ``EarlyStoppingCallback`` do.

After every evaluation the loop hands its record to ``MetricWatch.observe``. Every rank sees the same
record (the evaluation's sums are all-reduced), so every rank decides alike, without a collective.
An evaluation improves on the best when it is better by more than ``min_delta`` (``mode`` says which
way is better); the step boundary of an improving evaluation saves a checkpoint (if none was due) and
keeps it beside the newest ``checkpoint.keep`` until a better one comes (``Checkpointer.protected``);
rank 0 names it in ``checkpoints/best.json``. After ``patience`` evaluations in a row without an
improvement the run stops at that step's boundary, saved, as completed (``stopped_at``). What the
watch has seen is part of the train state of every checkpoint, so a resumed run decides as its twin,
and a run resumed after it stopped early does not train on.
"""

from __future__ import annotations

import json
import math
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc.core.errors import ConfigError
from hpc.core.spec import JobSpec

BEST_FILE = "best.json"


@dataclass
class MetricWatch:
    metric: str  # a key of the eval record, e.g. eval_accuracy
    mode: str  # "min" or "max"
    patience: int = 0  # evaluations without improvement before stopping (0: never stop)
    min_delta: float = 0.0
    keep_best: bool = False  # whether the best checkpoint is kept (checkpoint.keep_best)
    best: float | None = None
    best_step: int | None = None
    since: int = 0  # evaluations since the last improvement
    improved_at: int | None = None  # the step of the last evaluation, when it improved
    stopped_at: int | None = None  # the step at which patience ran out

    def observe(self, record: dict[str, tp.Any], step: int) -> None:
        """Take the evaluation record of ``step``: improvement, patience."""
        if self.metric not in record:
            names = ", ".join(k for k in record if k.startswith("eval_") and k not in NOT_METRICS)
            raise ConfigError([f"`checkpoint.keep_best` = {self.metric!r}: the evaluation gives no such metric: "
                               f"expected one of {names}"])
        value = float(record[self.metric])
        self.improved_at = None
        if self._better(value):
            self.best, self.best_step, self.since, self.improved_at = value, step, 0, step
            return
        self.since += 1
        if self.patience and self.since >= self.patience:
            self.stopped_at = step

    def _better(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        gain = self.best - value if self.mode == "min" else value - self.best
        return gain > self.min_delta

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def state_dict(self) -> dict[str, tp.Any]:
        """Plain data for the train state of a checkpoint."""
        return {"best": self.best, "best_step": self.best_step, "since": self.since, "stopped_at": self.stopped_at}

    def load_state_dict(self, state: dict[str, tp.Any]) -> None:
        self.best, self.best_step = state.get("best"), state.get("best_step")
        self.since, self.stopped_at = int(state.get("since", 0)), state.get("stopped_at")

    def protected(self) -> frozenset[int]:
        """The steps whose checkpoints pruning keeps: the best one, when kept."""
        return frozenset({self.best_step}) if self.keep_best and self.best_step is not None else frozenset()


NOT_METRICS = ("eval_tokens", "eval_samples", "eval_s")


def watch_for(spec: JobSpec) -> MetricWatch | None:
    """The watch of ``spec`` (None when neither the best checkpoint nor early stopping is asked for)."""
    c, t = spec.checkpoint, spec.train
    if not (c.keep_best or t.early_stop_patience):
        return None
    metric = c.keep_best or "eval_loss"
    mode = c.best_mode if c.best_mode != "auto" else inferred_mode(metric)
    return MetricWatch(metric, mode, t.early_stop_patience, t.early_stop_min_delta, keep_best=bool(c.keep_best))


HIGHER_IS_BETTER = ("acc", "f1", "precision", "recall", "auc", "bleu", "rouge", "score", "map", "iou", "dice",
                    "correct")


def inferred_mode(metric: str) -> str:
    """``best_mode = "auto"``: "max" for a metric whose name says higher is better (accuracy, f1, ...),
    else "min" (loss, perplexity, error ...)."""
    name = metric.removeprefix("eval_").lower()
    return "max" if any(word in name for word in HIGHER_IS_BETTER) else "min"


def write_best(run_dir: Path, watch: MetricWatch) -> None:
    """Rank 0: ``checkpoints/best.json`` names the best step (its folder is ``step-NNNNNNN`` beside it)."""
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"step": watch.best_step, "checkpoint": f"step-{watch.best_step:07d}", "metric": watch.metric,
           "value": watch.best, "mode": watch.mode}
    tmp = folder / f".{BEST_FILE}.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(folder / BEST_FILE)
