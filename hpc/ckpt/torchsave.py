"""A single ``torch.save`` file, read one tensor at a time.

Read with ``TorchZip`` (hpc/ckpt/torch_zip.py): ``data.pkl`` through an allow-list
unpickler that records where each tensor's bytes are, then one tensor at a time from its
zip record (or only rows ``[a, b)`` of one, ``read_rows``, when it is contiguous in a stored record:
what ``checkpoint.init_from`` reads per rank). Layouts it does not handle (legacy non-zip files, big-endian,
quantized/sparse tensors) fall back to ``torch.load(weights_only=True, mmap=True)``.
Writing is streamed too: ``TorchWriter`` (hpc/ckpt/torch_write.py) pickles the nested dict from
the entries' dtypes and shapes, then writes one tensor record at a time.
"""

from __future__ import annotations

import pickle
import typing as tp
import zipfile
from pathlib import Path

import torch

from hpc import compat
from hpc.ckpt.entries import (Entry, Progress, Reader, Scratch, graph_problem, load_error, raise_problems,
                              tensor_entry, unflatten)
from hpc.ckpt.files import open_regular
from hpc.ckpt.outputs import describe, fsync_file, staged
from hpc.ckpt.torch_write import Stored, TorchWriter
from hpc.ckpt.torch_zip import StorageScan, TorchZip, Unsupported, zip_load_problems
from hpc.core.errors import CheckpointError

MAX_UNBACKED = 64 << 20  # bytes that stride-0 / overlapping views may add over their storages, file-wide


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
        self.flat: dict[str, tp.Any] = {}
        self.file = open_regular(self.path, "a torch.save file")
        try:
            obj = self._load()
            if not isinstance(obj, dict) or (problem := graph_problem(obj)):
                what = f"holds a {type(obj).__name__}" if not isinstance(obj, dict) else f"data.pkl {problem}"
                raise CheckpointError([f"{self.path}: {what}, expected a state dict"])
            self.flat, self.paths = self._flatten(obj if isinstance(obj.get("model"), dict) else {"model": obj})
            raise_problems(self._unbacked())
        except BaseException:
            self.close()
            raise
        self.entries = {k: tensor_entry(k, v.dtype, v.shape) if isinstance(v, torch.Tensor) else Entry(k, None, None, 0)
                        for k, v in self.flat.items()}
        self.meta = {k[len("meta."):]: v for k, v in self.flat.items() if k.startswith("meta.")}

    def _load(self) -> tp.Any:
        """The unpickled object: tensors as placeholders (``TorchZip``), or loaded by the fallback."""
        is_zip = self.file.read(4) == b"PK\x03\x04"
        try:
            if not is_zip:
                raise Unsupported("not a zip (legacy torch.save format)")
            self.zip = TorchZip(self.file, str(self.path))
            return self.zip.obj
        except Unsupported as exc:
            self.streamed, self.fallback_reason, self.zip = False, str(exc), None
            if is_zip and (packed := self._compressed()):
                raise CheckpointError([f"{self.path}: record {packed[0]} is compressed, in a layout hpcx does not "
                                       f"stream ({exc}); torch.load(mmap=True) would map its compressed bytes as "
                                       "tensor data"]) from None
            if not is_zip:
                raise_problems(legacy_problems(self.file, str(self.path)))
            return self._torch_load(is_zip)

    def _compressed(self) -> list[str]:
        self.file.seek(0)
        try:
            return [i.filename for i in zipfile.ZipFile(self.file).infolist() if i.compress_type != zipfile.ZIP_STORED]
        except zipfile.BadZipFile:
            return []

    def _flatten(self, obj: dict) -> tuple[dict, dict]:
        try:
            return compat.flatten_state_dict(obj)
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointError([f"{self.path}: its keys do not flatten to a state dict ({exc})"]) from None

    def _backed(self, value: torch.Tensor) -> int:
        """Bytes the file holds for the storage under tensor ``value`` (0 for a sparse one: its dense
        form, what a conversion writes, is all unbacked)."""
        ref = self.zip.ref(value) if self.zip is not None else None
        if ref is not None:
            return self.zip.records[f"data/{ref.storage.key}"].file_size  # type: ignore[union-attr]
        if value.layout != torch.strided:
            return 0
        return value.untyped_storage().nbytes()

    def _unbacked(self) -> list[str]:
        """Tensors whose views (stride 0, overlapping, sparse) hold more elements than the file stores
        for them, past ``MAX_UNBACKED`` bytes in all: reading them would allocate what the file does
        not hold. Quantized tensors, which no other format holds, are refused too."""
        excess, problems = {}, []
        for key, value in self.flat.items():
            if isinstance(value, torch.Tensor) and value.is_quantized:
                problems.append(f"{self.path}: tensor {key!r} is quantized ({value.dtype}); hpcx converts plain "
                                "tensors only (dequantize it first)")
            elif isinstance(value, torch.Tensor):
                need, held = value.numel() * value.element_size(), self._backed(value)
                if need > held:
                    excess[key] = (need, held, value)
        if sum(n - h for n, h, _ in excess.values()) <= MAX_UNBACKED:
            return problems
        return problems + [f"{self.path}: tensor {key!r} is {_view(value)}, {need} bytes, over "
                           + (f"a storage record of {held} bytes" if value.layout == torch.strided else
                              "only its stored values and indices")
                           + "; refused before allocating it" for key, (need, held, value) in excess.items()]

    def _torch_load(self, is_zip: bool) -> tp.Any:
        if is_zip:
            raise_problems(zip_load_problems(self.file, str(self.path)))
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=is_zip)
        except pickle.UnpicklingError as exc:
            raise CheckpointError([f"{self.path}: refused by weights-only loading ({load_error(exc)})"]) from None
        except Exception as exc:  # noqa: BLE001  (garbled file: torch.load raises many types)
            raise CheckpointError([f"{self.path}: unreadable torch file ({load_error(exc)})"]) from None

    def _ref(self, key: str) -> tp.Any:
        value = self.flat[key]
        return self.zip.ref(value) if self.zip is not None and isinstance(value, torch.Tensor) else None

    def read(self, key: str) -> tp.Any:
        ref = self._ref(key)
        value = self.flat[key]
        if isinstance(value, torch.Tensor) and value.layout != torch.strided:
            return value.to_dense()  # bounded by _unbacked; what every other format holds
        try:
            return self.zip.read(ref) if ref is not None else value  # type: ignore[union-attr]
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

    def read_rows(self, key: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows ``[start, stop)`` of tensor ``key`` into the contiguous ``out``, reading only their bytes,
        when the file was streamed and the tensor is contiguous in a stored record (``TorchZip.readrows``);
        False (nothing read) otherwise: the caller reads it whole."""
        ref = self._ref(key)
        try:
            return ref is not None and self.zip.readrows(ref, start, stop, out)  # type: ignore[union-attr]
        except OSError as exc:
            raise CheckpointError([f"{self.path}: cannot read {key!r} ({describe(exc)})"]) from None

    def close(self) -> None:
        self.flat = {}
        self.file.close()


def _view(t: torch.Tensor) -> str:
    """``a view of shape [..] stride [..] (a stride-0 or overlapping view)`` or ``a sparse_coo tensor of shape [..]``."""
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor of shape {list(t.shape)}"
    return f"a view of shape {list(t.shape)} stride {list(t.stride())} (a stride-0 or overlapping view)"


def legacy_problems(f: tp.BinaryIO, source: str) -> list[str]:
    """A legacy (torch < 1.6) file's storages against its size: ``torch.load`` allocates every
    storage its pickle declares before reading a byte of it, so a declared size the file cannot
    hold is refused here first."""
    size = f.seek(0, 2)
    f.seek(0)
    try:
        for _ in range(3):  # magic number, protocol version, system info
            pickle.Unpickler(f).load()
        scan = StorageScan(f)
        scan.load()
    except Exception as exc:  # noqa: BLE001  (garbled: torch.load reports it below)
        return [] if not isinstance(exc, RecursionError) else [f"{source}: legacy pickle nests too deep"]
    if scan.negative:
        return [f"{source}: its pickle declares a storage of {scan.negative[0]} elements; refused"]
    declared = sum(scan.storages.values())
    if declared <= size:
        return []
    return [f"{source}: its pickle declares storages of {declared} bytes in all; the file holds {size} "
            "(a legacy torch.save file whose sizes lie); refused before allocating them"]


def write_torch(reader: Reader, dst: Path, keys: list[str], *, model_only: bool,
                progress: Progress = lambda n: None, scratch: Scratch | None = None) -> Path:
    """One ``torch.save`` file (CRC32 as torch's setting says), written tensor by tensor: the
    nested dict is pickled from the entries' dtypes and shapes, then each tensor is read into
    ``scratch`` and written as its record."""
    scratch = scratch or Scratch()
    layout = {k: Stored(k, e.dtype, e.shape) if e.is_tensor else reader.read(k)  # type: ignore[arg-type]  # a tensor's
              for k, e in ((k, reader.entries[k]) for k in keys)}
    nested = unflatten(layout, reader.paths, str(getattr(reader, "path", "checkpoint")))
    obj = nested.get("model", {}) if model_only else nested
    with staged(dst) as tmp, open(tmp, "wb") as f:
        writer = TorchWriter(f, obj)
        try:
            writer.write_storages(lambda stored, out: reader.read_into(stored.key, out), scratch, progress,
                                  str(getattr(reader, "path", "")))
            writer.finish()
        finally:
            writer.close()
        fsync_file(f)
    return dst
