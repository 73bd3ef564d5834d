"""A small classifier task over an iterable dataset (with or without ``state_dict``) or over a map-style
one in the order of its own sampler, for tests/resilience/test_task_data_local.py and tests/test_task_data.py.

``DRILL_HOLD = MARKER`` (a drilled run only): the loss of step ``HOLD_STEP`` (this process's call count)
waits until the file MARKER exists, so a drill lands mid-run however busy the machine is.
"""

from __future__ import annotations

import os
import time
import typing as tp
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset, WeightedRandomSampler

HOLD_STEP = 6
GUARD_S = 900  # a hang guard: the test creates the marker within seconds of its drill


def sample(seed: int, epoch: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + epoch * 100_003 + i)
    x = torch.randn(4, generator=g)
    return x, torch.tensor(int(x.sum() > 0))


class Stream(IterableDataset):
    """``samples`` samples per epoch, generated from the seed, the epoch and the position; no state."""

    def __init__(self, samples: int, seed: int = 1):
        self.samples, self.seed, self.epoch, self.pos, self.reads = samples, seed, 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.pos = epoch, 0

    def __iter__(self) -> tp.Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while self.pos < self.samples:
            i = self.pos
            self.pos += 1  # counted before the yield: the state after a read is the next position
            self.reads += 1
            yield sample(self.seed, self.epoch, i)


class StatefulStream(Stream):
    """The same stream, with its position as its state: a resume continues there without reading again."""

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


class StreamTask:
    def __init__(self, kind: str = "stateful", samples: int = 20):
        self.kind, self.samples, self.calls = kind, samples, 0

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))

    def units(self, model: nn.Module) -> nn.ModuleList:
        return nn.ModuleList([model[1]])

    def train_dataset(self) -> tp.Any:
        if self.kind == "stateful":
            return StatefulStream(self.samples)
        if self.kind == "stateless":
            return Stream(self.samples)
        xs, ys = zip(*(sample(1, 0, i) for i in range(self.samples)))
        return TensorDataset(torch.stack(xs), torch.stack(ys))

    def sampler(self, dataset: tp.Any) -> tp.Any:
        """Sample 4 in 5 of the samples, the later ones more often (draws from torch's global RNG)."""
        if self.kind != "sampler":
            return None
        return WeightedRandomSampler(torch.linspace(0.1, 1.0, len(dataset)), num_samples=16, replacement=True)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.calls += 1
        hold = os.environ.get("DRILL_HOLD")
        if hold and self.calls == HOLD_STEP:
            waited = time.monotonic()
            while not Path(hold).exists() and time.monotonic() - waited < GUARD_S:
                time.sleep(0.02)
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)
