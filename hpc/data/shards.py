"""Shard files: tokens, their document offsets and (prompt-response) the loss mask, each written
whole or not at all (temp file, fsync, rename: ``hpc.runs.write_atomic``) and hashed as written.

A shard is closed at the first document boundary at or past ``shard_tokens`` tokens, so memory
holds at most one shard (plus one batch of documents) per worker, whatever the corpus.

With a ``window`` (``hpcx data prepare --window SEQ_LEN``) no document straddles two windows of
``window`` tokens: a document that does not fit in what is left of the current window starts the next
one, the rest padded with ``pad_id`` (loss mask 0, counted in the document before it: nothing of a later
document sees it); one longer than a window is cut to the window (``truncated``). A shard then holds whole
windows and one pad token more, so the trainer's samples of ``window + 1`` tokens (``trainer.tokens``)
are exactly its windows, each followed by a token that is no target of a counted document."""

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

    def __init__(self, out: Path, split: str, group: int, dtype: str, shard_tokens: int, masked: bool,
                 window: int = 0, pad_id: int = 0):
        self.out, self.split, self.group = out, split, group
        self.dtype, self.shard_tokens, self.masked = np.dtype(dtype), shard_tokens, masked
        self.window, self.pad_id = window, pad_id
        self.tokens: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.count = self.padding = 0
        self.truncated = 0  # documents of this shard cut to the window
        self.shards: list[dict[str, tp.Any]] = []

    def add(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        """One document (its EOS included); closes the shard once it is full."""
        if self.window:
            tokens, mask = self._fit(tokens, mask)
        self.tokens.append(tokens.astype(self.dtype, copy=False))
        if self.masked:
            assert mask is not None, "a masked writer takes a mask with every document"
            self.masks.append(mask.astype(np.uint8, copy=False))
        self.count += len(tokens)
        if self.count >= self.shard_tokens:
            self.flush()

    def _fit(self, tokens: np.ndarray, mask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """The document cut to one window, after the current window is padded when it does not fit."""
        if len(tokens) > self.window:
            self.truncated += 1
            tokens, mask = tokens[:self.window], None if mask is None else mask[:self.window]
        used = self.count % self.window
        if used and used + len(tokens) > self.window:
            self._pad(self.window - used)
        return tokens, mask

    def _pad(self, n: int) -> None:
        """``n`` pad tokens (mask 0) after the last document."""
        self.tokens[-1] = np.concatenate([self.tokens[-1], np.full(n, self.pad_id, dtype=self.dtype)])
        if self.masked:
            self.masks[-1] = np.concatenate([self.masks[-1], np.zeros(n, dtype=np.uint8)])
        self.count += n
        self.padding += n

    def flush(self) -> None:
        """Write the documents collected so far as the next shard (nothing when there are none)."""
        if not self.tokens:
            return
        if self.window:  # whole windows, and the last sample's final token
            self._pad((-self.count) % self.window + 1)
        stem = shard_stem(self.split, self.group, len(self.shards))
        offsets = np.zeros(len(self.tokens) + 1, dtype=np.uint64)
        np.cumsum([len(t) for t in self.tokens], out=offsets[1:])
        tokens = np.concatenate(self.tokens)
        record: dict[str, tp.Any] = {"tokens": int(offsets[-1]), "documents": len(self.tokens), "max_id": int(tokens.max())}
        if self.window:
            record.update(padding=self.padding, truncated=self.truncated)
        record.update(self._write(f"{stem}.bin", tokens, "file"))
        record.update(self._write(f"{stem}.idx", offsets, "index"))
        if self.masked:
            record.update(self._write(f"{stem}.mask", np.concatenate(self.masks), "mask"))
        self.shards.append(record)
        self.tokens, self.masks, self.count, self.padding, self.truncated = [], [], 0, 0, 0

    def _write(self, name: str, array: np.ndarray, key: str) -> dict[str, str]:
        data = array.tobytes()
        write_atomic(self.out / name, data)
        return {key: name, f"{key}_sha256": hashlib.sha256(data).hexdigest()}
