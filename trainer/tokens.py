"""Token shards of a manifest (``hpcx data prepare``), memory-mapped, as one dataset of samples.

Sample ``i`` is ``seq_len + 1`` consecutive tokens of one shard (inputs and shifted targets from one
read); shard ``k`` holds ``(tokens_k − 1) // seq_len`` samples, numbered after the shards before it in
manifest order, and a sample never spans two shards. Documents are packed, each ended by its EOS.
With a loss mask (``--format prompt-response``) a sample is ``(tokens, mask)``. With ``documents``
(``data.packing = "document"``) it is ``(tokens, mask, documents)``: each position's document number
from the shard's index (``.idx``, the offsets where documents start), and a mask that counts no target
across a boundary (``trainer.objective.document_targets``). Every shard is opened lazily in the process
that reads it, so DataLoader workers never pickle a memory map.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import typing as tp
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from hpc.core.manifest import PREPARED, load_manifest, manifest_path, val_split_source, window_totals
from hpc.core.runs import RunDir, write_json
from hpc.core.spec import Data
from trainer.objective import document_targets


class ManifestTokens(Dataset):
    """The samples of one split of a prepared folder."""

    def __init__(self, source: str | Path, split: str, seq_len: int, vocab: int = 0, documents: bool = False):
        path = manifest_path(source)
        if path is None:
            raise ValueError(f"{source}: no manifest.json (made by `hpcx data prepare`)")
        self.folder, self.split, self.seq_len, self.vocab = path.parent, split, seq_len, vocab
        self.manifest = load_manifest(path)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.masked = bool(self.manifest.get("masked"))
        self.documents = documents
        self.shards = [s for s in self.manifest["splits"][split]["shards"] if s["tokens"] > seq_len]
        counts = [(s["tokens"] - 1) // seq_len for s in self.shards]
        self.starts = np.cumsum([0] + counts).tolist()
        self._maps: dict[int, tuple[np.memmap, np.memmap | None]] = {}
        self._offsets: dict[int, np.ndarray] = {}
        if not len(self):
            raise ValueError(f"{path}: the {split} split holds no sample of seq_len + 1 = {seq_len + 1} tokens")

    def __len__(self) -> int:
        return self.starts[-1]

    def _open(self, k: int) -> tuple[np.memmap, np.memmap | None]:
        if k not in self._maps:
            shard = self.shards[k]
            tokens = np.memmap(self.folder / shard["file"], dtype=self.dtype, mode="r")
            mask = np.memmap(self.folder / shard["mask"], dtype=np.uint8, mode="r") if self.masked else None
            self._maps[k] = (tokens, mask)
        return self._maps[k]

    def _document_numbers(self, k: int, first: int) -> torch.Tensor:
        """The document of each token of the sample starting at token ``first`` of shard ``k``."""
        if k not in self._offsets:
            self._offsets[k] = np.fromfile(self.folder / self.shards[k]["index"], dtype=np.uint64).astype(np.int64)
        where = np.arange(first, first + self.seq_len + 1, dtype=np.int64)
        return torch.from_numpy(np.searchsorted(self._offsets[k], where, side="right") - 1)

    def __getitem__(self, index: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        k = bisect.bisect_right(self.starts, index) - 1
        first = (index - self.starts[k]) * self.seq_len
        tokens, mask = self._open(k)
        window = torch.from_numpy(tokens[first:first + self.seq_len + 1].astype(np.int64))
        if self.vocab and int(window.max()) >= self.vocab:  # an embedding lookup would fail naming nothing
            at = first + int(torch.argmax(window))
            raise ValueError(f"{self.folder / self.shards[k]['file']}: token id {int(window.max())} at token {at} "
                             f"is not below the model's vocabulary of {self.vocab} (run `hpcx data verify "
                             f"{self.folder}`)")
        counted = None if mask is None else torch.from_numpy(mask[first:first + self.seq_len + 1].astype(np.bool_))
        if self.documents:
            numbers = self._document_numbers(k, first)
            return window, document_targets(counted, numbers), numbers
        return window if counted is None else (window, counted)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}, "_offsets": {}}


def data_record(data: Data, kind: str) -> dict[str, tp.Any]:
    """What a run trained on: the manifest (path, SHA-256, totals), its tokenizer (path, SHA-256,
    vocabulary, EOS; what a model export ships) and the validation source."""
    if kind != PREPARED:
        return {"source": data.source}
    path = manifest_path(data.source)
    assert path is not None  # is_manifest_source
    manifest = load_manifest(path)
    return {"source": data.source, "manifest": str(path), "manifest_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "tokenizer": manifest["tokenizer"], "dtype": manifest["dtype"], "masked": bool(manifest.get("masked")),
            "splits": {s: {k: m[k] for k in ("tokens", "documents")} | window_totals(m)
                       for s, m in manifest["splits"].items()},
            "window": manifest.get("window", 0), "val_source": val_split_source(data, kind), "packing": data.packing,
            "chat_template": manifest.get("chat_template")}  # what a model export writes (hpc.ckpt.hf)


def record_data(run_dir: Path, data: Data, kind: str) -> None:
    """Rank 0 writes ``RUN/data.json`` (``data_record``) and logs a windowed train split's padding."""
    record = data_record(data, kind)
    write_json(RunDir(run_dir).data, record)
    train = record.get("splits", {}).get("train", {})
    if "padding_fraction" in train:
        logging.getLogger("hpcx.trainer").info(
            "data: windows of %d tokens, %.1f%% padding, %d examples cut to the window; packing %s",
            record["window"], 100 * train["padding_fraction"], train["truncated"], data.packing)
