"""A small classifier task that fails on purpose, for tests/resilience/test_user_errors_local.py.

``fail`` picks how (after ``at`` calls of ``loss`` on the ranks ``rank`` names, -1: every rank): ``value``
raises a ValueError in the task's own loss, ``forward`` a shape error from inside the model's forward,
``nograd`` returns a detached loss, ``metric`` raises a NameError in ``metrics``, ``kill`` SIGKILLs the rank
(the machine's kind of failure: requeued). The rank is read from torchrun's ``RANK``, which task mode sets.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Flaky:
    def __init__(self, fail: str = "none", at: int = 3, rank: int = -1):
        self.fail, self.at, self.rank, self.calls = fail, at, rank, 0

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 2))

    def units(self, model: nn.Module) -> nn.ModuleList:
        return nn.ModuleList([model[1]])

    def train_dataset(self) -> TensorDataset:
        g = torch.Generator().manual_seed(0)
        return TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))

    def eval_dataset(self) -> TensorDataset | None:
        return self.train_dataset() if self.fail == "metric" else None

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        x, y = batch
        due = self.calls > self.at and self.rank in (-1, int(os.environ["RANK"]))
        if due and self.fail == "value":
            raise ValueError(f"label out of range in call {self.calls}")
        if due and self.fail == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if due and self.fail == "forward":
            x = x[:, :3]  # the first Linear's matmul refuses it, inside the model's forward
        loss = nn.functional.cross_entropy(model(x), y)
        return loss.detach() if due and self.fail == "nograd" else loss

    def metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
        x, y = batch
        correct = (model(x).argmax(-1) == y).sum()
        return {"accuracy": (correct, undefined_count)}  # noqa: F821  (the bug under test)
