"""The worked examples of the task seam, run for real on this machine (2 ranks, gloo, the local site):
the ResNet-style classifier (with BatchNorm) and the BERT-style one with DDP and with FSDP, each drilled mid-run and
resumed bit for bit (every step's loss, the final model and optimizer state), their accuracy in
metrics.jsonl, `hpcx status` and `hpcx plot`; BERT's first loss is transformers' own on the same batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpc.core import runs
from tests.conftest import REPO, hpcx
from tests.extras import extra
from tests.resilience.resilience_lib import ledger, same_checkpoint_tensors, submit, wait_state

pytestmark = pytest.mark.slow

# The drilled runs hold at HOLD_STEP's samples (tests/resilience/held.py) until the drill has signalled, so the
# drill lands mid-run however busy the machine is; without the hold the tasks are the examples' own.
STEPS, DRILL_AT, HOLD_STEP = 24, 3, 6
COMMON = ["train.log_every=1", f"train.steps={STEPS}", "train.eval_every=8", "checkpoint.interval_steps=8",
          "train.warmup_steps=2"]
HELD = {"resnet-ddp": "tests.resilience.held:HeldImageTask",
        "bert-ddp": "tests.resilience.held:HeldSequenceClassificationTask",
        "bert-fsdp": "tests.resilience.held:HeldSequenceClassificationTask"}


def held_target(job: str) -> str:
    return f"task.target={HELD[Path(job).stem]!r}"


def train_losses(run_dir: Path) -> dict[int, float]:
    """Step → loss of the training lines; a step logged twice (recomputed after a restart) must agree."""
    out: dict[int, float] = {}
    for record in runs.read_jsonl(run_dir / "metrics.jsonl"):
        if "loss" in record:
            assert out.get(record["step"], record["loss"]) == record["loss"], f"step {record['step']} differs"
            out[record["step"]] = record["loss"]
    return out


def evals(run_dir: Path) -> list[dict]:
    return [r for r in runs.read_jsonl(run_dir / "metrics.jsonl") if "eval_loss" in r]


def finished(run: Path) -> Path:
    info = wait_state(run, ("COMPLETED", "FAILED"), timeout=600)
    assert info["state"] == "COMPLETED", (run / "logs" / "rank-0.log").read_text()[-3000:]
    return run


def step_samples(run: Path, step: int) -> list[int]:
    """The samples (every rank's) of optimizer step ``step`` (1-based) of ``run``'s spec."""
    import importlib

    from hpc.core.spec import spec_from_dict
    from trainer.data import GlobalSampler

    spec = spec_from_dict(json.loads((run / "resolved.json").read_text())["spec"])
    module, _, name = spec.task.target.partition(":")
    dataset = getattr(importlib.import_module(module), name)(**spec.task.kwargs).train_dataset()
    g = spec.train.global_batch
    return GlobalSampler(len(dataset), g, g, 0, 1, spec.train.seed, spec.data.shuffle).step_batches((step - 1) * g)[0]


def drilled_matches(job: str, sets: list[str], reference: Path, tmp_path: Path) -> Path:
    """A run of the same spec drilled at step 3 while it holds at step 6's samples: requeued once,
    resumed from its preemption save, and equal to ``reference`` bit for bit."""
    marker = tmp_path / "release-the-hold"
    hold = f"{marker}:{','.join(map(str, step_samples(reference, HOLD_STEP)))}"
    run = submit(job, *sets, "job.name=drilled", f"env.set.DRILL_HOLD={json.dumps(hold)}")
    out = hpcx("drill", str(run), "--at-step", str(DRILL_AT), "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step"] < HOLD_STEP, "the run went past its hold"
    marker.touch()
    finished(run)
    start0, stop0, start1, stop1 = ledger(run)
    assert stop0["reason"] == "preempted" and stop0["requeued"] and DRILL_AT <= stop0["step"] <= HOLD_STEP + 1
    assert start1["step"] == stop0["step"] and start1["checkpoint"] == f"step-{stop0['step']:07d}"
    assert stop1["reason"] == "completed" and stop1["step"] == STEPS
    assert train_losses(run) == train_losses(reference) and sorted(train_losses(run)) == list(range(1, STEPS + 1))
    final = f"checkpoints/step-{STEPS:07d}"
    assert same_checkpoint_tensors(run / final, reference / final) == []
    assert [(r["step"], r["eval_loss"], r["eval_accuracy"]) for r in evals(run)][-1] == \
        [(r["step"], r["eval_loss"], r["eval_accuracy"]) for r in evals(reference)][-1]
    return run


def shows_accuracy(run: Path, tmp_path: Path) -> None:
    """eval_accuracy in metrics.jsonl, `hpcx status` (text and JSON) and `hpcx plot`."""
    last = evals(run)[-1]
    assert last["step"] == STEPS and 0.0 <= last["eval_accuracy"] <= 1.0 and "eval_perplexity" not in last
    if "ImageTask" in json.loads((run / "resolved.json").read_text())["spec"]["task"]["target"]:
        # the task's own scalar beside its loss (examples/resnet.py): every train line, averaged over ranks
        train = [r for r in runs.read_jsonl(run / "metrics.jsonl") if "loss" in r]
        assert all(0.0 <= r["train_accuracy"] <= 1.0 for r in train) and len(train) >= STEPS
    status = hpcx("status", str(run))
    assert status.returncode == 0 and f"accuracy {last['eval_accuracy']:.4g}" in status.stdout, status.stdout
    info = json.loads(hpcx("status", str(run), "--json").stdout)
    assert info["eval_metrics"] == {"eval_accuracy": last["eval_accuracy"]}
    png = tmp_path / f"{run.name}.png"
    plot = hpcx("plot", str(run), "--out", str(png))
    assert plot.returncode == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_resnet_task_trains_reports_accuracy_and_resumes_bit_identical(tmp_path, strategy):
    sets = [f"job.run_root={json.dumps(str(tmp_path / 'runs'))}", f"parallel.strategy={strategy!r}", *COMMON,
            "train.global_batch=16", "train.micro_batch=4", "task.kwargs.norm='batch'"]  # BatchNorm's buffers resume too
    job = str(REPO / "jobs" / "resnet-ddp.toml")
    sets.append(held_target(job))
    reference = finished(submit(job, *sets, "job.name=reference"))
    assert json.loads((reference / "world.json").read_text())["world_size"] == 2
    shows_accuracy(reference, tmp_path)
    drilled_matches(job, sets, reference, tmp_path)


def loads_into_transformers(run: Path, folder: Path, tmp_path: Path) -> None:
    """`hpcx ckpt convert --to safetensors` of the final step: its `model.*` tensors are the fine-tuned
    BertForSequenceClassification's, by transformers' own names (strict)."""
    from safetensors.torch import load_file
    from transformers import BertForSequenceClassification

    out = tmp_path / f"{run.name}.safetensors"
    done = hpcx("ckpt", "convert", str(run / f"checkpoints/step-{STEPS:07d}"), str(out), "--to", "safetensors")
    assert done.returncode == 0, done.stderr
    tensors = {k.removeprefix("model."): v for k, v in load_file(out).items() if k.startswith("model.")}
    model = BertForSequenceClassification.from_pretrained(folder)
    before = model.classifier.weight.clone()
    model.load_state_dict(tensors, strict=True)
    assert not torch.equal(model.classifier.weight, before)  # trained


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    transformers = extra("transformers")
    folder = tmp_path_factory.mktemp("bert") / "bert-tiny"
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(1)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def first_batch_loss(folder: Path, run: Path) -> float:
    """transformers' loss on the run's first global batch (the sampler's first samples, in order)."""
    from transformers import BertForSequenceClassification

    from examples.bert import SequenceClassificationTask
    from hpc.core.spec import spec_from_dict
    from trainer.data import GlobalSampler

    spec = spec_from_dict(json.loads((run / "resolved.json").read_text())["spec"])
    task = SequenceClassificationTask(**spec.task.kwargs)
    dataset = task.train_dataset()
    g = spec.train.global_batch
    sampler = GlobalSampler(len(dataset), g, g, 0, 1, spec.train.seed, spec.data.shuffle)
    batch = torch.utils.data.default_collate([dataset[i] for i in sampler.step_batches(0)[0]])
    model = BertForSequenceClassification.from_pretrained(folder).train()
    with torch.no_grad():
        return model(**batch).loss.item()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_bert_task_fine_tunes_from_save_pretrained_its_first_loss_is_transformers(tmp_path, tiny_bert, strategy):
    sets = [f"job.run_root={json.dumps(str(tmp_path / 'runs'))}", *COMMON, "train.global_batch=8",
            "train.micro_batch=2", f"task.kwargs.pretrained={json.dumps(str(tiny_bert))}", "task.kwargs.seq_len=12",
            "task.tokens_per_sample=12"]
    job = str(REPO / "jobs" / f"bert-{strategy}.toml")
    sets.append(held_target(job))
    reference = finished(submit(job, *sets, "job.name=reference"))
    first = train_losses(reference)[1]
    assert first == pytest.approx(first_batch_loss(tiny_bert, reference), rel=1e-5, abs=1e-6)
    shows_accuracy(reference, tmp_path)
    loads_into_transformers(reference, tiny_bert, tmp_path)
    drilled_matches(job, sets, reference, tmp_path)


BROKEN_TASK = '''
import torch
from torch import nn


class Images:
    def build_model(self):
        return nn.Sequential(nn.Linear(4, 2))

    def units(self, model):
        return nn.ModuleList([model[0]])

    def train_dataset(self):
        return torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="none")  # per sample: not the mean
'''


def test_a_task_whose_loss_is_not_a_scalar_fails_its_start_in_one_line_and_is_not_requeued(tmp_path):
    """The job's code is imported from the folder it was submitted from; its wrong loss stops the first
    step with one line naming `loss(model, batch)`, and the failure is not requeued."""
    import subprocess
    import sys

    (tmp_path / "my_broken.py").write_text(BROKEN_TASK)
    (tmp_path / "job.toml").write_text('[job]\nname = "broken"\n[task]\ntarget = "my_broken:Images"\n'
                                       '[train]\nsteps = 2\nglobal_batch = 4\nmicro_batch = 2\n'
                                       '[parallel]\nstrategy = "ddp"\n')
    out = subprocess.run([sys.executable, "-m", "hpc.cli", "submit", "job.toml", "--json", "--set",
                          f"job.run_root={json.dumps(str(tmp_path / 'runs'))}"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "my_broken" in out.stderr and str(tmp_path / "my_broken.py") in out.stderr  # the user-code notice
    run = Path(json.loads(out.stdout)["run_dir"])
    info = wait_state(run, ("COMPLETED", "FAILED"), timeout=600)
    assert info["state"] == "FAILED"
    (start, stop) = ledger(run)
    assert stop["reason"] == "failed" and not stop["requeued"] and "fail the same way" in stop["not_requeued"]
    error = str(stop["error"])
    assert "`task.target` = 'my_broken:Images': loss(model, batch) returned a torch.float32 tensor of shape (2,)" \
        in error and len(error.splitlines()) == 1, error
    assert info["last_stop"]["words"].startswith("failed at step 0: ConfigError")
