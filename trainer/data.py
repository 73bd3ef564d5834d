"""Token data and the sampler whose position is counted in global samples.

Sample order is defined once, for the whole job, independently of how many
ranks consume it: global sample ``g`` is dataset index ``perm(epoch)[g % N]``
with ``epoch = g // N`` and ``perm(epoch)`` a permutation seeded from
``(train.seed, epoch)`` (``set_epoch`` semantics of DistributedSampler). Optimizer
step ``s`` takes global samples ``[s·G, (s+1)·G)``; inside it, micro-step ``m`` of
rank ``r`` takes ``B`` consecutive ones starting at ``s·G + (m·W + r)·B``. So the
set and order of samples of every optimizer step are the same at any world size
``W`` and micro batch ``B``, and a resume at another world size continues from
``consumed_samples`` exactly.
"""

from __future__ import annotations

import typing as tp
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hpc.core.manifest import PREPARED, SYNTHETIC
from hpc.core.spec import Data
from hpc.core.validate import check_batch
from trainer.tokens import ManifestTokens

SYNTHETIC_SAMPLES = 1 << 40  # effectively endless; synthetic sample g is random tokens seeded from g


class SyntheticTokens(Dataset):
    """Seeded synthetic tokens that a model can learn: sample ``i`` is an arithmetic sequence
    ``start + stride·k (mod vocab)`` with a seeded random start and stride (1–16), the same on every
    rank and run with the same seed. The next token follows from the two before it, so the loss
    falls from ln(vocab) towards 0 as training works — a visible check that a run is learning."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __len__(self) -> int:
        return SYNTHETIC_SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size, (), generator=gen)
        stride = torch.randint(1, 17, (), generator=gen)
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size


class TokenFile(Dataset):
    """A flat ``.bin`` file of uint16/uint32 tokens (numpy memmap); sample ``i`` is tokens
    ``[i·S, i·S + S + 1)`` so inputs and shifted targets come from one read. The memmap is
    opened lazily in each process, so DataLoader workers never pickle its pages."""

    def __init__(self, path: str | Path, dtype: str, seq_len: int):
        self.path, self.dtype, self.seq_len = str(path), np.dtype(dtype), seq_len
        self.num_tokens = Path(path).stat().st_size // self.dtype.itemsize
        self._tokens: np.memmap | None = None
        if self.num_tokens < seq_len + 1:
            raise ValueError(f"{path}: {self.num_tokens} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = index * self.seq_len
        return torch.from_numpy(self._tokens[start:start + self.seq_len + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


class GlobalSampler:
    """Yields this rank's micro-batches of dataset indices, endlessly, from ``consumed_samples`` on.

    Iterate it through a DataLoader (``batch_sampler=``); the loop calls ``advance`` after each
    optimizer step — the DataLoader prefetches ahead, so the position is not taken from the iterator.
    After ``load_state_dict`` or ``set_epoch``, make a new DataLoader iterator.
    """

    def __init__(self, num_samples: int, global_batch: int, micro_batch: int, rank: int, world_size: int,
                 seed: int, shuffle: bool, order: tp.Callable[[int], tp.Sequence[int]] | None = None):
        problems = check_batch(global_batch, micro_batch, world_size)  # resolve's check, for direct callers
        if problems:
            raise ValueError(problems[0])
        self.num_samples, self.global_batch, self.micro_batch = num_samples, global_batch, micro_batch
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.order = order  # a task's own sampler: epoch → its indices (``epoch_order``), instead of hpcx's
        self.consumed_samples = 0
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.world_size)

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Start at the first sample of ``epoch``."""
        self.consumed_samples = epoch * self.num_samples

    def advance(self, steps: int = 1) -> None:
        self.consumed_samples += steps * self.global_batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at ``consumed_samples`` (any world size or micro batch; ``epoch`` follows from it)."""
        self.consumed_samples = int(state["consumed_samples"])

    def index(self, g: int) -> int:
        """Dataset index of global sample ``g``."""
        epoch, offset = divmod(g, self.num_samples)
        if not self.shuffle and self.order is None:
            return offset
        if self._perm is None or self._perm[0] != epoch:
            if self.order is not None:
                self._perm = (epoch, torch.as_tensor(list(self.order(epoch)), dtype=torch.long))
            else:
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = (epoch, torch.randperm(self.num_samples, generator=gen))
        return int(self._perm[1][offset])

    def data_state(self) -> dict[str, tp.Any]:
        """The dataset's own state to checkpoint: none for a map-style dataset (the indices say it all)."""
        return {}

    def load_data_state(self, state: dict[str, tp.Any]) -> None:
        """Nothing to restore for a map-style dataset."""

    def step_batches(self, start: int) -> list[list[int]]:
        """This rank's micro-batches for the optimizer step starting at global sample ``start``."""
        out = []
        for micro in range(self.grad_accum):
            first = start + (micro * self.world_size + self.rank) * self.micro_batch
            out.append([self.index(g) for g in range(first, first + self.micro_batch)])
        return out

    def __iter__(self) -> tp.Iterator[list[int]]:
        start = self.consumed_samples
        while True:
            yield from self.step_batches(start)
            start += self.global_batch


def epoch_order(sampler: tp.Any, seed: int) -> tp.Callable[[int], list[int]]:
    """A task's own sampler as the global order of each epoch: its indices after ``set_epoch(epoch)`` (when
    it has one), drawn with torch's global RNG seeded from ``seed`` and the epoch (and restored after), so a
    sampler that draws from it (``RandomSampler``, ``WeightedRandomSampler`` without a generator) gives the
    same order in every process and after every restart: hpcx splits that order over the ranks."""

    def order(epoch: int) -> list[int]:
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + epoch)
            return [int(i) for i in sampler]

    return order


class StreamSampler:
    """An iterable dataset's (no ``__len__``) micro-batches for this rank, in global sample order.

    Every rank reads the whole stream, one global batch per optimizer step, and keeps the samples that
    ``GlobalSampler`` would give it at those positions (rank-major micro-batches), so a step holds the same
    samples at any world size and micro batch. When the stream ends, it starts again (the next epoch: the
    dataset's ``set_epoch(epoch)`` when it has one). Iterated directly (no DataLoader, no workers: nothing is
    read ahead of the step, so the dataset's state at a step boundary is exactly the samples consumed).

    Resume: a dataset with ``state_dict()`` / ``load_state_dict(state)`` is checkpointed with every save and
    continues exactly where the save was; one without starts its stream again from the beginning and skips
    the samples consumed (exact only if it yields the same stream each time: ``resume_words`` says so)."""

    def __init__(self, dataset: tp.Any, global_batch: int, micro_batch: int, rank: int, world_size: int,
                 collate: tp.Callable[[list], tp.Any]):
        problems = check_batch(global_batch, micro_batch, world_size)
        if problems:
            raise ValueError(problems[0])
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.rank, self.world_size, self.collate = rank, world_size, collate
        self.consumed_samples, self.stream_epoch = 0, 0
        self._state: dict[str, tp.Any] = {}

    @property
    def grad_accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.world_size)

    @property
    def stateful(self) -> bool:
        return callable(getattr(self.dataset, "state_dict", None)) and \
            callable(getattr(self.dataset, "load_state_dict", None))

    def resume_words(self) -> str | None:
        """None when a resume continues exactly; else the one line that says why it may not."""
        if self.stateful:
            return None
        return (f"{type(self.dataset).__name__} is an iterable dataset without state_dict()/load_state_dict(): a "
                "resume reads its stream again from the start and skips the samples consumed, exact only if it "
                "yields the same samples each time")

    def advance(self, steps: int = 1) -> None:
        self.consumed_samples += steps * self.global_batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "epoch": self.stream_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples, self.stream_epoch = int(state["consumed_samples"]), int(state.get("epoch", 0))

    def data_state(self) -> dict[str, tp.Any]:
        """The dataset's own state (its ``state_dict()``) as of the last step read, with its epoch."""
        return dict(self._state)

    def load_data_state(self, state: dict[str, tp.Any]) -> None:
        self._state = dict(state)

    def __iter__(self) -> tp.Iterator[tp.Any]:
        samples = self._samples()
        while True:
            batch = [next(samples) for _ in range(self.global_batch)]
            if self.stateful:
                self._state = {"epoch": self.stream_epoch, "dataset": self.dataset.state_dict()}
            for micro in range(self.grad_accum):
                first = (micro * self.world_size + self.rank) * self.micro_batch
                yield self.collate(batch[first:first + self.micro_batch])

    def _samples(self) -> tp.Iterator[tp.Any]:
        """The stream from the position of ``consumed_samples``: restored, or replayed and skipped."""
        skip, restored = 0, False
        if self.stateful and self._state:
            self.stream_epoch = int(self._state.get("epoch", self.stream_epoch))
            self.dataset.load_state_dict(self._state["dataset"])
            restored = True
        elif self.consumed_samples:
            self.stream_epoch, skip = 0, self.consumed_samples
        while True:
            if not restored and callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(self.stream_epoch)
            count = 0
            for sample in self.dataset:
                count += 1
                if skip:
                    skip -= 1
                    continue
                yield sample
            if count == 0 and not restored:  # a restored position may be the very end of its epoch
                raise ValueError(f"{type(self.dataset).__name__}: the iterable dataset yielded no samples")
            restored = False
            self.stream_epoch += 1


def is_stream(dataset: tp.Any) -> bool:
    """An iterable dataset: ``__iter__`` and no ``__len__`` (a map-style one has both ``__len__`` and
    ``__getitem__``)."""
    return callable(getattr(dataset, "__iter__", None)) and not callable(getattr(dataset, "__len__", None))


def order_words(order: tp.Callable[[int], tp.Sequence[int]]) -> str | None:
    """None when a task's sampler gives the same order each time its epoch is drawn (``epoch_order``), else
    the one line that says a resume is not exact."""
    if list(order(0)) == list(order(0)):
        return None
    return ("the task's sampler gives another order each time it is iterated (it draws from a generator of its "
            "own?): a resume is not exact; seed it in set_epoch(epoch), or draw from torch's global RNG")


def build_dataset(data: Data, kind: str, seq_len: int, vocab_size: int, seed: int) -> Dataset:
    """Synthetic tokens, the train split of a prepared folder (``trainer.tokens``) or a ``.bin`` token
    file, per ``kind``: what ``data.source`` names, decided at resolve (``Launch.data_source``)."""
    if kind == SYNTHETIC:
        return SyntheticTokens(vocab_size, seq_len, seed)
    if kind == PREPARED:
        return ManifestTokens(data.source, "train", seq_len, vocab_size, documents=data.packing == "document")
    return TokenFile(data.source, data.dtype, seq_len)


def build_loader(dataset: Dataset, sampler: GlobalSampler, data: Data, seed: int, pin_memory: bool,
                 workers: int | None = None, collate: tp.Callable[[list], tp.Any] | None = None) -> DataLoader:
    """A DataLoader with its own generator: creating its iterator must not draw from the global RNG.
    ``workers``: the launch's ``hpc.spec.loader_workers`` (default: ``data.num_workers``, -1 as 0);
    workers persist across iterators, and pinned memory is used only with a GPU. ``collate``: the
    task's (``LoopTask.collate``; default torch's)."""
    workers = max(0, data.num_workers) if workers is None else workers
    return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory, collate_fn=collate,
                      generator=torch.Generator().manual_seed(seed), persistent_workers=workers > 0)


def shuffle_enabled(data: Data, kind: str) -> bool:
    """Synthetic samples are already independent random draws; only token files are permuted (``kind``:
    ``Launch.data_source``)."""
    return data.shuffle and kind != SYNTHETIC
