"""A task's own scalars beside its loss (``loss`` returns ``(loss, {name: scalar})`` or ``{"loss": …, name:
…}``): averaged over the step's micro-batches by the seam, reduced over ranks with the loss in one
all-reduce (``trainer.loop.logged_values``), written as ``train_<name>`` to metrics.jsonl and TensorBoard.
A real two-rank run: tests/resilience/test_tasks_local.py (the ResNet example logs its train accuracy)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from hpc.core.errors import ConfigError
from hpc.core.spec import spec_from_dict

TASK = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Scalars:
    def __init__(self, form="tuple"):
        self.form, self.calls = form, 0

    def build_model(self):
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))

    def units(self, model):
        return nn.ModuleList([model[1]])

    def train_dataset(self):
        return TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))

    def loss(self, model, batch):
        x, y = batch
        self.calls += 1
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        accuracy = (logits.argmax(-1) == y).float().mean()
        if self.form == "tuple":
            return loss, {"accuracy": accuracy, "calls": self.calls}
        if self.form == "dict":
            return {"loss": loss, "accuracy": accuracy, "calls": torch.tensor([float(self.calls)])}
        if self.form == "badname":
            return loss, {"top-1": accuracy}
        if self.form == "loss":
            return loss, {"loss": accuracy}
        if self.form == "vector":
            return loss, {"accuracy": logits}
        if self.form == "changing":
            return loss, {f"metric{self.calls}": accuracy}
        return loss
'''


@pytest.fixture
def seam(tmp_path, monkeypatch):
    (tmp_path / "scalar_tasks.py").write_text(textwrap.dedent(TASK))
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(form: str):
        from trainer.tasks import task_for

        task = task_for(spec_from_dict({"task": {"target": "scalar_tasks:Scalars", "kwargs": {"form": form}}}))
        model = task.meta_model().to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p)
        return task, model

    yield make
    sys.modules.pop("scalar_tasks", None)


def micro_losses(task, model, n: int) -> list[torch.Tensor]:
    data = task.train_dataset()
    off = torch.autocast("cpu", enabled=False)
    return [task.micro_loss(model, task.collate([data[i] for i in range(4 * k, 4 * k + 4)]), 1.0 / n, off)
            for k in range(n)]


@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_the_tasks_scalars_are_the_mean_over_the_steps_micro_batches(seam, form):
    task, model = seam(form)
    losses = micro_losses(task, model, 2)
    assert all(loss.dim() == 0 and loss.requires_grad for loss in losses)
    step = task.step_scalars()
    assert sorted(step) == ["accuracy", "calls"] and step["calls"].item() == 1.5  # calls 1 and 2
    assert 0.0 <= step["accuracy"].item() <= 1.0 and not step["accuracy"].requires_grad
    micro_losses(task, model, 1)
    assert task.step_scalars()["calls"].item() == 3.0  # emptied after each step
    with torch.no_grad():  # an evaluation takes the loss and leaves the scalars alone
        terms = task.eval_terms(model, task.collate([task.train_dataset()[0]]), 1, torch.autocast("cpu", enabled=False))
    assert terms.shape == (2,) and task.step_scalars() == {}


def test_a_task_without_scalars_has_none(seam):
    task, model = seam("plain")
    micro_losses(task, model, 2)
    assert task.step_scalars() == {}


@pytest.mark.parametrize("form,words", [
    ("badname", "named a scalar 'top-1' (expected an identifier other than 'loss')"),
    ("loss", "named a scalar 'loss'"),
    ("vector", "gave 'accuracy' as not a number or a one-element tensor"),
])
def test_a_wrong_scalar_is_one_line(seam, form, words):
    task, model = seam(form)
    with pytest.raises(ConfigError) as info:
        micro_losses(task, model, 1)
    (message,) = info.value.messages
    assert message.startswith("`task.target` = 'scalar_tasks:Scalars': loss(model, batch) ") and words in message


def test_scalars_whose_names_change_between_steps_are_one_line(seam):
    task, model = seam("changing")
    with pytest.raises(ConfigError, match=r"returned the scalars \['metric2'\], then \['metric1'\] before"):
        micro_losses(task, model, 2)


def test_the_metrics_writer_gives_tensorboard_every_train_scalar(tmp_path):
    from trainer.metrics import MetricsWriter

    class Recorder:  # what SummaryWriter.add_scalar is given (tensorboard is an optional extra)
        def __init__(self):
            self.seen: list[tuple] = []

        def add_scalar(self, key, value, step):
            self.seen.append((key, value, step))

        def close(self):
            pass

    writer = MetricsWriter(tmp_path, enabled=True)
    writer.tb = Recorder()
    writer.write({"step": 3, "loss": 0.5, "lr": 1e-3, "train_accuracy": 0.75, "phases_s": {"data": 0.1}})
    seen, _ = writer.tb.seen, writer.close()
    assert ("train_accuracy", 0.75, 3) in seen and ("loss", 0.5, 3) in seen and len(seen) == 3
    assert '"train_accuracy": 0.75' in (tmp_path / "metrics.jsonl").read_text()
