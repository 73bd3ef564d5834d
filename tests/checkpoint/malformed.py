"""Builders of checkpoint files that are torn, damaged or lie about themselves, for tests.

Everything is written by hand into a test's tmp_path: safetensors files from a header object
and raw bytes, DCP folders by ``dcp.save`` and then edited (metadata rewritten, bytes of a shard
overwritten in place at the same length), hand-built sharded DCP entries, planted pickles.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import typing as tp
import zipfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from hpc import compat

ST_NAME = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
           torch.uint8: "U8", torch.bool: "BOOL", torch.int32: "I32", torch.float64: "F64"}


# ---------------------------------------------------------------- safetensors


def st_bytes(header: tp.Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    """A safetensors file: ``header`` (an object dumped as JSON, or raw bytes) and ``data``;
    ``length`` overrides the 8-byte header length."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def write_st(path: Path, header: tp.Any, data: bytes = b"", *, length: int | None = None) -> Path:
    path.write_bytes(st_bytes(header, data, length=length))
    return path


def entry(dtype: str = "F32", shape: tp.Any = (1,), offsets: tp.Any = (0, 4)) -> dict:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets}


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def st_layout(tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> tuple[dict, bytes]:
    """(header, data) of a valid file holding ``tensors`` in order."""
    header: dict[str, tp.Any] = {"__metadata__": metadata} if metadata is not None else {}
    data, pos = b"", 0
    for name, t in tensors.items():
        raw = tensor_bytes(t)
        header[name] = entry(ST_NAME[t.dtype], tuple(t.shape), (pos, pos + len(raw)))
        data, pos = data + raw, pos + len(raw)
    return header, data


def valid_st(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Path:
    header, data = st_layout(tensors, metadata)
    return write_st(path, header, data)


def st_index(folder: Path, weight_map: tp.Any, shards: dict[str, dict[str, torch.Tensor]] | None = None,
             *, raw: str | None = None) -> Path:
    """A folder of safetensors shards plus an index whose weight_map is ``weight_map`` (anything)."""
    folder.mkdir(exist_ok=True)
    for name, tensors in (shards or {}).items():
        valid_st(folder / name, tensors)
    text = raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)
    return folder


# ---------------------------------------------------------------- DCP


def dcp_save(path: Path, state: dict) -> Path:
    """A real single-process DCP folder holding ``state``."""
    dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def read_metadata(path: Path) -> dcp_md.Metadata:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own file


def write_metadata(path: Path, metadata: tp.Any) -> None:
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def edit_metadata(path: Path, edit: tp.Callable[[dcp_md.Metadata], None]) -> Path:
    """Rewrite ``.metadata`` after ``edit`` changed it in place."""
    metadata = read_metadata(path)
    edit(metadata)
    write_metadata(path, metadata)
    return path


def record(metadata: dcp_md.Metadata, key: str, offsets: tp.Sequence[int] | None = None) -> tuple[tp.Any, tp.Any]:
    """(index, storage info) of ``key`` (its chunk at ``offsets``; the first chunk by default)."""
    for index, info in metadata.storage_data.items():
        if index.fqn == key and (offsets is None or tuple(index.offset) == tuple(offsets)):
            return index, info
    raise KeyError(key)


def item_bytes(path: Path, key: str) -> tuple[Path, int, int]:
    """(file, offset, length) of ``key``'s first stored item."""
    _, info = record(read_metadata(path), key)
    return path / info.relative_path, info.offset, info.length


def sharded_dcp(path: Path, tensors: dict[str, tuple[torch.Tensor, list[tuple[tuple, tuple]]]],
                objects: dict[str, tp.Any] | None = None) -> Path:
    """A DCP folder whose tensors are stored as the given chunks ``(offsets, sizes)``, one blob each,
    in one shard file, as a multi-rank save would lay them out."""
    path.mkdir()
    state_md, storage = {}, {}
    with open(path / "__0_0.distcp", "wb") as f:
        for key, (t, chunks) in tensors.items():
            metas = []
            for offsets, sizes in chunks:
                part = t
                for dim, (o, s) in enumerate(zip(offsets, sizes)):
                    part = part.narrow(dim, o, s)
                start = f.tell()
                torch.save(part.clone(), f)
                index = dcp_md.MetadataIndex(key, torch.Size(offsets), 0)
                storage[index] = compat.storage_info("__0_0.distcp", start, f.tell() - start)
                metas.append(dcp_md.ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            state_md[key] = dcp_md.TensorStorageMetadata(dcp_md.TensorProperties(dtype=t.dtype), t.shape, metas)
        for key, value in (objects or {}).items():
            start = f.tell()
            torch.save(value, f)
            storage[dcp_md.MetadataIndex(key)] = compat.storage_info("__0_0.distcp", start, f.tell() - start)
            state_md[key] = dcp_md.BytesStorageMetadata()
    write_metadata(path, dcp_md.Metadata(state_md, storage_data=storage, storage_meta=dcp_md.StorageMeta(),
                                         version=dcp_fs.CURRENT_DCP_VERSION))
    return path


def overwrite(file: Path, at: int, data: bytes) -> None:
    """Overwrite bytes of ``file`` in place: same length, so size checks cannot see it."""
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(data)


def find_in_item(file: Path, offset: int, length: int, needle: bytes, last: bool = True) -> int:
    """Absolute position of ``needle`` inside the item ``[offset, offset+length)`` of ``file``."""
    blob = file.read_bytes()[offset:offset + length]
    at = blob.rfind(needle) if last else blob.find(needle)
    assert at >= 0, needle
    return offset + at


ZIP_END = b"PK\x05\x06"
ZIP_CENTRAL = b"PK\x01\x02"
ZIP_LOCAL = b"PK\x03\x04"


def damage_item(file: Path, offset: int, length: int, what: str) -> None:
    """Damage one stored torch.save blob without changing its length: its zip end record, its
    first central directory entry, its first local header, or its data.pkl bytes."""
    if what == "end-record":
        overwrite(file, find_in_item(file, offset, length, ZIP_END), b"XXXX")
    elif what == "central-entry":
        overwrite(file, find_in_item(file, offset, length, ZIP_CENTRAL, last=False), b"XXXX")
    elif what == "local-header":
        overwrite(file, find_in_item(file, offset, length, ZIP_LOCAL, last=False), b"XXXX")
    elif what == "pickle":
        pkl = find_in_item(file, offset, length, b"data.pkl", last=False)
        overwrite(file, pkl + 64, b"\xff" * 16)  # inside the pickle's bytes, after the local header
    else:
        raise ValueError(what)


# ---------------------------------------------------------------- planted pickles


class Planted:
    """Unpickling this would create ``target``: a test checks that it never happens."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def planted_torch_blob(marker: Path, like: tp.Any) -> bytes:
    """``torch.save(like)`` with its data.pkl replaced by a pickle that would create ``marker``."""
    buf = io.BytesIO()
    torch.save(like, buf)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = pickle.dumps({"w": Planted(marker)}, protocol=2)
            dst.writestr(info.filename, data)
    return out.getvalue()


def replace_item(path: Path, key: str, blob: bytes) -> None:
    """Append ``blob`` to ``key``'s shard and point its storage record at it (a consistent lie)."""
    metadata = read_metadata(path)
    index, info = record(metadata, key)
    file = path / info.relative_path
    start = file.stat().st_size
    with open(file, "ab") as f:
        f.write(blob)
    metadata.storage_data[index] = compat.storage_info(info.relative_path, start, len(blob))
    write_metadata(path, metadata)


def truncate(file: Path, size: int) -> None:
    os.truncate(file, size)
