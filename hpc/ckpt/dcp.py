"""DCP folders (``.metadata`` + ``*.distcp``), read through their metadata one chunk at a time.

Each stored item is a ``torch.save`` blob at ``(file, offset, length)`` given by the metadata.
Nothing in ``.metadata`` is trusted before ``dcp_problems`` has checked it: every entry's
dtype, size and chunks (chunks inside the tensor and tiling it exactly, no holes, no
overlaps), every storage record (a file name inside the folder, a byte range inside a file
long enough for it, no two items sharing bytes), a storage record for every chunk.
``DcpReader`` then reads each chunk's blob itself and refuses a blob whose tensor is not the
dtype and shape its chunk says; ``check_items`` does that for every blob without reading
tensor data (what ``hpcx ckpt inspect`` runs). ``write_dcp`` writes one shard file plus
``.metadata`` (the layout a single-rank ``dcp.save`` makes), and on request the shard's digest.
"""

from __future__ import annotations

import bisect
import math
import pickle
import typing as tp
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from hpc import compat
from hpc.ckpt.digests import HashingWriter, write_digest
from hpc.ckpt.entries import (Entry, Progress, Reader, Scratch, allocate, checked_object, checked_paths, default_paths,
                              dims, load_error, raise_problems, short_repr, tensor_entry)
from hpc.ckpt.files import not_regular, open_regular, relative_name_problem
from hpc.ckpt.outputs import describe, fsync_file, staged, stops_deferred
from hpc.ckpt.safe_pickle import METADATA_FILE, load_dcp_metadata
from hpc.ckpt.torch_write import Sink, Stored, TorchWriter
from hpc.ckpt.torch_zip import FileSlice, TorchZip, Unsupported, zip_load_problems
from hpc.core.errors import CheckpointError

SHARD_FILE = "__0_0.distcp"
MAX_COVERAGE_CELLS = 1 << 22  # a finer chunk grid is checked by volume only
MAX_CHUNKS = 1 << 20  # chunks of one tensor: one per rank that holds a piece of it


def index_offsets(index: tp.Any) -> tuple | None:
    """A MetadataIndex's chunk offsets as a tuple (None for a bytes item): the storage key's half."""
    return tuple(index.offset) if index.offset is not None else None


# ---------------------------------------------------------------- checking .metadata


def dcp_problems(path: str | Path, metadata: dcp_md.Metadata | None = None) -> list[str]:
    """Why the DCP folder at ``path`` cannot be trusted (empty when it can be read as it says)."""
    path = Path(path)
    try:
        metadata = metadata or load_dcp_metadata(path)
    except CheckpointError as exc:
        return exc.messages
    where = path / METADATA_FILE
    problems = [p for key, md in metadata.state_dict_metadata.items() for p in _entry_problems(where, key, md)]
    problems += _storage_record_problems(where, metadata)
    if problems:
        return problems  # the checks below assume well-formed entries and records
    return _unindexed(where, metadata) + _file_problems(path, metadata)


def _entry_problems(where: Path, key: tp.Any, md: tp.Any) -> list[str]:
    """A state-dict entry: a tensor with a dtype, a size and chunks that tile it, or bytes."""
    if not isinstance(key, str):
        return [f"{where}: entry key {short_repr(key)} is not a string"]
    if isinstance(md, dcp_md.BytesStorageMetadata):
        return []
    if not isinstance(md, dcp_md.TensorStorageMetadata):
        return [f"{where}: entry {key!r} is a {type(md).__name__}, expected tensor or bytes metadata"]
    dtype = getattr(md.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return [f"{where}: entry {key!r} has dtype {short_repr(dtype)}, expected a torch dtype"]
    size = dims(md.size)
    if size is None:
        return [f"{where}: entry {key!r} has size {short_repr(md.size)}, expected non-negative integers"]
    if not isinstance(md.chunks, (list, tuple)) or (not md.chunks and math.prod(size) > 0):
        return [f"{where}: entry {key!r} has no chunks"]
    if len(md.chunks) > MAX_CHUNKS:
        return [f"{where}: entry {key!r} has {len(md.chunks)} chunks, more than the {MAX_CHUNKS} a save of "
                "any world size writes"]
    for chunk in md.chunks:
        problem = _chunk_problem(size, chunk)
        if problem:
            return [f"{where}: entry {key!r} {problem}"]
    problem = _coverage_problem(size, [(dims(c.offsets), dims(c.sizes)) for c in md.chunks])  # type: ignore[misc]  # checked
    return [f"{where}: entry {key!r} {problem}"] if problem else []


def _chunk_problem(size: tuple[int, ...], chunk: tp.Any) -> str | None:
    if not isinstance(chunk, dcp_md.ChunkStorageMetadata):
        return f"has a chunk of type {type(chunk).__name__}"
    offsets, sizes = dims(chunk.offsets), dims(chunk.sizes)
    if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
        return (f"has a chunk at {short_repr(chunk.offsets)} of {short_repr(chunk.sizes)}, expected {len(size)} "
                "non-negative "
                "offsets and sizes")
    if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
        return f"has a chunk at {list(offsets)} of {list(sizes)} reaching outside its size {list(size)}"
    return None


def _coverage_problem(size: tuple[int, ...], boxes: list[tuple[tuple, tuple]]) -> str | None:
    """None when the boxes (offsets, sizes) tile ``size`` exactly, else what is wrong."""
    numel = math.prod(size)
    volume = sum(math.prod(s) for _, s in boxes)
    if numel == 0:
        return None
    if volume < numel:
        return (f"chunks hold {volume} of its {numel} elements; the rest would read as "
                "uninitialized memory")
    cuts = [sorted({0, d, *(o[i] for o, _ in boxes), *(o[i] + s[i] for o, s in boxes)}) for i, d in enumerate(size)]
    if math.prod(len(c) - 1 for c in cuts) > MAX_COVERAGE_CELLS:
        return None if volume == numel else f"chunks overlap ({volume} elements held for {numel})"
    count = torch.zeros([len(c) - 1 for c in cuts], dtype=torch.int32)
    for offsets, sizes in boxes:
        cells = tuple(slice(bisect.bisect_left(c, o), bisect.bisect_left(c, o + s))
                      for c, o, s in zip(cuts, offsets, sizes))
        count[cells] += 1
    for bad, what in ((count == 0, "no chunk holds the element"), (count > 1, "chunks overlap at element")):
        if bool(bad.any()):
            cell = [int(i) for i in bad.nonzero()[0]]
            return f"{what} at index {[c[i] for c, i in zip(cuts, cell)]}"
    return None


def _storage_record_problems(where: Path, metadata: dcp_md.Metadata) -> list[str]:
    """Every storage record: a MetadataIndex mapped to a byte range of a file inside the folder."""
    info_type, problems = compat.storage_info_type(), []
    for index, info in metadata.storage_data.items():
        if not isinstance(index, dcp_md.MetadataIndex) or not isinstance(index.fqn, str):
            problems.append(f"{where}: storage record key {short_repr(index)} is not a MetadataIndex")
            continue
        if not isinstance(info, info_type):
            problems.append(f"{where}: storage record for {index.fqn!r} is a {type(info).__name__}, "
                            "expected FileSystemWriter's _StorageInfo")
            continue
        name = info.relative_path
        if (why := relative_name_problem(name)) is not None:
            problems.append(f"{where}: {index.fqn!r} {why} ({short_repr(name)})")
        elif dims((info.offset, info.length)) is None:
            problems.append(f"{where}: {index.fqn!r} has byte range offset={short_repr(info.offset)} "
                            f"length={short_repr(info.length)}, "
                            "expected non-negative integers")
        elif info.transform_descriptors:
            problems.append(f"{where}: {index.fqn!r} uses stream transforms {short_repr(info.transform_descriptors)}, "
                            "which hpcx does not read")
    return problems


def _unindexed(where: Path, metadata: dcp_md.Metadata) -> list[str]:
    """Entries (or chunks) with no storage record: nothing says where their bytes are."""
    stored = {(i.fqn, index_offsets(i)) for i in metadata.storage_data}
    missing = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, dcp_md.TensorStorageMetadata):
            missing += [f"{key!r} chunk at {list(c.offsets)}" for c in md.chunks
                        if math.prod(c.sizes) and (key, tuple(c.offsets)) not in stored]
        elif (key, None) not in stored:
            missing.append(repr(key))
    return [f"{where}: no storage record for {k}" for k in missing] + _unbacked(where, metadata)


def _unbacked(where: Path, metadata: dcp_md.Metadata) -> list[str]:
    """Chunks that declare more bytes than their stored item holds: a blob of a tensor holds at
    least the tensor's bytes, so such a chunk is a lie, refused before anything allocates it."""
    problems, stored = [], {(i.fqn, index_offsets(i)): info for i, info in metadata.storage_data.items()}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, dcp_md.TensorStorageMetadata):
            continue
        for c in md.chunks:
            need = math.prod(c.sizes) * md.properties.dtype.itemsize
            info = stored.get((key, tuple(c.offsets))) if need else None
            if info is not None and need > info.length:
                problems.append(f"{where}: entry {key!r} chunk at {list(c.offsets)} declares {list(c.sizes)} "
                                f"{str(md.properties.dtype).removeprefix('torch.')}, {need} bytes, but its stored "
                                f"item holds {info.length} bytes")
    return problems


def _file_problems(path: Path, metadata: dcp_md.Metadata) -> list[str]:
    """Each referenced file present, long enough, and no two items sharing bytes."""
    per_file: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in metadata.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, index.fqn))
    problems = []
    for name, items in sorted(per_file.items()):
        file, end = path / name, max(e for _, e, _ in items)
        kind = not_regular(file, f"a shard file of at least {end} bytes (.metadata lists it)")
        if kind:
            problems.append(kind)
            continue
        size = file.stat().st_size
        if size < end:
            cut = sorted(k for b, e, k in items if e > size)
            more = f" and {len(cut) - 1} more" if len(cut) > 1 else ""
            problems.append(f"{file}: truncated to {size} bytes; .metadata expects at least {end} (item "
                            f"{cut[0]!r}{more} past the end)")
        items.sort()
        for (b0, e0, k0), (b1, _, k1) in zip(items, items[1:]):
            if b1 < e0:
                problems.append(f"{file}: items {k0!r} and {k1!r} overlap at bytes {b1}..{e0}")
    return problems


# ---------------------------------------------------------------- reading


def load_object(f: tp.BinaryIO, where: str) -> tp.Any:
    """``torch.load(weights_only=True)`` of one stored item; CheckpointError naming ``where`` when
    it is refused (a global outside torch's allow-list) or unreadable."""
    raise_problems(zip_load_problems(f, where))
    f.seek(0)
    try:
        with stops_deferred():  # torch's C++ zip reader calls f.read from C
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError([f"{where}: refused a stored object ({load_error(exc)})"]) from None
    except OSError as exc:
        raise CheckpointError([f"{where}: cannot read ({describe(exc)})"]) from None
    except Exception as exc:  # noqa: BLE001  (any other failure: an unreadable item)
        raise CheckpointError([f"{where}: unreadable item ({load_error(exc)})"]) from None


class DcpReader:
    """A DCP folder read through its checked metadata, one stored chunk at a time."""

    format = "dcp"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata = load_dcp_metadata(self.path)
        raise_problems(dcp_problems(self.path, self.metadata))
        self.storage = {(i.fqn, index_offsets(i)): s for i, s in self.metadata.storage_data.items()}
        self.key_of = {id(s): i.fqn for i, s in self.metadata.storage_data.items()}
        self.chunks = {(k, tuple(c.offsets)): c for k, md in self.metadata.state_dict_metadata.items()
                       if isinstance(md, dcp_md.TensorStorageMetadata) for c in md.chunks}
        self.entries = {k: self._entry(k, md) for k, md in self.metadata.state_dict_metadata.items()}
        source = f"{self.path / METADATA_FILE} planner_data"
        self.paths: dict[str, tuple] = default_paths(checked_paths(self.metadata.planner_data, source))
        self.files: dict[str, tp.BinaryIO] = {}
        self.meta = self._read_meta()

    def _entry(self, key: str, md: tp.Any) -> Entry:
        if isinstance(md, dcp_md.TensorStorageMetadata):
            return tensor_entry(key, md.properties.dtype, md.size)
        return Entry(key, None, None, self.storage[(key, None)].length)

    def _read_meta(self) -> dict[str, tp.Any]:
        keys = [k for k in self.entries if k.startswith("meta.") and not self.entries[k].is_tensor]
        return {k[len("meta."):]: self.read(k) for k in keys}

    def _file(self, info: tp.Any) -> tp.BinaryIO:
        f = self.files.get(info.relative_path)
        if f is None:
            f = self.files[info.relative_path] = open_regular(self.path / info.relative_path, "a DCP shard file")
        return f

    def _where(self, info: tp.Any) -> str:
        """Where a stored item is, for messages: its file, its key and its byte offset."""
        key = self.key_of.get(id(info), "?")
        return f"{self.path / info.relative_path} (item {key!r} at byte {info.offset})"

    def _blob(self, key: str, info: tp.Any) -> tuple[TorchZip | None, tp.Any]:
        """(the parsed blob, the ref of its tensor) or (None, None) for a layout TorchZip leaves
        to torch.load; CheckpointError when the blob is damaged or holds something else."""
        try:
            z = TorchZip(self._file(info), self._where(info), info.offset, info.length)
        except Unsupported:
            return None, None
        ref = z.ref(z.obj) if isinstance(z.obj, torch.Tensor) else None
        if ref is None:
            raise CheckpointError([f"{self._where(info)}: holds a {type(z.obj).__name__}, "
                                   ".metadata says a tensor"])
        return z, ref

    def _check_chunk(self, key: str, info: tp.Any, dtype: tp.Any, shape: tuple, chunk: tp.Any) -> None:
        if dtype != self.entries[key].dtype or tuple(shape) != tuple(chunk.sizes):
            raise CheckpointError([f"{self._where(info)}: chunk at {list(chunk.offsets)} holds "
                                   f"{str(dtype).removeprefix('torch.')}{list(shape)}, .metadata says "
                                   f"{str(self.entries[key].dtype).removeprefix('torch.')}{list(chunk.sizes)}"])

    def _object(self, info: tp.Any) -> tp.Any:
        where = self._where(info)
        return checked_object(load_object(FileSlice(self._file(info), info.offset, info.length), where), where)  # type: ignore[arg-type]

    def read(self, key: str) -> tp.Any:
        """The whole value of ``key``; a sharded tensor is assembled chunk by chunk into one buffer."""
        entry = self.entries[key]
        if not entry.is_tensor:
            return self._object(self.storage[(key, None)])
        assert entry.dtype is not None and entry.shape is not None  # a tensor entry
        out = allocate(entry.shape, entry.dtype, f"{self.path}: tensor {key!r}")
        self.read_into(key, out)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, the entry's dtype and shape) with tensor ``key``, chunk by chunk:
        straight from the file where the chunk's place in ``out`` is contiguous."""
        for chunk in self.metadata.state_dict_metadata[key].chunks:  # type: ignore[union-attr]  # a tensor's
            if math.prod(chunk.sizes) == 0:
                continue
            view = out
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, o, s)
            try:
                self._chunk_into(key, chunk, view)
            except OSError as exc:
                info = self.storage[(key, tuple(chunk.offsets))]
                raise CheckpointError([f"{self._where(info)}: cannot read ({describe(exc)})"]) from None

    def _chunk_into(self, key: str, chunk: tp.Any, view: torch.Tensor) -> None:
        info = self.storage[(key, tuple(chunk.offsets))]
        z, ref = self._blob(key, info)
        if z is not None:
            self._check_chunk(key, info, ref.dtype, ref.size, chunk)
            if not (view.is_contiguous() and z.readinto(ref, view)):
                view.copy_(z.read(ref))
            return
        value = self._object(info)
        if not isinstance(value, torch.Tensor):
            raise CheckpointError([f"{self._where(info)}: holds a {type(value).__name__}, "
                                   ".metadata says a tensor"])
        self._check_chunk(key, info, value.dtype, tuple(value.shape), chunk)
        view.copy_(value)

    def read_request(self, key: str, chunk_offsets: tuple, offsets: tp.Sequence[int], lengths: tp.Sequence[int],
                     target: torch.Tensor) -> None:
        """Fill ``target`` with the box at ``offsets`` of ``lengths`` inside the stored chunk of ``key``
        at ``chunk_offsets`` (a request of DCP's load plan): straight from the file when the box is
        the whole chunk and ``target`` matches it, else through a fresh tensor, narrowed."""
        chunk = self.chunks[(key, tuple(chunk_offsets))]
        info = self.storage[(key, tuple(chunk_offsets))]
        z, ref = self._blob(key, info)
        if z is not None:
            self._check_chunk(key, info, ref.dtype, ref.size, chunk)
            whole = all(o == 0 for o in offsets) and tuple(lengths) == ref.size
            if whole and target.is_contiguous() and z.readinto(ref, target):
                return
            tensor = z.read(ref)
        else:
            tensor = self._object(info)
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError([f"{self._where(info)}: holds a {type(tensor).__name__}, "
                                       ".metadata says a tensor"])
            self._check_chunk(key, info, tensor.dtype, tuple(tensor.shape), chunk)
        tensor = compat.narrow_tensor_by_index(tensor, offsets, lengths)
        if target.size() != tensor.size():
            raise CheckpointError([f"{self._where(info)}: holds {list(tensor.size())}, the model expects "
                                   f"{list(target.size())}"])
        target.copy_(tensor)

    def check_items(self) -> int:
        """Parse every stored blob (zip directory, pickle, records inside the item) and compare each
        tensor blob with its chunk, reading no tensor data; the number of items checked."""
        problems = []
        for key, md in self.metadata.state_dict_metadata.items():
            for chunk in md.chunks if isinstance(md, dcp_md.TensorStorageMetadata) else [None]:
                try:
                    self._check_item(key, chunk)
                except CheckpointError as exc:
                    problems += exc.messages
        raise_problems(problems)
        return len(self.storage)

    def _check_item(self, key: str, chunk: tp.Any) -> None:
        if chunk is None:
            info = self.storage[(key, None)]
            try:
                TorchZip(self._file(info), self._where(info), info.offset, info.length)
            except Unsupported:
                self._object(info)  # torch.load with weights_only: refuses what it does not admit
            return
        if math.prod(chunk.sizes) == 0:
            return
        info = self.storage[(key, tuple(chunk.offsets))]
        z, ref = self._blob(key, info)
        if z is None:
            value = self._object(info)
            ref = value if isinstance(value, torch.Tensor) else None
            if ref is None:
                raise CheckpointError([f"{self._where(info)}: holds a {type(value).__name__}, "
                                       ".metadata says a tensor"])
        self._check_chunk(key, info, ref.dtype, tuple(ref.size if z is not None else ref.shape), chunk)

    def shard_files(self) -> list[str]:
        """The file names the metadata references."""
        return sorted({info.relative_path for info in self.storage.values()})

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


# ---------------------------------------------------------------- writing


def _write_item(f: tp.Any, reader: Reader, entry: Entry, scratch: Scratch) -> tuple[tp.Any, tp.Any, tp.Any]:
    """Append one entry as a torch.save blob; its DCP metadata, index and storage record."""
    offset = f.tell()
    if entry.is_tensor:
        assert entry.dtype is not None and entry.shape is not None  # a tensor entry
        writer = TorchWriter(f, Stored(entry.key, entry.dtype, entry.shape), crc32=False)
        try:
            writer.write_storages(lambda stored, out: reader.read_into(stored.key, out), scratch,
                                  source=str(getattr(reader, "path", "")))
            writer.finish()
        finally:
            writer.close()
        zeros = [0] * len(entry.shape)
        md: tp.Any = dcp_md.TensorStorageMetadata(
            dcp_md.TensorProperties(dtype=entry.dtype), torch.Size(entry.shape),
            [dcp_md.ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=torch.Size(entry.shape))])
        index = dcp_md.MetadataIndex(entry.key, zeros, 0)
    else:
        sink = Sink(f)  # a failed write surfaces here, not inside torch's C++ writer
        value = reader.read(entry.key)
        with compat.crc32_off(), stops_deferred():  # as hpcx's DCP saves; torch's C++ writer calls sink.write
            torch.save(value, sink)  # type: ignore[arg-type]  # a file-like writer
        sink.check()
        md, index = dcp_md.BytesStorageMetadata(), dcp_md.MetadataIndex(entry.key)
    return md, index, compat.storage_info(SHARD_FILE, offset, f.tell() - offset)


def write_dcp(reader: Reader, dst: Path, keys: list[str], progress: Progress = lambda n: None,
              scratch: Scratch | None = None, *, digest: bool = False) -> Path:
    """A one-shard DCP folder at ``dst`` holding ``keys`` of ``reader``, one tensor in memory at a
    time (in ``scratch``); with ``digest`` the shard's SHA-256 beside it, hashed as it is written."""
    scratch = scratch or Scratch()
    with staged(dst, folder=True) as tmp:
        state_md, storage = {}, {}
        with open(tmp / SHARD_FILE, "wb") as raw:
            f: tp.Any = HashingWriter(raw) if digest else raw
            try:
                for key in keys:
                    state_md[key], index, storage[index] = _write_item(f, reader, reader.entries[key], scratch)
                    progress(reader.entries[key].nbytes)
            finally:
                if digest:
                    f.close()
            fsync_file(raw)
        if digest:
            write_digest(tmp / SHARD_FILE, f.hexdigest())
        metadata = dcp_md.Metadata(state_md, planner_data={k: reader.paths[k] for k in keys},
                                   storage_data=storage, storage_meta=dcp_md.StorageMeta(),
                                   version=dcp_fs.CURRENT_DCP_VERSION)
        with open(tmp / METADATA_FILE, "wb") as f:
            pickle.dump(metadata, f)
            fsync_file(f)
    return dst
