"""Shard files: tokens, their document offsets and (prompt-response) the loss mask, each written
whole or not at all (temp file, fsync, rename: ``hpc.runs.write_atomic``) and hashed as written.

A shard is closed at the first document boundary at or past ``shard_tokens`` tokens, so memory
holds at most one shard (plus one batch of documents) per worker, whatever the corpus."""

from __future__ import annotations

import hashlib
import typing as tp
from pathlib import Path

import numpy as np

from hpc.core.runs import write_atomic

SPLITS = ("train", "val")


def shard_stem(split: str, group: int, number: int) -> str:
    """``train-00003-0001``: group 3's second shard of the train split."""
    return f"{split}-{group:05d}-{number:04d}"


class ShardWriter:
    """Collects the documents of one split of one group and writes them as numbered shards."""

    def __init__(self, out: Path, split: str, group: int, dtype: str, shard_tokens: int, masked: bool):
        self.out, self.split, self.group = out, split, group
        self.dtype, self.shard_tokens, self.masked = np.dtype(dtype), shard_tokens, masked
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.count = 0
        self.shards: list[dict[str, tp.Any]] = []

    def add(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        """One document (its EOS included); closes the shard once it is full."""
        self.tokens.append(tokens.astype(self.dtype, copy=False))
        if self.masked:
            assert mask is not None, "a masked writer takes a mask with every document"
            self.masks.append(mask.astype(np.uint8, copy=False))
        self.count += len(tokens)
        if self.count >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        """Write the documents collected so far as the next shard (nothing when there are none)."""
        if not self.tokens:
            return
        stem = shard_stem(self.split, self.group, len(self.shards))
        offsets = np.zeros(len(self.tokens) + 1, dtype=np.uint64)
        np.cumsum([len(t) for t in self.tokens], out=offsets[1:])
        tokens = np.concatenate(self.tokens)
        record: dict[str, tp.Any] = {"tokens": int(offsets[-1]), "documents": len(self.tokens), "max_id": int(tokens.max())}
        record.update(self._write(f"{stem}.bin", tokens, "file"))
        record.update(self._write(f"{stem}.idx", offsets, "index"))
        if self.masked:
            record.update(self._write(f"{stem}.mask", np.concatenate(self.masks), "mask"))
        self.shards.append(record)
        self.tokens, self.masks, self.count = [], [], 0

    def _write(self, name: str, array: np.ndarray, key: str) -> dict[str, str]:
        data = array.tobytes()
        write_atomic(self.out / name, data)
        return {key: name, f"{key}_sha256": hashlib.sha256(data).hexdigest()}
