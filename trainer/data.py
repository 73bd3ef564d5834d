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
                 seed: int, shuffle: bool):
        problems = check_batch(global_batch, micro_batch, world_size)  # resolve's check, for direct callers
        if problems:
            raise ValueError(problems[0])
        self.num_samples, self.global_batch, self.micro_batch = num_samples, global_batch, micro_batch
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
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
        if not self.shuffle:
            return offset
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=gen))
        return int(self._perm[1][offset])

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


def build_dataset(data: Data, kind: str, seq_len: int, vocab_size: int, seed: int) -> Dataset:
    """Synthetic tokens, the train split of a prepared folder (``trainer.tokens``) or a ``.bin`` token
    file, per ``kind``: what ``data.source`` names, decided at resolve (``Launch.data_source``)."""
    if kind == SYNTHETIC:
        return SyntheticTokens(vocab_size, seq_len, seed)
    if kind == PREPARED:
        from trainer.tokens import ManifestTokens

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
