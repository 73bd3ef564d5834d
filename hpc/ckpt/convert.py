"""``hpcx ckpt inspect | convert | verify``: the work behind the commands, free of click.

Every function opens its inputs through ``open_checkpoint``, which validates a
checkpoint completely (metadata allow-list, every referenced file present and
long enough) before reading a byte of tensor data, and raises ``CheckpointError``
with one line per problem. Outputs are written to a temporary name beside the
destination and renamed only when complete.
"""

from __future__ import annotations

import math
import typing as tp
from pathlib import Path

import torch

from hpc.ckpt.dcp import DcpReader, write_dcp
from hpc.ckpt.entries import Entry, Progress, Reader, jsonable
from hpc.ckpt.safe_pickle import METADATA_FILE
from hpc.ckpt.safetensors import INDEX_FILE, SafetensorsReader, write_safetensors
from hpc.ckpt.torchsave import LEGACY_TORCH_MAGIC, TorchReader, write_torch
from hpc.errors import CheckpointError, ConfigError

TARGETS = ("torch", "safetensors", "dcp")
DEFAULT_SHARD_BYTES = 5 * 2**30  # 5 GiB, the usual safetensors shard size


def detect_format(path: str | Path) -> str:
    """``dcp``, ``safetensors`` or ``torch`` from what is at ``path``; CheckpointError when nothing fits."""
    path = Path(path)
    if path.is_dir():
        if (path / METADATA_FILE).exists() or any(path.glob("*.distcp")):
            return "dcp"
        if (path / INDEX_FILE).exists() or any(path.glob("*.safetensors")):
            return "safetensors"
        raise CheckpointError([f"{path}: a folder with neither a DCP .metadata nor .safetensors files"])
    if not path.exists():
        raise CheckpointError([f"{path}: no such file or folder"])
    with open(path, "rb") as f:
        head = f.read(4)
    return "torch" if head in (b"PK\x03\x04", LEGACY_TORCH_MAGIC) else "safetensors"


def open_checkpoint(path: str | Path) -> Reader:
    """A reader for the checkpoint at ``path``, any format; validated before anything is read."""
    fmt = detect_format(path)
    return {"dcp": DcpReader, "safetensors": SafetensorsReader, "torch": TorchReader}[fmt](path)


def inspect_checkpoint(path: str | Path) -> dict[str, tp.Any]:
    """What ``hpcx ckpt inspect`` shows: format, meta, train state, tensors, total size, completeness."""
    reader = open_checkpoint(path)  # raises CheckpointError when incomplete
    try:
        train = {k[len("train."):]: reader.read(k) for k in reader.entries
                 if k.startswith("train.") and not reader.entries[k].is_tensor}
        tensors = [{"key": e.key, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape),
                    "bytes": e.nbytes} for e in reader.entries.values() if e.is_tensor]
        return {"path": str(path), "format": reader.format, "complete": True,
                "step": reader.meta.get("step", train.get("step")),
                "tokens_seen": reader.meta.get("tokens_seen", train.get("tokens_seen")),
                "world_size": reader.meta.get("world_size"), "strategy": reader.meta.get("strategy"),
                "meta": jsonable(reader.meta), "train": jsonable(train), "tensors": tensors,
                "objects": sorted(k for k, e in reader.entries.items() if not e.is_tensor),
                "total_bytes": sum(t["bytes"] for t in tensors)}
    finally:
        reader.close()


def selected_keys(reader: Reader, model_only: bool) -> list[str]:
    """The keys a conversion copies: everything, or the model's tensors only."""
    keys = [k for k in reader.entries if not model_only or k.startswith("model.")]
    if not keys:
        raise CheckpointError([f"{getattr(reader, 'path', '?')}: no {'model ' if model_only else ''}entries to convert"])
    return keys


def convert_checkpoint(src: str | Path, dst: str | Path, to: str, *, model_only: bool = False,
                       shard_bytes: int = DEFAULT_SHARD_BYTES,
                       progress: Progress = lambda n: None) -> dict[str, tp.Any]:
    """Convert ``src`` (any format) to ``dst`` in format ``to``; a summary dict.

    ``dcp`` and ``safetensors`` outputs are streamed (one tensor in memory at a time); ``torch``
    is not: a single ``torch.save`` file needs the whole dict in memory. A torch source in a layout
    ``TorchZip`` does not handle (e.g. a legacy non-zip file) is loaded whole (``streamed`` False).
    """
    if to not in TARGETS:
        raise ConfigError([f"--to {to!r}: expected one of {', '.join(TARGETS)}"])
    dst = Path(dst)
    reader = open_checkpoint(src)
    try:
        keys = selected_keys(reader, model_only)
        if to == "dcp":
            write_dcp(reader, dst, keys, progress)
        elif to == "safetensors":
            write_safetensors(reader, dst, keys, model_only=model_only, shard_bytes=shard_bytes, progress=progress)
        else:
            write_torch(reader, dst, keys, model_only=model_only, progress=progress)
        total = sum(reader.entries[k].nbytes for k in keys)
        return {"src": str(src), "dst": str(dst), "from": reader.format, "to": to, "keys": len(keys),
                "bytes": total, "streamed": to != "torch" and getattr(reader, "streamed", True)}
    finally:
        reader.close()


def total_bytes(path: str | Path, model_only: bool = False) -> int:
    """Bytes a conversion of ``path`` will copy (for a progress bar)."""
    reader = open_checkpoint(path)
    try:
        return sum(reader.entries[k].nbytes for k in selected_keys(reader, model_only))
    finally:
        reader.close()


def compare_values(a: tp.Any, b: tp.Any, atol: float) -> str | None:
    """None when equal (bit-exact for tensors when ``atol`` is 0), else what differs."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return f"{type(a).__name__} vs {type(b).__name__}"
    if not isinstance(a, torch.Tensor):
        return None if a == b else f"{a!r} vs {b!r}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if atol == 0:
        same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) if a.numel() else True
        return None if same else _max_diff(a, b)
    if a.numel() == 0:
        return None
    diff = (a.double() - b.double()).abs().max().item()
    return None if diff <= atol or (math.isnan(diff) and torch.equal(a.isnan(), b.isnan())) else _max_diff(a, b)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.is_floating_point() or a.is_complex():
        d = (a.double() - b.double()).abs()
        i = int(d.nan_to_num(float("inf")).argmax())
        return f"max |a-b| = {d.reshape(-1)[i].item():.3g} at flat index {i}"
    ne = (a != b).reshape(-1).nonzero()
    return f"{len(ne)} elements differ, first at flat index {int(ne[0]) if len(ne) else -1}"


def verify_checkpoints(a: str | Path, b: str | Path, *, atol: float = 0.0, model_only: bool = False,
                       limit: int = 10, progress: Progress = lambda n: None) -> dict[str, tp.Any]:
    """Compare two checkpoints of any formats key by key; equal, and the first ``limit`` differences."""
    ra, rb = open_checkpoint(a), open_checkpoint(b)
    try:
        ka, kb = (set(selected_keys(r, model_only)) for r in (ra, rb))
        diffs = [f"{k}: only in A" for k in sorted(ka - kb)] + [f"{k}: only in B" for k in sorted(kb - ka)]
        for key in sorted(ka & kb):
            if len(diffs) >= limit:
                break
            problem = compare_values(ra.read(key), rb.read(key), atol)
            if problem:
                diffs.append(f"{key}: {problem}")
            progress(ra.entries[key].nbytes)
        count = len(diffs)
        return {"a": str(a), "b": str(b), "equal": count == 0, "compared": len(ka & kb), "atol": atol,
                "differences": diffs[:limit], "more": count > limit}
    finally:
        ra.close()
        rb.close()


def largest(entries: tp.Iterable[Entry]) -> int:
    return max((e.nbytes for e in entries if e.is_tensor), default=0)
