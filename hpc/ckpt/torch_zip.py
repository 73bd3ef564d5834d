"""Read ``torch.save`` zip archives one tensor at a time, without running code from them.

A ``torch.save`` file (and every tensor blob inside a DCP shard) is a zip of
stored (uncompressed) records: ``<root>/data.pkl`` (the pickled object, where
each storage is a persistent id) and one ``<root>/data/<key>`` record per
storage, its bytes aligned to 64. ``TorchZip`` parses the central directory
with ``zipfile``, unpickles ``data.pkl`` through ``TensorUnpickler`` — an
allow-list of what a state dict of tensors needs (``_rebuild_tensor_v2/v3``,
``_rebuild_parameter``, storage classes, dtypes, ``torch.Size``,
``OrderedDict``); any other global raises ``Unsupported`` before it is looked
up — and records for every tensor its storage key, dtype, element offset, size
and stride (``TensorRef``) without reading data. Each tensor is then read on
request straight from its record into a fresh buffer (``read``) or into an
existing tensor (``readinto``), or only rows ``[a, b)`` of a contiguous one in a
stored record (``readrows``), so memory holds one tensor at a time.

Record bytes are read by offset, never through ``zipfile``'s readers: like
``torch.load``, this does not check a stored record's CRC32 (hpcx writes DCP
shards with CRC32 off; see docs/checkpoints.md). A record that was deflated
(an archive re-zipped by a zip tool) is inflated a chunk at a time, and its
size and CRC32 are checked over the whole record; other methods, encryption,
a local header that disagrees with the directory, or a declared size deflate
cannot reach are refused. Every record a tensor needs is checked to lie
inside the archive before any data is read.

``Unsupported`` means "a layout this reader does not handle" (legacy non-zip
files, big-endian data, quantized/sparse tensors, a global outside the list):
callers fall back to ``torch.load(weights_only=True)``, which either loads it
safely or refuses it. ``CheckpointError`` means the archive is damaged.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import math
import pickle
import struct
import sys
import typing as tp
import warnings
import zipfile
import zlib

import torch

from hpc import compat
from hpc.ckpt.entries import allocate, short_repr
from hpc.core.errors import CheckpointError

MAX_PICKLE = 256 * 2**20  # a state dict's data.pkl is small; refuse absurd ones rather than read them
MAX_DEFLATE_RATIO = 1032  # deflate's largest expansion: one 258-byte match per 2 bits
ZIP_METHODS = {zipfile.ZIP_BZIP2: "bzip2", zipfile.ZIP_LZMA: "lzma", 93: "zstandard", 1: "shrink", 6: "implode",
               9: "deflate64", 98: "PPMd"}


class Unsupported(Exception):
    """A valid-looking archive in a layout this reader does not handle; fall back to torch.load."""


@dataclasses.dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: torch.dtype
    numel: int  # in elements of ``dtype``


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: storage record ``key``, and the view on it."""

    storage: StorageRef
    dtype: torch.dtype
    offset: int  # in elements of ``dtype``
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    def span(self) -> tuple[int, int]:
        """[first, last+1) element index of the storage this view touches."""
        if self.numel == 0:
            return self.offset, self.offset
        last = self.offset + sum((s - 1) * st for s, st in zip(self.size, self.stride))
        return self.offset, last + 1

    def is_contiguous(self) -> bool:
        expected, contiguous = 1, True
        for s, st in reversed(list(zip(self.size, self.stride))):
            if s != 1 and st != expected:
                contiguous = False
            expected *= s
        return contiguous


class StorageType:
    """A storage class a pickle names (``torch.FloatStorage`` & co.), reduced to its dtype."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _Refs:
    """Collects the TensorRefs created while unpickling; stands in each tensor by a meta tensor."""

    def __init__(self) -> None:
        self.by_id: dict[int, TensorRef] = {}

    def tensor(self, storage: tp.Any, offset: tp.Any, size: tp.Any, stride: tp.Any, dtype: torch.dtype,
               backward_hooks: tp.Any, metadata: tp.Any) -> torch.Tensor:
        if not isinstance(storage, StorageRef):
            raise Unsupported(f"tensor over a {type(storage).__name__}, expected a stored storage")
        if backward_hooks or metadata:
            raise Unsupported("tensor with backward hooks or conj/neg metadata")
        try:
            size_t, stride_t, off = tuple(int(s) for s in size), tuple(int(s) for s in stride), int(offset)
        except (TypeError, ValueError):
            raise Unsupported("tensor with non-integer size, stride or offset") from None
        if len(size_t) != len(stride_t) or off < 0 or any(s < 0 for s in size_t + stride_t):
            raise Unsupported(f"tensor view size={size_t} stride={stride_t} offset={off}")
        ref = TensorRef(storage, dtype, off, size_t, stride_t)
        if dtype.itemsize != storage.dtype.itemsize and storage.dtype != torch.uint8:
            raise Unsupported(f"tensor of {dtype} over a {storage.dtype} storage")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32: "ComplexHalf support is experimental"
            placeholder = torch.empty_strided(size_t, stride_t, dtype=dtype, device="meta")
        self.by_id[id(placeholder)] = ref
        return placeholder

    def v2(self, storage, offset, size, stride, requires_grad, backward_hooks, metadata=None):  # noqa: ANN001, ANN202
        dtype = storage.dtype if isinstance(storage, StorageRef) else None
        return self.tensor(storage, offset, size, stride, dtype, backward_hooks, metadata)  # type: ignore[arg-type]  # None: refused

    def v3(self, storage, offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):  # noqa: ANN001, ANN202
        if not isinstance(dtype, torch.dtype):
            raise Unsupported(f"tensor dtype {short_repr(dtype)}")
        return self.tensor(storage, offset, size, stride, dtype, backward_hooks, metadata)

    def parameter(self, data, requires_grad, backward_hooks):  # noqa: ANN001, ANN202
        if not isinstance(data, torch.Tensor) or id(data) not in self.by_id or backward_hooks:
            raise Unsupported("parameter that is not a plain stored tensor")
        return data


@functools.cache
def legacy_storage_dtypes() -> dict[str, torch.dtype]:
    """``FloatStorage`` -> torch.float32 & co.: the storage classes torch.save names in its pickles."""
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # touching TypedStorage classes warns that they are deprecated
        for name in dir(torch):
            if name.endswith("Storage") and not name.startswith(("Typed", "Untyped", "Q")):
                dtype = getattr(getattr(torch, name), "dtype", None)
                if isinstance(dtype, torch.dtype):
                    out[name] = dtype
    return out


class TensorUnpickler(pickle.Unpickler):
    """Unpickles a ``data.pkl`` admitting only what a state dict of tensors needs; no data is read."""

    def __init__(self, data: bytes, refs: _Refs):
        super().__init__(io.BytesIO(data))
        self.refs = refs
        self.allowed: dict[tuple[str, str], tp.Any] = {
            compat.REBUILD_TENSOR_V2: refs.v2,
            compat.REBUILD_TENSOR_V3: refs.v3,
            compat.REBUILD_PARAMETER: refs.parameter,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch", "Size"): torch.Size,
            ("torch.storage", "UntypedStorage"): StorageType(torch.uint8),
            ("torch", "UntypedStorage"): StorageType(torch.uint8),
        }

    def find_class(self, module: str, name: str) -> tp.Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(name, str) and name.isidentifier():
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
            if name in legacy_storage_dtypes():
                return StorageType(legacy_storage_dtypes()[name])  # torch.FloatStorage & co.
        raise Unsupported(f"pickle global {module}.{name}")

    def persistent_load(self, pid: tp.Any) -> tp.Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] in ("storage", b"storage")
                and isinstance(pid[1], StorageType) and isinstance(pid[4], int)):
            raise Unsupported(f"persistent id {short_repr(pid)}")
        key = pid[2].decode() if isinstance(pid[2], bytes) else pid[2]
        if not isinstance(key, str):
            raise Unsupported(f"storage key {short_repr(key)}")
        return StorageRef(key, pid[1].dtype, pid[4])


class TorchZip:
    """One ``torch.save`` archive at ``[base, base+length)`` of the open file ``f``, read lazily.

    ``obj`` is the unpickled object with every tensor replaced by a meta-device placeholder
    of the right dtype, shape and stride; ``ref(t)`` gives a placeholder's ``TensorRef``.
    Raises ``Unsupported`` (fall back to torch.load) or ``CheckpointError`` (damaged).
    """

    def __init__(self, f: tp.BinaryIO, source: str, base: int = 0, length: int | None = None):
        self.f, self.source, self.base = f, source, base
        whole = base == 0 and length is None
        if length is None:
            f.seek(0, 2)
            length = f.tell() - base
        self.length = length
        self.offsets: dict[str, int] = {}
        try:
            infos = zipfile.ZipFile(f if whole else FileSlice(f, base, length)).infolist()
        except zipfile.BadZipFile as exc:
            raise CheckpointError([f"{source}: not a complete torch.save zip, truncated or damaged ({exc})"]) from None
        pkl = [i for i in infos if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise Unsupported("no single <root>/data.pkl record (TorchScript or another zip)")
        self.root = pkl[0].filename[: -len("data.pkl")]
        self.records = {i.filename[len(self.root):]: i for i in infos if i.filename.startswith(self.root)}
        order = self._record_bytes("byteorder", 16) if "byteorder" in self.records else sys.byteorder.encode()
        if order.decode(errors="replace") != sys.byteorder:
            raise Unsupported(f"byte order {order!r}")
        refs = _Refs()
        try:
            self.obj = TensorUnpickler(self._record_bytes("data.pkl", MAX_PICKLE), refs).load()
        except Unsupported:
            raise
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001  (garbled pickle: many exception types)
            raise CheckpointError([f"{source}: unreadable data.pkl ({type(exc).__name__}: {exc})"]) from None
        self.refs = refs.by_id
        for ref in self.refs.values():  # every record is checked before any tensor is read
            self._check(ref)

    def ref(self, placeholder: torch.Tensor) -> TensorRef | None:
        return self.refs.get(id(placeholder))

    def _data_offset(self, name: str) -> tuple[int, int]:
        """(absolute file offset of the record's bytes, bytes stored: compressed ones when deflated)."""
        info = self.records.get(name)
        if info is None:
            raise CheckpointError([f"{self.source}: record {self.root}{name} is missing"])
        if name not in self.offsets:
            self.offsets[name] = self._local_header(name, info)
        start = self.offsets[name]
        if start + info.compress_size > self.length:
            raise CheckpointError([f"{self.source}: record {self.root}{name} ends at byte "
                                   f"{start + info.compress_size}, past the end ({self.length}); truncated"])
        return self.base + start, info.compress_size

    def _local_header(self, name: str, info: zipfile.ZipInfo) -> int:
        """Where the record's bytes start, after checking how they are stored (stored or deflated,
        not encrypted, the same method in the local header as in the directory, a possible ratio)."""
        where = f"{self.source}: record {self.root}{name}"
        if info.flag_bits & 0x1:
            raise CheckpointError([f"{where} is encrypted; a torch.save archive never is"])
        method = info.compress_type
        if method not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CheckpointError([f"{where} is compressed with {ZIP_METHODS.get(method, 'method')} ({method}); hpcx "
                                   "reads stored and deflated records only (torch.save writes stored ones)"])
        if method == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise CheckpointError([f"{where} is stored with {info.compress_size} bytes but declares {info.file_size}"])
        if method == zipfile.ZIP_DEFLATED and info.file_size > info.compress_size * MAX_DEFLATE_RATIO + 64:
            raise CheckpointError([f"{where} declares {info.file_size} bytes from {info.compress_size} deflated ones, "
                                   f"more than deflate can expand ({MAX_DEFLATE_RATIO}x); the directory lies"])
        self.f.seek(self.base + info.header_offset)
        head = self.f.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise CheckpointError([f"{where} has no local header at byte {info.header_offset} (damaged)"])
        (local_method,) = struct.unpack("<H", head[8:10])
        if local_method != method:
            raise CheckpointError([f"{where}: its local header says compression method {local_method}, the "
                                   f"directory says {method} (damaged or forged)"])
        n, m = struct.unpack("<HH", head[26:30])
        return info.header_offset + 30 + n + m

    def _record_bytes(self, name: str, limit: int) -> bytes:
        self._data_offset(name)
        size = self.records[name].file_size
        if size > limit:
            raise CheckpointError([f"{self.source}: record {self.root}{name} is implausibly large ({size} bytes)"])
        data = bytearray(size)
        self._fill(name, 0, memoryview(data))
        return bytes(data)

    def _check(self, ref: TensorRef) -> tuple[int, int]:
        """(absolute offset of the view's first byte, byte count of its span); CheckpointError if out of range.
        For a deflated record the offset is inside its inflated bytes (read through ``_fill``)."""
        pos, _ = self._data_offset(f"data/{ref.storage.key}")
        size = self.records[f"data/{ref.storage.key}"].file_size
        isz = ref.dtype.itemsize
        expected = ref.storage.numel * ref.storage.dtype.itemsize
        first, end = ref.span()
        if size != expected or end * isz > size:
            raise CheckpointError([f"{self.source}: record {self.root}data/{ref.storage.key} holds {size} bytes; "
                               f"the pickle expects {expected} (view up to byte {end * isz})"])
        return pos + first * isz, (end - first) * isz

    def _fill(self, name: str, first: int, view: memoryview) -> None:
        """Bytes ``[first, first+len(view))`` of record ``name`` into ``view``: read in place when stored,
        inflated (bounded memory, size and CRC-32 checked over the whole record) when deflated."""
        info = self.records[name]
        pos, stored = self._data_offset(name)
        if info.compress_type == zipfile.ZIP_STORED:
            read_exact(self.f, pos + first, view, self.source)
            return
        got, crc = inflate(self.f, pos, stored, first, view, info.file_size)
        if got != info.file_size or crc != info.CRC:
            raise CheckpointError([f"{self.source}: record {self.root}{name} inflates to {got} bytes with CRC-32 "
                                   f"{crc:08x}; its directory says {info.file_size} bytes, {info.CRC:08x} (corrupt)"])

    def read(self, ref: TensorRef) -> torch.Tensor:
        """A fresh tensor equal to what ``torch.load`` gives (same dtype, shape, stride and bytes)."""
        if ref.numel == 0:
            return torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype)
        pos, nbytes = self._check(ref)
        buf = allocate((nbytes // ref.dtype.itemsize,), ref.dtype)
        self._fill(f"data/{ref.storage.key}", ref.span()[0] * ref.dtype.itemsize, byte_view(buf))
        return buf if ref.is_contiguous() and buf.shape == ref.size else buf.as_strided(ref.size, ref.stride)

    def readinto(self, ref: TensorRef, out: torch.Tensor) -> bool:
        """Read straight into ``out`` when it is contiguous and matches; False (nothing read) otherwise."""
        if not (ref.is_contiguous() and out.is_contiguous() and out.dtype == ref.dtype
                and tuple(out.shape) == ref.size and out.device.type == "cpu"):
            return False
        if ref.numel:
            self._check(ref)
            self._fill(f"data/{ref.storage.key}", ref.span()[0] * ref.dtype.itemsize, byte_view(out))
        return True

    def readrows(self, ref: TensorRef, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows ``[start, stop)`` of dim 0 straight into ``out`` when the view is contiguous and its
        record stored (not deflated): one byte range, after ``_check`` of the whole view; False (nothing
        read) otherwise, or when ``out`` is not a contiguous CPU tensor of those rows."""
        rows, row = (ref.size[0], math.prod(ref.size[1:])) if ref.size else (1, 1)
        info = self.records.get(f"data/{ref.storage.key}")
        if not (0 <= start <= stop <= rows and ref.is_contiguous() and info is not None
                and info.compress_type == zipfile.ZIP_STORED and out.is_contiguous() and out.dtype == ref.dtype
                and out.device.type == "cpu" and out.numel() == (stop - start) * row):
            return False
        if out.numel():
            self._check(ref)
            first = (ref.span()[0] + start * row) * ref.dtype.itemsize
            self._fill(f"data/{ref.storage.key}", first, byte_view(out))
        return True

    def compressed(self) -> list[str]:
        """Names of the records that are not stored as is."""
        return [n for n, i in self.records.items() if i.compress_type != zipfile.ZIP_STORED]


INFLATE_CHUNK = 1 << 20


def inflate(f: tp.BinaryIO, pos: int, stored: int, first: int, view: memoryview, limit: int) -> tuple[int, int]:
    """Inflate the raw deflate stream of ``stored`` bytes at ``pos`` of ``f``, copying its bytes
    ``[first, first+len(view))`` into ``view``; (bytes it inflated to, their CRC-32). Memory stays at
    one chunk; it stops past ``limit`` bytes (the size the directory declares)."""
    d, crc, done, taken = zlib.decompressobj(-15), 0, 0, 0
    while not d.eof and done <= limit:
        data = d.unconsumed_tail
        if not data and taken < stored:
            f.seek(pos + taken)
            data = f.read(min(INFLATE_CHUNK, stored - taken))
            taken += len(data)
        try:
            out = d.decompress(data, INFLATE_CHUNK)
        except zlib.error:
            break
        if not out and not data:
            break
        crc = zlib.crc32(out, crc)
        lo, hi = max(done, first), min(done + len(out), first + len(view))
        if lo < hi:
            view[lo - first:hi - first] = out[lo - done:hi - done]
        done += len(out)
    return done, crc


class _Stub:
    """Whatever a scanned pickle builds, inert: calls, items and state go nowhere."""

    def __call__(self, *args: tp.Any, **kwargs: tp.Any) -> "_Stub":
        return _Stub()

    def __setitem__(self, key: tp.Any, value: tp.Any) -> None:
        pass

    def __setstate__(self, state: tp.Any) -> None:
        pass

    def append(self, value: tp.Any) -> None:
        pass

    def extend(self, values: tp.Any) -> None:
        pass


class StorageScan(pickle.Unpickler):
    """Reads a pickle only to list the storages it declares (zip and legacy persistent ids); every
    global is an inert stub, so nothing runs and nothing is allocated."""

    def __init__(self, f: tp.BinaryIO):
        super().__init__(f)
        self.storages: dict[tp.Any, int] = {}  # storage key -> declared bytes
        self.negative: list[int] = []

    def find_class(self, module: str, name: str) -> tp.Any:
        dtype = legacy_storage_dtypes().get(name) if module == "torch" else None
        if module in ("torch", "torch.storage") and name == "UntypedStorage":
            dtype = torch.uint8
        return StorageType(dtype) if dtype is not None else _Stub()

    def persistent_load(self, pid: tp.Any) -> tp.Any:
        if isinstance(pid, tuple) and len(pid) in (5, 6) and isinstance(pid[1], StorageType) \
                and isinstance(pid[4], int) and not isinstance(pid[4], bool):
            key = pid[2].decode(errors="replace") if isinstance(pid[2], bytes) else str(pid[2])
            if pid[4] < 0:
                self.negative.append(pid[4])
            self.storages[key] = max(self.storages.get(key, 0), pid[4] * pid[1].dtype.itemsize)
        return _Stub()


def zip_load_problems(f: tp.BinaryIO, source: str, base: int = 0, length: int | None = None) -> list[str]:
    """What ``torch.load`` of the archive at ``[base, base+length)`` would allocate but the file does
    not hold: it allocates each storage its data.pkl declares, then reads the record (inflating a
    deflated one whole). Empty when every record holds its declared bytes (or this is no archive)."""
    f.seek(0, 2)
    length = f.tell() - base if length is None else length
    try:
        z = zipfile.ZipFile(FileSlice(f, base, length))
        infos = {i.filename: i for i in z.infolist()}
        pkl = [n for n in infos if n.count("/") == 1 and n.endswith("/data.pkl")]
        if len(pkl) != 1 or infos[pkl[0]].file_size > MAX_PICKLE:
            return []
        scan = StorageScan(io.BytesIO(z.read(pkl[0])))
        scan.load()
    except Exception:  # noqa: BLE001  (not a readable archive or pickle: torch.load says why)
        return []
    root = pkl[0][: -len("data.pkl")]
    if scan.negative:
        return [f"{source}: data.pkl declares a storage of {scan.negative[0]} elements"]
    problems = []
    for key, nbytes in scan.storages.items():
        info = infos.get(f"{root}data/{key}")
        if info is not None and nbytes > info.file_size:
            problems.append(f"{source}: record {root}data/{key} holds {info.file_size} bytes; data.pkl declares "
                            f"{nbytes}; refused before torch.load allocates them")
        elif info is not None and info.file_size > info.compress_size * MAX_DEFLATE_RATIO + 64:
            problems.append(f"{source}: record {root}data/{key} declares {info.file_size} bytes from "
                            f"{info.compress_size} compressed ones, more than deflate can expand")
    return problems


class FileSlice(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset+length)`` of an open file (for ``zipfile``
    and ``torch.load``)."""

    def __init__(self, f: tp.BinaryIO, offset: int, length: int):
        super().__init__()
        self.f, self.start, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, min(self.length, {0: 0, 1: self.pos, 2: self.length}[whence] + pos))
        return self.pos

    def readinto(self, buf: tp.Any) -> int:
        view = memoryview(buf).cast("B")
        n = min(len(view), self.length - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(view[:n]) or 0  # type: ignore[attr-defined]  # a raw file (open_regular)
        self.pos += got
        return got


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # a buffer


def read_exact(f: tp.BinaryIO, pos: int, out: torch.Tensor | memoryview, source: str) -> None:
    """Fill the contiguous tensor (or byte view) ``out`` with the bytes at ``pos`` of ``f``; CheckpointError
    if the file ends."""
    view = out if isinstance(out, memoryview) else byte_view(out)
    f.seek(pos)
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])  # type: ignore[attr-defined]  # a raw file (open_regular) or a FileSlice
        if not got:
            raise CheckpointError([f"{source}: ends at byte {pos + done}, {len(view) - done} bytes short; truncated"])
        done += got
