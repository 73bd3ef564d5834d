"""The worked examples' tasks with a deterministic hold for drills: a drill lands mid-run however busy
the machine is, instead of racing a short run.

``DRILL_HOLD = "MARKER:i,j,..."`` (set for a drilled run only): fetching any of those train samples
waits until the file ``MARKER`` exists. The test names the samples of a step after the one its drill
waits for, and creates ``MARKER`` once the drill has signalled; then the run goes on, reaches the next
step boundary and stops there. Later fetches (and the resumed run's) find ``MARKER`` and never wait.
Without the variable the tasks are the examples' own, sample for sample.
"""

from __future__ import annotations

import os
import time
import typing as tp
from pathlib import Path

from torch.utils.data import Dataset

from examples.bert import SequenceClassificationTask
from examples.resnet import ImageTask

GUARD_S = 900  # a hang guard: the test creates the marker within seconds of its drill


class HeldSamples(Dataset):
    def __init__(self, inner: Dataset, hold: str):
        marker, _, indices = hold.rpartition(":")
        self.inner, self.marker, self.indices = inner, Path(marker), {int(i) for i in indices.split(",") if i}

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]  # map-style datasets have one

    def __getitem__(self, index: int) -> tp.Any:
        if index in self.indices:
            waited = time.monotonic()
            while not self.marker.exists():
                if time.monotonic() - waited > GUARD_S:
                    raise RuntimeError(f"held at sample {index}: {self.marker} never appeared")
                time.sleep(0.02)
        return self.inner[index]


def held(dataset: Dataset) -> Dataset:
    hold = os.environ.get("DRILL_HOLD")
    return HeldSamples(dataset, hold) if hold else dataset


class HeldImageTask(ImageTask):
    def train_dataset(self) -> Dataset:
        return held(super().train_dataset())


class HeldSequenceClassificationTask(SequenceClassificationTask):
    def train_dataset(self) -> Dataset:
        return held(super().train_dataset())
