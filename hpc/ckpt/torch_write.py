"""Write ``torch.save`` archives one tensor at a time.

``torch.save`` needs every tensor in memory before it writes the first byte. ``TorchWriter``
writes the same archive (the records ``torch.save`` writes, in its order, through torch's own
zip writer) from a *layout*: the object to save with each tensor replaced by a ``Stored``
placeholder (dtype and shape only; a real tensor inside a Python object is written from
memory). ``data.pkl`` is pickled from the layout first; then each placeholder's bytes are
written as its storage record, filled by the caller into a reusable scratch buffer. Memory holds one tensor at a time, and ``torch.load``
(``weights_only=True``) reads the result as the dict of plain tensors it describes; the
pickle is byte for byte the one ``torch.save`` writes for that dict (tests/test_compat.py).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import pickle
import sys
import typing as tp

import torch

from hpc import compat
from hpc.ckpt.entries import Scratch, owned
from hpc.ckpt.outputs import stops_deferred
from hpc.ckpt.torch_zip import legacy_storage_dtypes

PICKLE_PROTOCOL = 2  # torch.save's default


@dataclasses.dataclass(frozen=True)
class Stored:
    """A tensor to be written later: what the reader calls it, its dtype and shape."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


class _Storage:
    """A storage record in the making: its key in the archive, what it holds, and its bytes when
    they are already in memory (a tensor inside a Python object of the layout)."""

    def __init__(self, key: str, stored: Stored, data: torch.Tensor | None = None):
        self.key, self.stored, self.data = key, stored, data


@functools.cache
def _storage_classes() -> dict[torch.dtype, tp.Any]:
    """dtype -> ``torch.FloatStorage`` & co., the classes torch.save names for "v2" tensors."""
    names = {dtype: name for name, dtype in legacy_storage_dtypes().items() if name != "Storage"}
    return {dtype: getattr(torch, name) for dtype, name in names.items()}


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for s in reversed(shape):
        out.append(step)
        step *= max(s, 1)
    return tuple(reversed(out))


class _LayoutPickler(pickle.Pickler):
    """Pickles a layout as torch.save pickles the tensors it stands for (plain contiguous tensors)."""

    def __init__(self, buf: io.BytesIO, storages: list[_Storage]):
        super().__init__(buf, protocol=PICKLE_PROTOCOL)
        self.storages = storages

    def persistent_id(self, obj: tp.Any) -> tp.Any:
        if not isinstance(obj, _Storage):
            return None
        dtype = obj.stored.dtype
        cls = _storage_classes().get(dtype)
        if cls is None:  # dtypes without a legacy storage class: an untyped storage counted in bytes
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.stored.nbytes)
        numel = obj.stored.nbytes // dtype.itemsize
        return ("storage", cls, obj.key, "cpu", numel)

    def reducer_override(self, obj: tp.Any) -> tp.Any:
        data = None
        if isinstance(obj, torch.Tensor):  # a tensor inside an object: written from memory
            if obj.layout != torch.strided or obj.is_quantized:
                raise TypeError(f"cannot stream a {obj.layout} tensor")
            data = owned(obj)
            obj = Stored("", data.dtype, tuple(data.shape))
        elif not isinstance(obj, Stored):
            return NotImplemented
        storage = _Storage(str(len(self.storages)), obj, data)
        self.storages.append(storage)
        args: tuple = (storage, 0, obj.shape, _strides(obj.shape), False, collections.OrderedDict())
        if obj.dtype in _storage_classes():
            return compat.rebuild_function(compat.REBUILD_TENSOR_V2), args
        return compat.rebuild_function(compat.REBUILD_TENSOR_V3), args + (obj.dtype,)


class Sink:
    """A binary file as torch's C++ zip writer sees it: a write that fails is remembered, not raised
    into the C++ writer (an exception there, or in its destructor, which writes the end records of
    an unfinished archive, aborts the process); ``check`` raises it once torch has returned."""

    def __init__(self, f: tp.Any):
        self.f = f
        self.error: BaseException | None = None

    def write(self, data: tp.Any) -> int:
        if self.error is None:
            try:
                self.f.write(data)
            except BaseException as exc:  # noqa: BLE001  (re-raised by check)
                self.error = exc
        return memoryview(data).nbytes

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        if self.error is None:
            self.write(b"")

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class TorchWriter:
    """One ``torch.save`` archive written from a layout, tensor by tensor.

    ``f`` is a path (the archive is named after it, as ``torch.save(obj, path)`` names it) or
    an open binary file (named ``archive``; DCP shard files hold one such archive per item).
    ``crc32`` as ``torch.save`` would (torch's setting) unless False.
    """

    def __init__(self, f: tp.BinaryIO | Sink, layout: tp.Any, *, crc32: bool | None = None):
        import torch.utils.serialization as ts_config

        crc = torch.serialization.get_crc32_options() if crc32 is None else crc32
        buf = io.BytesIO()
        self.storages: list[_Storage] = []
        _LayoutPickler(buf, self.storages).dump(layout)
        data = buf.getvalue()
        alignment = ts_config.config.save.storage_alignment
        self.sink = f if isinstance(f, Sink) else Sink(f)
        self.finished = False
        with stops_deferred():
            self.zip: tp.Any = compat.torch_file_writer(self.sink, crc, alignment)
        try:
            self._record("data.pkl", data, len(data))
            self._record(".format_version", "1", 1)
            self._record(".storage_alignment", str(alignment), len(str(alignment)))
            self._record("byteorder", sys.byteorder, len(sys.byteorder))
        except BaseException:
            self.close()
            raise

    def _record(self, name: str, data: tp.Any, size: int) -> None:
        with stops_deferred():
            self.zip.write_record(name, data, size)
        self.sink.check()

    def write_storages(self, fill: tp.Callable[[Stored, torch.Tensor], None], scratch: Scratch,
                       progress: tp.Callable[[int], None] = lambda n: None, source: str = "") -> None:
        """Every storage record in archive order; ``fill(stored, out)`` fills ``out`` (a view of
        ``scratch`` of the stored dtype and shape) with a placeholder's bytes (``source`` names
        where they come from, for messages)."""
        for index, storage in enumerate(self.storages):
            data = storage.data
            if data is None:
                where = f"{source}: tensor {storage.stored.key!r}" if source else f"tensor {storage.stored.key!r}"
                data = scratch.view(storage.stored.dtype, storage.stored.shape, where)
                fill(storage.stored, data)
            self.write(index, data)
            progress(storage.stored.nbytes)

    def write(self, index: int, data: torch.Tensor) -> None:
        """Storage record ``index`` (archive order) from ``data``: a contiguous CPU tensor that
        starts its storage (a view of the start of a scratch buffer is fine)."""
        storage = self.storages[index]
        if data.nbytes != storage.stored.nbytes:
            raise ValueError(f"record {storage.key}: got {data.nbytes} bytes, expected {storage.stored.nbytes}")
        if not data.nbytes:
            self._record(f"data/{storage.key}", b"", 0)
            return
        whole = data.untyped_storage()
        if not data.is_contiguous() or data.data_ptr() != whole.data_ptr():
            raise ValueError(f"record {storage.key}: needs contiguous bytes at the start of a storage")
        # the first ``nbytes`` of the storage: a scratch buffer may be longer than this tensor
        self._record(f"data/{storage.key}", whole, data.nbytes)

    def finish(self) -> None:
        """Write the end records (``version``, the serialization id) and the zip directory."""
        with stops_deferred():
            self.finished = True  # torch marks its writer finalized even when this raises
            self.zip.write_end_of_file()
        self.sink.check()

    def close(self) -> None:
        """Drop torch's writer. Unfinished, its destructor would write the end records through ``Sink.write``
        and abort the process on any error there (a C++ exception in a destructor); writing them here
        first, an error is a Python one, ignored (the archive is being discarded), and the writer is
        marked finalized, so its destructor writes nothing."""
        if self.zip is None:
            return
        with stops_deferred():
            if not self.finished:
                self.finished = True
                try:
                    self.zip.write_end_of_file()
                except Exception:  # noqa: BLE001  (an abandoned archive: whatever its end records do)
                    pass
            self.zip = None
