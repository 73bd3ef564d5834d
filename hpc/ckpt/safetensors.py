"""safetensors: one file, or shards plus ``model.safetensors.index.json``.

Header + raw bytes, read with ``readinto`` and written by hand, so neither side holds more
than one tensor. Non-tensor entries (optimizer hyper-parameters, scheduler state) ride in
the header metadata as a base64 ``torch.save`` blob, read back with ``weights_only=True``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import typing as tp
from pathlib import Path

import torch

from hpc.ckpt.entries import (MAX_LISTED, Entry, Progress, Reader, default_paths, jsonable, owned,
                              tensor_entry)
from hpc.ckpt.outputs import commit, fresh
from hpc.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
             torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
META_LAYOUT, META_OBJECTS, META_PATHS, META_HPCX = "hpcx.layout", "hpcx.objects", "hpcx.paths", "hpcx.meta"


def _st_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section); CheckpointError on anything malformed."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError([f"{path}: not a safetensors file ({exc})"]) from None
    end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] or [0])
    if 8 + n + end > size:
        raise CheckpointError([f"{path}: truncated to {size} bytes; its header expects {8 + n + end}"])
    return header, 8 + n


def _st_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise CheckpointError([f"{index}: not a safetensors index ({exc})"]) from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file() or Path(n).name != n]
        if missing:
            raise CheckpointError([f"{path / n}: missing; {INDEX_FILE} lists it" for n in missing])
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise CheckpointError([f"{path}: expected one .safetensors file or a {INDEX_FILE}, found {len(files)} files"])
    return files


class SafetensorsReader:
    """One safetensors file or a sharded set; tensors read with ``readinto``, one at a time."""

    format = "safetensors"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.where: dict[str, tuple[Path, int, dict]] = {}
        st_meta: dict[str, str] = {}
        for file in _st_files(self.path):
            header, base = _st_header(file)
            st_meta.update(header.pop("__metadata__", None) or {})
            for name, info in header.items():
                if info.get("dtype") not in ST_NAMES:
                    raise CheckpointError([f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}, "
                                       f"expected one of {', '.join(ST_NAMES)}"])
                self.where[name] = (file, base, info)
        self.prefix = "" if st_meta.get(META_LAYOUT) == "full" else "model."
        self.objects = self._objects(st_meta)
        self.entries = {self.prefix + n: tensor_entry(self.prefix + n, ST_NAMES[i["dtype"]], i["shape"])
                        for n, (_, _, i) in self.where.items()}
        self.entries.update({k: Entry(k, None, None, 0) for k in self.objects})
        recorded = {k: tuple(v) for k, v in json.loads(st_meta.get(META_PATHS, "{}")).items()}
        self.paths = {**default_paths(self.entries), **recorded}
        self.meta = json.loads(st_meta.get(META_HPCX, "{}"))

    def _objects(self, st_meta: dict[str, str]) -> dict[str, tp.Any]:
        blob = st_meta.get(META_OBJECTS)
        if not blob:
            return {}
        try:
            return torch.load(io.BytesIO(base64.b64decode(blob)), weights_only=True)
        except Exception as exc:
            raise CheckpointError([f"{self.path}: refused the non-tensor entries in its metadata "
                               f"({str(exc).splitlines()[0]})"]) from None

    def read(self, key: str) -> tp.Any:
        if key in self.objects:
            return self.objects[key]
        file, base, info = self.where[key[len(self.prefix):]]
        begin, end = info["data_offsets"]
        out = torch.empty(info["shape"], dtype=ST_NAMES[info["dtype"]])
        if out.numel():
            with open(file, "rb") as f:
                f.seek(base + begin)
                f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        return out

    def close(self) -> None:
        pass


def _st_write(path: Path, reader: Reader, names: dict[str, str], metadata: dict[str, str],
              progress: Progress) -> None:
    """One safetensors file at ``path``: output name -> reader key in ``names``, data in that order."""
    header: dict[str, tp.Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, key in names.items():
        e = reader.entries[key]
        header[name] = {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key in names.values():
            t = owned(reader.read(key))
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            progress(t.numel() * t.element_size())
            del t
        f.flush()
        os.fsync(f.fileno())


def _shards(entries: list[Entry], shard_bytes: int) -> list[list[Entry]]:
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_safetensors(reader: Reader, dst: Path, keys: list[str], *, model_only: bool, shard_bytes: int,
                      progress: Progress = lambda n: None) -> Path:
    """safetensors at ``dst``: a single ``*.safetensors`` file, or a folder of shards plus an index."""
    tensors = [reader.entries[k] for k in keys if reader.entries[k].is_tensor]
    unsupported = [f"{e.key} ({e.dtype})" for e in tensors if e.dtype not in ST_DTYPES]
    if unsupported:
        raise CheckpointError([f"{dst}: safetensors cannot hold {', '.join(unsupported[:MAX_LISTED])}"])
    strip = "model." if model_only else ""
    meta = _st_metadata(reader, keys, model_only)
    shards = _shards(tensors, shard_bytes)
    tmp = fresh(dst)
    if dst.suffix == ".safetensors":
        if len(shards) > 1:
            raise CheckpointError([f"{dst}: {sum(e.nbytes for e in tensors)} bytes exceed --shard-size; give a "
                               "folder (no .safetensors suffix) to get shards and an index"])
        _st_write(tmp, reader, {e.key[len(strip):]: e.key for e in shards[0]}, meta, progress)
        return commit(tmp, dst)
    tmp.mkdir()
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    weight_map = {}
    for name, shard in zip(names, shards):
        _st_write(tmp / name, reader, {e.key[len(strip):]: e.key for e in shard}, meta, progress)
        weight_map.update({e.key[len(strip):]: name for e in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in tensors)}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return commit(tmp, dst)


def _st_metadata(reader: Reader, keys: list[str], model_only: bool) -> dict[str, str]:
    """safetensors header metadata: layout, object paths, hpcx meta and the non-tensor entries."""
    meta = {"format": "pt", META_HPCX: json.dumps(jsonable(reader.meta))}
    if model_only:
        return meta
    objects = {k: reader.read(k) for k in keys if not reader.entries[k].is_tensor}
    buf = io.BytesIO()
    torch.save(objects, buf)
    meta.update({META_LAYOUT: "full", META_PATHS: json.dumps({k: list(reader.paths[k]) for k in keys}),
                 META_OBJECTS: base64.b64encode(buf.getvalue()).decode()})
    return meta
