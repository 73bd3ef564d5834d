"""The watched evaluation metric (``trainer.watch``): the best checkpoint kept beside keep-k
(``checkpoint.keep_best``) and early stopping (``train.early_stop_patience``), decided from a rule here and
for real in small runs of the ResNet task (one process and two gloo ranks, the local site)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from hpc.core import runs
from hpc.core.errors import ConfigError
from hpc.core.resolve import resolved_document
from hpc.core.site import load_site
from hpc.core.spec import load_spec, spec_from_dict
from hpc.plan.resolve import resolve
from trainer.watch import MetricWatch, inferred_mode, watch_for
from trainer_testlib import REPO, torchrun

RESNET = REPO / "jobs" / "resnet-ddp.toml"


@pytest.mark.parametrize("metric,mode", [("eval_loss", "min"), ("eval_perplexity", "min"), ("eval_accuracy", "max"),
                                         ("eval_top5_acc", "max"), ("eval_f1", "max"), ("eval_error_rate", "min"),
                                         ("eval_bleu", "max"), ("eval_wer", "min")])
def test_auto_mode_is_max_for_names_that_say_higher_is_better(metric, mode):
    assert inferred_mode(metric) == mode


def observed(watch: MetricWatch, values: list[float]) -> list[tuple]:
    out = []
    for i, value in enumerate(values):
        step = 10 * (i + 1)
        watch.observe({"step": step, watch.metric: value}, step)
        out.append((watch.improved_at, watch.best_step, watch.since, watch.stopped_at))
    return out


def test_improvement_patience_and_min_delta():
    up = MetricWatch("eval_accuracy", "max", patience=2, min_delta=0.01, keep_best=True)
    assert observed(up, [0.5, 0.505, 0.6, 0.59, 0.6, math.nan]) == [
        (10, 10, 0, None), (None, 10, 1, None), (30, 30, 0, None), (None, 30, 1, None), (None, 30, 2, 50),
        (None, 30, 3, 60)]
    assert up.protected() == {30} and up.stopped
    down = MetricWatch("eval_loss", "min")  # patience 0: never stops
    assert [r[1] for r in observed(down, [3.0, 2.0, 2.5, 1.0] + [5.0] * 20)][-1] == 40 and not down.stopped
    assert down.protected() == frozenset()  # only early stopping: no checkpoint kept for it


def test_the_watch_state_survives_as_plain_data():
    watch = MetricWatch("eval_loss", "min", patience=3)
    observed(watch, [2.0, 2.5])
    again = MetricWatch("eval_loss", "min", patience=3)
    again.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert observed(again, [2.6, 2.7]) == [(None, 10, 2, None), (None, 10, 3, 20)]  # steps count from 10 again


def test_a_metric_the_evaluation_lacks_is_one_line_naming_what_it_gives():
    with pytest.raises(ConfigError) as info:
        MetricWatch("eval_acc", "max").observe({"step": 1, "eval_loss": 1.0, "eval_accuracy": 0.5, "eval_s": 1}, 1)
    assert info.value.messages == ["`checkpoint.keep_best` = 'eval_acc': the evaluation gives no such metric: "
                                   "expected one of eval_loss, eval_accuracy"]


@pytest.mark.parametrize("doc,expected", [
    ({"checkpoint": {"keep_best": "eval/accuracy"}, "train": {"eval_every": 5}}, ("eval_accuracy", "max", 0)),
    ({"checkpoint": {"keep_best": "eval_accuracy", "best_mode": "min"}, "train": {"eval_every": 5}},
     ("eval_accuracy", "min", 0)),
    ({"train": {"eval_every": 5, "early_stop_patience": 4}}, ("eval_loss", "min", 4)),
    ({"train": {"eval_every": 5}}, None),
])
def test_the_spec_names_the_watch(doc, expected):
    spec = spec_from_dict({"task": {"target": "examples.resnet:ImageTask"}, **doc})
    watch = watch_for(spec)
    assert (watch.metric, watch.mode, watch.patience) == expected if watch else expected is None


@pytest.mark.parametrize("doc,expected", [
    ({"checkpoint": {"keep_best": "eval_accuracy"}}, "`checkpoint.keep_best` watches an evaluation, but "
     "`train.eval_every` = 0"),
    ({"train": {"early_stop_patience": 2}}, "`train.early_stop_patience` watches an evaluation, but "
     "`train.eval_every` = 0"),
    ({"checkpoint": {"keep_best": "accuracy"}, "train": {"eval_every": 5}}, "`checkpoint.keep_best` = "
     "'accuracy': expected an evaluation metric"),
    ({"checkpoint": {"keep_best": "eval/accuracy"}, "train": {"eval_every": 5}, "task": {}},
     "`checkpoint.keep_best` = 'eval/accuracy': the language model's evaluation gives eval_loss and eval_perplexity"),
    ({"checkpoint": {"best_mode": "highest"}}, "`checkpoint.best_mode` = 'highest': expected one of"),
])
def test_a_watch_without_an_evaluation_or_a_metric_is_one_line(doc, expected):
    doc = {"task": {"target": "examples.resnet:ImageTask"}, **doc}
    with pytest.raises(ConfigError) as info:
        spec_from_dict(doc)
    assert len(info.value.messages) == 1 and info.value.messages[0].removeprefix("<spec>: ").startswith(expected)


SETS = ["train.steps=24", "train.global_batch=16", "train.micro_batch=8", "train.log_every=4", "train.eval_every=2",
        "train.warmup_steps=1", "checkpoint.interval_steps=5", "task.kwargs.width=8", "task.kwargs.train_samples=128",
        "task.kwargs.eval_samples=32", "parallel.timeout_s=120", "checkpoint.keep_best='eval/accuracy'"]


def run_folder(root: Path, name: str, ranks: int, sets: list[str]) -> Path:
    strategy = "ddp" if ranks > 1 else "none"
    spec = load_spec(RESNET, SETS + [f"job.tasks_per_node={ranks}", f"parallel.strategy={strategy!r}"] + sets)
    site = load_site("local")
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "resolved.json").write_text(json.dumps(resolved_document(spec, site, resolve(spec, site),
                                                                        str(run_dir)), indent=1))
    return run_dir


def trained(run_dir: Path, ranks: int) -> Path:
    proc = torchrun(ranks, ["-m", "trainer", str(run_dir)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def accuracies(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_accuracy"] for r in runs.read_jsonl(run_dir / "metrics.jsonl") if "eval_accuracy" in r}


def folders(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))


@pytest.mark.slow
def test_the_best_checkpoint_is_kept_beside_keep_k_and_names_the_best_evaluation(tmp_path):
    run = trained(run_folder(tmp_path, "best", 1, ["train.lr=0.05"]), 1)
    acc = accuracies(run)
    best_step = max(acc, key=lambda s: (acc[s], -s))  # the first of the highest
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert best == {"step": best_step, "checkpoint": f"step-{best_step:07d}", "metric": "eval_accuracy",
                    "value": acc[best_step], "mode": "max"}
    assert best_step < 20 and folders(run) == [best_step, 20, 24]  # the best, older than the newest two saves
    # the best checkpoint holds the evaluated weights: its train state says its step and what was seen
    from hpc.ckpt.dcp import DcpReader

    reader = DcpReader(run / "checkpoints" / best["checkpoint"])
    try:
        assert reader.read("train.step") == best_step and reader.read("train.watch.best") == acc[best_step]
    finally:
        reader.close()


@pytest.mark.slow
def test_early_stopping_stops_saved_resumes_as_its_twin_and_does_not_train_on(tmp_path):
    sets = ["train.early_stop_patience=3", "train.early_stop_min_delta=0.5"]  # no evaluation improves by 0.5
    twin = trained(run_folder(tmp_path, "twin", 2, sets), 2)
    assert sorted(accuracies(twin)) == [2, 4, 6, 8]  # best at 2, then three without improvement
    assert folders(twin) == [2, 5, 8] and max(runs.read_jsonl(twin / "metrics.jsonl"), key=lambda r: r["step"])[
        "step"] == 8
    stop = [e for e in runs.read_jsonl(twin / "ledger.jsonl") if e.get("event") == "stop"]
    assert [(e["reason"], e["step"]) for e in stop] == [("completed", 8)]
    # resumed from step 5 (two evaluations without improvement seen): stops at 8 as its twin
    resumed = run_folder(tmp_path, "resumed", 2, sets)
    shutil.copytree(twin / "checkpoints" / "step-0000005", resumed / "checkpoints" / "step-0000005")
    trained(resumed, 2)
    assert accuracies(resumed) == {s: a for s, a in accuracies(twin).items() if s > 5}
    assert folders(resumed) == [5, 8]
    # started again after the early stop: nothing more is trained
    lines = len(runs.read_jsonl(twin / "metrics.jsonl"))
    trained(twin, 2)
    assert len(runs.read_jsonl(twin / "metrics.jsonl")) == lines
