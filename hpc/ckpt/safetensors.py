"""safetensors: one file, or shards plus ``model.safetensors.index.json``.

A file is an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
data_offsets}`` plus an optional ``__metadata__`` of strings) and the raw bytes. Nothing in a
header is trusted: ``read_header`` checks every entry's types, that its offsets span exactly
dtype x shape bytes, lie inside the file, and that the entries tile the data section with no
gap and no overlap, as ``safetensors`` itself requires; an index must name files inside its
folder and agree with what the shards hold. Each problem is one line naming the file and the
tensor. Tensors are then read with ``readinto`` (the bytes actually read are counted) and
written by hand, so neither side holds more than one tensor. Non-tensor entries (optimizer
hyper-parameters, scheduler state) ride in the header metadata as a base64 ``torch.save``
blob, read back with ``weights_only=True``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import os
import re
import struct
import typing as tp
from pathlib import Path, PurePosixPath

import torch

from hpc.ckpt.entries import (MAX_LISTED, Entry, Progress, Reader, Scratch, allocate, checked_object,
                              checked_paths, default_paths, dims, jsonable, load_error, raise_problems, short_repr,
                              tensor_entry)
from hpc.ckpt.files import INDEX_FILE, file_kind, not_regular, open_regular, relative_name_problem
from hpc.ckpt.outputs import describe, fsync_file, staged
from hpc.ckpt.torch_zip import byte_view, read_exact, zip_load_problems
from hpc.core.errors import CheckpointError

MAX_HEADER = 100_000_000  # what safetensors itself accepts
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
             torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
             torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
             torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.complex64: "C64"}
# the dtypes safetensors' own torch API maps (safetensors.torch._TYPES, 0.8); tests compare the two
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
ST_NAME_STRINGS = {k: k for k in ST_NAMES}  # one string object per dtype name, shared by every entry
META_LAYOUT, META_OBJECTS, META_PATHS, META_HPCX = "hpcx.layout", "hpcx.objects", "hpcx.paths", "hpcx.meta"
JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}


def json_type(value: tp.Any) -> str:
    """``a list``, ``an object``, ``null``...: what a JSON value is, for messages."""
    return "an object" if isinstance(value, RawEntry) else JSON_TYPES.get(type(value), type(value).__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class StTensor:
    """One checked header entry: bytes ``[begin, end)`` of the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int

    @property
    def end(self) -> int:
        return self.begin + math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass
class StHeader:
    """A checked safetensors header: tensors, string metadata, where the data section starts."""

    file: Path
    tensors: dict[str, StTensor]
    metadata: dict[str, str]
    data_start: int


# ---------------------------------------------------------------- checking a header


def read_header(file: Path) -> StHeader:
    """The checked header of one safetensors file; CheckpointError listing every problem."""
    size, raw = _header_bytes(file)
    length, text = len(raw), _decode(file, raw)
    del raw  # a header may be 100 MB: hold its text once, not twice
    header = _parse_json(file, text)
    del text
    metadata = _metadata(file, header.pop("__metadata__", {}))
    problems: list[str] = []
    tensors = {}
    for name, info in header.items():
        t = _entry(file, name, info, problems)
        if t is not None:
            tensors[name] = t
    if not problems:
        problems += _layout_problems(file, list(tensors.values()), size - 8 - length)
    raise_problems(problems)
    return StHeader(file, tensors, metadata, 8 + length)


def _header_bytes(file: Path) -> tuple[int, bytes]:
    try:
        with open_regular(file, "a safetensors file") as f:
            size = f.seek(0, 2)
            f.seek(0)
            if size < 8:
                what = "empty (0 bytes)" if size == 0 else f"{size} bytes long"
                raise CheckpointError([f"{file}: {what}, too short for a safetensors file (8-byte header "
                                       "length, JSON header, data)"])
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER, size - 8):
                raise CheckpointError([f"{file}: header length {n} runs past the end of the file ({size} bytes); "
                                       "not a safetensors file, or truncated"])
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError([f"{file}: cannot read ({describe(exc)})"]) from None
    if len(raw) != n:
        raise CheckpointError([f"{file}: header is {len(raw)} of {n} bytes; truncated"])
    return size, raw


def _no_duplicates(pairs: list[tuple[str, tp.Any]]) -> dict[str, tp.Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the key that appears twice
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"{key!r} appears twice")
    return out


ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


class RawEntry(tuple):
    """A well-typed header entry as the JSON parser makes it: (dtype, shape, data_offsets), the
    last two already tuples of non-negative ints. A third of a dict's memory, for headers of a
    million tensors; anything less regular stays a dict and is reported by ``_entry``."""

    __slots__ = ()

    def as_dict(self) -> dict[str, tp.Any]:
        return {"dtype": self[0], "shape": list(self[1]), "data_offsets": list(self[2])}


def _header_object(pairs: list[tuple[str, tp.Any]]) -> tp.Any:
    """``object_pairs_hook``: a well-typed entry becomes a ``RawEntry``; other objects dicts, refusing
    duplicate keys."""
    if len(pairs) == 3:
        d = dict(pairs)
        if d.keys() == ENTRY_KEYS and isinstance(d["dtype"], str):
            shape, offsets = dims(d["shape"]), dims(d["data_offsets"])
            if shape is not None and offsets is not None:
                return RawEntry((ST_NAME_STRINGS.get(d["dtype"], d["dtype"]), shape, offsets))
    return _no_duplicates(pairs)


def _plain(value: tp.Any) -> tp.Any:
    return value.as_dict() if isinstance(value, RawEntry) else value


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def too_deep(text: str, limit: int) -> bool:
    """Whether JSON ``text`` nests brackets deeper than ``limit``, in a few passes of C-speed regular
    expressions (strings removed, then the innermost pairs ``limit`` times): no Python loop per
    character, so a header of a million tensors is checked in well under a second."""
    rest = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    passes = 0
    while rest and passes < limit:
        rest, removed = _INNERMOST.subn("", rest)
        if not removed:
            break
        passes += 1
    depth = deepest = 0
    for c in rest:  # only what nests deeper than ``passes`` levels (or unbalanced brackets) is left
        depth = depth + 1 if c in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    return deepest > 0 and deepest + passes > limit


MAX_HEADER_DEPTH = 8  # a safetensors header is an object of objects (and one of strings)


def _no_constant(name: str) -> tp.Any:
    raise ValueError(f"{name} is not JSON")


def _decode(file: Path, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError([f"{file}: header is not UTF-8 text; not a safetensors file"]) from None


def _parse_json(file: Path, text: str) -> dict:
    if too_deep(text, MAX_HEADER_DEPTH):  # a header is 2 levels; refuse long before recursion
        raise CheckpointError([f"{file}: header nested deeper than {MAX_HEADER_DEPTH} levels; "
                               "not a safetensors header"])
    try:
        header = _plain(json.loads(text, object_pairs_hook=_header_object, parse_constant=_no_constant))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError([f"{file}: header is not valid JSON ({str(exc).splitlines()[0]})"]) from None
    if not isinstance(header, dict):
        raise CheckpointError([f"{file}: header is {json_type(header)}, expected a JSON object of tensors"])
    return header


def _metadata(file: Path, metadata: tp.Any) -> dict[str, str]:
    metadata = _plain(metadata)
    if not isinstance(metadata, dict):
        raise CheckpointError([f"{file}: __metadata__ is {json_type(metadata)}, expected an object of strings"])
    bad = [k for k, v in metadata.items() if not isinstance(v, str)]
    if bad:
        raise CheckpointError([f"{file}: __metadata__[{bad[0]!r}] is {json_type(metadata[bad[0]])}, "
                               "expected a string"])
    return metadata


def _entry(file: Path, name: str, info: tp.Any, problems: list[str]) -> StTensor | None:
    """One header entry checked on its own: types, dtype x shape against its offsets."""
    if isinstance(info, RawEntry):
        dtype, shape, offsets = info
        raw_shape, raw_offsets = list(shape), list(offsets)
    elif not isinstance(info, dict):
        problems.append(f"{file}: tensor {name!r} is {json_type(info)}, expected an object with dtype, shape "
                        "and data_offsets")
        return None
    elif missing := [k for k in ("dtype", "shape", "data_offsets") if k not in info]:
        problems.append(f"{file}: tensor {name!r} has no {' or '.join(missing)}")
        return None
    else:
        dtype, raw_shape, raw_offsets = info["dtype"], info["shape"], info["data_offsets"]
        shape, offsets = dims(raw_shape), dims(raw_offsets)
    where = f"{file}: tensor {name!r}"
    if not isinstance(dtype, str) or dtype not in ST_NAMES:
        problems.append(f"{where} has dtype {short_repr(dtype)}, expected one of {', '.join(ST_NAMES)}")
    elif shape is None:
        problems.append(f"{where} has shape {short_repr(raw_shape)}, expected a list of non-negative integers")
    elif offsets is None or len(offsets) != 2:
        problems.append(f"{where} has data_offsets {short_repr(raw_offsets)}, expected [begin, end]: two "
                        "non-negative integers")
    elif offsets[0] > offsets[1]:
        problems.append(f"{where} has data_offsets {list(offsets)}: begin is after end")
    elif math.prod(shape) * ST_NAMES[dtype].itemsize != offsets[1] - offsets[0]:
        need = math.prod(shape) * ST_NAMES[dtype].itemsize
        problems.append(f"{where} is {dtype}{list(shape)}, {need} bytes, but its data_offsets {list(offsets)} "
                        f"span {offsets[1] - offsets[0]}")
    else:
        return StTensor(name, ST_NAMES[dtype], shape, offsets[0])
    return None


def _layout_problems(file: Path, tensors: list[StTensor], data_size: int) -> list[str]:
    """The entries must tile the data section exactly: inside the file, no overlap, no gap."""
    problems = [f"{file}: tensor {t.name!r} ends at data byte {t.end}, past the end of the data ({data_size} "
                "bytes): truncated, or the header lies" for t in tensors if t.end > data_size]
    if problems:
        return problems
    pos, prev = 0, tp.cast(StTensor, None)  # set before it is read: the first tensor starts at 0
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            problems.append(f"{file}: tensors {prev.name!r} and {t.name!r} overlap at data bytes "
                            f"{t.begin}..{min(pos, t.end)}")
        elif t.begin > pos:
            problems.append(f"{file}: data bytes {pos}..{t.begin} belong to no tensor")
        if t.end >= pos:
            pos, prev = t.end, t
    if pos < data_size:
        problems.append(f"{file}: {data_size - pos} bytes after the last tensor belong to no tensor")
    return problems


# ---------------------------------------------------------------- files and index


def _index(path: Path) -> dict[str, str]:
    """The index's weight_map (tensor -> shard file name), checked."""
    index = path / INDEX_FILE
    try:
        with open_regular(index, "a JSON safetensors index") as f:
            if os.fstat(f.fileno()).st_size > MAX_HEADER:
                raise CheckpointError([f"{index}: larger than {MAX_HEADER} bytes; not a safetensors index"])
            raw = f.readall()
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates,
                         parse_constant=_no_constant)
    except OSError as exc:
        raise CheckpointError([f"{index}: cannot read ({describe(exc)})"]) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CheckpointError([f"{index}: not a JSON safetensors index ({str(exc).splitlines()[0]})"]) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        what = json_type(doc) if not isinstance(doc, dict) else f"a weight_map that is {json_type(weight_map)}"
        raise CheckpointError([f"{index}: has {what}, expected an object with a weight_map of tensor -> file"])
    problems = [f"{index}: weight_map[{k!r}] is {json_type(v)}, expected a file name"
                for k, v in weight_map.items() if not isinstance(v, str)]
    problems += [f"{index}: weight_map[{k!r}] = {v!r} {why}" for k, v in weight_map.items()
                 if isinstance(v, str) and (why := relative_name_problem(v))]
    raise_problems(problems)
    return {k: PurePosixPath(v).as_posix() for k, v in weight_map.items()}


def _headers(path: Path) -> list[StHeader]:
    """Every file's checked header: one file, the shards an index names, or a folder's one file."""
    if not path.is_dir():
        return [read_header(path)]
    if file_kind(path / INDEX_FILE) != "missing":
        weight_map = _index(path)
        names = sorted(set(weight_map.values()))
        expected = f"a safetensors shard ({INDEX_FILE} lists it)"
        raise_problems([p for n in names if (p := not_regular(path / n, expected))])
        headers = [read_header(path / n) for n in names]
        raise_problems(_index_problems(path, weight_map, headers))
        return headers
    files = sorted(path.glob("*.safetensors"))
    if len(files) != 1:
        raise CheckpointError([f"{path}: expected one .safetensors file or a {INDEX_FILE}, found {len(files)} files"])
    return [read_header(files[0])]


def _index_problems(path: Path, weight_map: dict[str, str], headers: list[StHeader]) -> list[str]:
    """The index and the shards must agree: every listed tensor in its shard, nothing unlisted."""
    held: dict[str, list[str]] = {}
    for h in headers:
        for name in h.tensors:
            held.setdefault(name, []).append(h.file.relative_to(path).as_posix())
    index, problems = path / INDEX_FILE, []
    for name, file in weight_map.items():
        where = held.get(name, [])
        if file not in where:
            also = f" (it is in {', '.join(where)})" if where else ""
            problems.append(f"{index}: lists {name!r} in {file}, which does not hold it{also}")
    for name, files in held.items():
        if len(files) > 1:
            problems.append(f"{path}: tensor {name!r} is in {' and '.join(files)}")
        elif name not in weight_map:
            problems.append(f"{path / files[0]}: holds {name!r}, which {INDEX_FILE} does not list")
    return problems


def tensor_offsets(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], Path, int]]:
    """Each tensor's dtype, shape, file and the absolute byte offset its data starts at, under the
    file's own names, from the checked headers alone (``checkpoint.init_from`` reads a rank's rows
    from there: ``hpc.ckpt.formats.BYTE_RANGES``)."""
    return {n: (t.dtype, t.shape, h.file, h.data_start + t.begin) for h in _headers(Path(path))
            for n, t in h.tensors.items()}


# ---------------------------------------------------------------- reading


class SafetensorsReader:
    """One safetensors file or a sharded set; tensors read with ``readinto``, one at a time."""

    format = "safetensors"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.headers = _headers(self.path)
        several = len(self.headers) > 1  # one file: no name -> shard map at all
        self.shard_of = {name: i for i, h in enumerate(self.headers) for name in h.tensors} if several else {}
        st_meta: dict[str, str] = {}
        for header in self.headers:
            st_meta.update(header.metadata)
        self.prefix = "" if st_meta.get(META_LAYOUT) == "full" else "model."
        self.objects = self._objects(st_meta)
        self.entries: dict[str, Entry] = {}
        for header in self.headers:
            for n, t in header.tensors.items():
                key = self.prefix + n if self.prefix else n
                self.entries[key] = tensor_entry(key, t.dtype, t.shape)
        self.entries.update({k: Entry(k, None, None, 0) for k in self.objects})
        self.paths: dict[str, tuple] = default_paths(checked_paths(self._json(st_meta, META_PATHS, {}),
                                                 f"{self.path} __metadata__ {META_PATHS}"))
        self.meta = self._json(st_meta, META_HPCX, {})
        if not isinstance(self.meta, dict):
            raise CheckpointError([f"{self.path}: __metadata__ {META_HPCX} is {json_type(self.meta)}, expected an object"])
        self.files: dict[Path, tp.BinaryIO] = {}

    def _json(self, st_meta: dict[str, str], key: str, default: tp.Any) -> tp.Any:
        if key not in st_meta:
            return default
        try:
            value = json.loads(st_meta[key], parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise CheckpointError([f"{self.path}: __metadata__ {key} is not JSON ({exc})"]) from None
        return checked_object(value, f"{self.path}: __metadata__ {key}")  # printed and compared later

    def _objects(self, st_meta: dict[str, str]) -> dict[str, tp.Any]:
        blob = st_meta.get(META_OBJECTS)
        if not blob:
            return {}
        where = f"{self.path}: __metadata__ {META_OBJECTS}"
        try:
            data = io.BytesIO(base64.b64decode(blob, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise CheckpointError([f"{where} is not base64 ({exc})"]) from None
        raise_problems(zip_load_problems(data, where))
        data.seek(0)
        try:
            objects = torch.load(data, weights_only=True)
        except Exception as exc:  # noqa: BLE001  (garbled entries: torch.load raises many types)
            raise CheckpointError([f"{self.path}: refused the non-tensor entries in its metadata "
                                   f"({load_error(exc)})"]) from None
        checked_object(objects, where)
        if not isinstance(objects, dict) or not all(isinstance(k, str) for k in objects):
            raise CheckpointError([f"{self.path}: __metadata__ {META_OBJECTS} holds a {type(objects).__name__}, "
                                   "expected a dict of entries"])
        return objects

    def read(self, key: str) -> tp.Any:
        if key in self.objects:
            return self.objects[key]
        entry = self.entries[key]
        assert entry.dtype is not None and entry.shape is not None  # a tensor entry
        out = allocate(entry.shape, entry.dtype, f"{self.path}: tensor {key!r}")
        self.read_into(key, out)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill the contiguous ``out`` with tensor ``key``; CheckpointError if the file ends early."""
        name = key[len(self.prefix):]
        header = self.headers[self.shard_of.get(name, 0)]
        t = header.tensors[name]
        if t.end == t.begin:
            return
        f = self.files.get(header.file)
        try:
            if f is None:
                f = self.files[header.file] = open_regular(header.file, "a safetensors file")
            read_exact(f, header.data_start + t.begin, out, str(header.file))
        except OSError as exc:
            raise CheckpointError([f"{header.file}: cannot read tensor {t.name!r} ({describe(exc)})"]) from None

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


# ---------------------------------------------------------------- writing


def _st_write(path: Path, reader: Reader, names: dict[str, str], metadata: dict[str, str],
              progress: Progress, scratch: Scratch) -> None:
    """One safetensors file at ``path``: output name -> reader key in ``names``, data in that order."""
    header: dict[str, tp.Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, key in names.items():
        e = reader.entries[key]
        assert e.dtype is not None and e.shape is not None  # a tensor entry
        header[name] = {"dtype": ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for key in names.values():
            e = reader.entries[key]
            assert e.dtype is not None and e.shape is not None  # a tensor entry
            data = scratch.view(e.dtype, e.shape, f"{getattr(reader, 'path', '?')}: tensor {key!r}")
            reader.read_into(key, data)
            if e.nbytes:
                f.write(byte_view(data))
            progress(e.nbytes)
        fsync_file(f)


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


def check_safetensors_target(reader: Reader, dst: Path, keys: list[str], shard_bytes: int) -> None:
    """Refuse before writing: dtypes safetensors cannot hold, a one-file DST too big for one shard."""
    tensors = [reader.entries[k] for k in keys if reader.entries[k].is_tensor]
    unsupported = [f"{e.key} ({e.dtype})" for e in tensors if e.dtype not in ST_DTYPES]
    if unsupported:
        raise CheckpointError([f"{dst}: safetensors cannot hold {', '.join(unsupported[:MAX_LISTED])}"])
    if dst.suffix == ".safetensors" and len(_shards(tensors, shard_bytes)) > 1:
        raise CheckpointError([f"{dst}: {sum(e.nbytes for e in tensors)} bytes exceed --shard-size; give a "
                               "folder (no .safetensors suffix) to get shards and an index"])


def write_safetensors(reader: Reader, dst: Path, keys: list[str], *, model_only: bool, shard_bytes: int,
                      progress: Progress = lambda n: None, scratch: Scratch | None = None) -> Path:
    """safetensors at ``dst``: a single ``*.safetensors`` file, or a folder of shards plus an index."""
    scratch = scratch or Scratch()
    check_safetensors_target(reader, dst, keys, shard_bytes)
    tensors = [reader.entries[k] for k in keys if reader.entries[k].is_tensor]
    strip = "model." if model_only else ""
    meta = _st_metadata(reader, keys, model_only)
    shards = _shards(tensors, shard_bytes)
    if dst.suffix == ".safetensors":
        with staged(dst) as tmp:
            _st_write(tmp, reader, {e.key[len(strip):]: e.key for e in shards[0]}, meta, progress, scratch)
        return dst
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    with staged(dst, folder=True) as tmp:
        weight_map = {}
        for name, shard in zip(names, shards):
            _st_write(tmp / name, reader, {e.key[len(strip):]: e.key for e in shard}, meta, progress, scratch)
            weight_map.update({e.key[len(strip):]: name for e in shard})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in tensors)}, "weight_map": weight_map}
            with open(tmp / INDEX_FILE, "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2) + "\n")
                fsync_file(f)  # type: ignore[arg-type]
    return dst


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
