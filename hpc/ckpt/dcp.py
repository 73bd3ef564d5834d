"""DCP folders (``.metadata`` + ``*.distcp``), read through their metadata one chunk at a time.

Each stored item is a ``torch.save`` blob at ``(file, offset, length)`` given by the
metadata. ``DcpReader`` reads those blobs itself, chunk by chunk, after checking that every
referenced file is present and long enough. ``write_dcp`` writes one shard file plus
``.metadata``, the layout a single-rank ``dcp.save`` makes.
"""

from __future__ import annotations

import os
import pickle
import typing as tp
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from hpc import compat
from hpc.ckpt.entries import MAX_LISTED, Entry, Progress, Reader, default_paths, owned, raise_problems, tensor_entry
from hpc.ckpt.outputs import commit, fresh
from hpc.ckpt.safe_pickle import METADATA_FILE, load_dcp_metadata
from hpc.ckpt.torch_zip import FileSlice, TorchZip, Unsupported
from hpc.errors import CheckpointError

SHARD_FILE = "__0_0.distcp"


def dcp_problems(path: str | Path, metadata: dcp_md.Metadata | None = None) -> list[str]:
    """Why the DCP folder at ``path`` cannot be trusted (empty when every referenced byte is there)."""
    path = Path(path)
    try:
        metadata = metadata or load_dcp_metadata(path)
    except CheckpointError as exc:
        return exc.messages
    needed: dict[str, int] = {}
    problems = []
    for index, info in metadata.storage_data.items():
        if not isinstance(info, compat.storage_info_type()):
            return [f"{path / METADATA_FILE}: storage entry for {index.fqn!r} is a {type(info).__name__}, "
                    "expected FileSystemWriter's _StorageInfo"]
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return [f"{path / METADATA_FILE}: {index.fqn!r} points outside the folder ({name!r})"]
        if info.transform_descriptors:
            problems.append(f"{path / name}: {index.fqn!r} uses stream transforms {info.transform_descriptors}, "
                            "which hpcx does not read")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{file}: missing; .metadata expects a shard file of at least {size} bytes")
        elif file.stat().st_size < size:
            problems.append(f"{file}: truncated to {file.stat().st_size} bytes; .metadata expects at least {size}")
    problems += _unindexed(path, metadata)
    return problems


def _unindexed(path: Path, metadata: dcp_md.Metadata) -> list[str]:
    """Keys of the metadata whose chunks have no storage entry."""
    stored = {(i.fqn, tuple(i.offset) if i.offset is not None else None) for i in metadata.storage_data}
    missing = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, dcp_md.TensorStorageMetadata):
            missing += [key for c in md.chunks if (key, tuple(c.offsets)) not in stored]
        elif (key, None) not in stored:
            missing.append(key)
    return [f"{path / METADATA_FILE}: no storage entry for {k!r}" for k in missing[:MAX_LISTED]]


class DcpReader:
    """A DCP folder read through its metadata, one stored chunk at a time."""

    format = "dcp"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata = load_dcp_metadata(self.path)
        raise_problems(dcp_problems(self.path, self.metadata))
        self.storage: dict[tuple[str, tuple | None], tp.Any] = {
            (i.fqn, tuple(i.offset) if i.offset is not None else None): s
            for i, s in self.metadata.storage_data.items()}
        self.entries = {k: self._entry(k, md) for k, md in self.metadata.state_dict_metadata.items()}
        planner_data = self.metadata.planner_data
        self.paths = {**default_paths(self.entries),
                      **(planner_data if isinstance(planner_data, dict) else {})}
        self.files: dict[str, tp.BinaryIO] = {}
        self.meta = self._read_meta()

    def _entry(self, key: str, md: tp.Any) -> Entry:
        if isinstance(md, dcp_md.TensorStorageMetadata):
            return tensor_entry(key, md.properties.dtype, md.size)
        info = self.storage[(key, None)]
        return Entry(key, None, None, info.length)

    def _read_meta(self) -> dict[str, tp.Any]:
        keys = [k for k in self.entries if k.startswith("meta.") and not self.entries[k].is_tensor]
        return {k[len("meta."):]: self.read(k) for k in keys}

    def _file(self, info: tp.Any) -> tp.BinaryIO:
        f = self.files.get(info.relative_path)
        if f is None:
            f = self.files[info.relative_path] = open(self.path / info.relative_path, "rb", buffering=0)
        return f

    def _tensor(self, info: tp.Any) -> torch.Tensor:
        """A stored tensor, read from its zip record into a fresh tensor (torch.load for other layouts)."""
        try:
            z = TorchZip(self._file(info), f"{self.path / info.relative_path} (item at byte {info.offset})",
                         info.offset, info.length)
            ref = z.ref(z.obj) if isinstance(z.obj, torch.Tensor) else None
            if ref is not None:
                return z.read(ref)
        except Unsupported:
            pass
        return self._blob(info)

    def _blob(self, info: tp.Any) -> tp.Any:
        f = self._file(info)
        try:
            return torch.load(FileSlice(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError([f"{self.path / info.relative_path}: refused a stored object at byte "
                               f"{info.offset}: {str(exc).splitlines()[0]}"]) from None
        except Exception as exc:
            raise CheckpointError([f"{self.path / info.relative_path}: unreadable item at byte {info.offset} "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"]) from None

    def read(self, key: str) -> tp.Any:
        """The whole value of ``key``; a sharded tensor is assembled chunk by chunk into one buffer."""
        md = self.metadata.state_dict_metadata[key]
        if not isinstance(md, dcp_md.TensorStorageMetadata):
            return self._blob(self.storage[(key, None)])
        if len(md.chunks) == 1 and tuple(md.chunks[0].sizes) == tuple(md.size):
            return self._tensor(self.storage[(key, tuple(md.chunks[0].offsets))])
        out = torch.empty(md.size, dtype=md.properties.dtype)
        for chunk in md.chunks:
            part = self._tensor(self.storage[(key, tuple(chunk.offsets))])
            view = out
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, o, s)
            view.copy_(part)
            del part
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


def _dcp_item(f: tp.BinaryIO, key: str, value: tp.Any) -> tuple[tp.Any, dcp_md.MetadataIndex, tp.Any]:
    """Write one value as a torch.save blob; its DCP metadata, index and storage info."""
    offset = f.tell()
    if isinstance(value, torch.Tensor):
        value = owned(value)
        torch.save(value, f)
        zeros = [0] * value.dim()
        md: tp.Any = dcp_md.TensorStorageMetadata(
            dcp_md.TensorProperties(dtype=value.dtype), value.size(),
            [dcp_md.ChunkStorageMetadata(offsets=torch.Size(zeros), sizes=value.size())])
        index = dcp_md.MetadataIndex(key, zeros, 0)
    else:
        torch.save(value, f)
        md, index = dcp_md.BytesStorageMetadata(), dcp_md.MetadataIndex(key)
    return md, index, compat.storage_info(SHARD_FILE, offset, f.tell() - offset)


def write_dcp(reader: Reader, dst: Path, keys: list[str], progress: Progress = lambda n: None) -> Path:
    """A one-shard DCP folder at ``dst`` holding ``keys`` of ``reader``, one tensor in memory at a time."""
    tmp = fresh(dst)
    tmp.mkdir()
    state_md, storage = {}, {}
    with open(tmp / SHARD_FILE, "wb") as f, compat.crc32_off():  # as hpcx's DCP saves
        for key in keys:
            state_md[key], index, storage[index] = _dcp_item(f, key, reader.read(key))
            progress(reader.entries[key].nbytes)
        f.flush()
        os.fsync(f.fileno())
    metadata = dcp_md.Metadata(state_md, planner_data={k: reader.paths[k] for k in keys},
                               storage_data=storage, storage_meta=dcp_md.StorageMeta(),
                               version=dcp_fs.CURRENT_DCP_VERSION)
    with open(tmp / METADATA_FILE, "wb") as f:
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())
    return commit(tmp, dst)
