"""A single ``torch.save`` file, read one tensor at a time.

Read with ``TorchZip`` (hpc/ckpt/torch_zip.py): ``data.pkl`` through an allow-list
unpickler that records where each tensor's bytes are, then one tensor at a time from its
zip record. Layouts it does not handle (legacy non-zip files, big-endian,
quantized/sparse tensors) fall back to ``torch.load(weights_only=True, mmap=True)``.
Writing is streamed too: ``TorchWriter`` (hpc/ckpt/torch_write.py) pickles the nested dict from
the entries' dtypes and shapes, then writes one tensor record at a time.
"""

from __future__ import annotations

import pickle
import typing as tp
from pathlib import Path

import torch

from hpc import compat
from hpc.ckpt.entries import Entry, Progress, Reader, Scratch, load_error, tensor_entry, unflatten
from hpc.ckpt.outputs import describe, fsync_file, staged
from hpc.ckpt.torch_write import Stored, TorchWriter
from hpc.ckpt.torch_zip import TorchZip, Unsupported
from hpc.core.errors import CheckpointError

LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a"  # pickle protocol 2 + the 10-byte magic number of torch < 1.6 files


class TorchReader:
    """A ``torch.save`` file, streamed: ``data.pkl`` parsed by ``TorchZip``, tensors read one at a time.

    ``streamed`` is False when the file's layout needed the fallback, ``torch.load(weights_only=True)``
    (mapped with ``mmap=True`` when it is a zip): legacy non-zip files, big-endian data,
    quantized/sparse tensors, globals outside ``TorchZip``'s list that torch's own allow-list admits.
    """

    format = "torch"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.zip: TorchZip | None = None
        self.streamed, self.fallback_reason = True, ""
        with open(self.path, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"
        self.file = open(self.path, "rb", buffering=0)
        try:
            if not is_zip:
                raise Unsupported("not a zip (legacy torch.save format)")
            self.zip = TorchZip(self.file, str(self.path))
            obj = self.zip.obj
        except Unsupported as exc:
            self.streamed, self.fallback_reason, self.zip = False, str(exc), None
            obj = self._torch_load(is_zip)
        except BaseException:
            self.file.close()
            raise
        if not isinstance(obj, dict):
            self.close()
            raise CheckpointError([f"{self.path}: holds a {type(obj).__name__}, expected a state dict"])
        if not isinstance(obj.get("model"), dict):
            obj = {"model": obj}  # a plain model.state_dict()
        try:
            self.flat, self.paths = compat.flatten_state_dict(obj)
        except (ValueError, TypeError, KeyError) as exc:
            self.close()
            raise CheckpointError([f"{self.path}: its keys do not flatten to a state dict ({exc})"]) from None
        self.entries = {k: tensor_entry(k, v.dtype, v.shape) if isinstance(v, torch.Tensor) else Entry(k, None, None, 0)
                        for k, v in self.flat.items()}
        self.meta = {k[len("meta."):]: v for k, v in self.flat.items() if k.startswith("meta.")}

    def _torch_load(self, is_zip: bool) -> tp.Any:
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=is_zip)
        except pickle.UnpicklingError as exc:
            raise CheckpointError([f"{self.path}: refused by weights-only loading ({load_error(exc)})"]) from None
        except Exception as exc:
            raise CheckpointError([f"{self.path}: unreadable torch file ({load_error(exc)})"]) from None

    def _ref(self, key: str) -> tp.Any:
        value = self.flat[key]
        return self.zip.ref(value) if self.zip is not None and isinstance(value, torch.Tensor) else None

    def read(self, key: str) -> tp.Any:
        ref = self._ref(key)
        try:
            return self.zip.read(ref) if ref is not None else self.flat[key]  # type: ignore[union-attr]
        except OSError as exc:
            raise CheckpointError([f"{self.path}: cannot read {key!r} ({describe(exc)})"]) from None

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill the contiguous ``out`` with tensor ``key``: straight from its record when it is stored
        contiguously, else through a fresh tensor."""
        ref = self._ref(key)
        try:
            if ref is None or not self.zip.readinto(ref, out):  # type: ignore[union-attr]
                out.copy_(self.read(key))
        except OSError as exc:
            raise CheckpointError([f"{self.path}: cannot read {key!r} ({describe(exc)})"]) from None

    def close(self) -> None:
        self.flat = {}
        self.file.close()


def write_torch(reader: Reader, dst: Path, keys: list[str], *, model_only: bool,
                progress: Progress = lambda n: None, scratch: Scratch | None = None) -> Path:
    """One ``torch.save`` file (CRC32 as torch's setting says), written tensor by tensor: the
    nested dict is pickled from the entries' dtypes and shapes, then each tensor is read into
    ``scratch`` and written as its record."""
    scratch = scratch or Scratch()
    layout = {k: Stored(k, e.dtype, e.shape) if e.is_tensor else reader.read(k)
              for k, e in ((k, reader.entries[k]) for k in keys)}
    nested = unflatten(layout, reader.paths, str(getattr(reader, "path", "checkpoint")))
    obj = nested.get("model", {}) if model_only else nested
    with staged(dst) as tmp, open(tmp, "wb") as f:
        writer = TorchWriter(f, obj)
        writer.write_storages(lambda stored, out: reader.read_into(stored.key, out), scratch, progress)
        writer.finish()
        del writer
        fsync_file(f)
    return dst
