"""Checkpoint files, read and written one tensor at a time.

Three formats share one flat view: every entry has a *key* in DCP's flattened
form (``model.blocks.0.attn.qkv.weight``, ``optim.state.head.weight.exp_avg``,
``optim.param_groups.0.lr``) and a value that is a tensor or a small Python
object. ``paths`` maps each key to its object path in the nested state dict
(what DCP records as ``planner_data``), so a nested dict can be rebuilt.

- **DCP folder** (``.metadata`` + ``*.distcp``): each stored item is a
  ``torch.save`` blob at ``(file, offset, length)`` given by the metadata.
  ``DcpReader`` reads those blobs itself, chunk by chunk, after checking that
  every referenced file is present and long enough. ``write_dcp`` writes one
  shard file plus ``.metadata``, the layout a single-rank ``dcp.save`` makes.
- **safetensors** (one file, or shards + ``model.safetensors.index.json``):
  header + raw bytes, read with ``readinto`` and written by hand, so neither
  side holds more than one tensor. Non-tensor entries (optimizer hyper-
  parameters, scheduler state) ride in the header metadata as a base64
  ``torch.save`` blob, read back with ``weights_only=True``.
- **torch file** (one ``torch.save`` zip of the nested dict): read with
  ``TorchZip`` (trainer/torch_zip.py): ``data.pkl`` through an allow-list
  unpickler that records where each tensor's bytes are, then one tensor at a
  time from its zip record. Layouts it does not handle (legacy non-zip files,
  big-endian, quantized/sparse tensors) fall back to
  ``torch.load(weights_only=True, mmap=True)``. Writing needs the whole dict in
  memory at once — the one direction that is not streamed.

A *model-only* file (a plain ``model.state_dict()``) appears under ``model.``
keys, so any two checkpoints compare key by key.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
import typing as tp
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from hpc.config import ConfigError
from trainer.safe_pickle import METADATA_FILE, load_dcp_metadata
from trainer.torch_zip import FileSlice, TorchZip, Unsupported, no_crc32

Path_ = tuple  # object path: tuple of str keys and int list indices
Progress = tp.Callable[[int], None]
INDEX_FILE = "model.safetensors.index.json"
SHARD_FILE = "__0_0.distcp"
MAX_LISTED = 8  # problems listed before "... and N more"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One key of a checkpoint: a tensor (dtype and shape set) or a Python object."""

    key: str
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    nbytes: int

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


def tensor_entry(key: str, dtype: torch.dtype, shape: tp.Sequence[int]) -> Entry:
    numel = 1
    for s in shape:
        numel *= int(s)
    return Entry(key, dtype, tuple(int(s) for s in shape), numel * dtype.itemsize)


class Reader(tp.Protocol):
    """What every format reader offers."""

    format: str
    entries: dict[str, Entry]
    paths: dict[str, Path_]
    meta: dict[str, tp.Any]

    def read(self, key: str) -> tp.Any: ...

    def close(self) -> None: ...


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor that owns exactly its bytes (torch.save writes whole storages)."""
    t = t.detach().cpu().contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def default_paths(keys: tp.Iterable[str]) -> dict[str, Path_]:
    """Object paths for keys with no recorded ones: split on the first dot only."""
    return {k: tuple(k.split(".", 1)) if "." in k else (k,) for k in keys}


def unflatten(flat: dict[str, tp.Any], paths: dict[str, Path_]) -> dict[str, tp.Any]:
    """The nested state dict of ``flat`` along ``paths`` (int path parts become list indices)."""
    root: dict[str, tp.Any] = {}
    for key, value in flat.items():
        path = paths.get(key) or (key,)
        node: tp.Any = root
        for part, nxt in zip(path[:-1], path[1:]):
            empty: tp.Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                node.extend([None] * (part + 1 - len(node)))
                node[part] = empty if node[part] is None else node[part]
            else:
                node.setdefault(part, empty)
            node = node[part]
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return root


# ---------------------------------------------------------------- DCP


def dcp_problems(path: str | Path, metadata: dcp_md.Metadata | None = None) -> list[str]:
    """Why the DCP folder at ``path`` cannot be trusted (empty when every referenced byte is there)."""
    path = Path(path)
    try:
        metadata = metadata or load_dcp_metadata(path)
    except ConfigError as exc:
        return exc.messages
    needed: dict[str, int] = {}
    problems = []
    for index, info in metadata.storage_data.items():
        if not isinstance(info, dcp_fs._StorageInfo):
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


def raise_problems(problems: list[str]) -> None:
    if problems:
        more = [f"... and {len(problems) - MAX_LISTED} more problems"] if len(problems) > MAX_LISTED else []
        raise ConfigError(problems[:MAX_LISTED] + more)


class DcpReader:
    """A DCP folder read through its metadata, one stored chunk at a time."""

    format = "dcp"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata = load_dcp_metadata(self.path)
        raise_problems(dcp_problems(self.path, self.metadata))
        self.storage: dict[tuple[str, tuple | None], dcp_fs._StorageInfo] = {
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

    def _file(self, info: dcp_fs._StorageInfo) -> tp.BinaryIO:
        f = self.files.get(info.relative_path)
        if f is None:
            f = self.files[info.relative_path] = open(self.path / info.relative_path, "rb", buffering=0)
        return f

    def _tensor(self, info: dcp_fs._StorageInfo) -> torch.Tensor:
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

    def _blob(self, info: dcp_fs._StorageInfo) -> tp.Any:
        f = self._file(info)
        try:
            return torch.load(FileSlice(f, info.offset, info.length), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ConfigError([f"{self.path / info.relative_path}: refused a stored object at byte "
                               f"{info.offset}: {str(exc).splitlines()[0]}"]) from None
        except Exception as exc:
            raise ConfigError([f"{self.path / info.relative_path}: unreadable item at byte {info.offset} "
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


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.partial-{os.getpid()}"


def commit(tmp: Path, dst: Path) -> Path:
    """Rename the finished ``tmp`` to ``dst`` (refusing an existing ``dst``) and sync the parent."""
    if dst.exists():
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise ConfigError([f"{dst}: already exists; hpcx never writes into an existing checkpoint"])
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
    return dst


def _fresh(dst: Path) -> Path:
    """A new temp path beside ``dst``; refuses when ``dst`` exists."""
    if dst.exists():
        raise ConfigError([f"{dst}: already exists; choose a new destination (outputs are never overwritten)"])
    if not dst.parent.is_dir():
        raise ConfigError([f"{dst.parent}: no such folder for the output"])
    tmp = partial_path(dst)
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    return tmp


def _dcp_item(f: tp.BinaryIO, key: str, value: tp.Any) -> tuple[tp.Any, dcp_md.MetadataIndex, dcp_fs._StorageInfo]:
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
    return md, index, dcp_fs._StorageInfo(SHARD_FILE, offset, f.tell() - offset)


def write_dcp(reader: Reader, dst: Path, keys: list[str], progress: Progress = lambda n: None) -> Path:
    """A one-shard DCP folder at ``dst`` holding ``keys`` of ``reader``, one tensor in memory at a time."""
    tmp = _fresh(dst)
    tmp.mkdir()
    state_md, storage = {}, {}
    with open(tmp / SHARD_FILE, "wb") as f, no_crc32():  # as hpcx's DCP saves (see HpcxFileSystemWriter)
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


# ---------------------------------------------------------------- safetensors

ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
             torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
META_LAYOUT, META_OBJECTS, META_PATHS, META_HPCX = "hpcx.layout", "hpcx.objects", "hpcx.paths", "hpcx.meta"


def _st_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset of the data section); ConfigError on anything malformed."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError(f"header length {n} is implausible")
            header = json.loads(f.read(n))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        raise ConfigError([f"{path}: not a safetensors file ({exc})"]) from None
    end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] or [0])
    if 8 + n + end > size:
        raise ConfigError([f"{path}: truncated to {size} bytes; its header expects {8 + n + end}"])
    return header, 8 + n


def _st_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ConfigError([f"{index}: not a safetensors index ({exc})"]) from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file() or Path(n).name != n]
        if missing:
            raise ConfigError([f"{path / n}: missing; {INDEX_FILE} lists it" for n in missing])
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise ConfigError([f"{path}: expected one .safetensors file or a {INDEX_FILE}, found {len(files)} files"])
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
                    raise ConfigError([f"{file}: tensor {name!r} has dtype {info.get('dtype')!r}, "
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
            raise ConfigError([f"{self.path}: refused the non-tensor entries in its metadata "
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
        raise ConfigError([f"{dst}: safetensors cannot hold {', '.join(unsupported[:MAX_LISTED])}"])
    strip = "model." if model_only else ""
    meta = _st_metadata(reader, keys, model_only)
    shards = _shards(tensors, shard_bytes)
    tmp = _fresh(dst)
    if dst.suffix == ".safetensors":
        if len(shards) > 1:
            raise ConfigError([f"{dst}: {sum(e.nbytes for e in tensors)} bytes exceed --shard-size; give a "
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


def jsonable(value: tp.Any) -> tp.Any:
    """``value`` with tensors turned into lists and other unknowns into strings, for JSON output."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist() if value.numel() <= 16 else f"<tensor {tuple(value.shape)} {value.dtype}>"
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


# ---------------------------------------------------------------- torch.save file


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
            raise ConfigError([f"{self.path}: holds a {type(obj).__name__}, expected a state dict"])
        if not isinstance(obj.get("model"), dict):
            obj = {"model": obj}  # a plain model.state_dict()
        self.flat, self.paths = flatten_state_dict(obj)
        self.entries = {k: tensor_entry(k, v.dtype, v.shape) if isinstance(v, torch.Tensor) else Entry(k, None, None, 0)
                        for k, v in self.flat.items()}
        self.meta = {k[len("meta."):]: v for k, v in self.flat.items() if k.startswith("meta.")}

    def _torch_load(self, is_zip: bool) -> tp.Any:
        try:
            return torch.load(self.path, map_location="cpu", weights_only=True, mmap=is_zip)
        except pickle.UnpicklingError as exc:
            raise ConfigError([f"{self.path}: refused by weights_only loading: {str(exc).splitlines()[0]}"]) from None
        except Exception as exc:
            raise ConfigError([f"{self.path}: unreadable torch file ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''})"]) from None

    def read(self, key: str) -> tp.Any:
        value = self.flat[key]
        ref = self.zip.ref(value) if self.zip is not None and isinstance(value, torch.Tensor) else None
        return self.zip.read(ref) if ref is not None else value

    def close(self) -> None:
        self.flat = {}
        self.file.close()


def write_torch(reader: Reader, dst: Path, keys: list[str], *, model_only: bool,
                progress: Progress = lambda n: None) -> Path:
    """One ``torch.save`` file; NOT streamed: the whole (nested) dict is in memory before writing."""
    flat = {}
    for key in keys:
        flat[key] = reader.read(key)
        progress(reader.entries[key].nbytes)
    nested = unflatten(flat, reader.paths)
    del flat
    obj = nested.get("model", {}) if model_only else nested
    tmp = _fresh(dst)
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return commit(tmp, dst)


# ---------------------------------------------------------------- any


def detect_format(path: str | Path) -> str:
    """``dcp``, ``safetensors`` or ``torch`` from what is at ``path``; ConfigError when nothing fits."""
    path = Path(path)
    if path.is_dir():
        if (path / METADATA_FILE).exists() or any(path.glob("*.distcp")):
            return "dcp"
        if (path / INDEX_FILE).exists() or any(path.glob("*.safetensors")):
            return "safetensors"
        raise ConfigError([f"{path}: a folder with neither a DCP .metadata nor .safetensors files"])
    if not path.exists():
        raise ConfigError([f"{path}: no such file or folder"])
    with open(path, "rb") as f:
        head = f.read(4)
    return "torch" if head in (b"PK\x03\x04", LEGACY_TORCH_MAGIC) else "safetensors"


def open_checkpoint(path: str | Path) -> Reader:
    """A reader for the checkpoint at ``path``, any format; validated before anything is read."""
    fmt = detect_format(path)
    return {"dcp": DcpReader, "safetensors": SafetensorsReader, "torch": TorchReader}[fmt](path)
