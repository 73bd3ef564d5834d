"""``hpcx ckpt inspect | convert | verify``: the work behind the commands, free of click.

Every function opens its inputs through ``open_checkpoint``, which checks a checkpoint's
structure completely (metadata allow-list and consistency, every referenced file present and
long enough, a safetensors header that tells the truth) before reading a byte of tensor data,
and raises ``CheckpointError`` with one line per problem. A destination is refused before the
source is read; outputs are written under a temporary name beside it, renamed only when
complete, and removed on any error (hpc/ckpt/outputs.py).
"""

from __future__ import annotations

import math
import typing as tp
from pathlib import Path

import torch

from hpc.ckpt import formats
from hpc.ckpt.dcp import DcpReader
from hpc.ckpt.digests import check_digests, recorded_digest
from hpc.ckpt.entries import Entry, Progress, Reader, Scratch, jsonable
from hpc.ckpt.outputs import check_destination, parents_made
from hpc.core.errors import CheckpointError, ConfigError

DEFAULT_SHARD_BYTES = 5 * 2**30  # 5 GiB, the usual safetensors shard size
Start = tp.Callable[[int], Progress]  # called with the byte total once the inputs are checked


def _no_progress(total: int) -> Progress:
    return lambda n: None


def detect_format(path: str | Path) -> str:
    """``dcp``, ``safetensors`` or ``torch`` from what is at ``path`` (``hpc.ckpt.formats.detect``);
    CheckpointError when nothing fits."""
    return formats.detect(path).name


def open_checkpoint(path: str | Path) -> Reader:
    """A reader for the checkpoint at ``path``, any format; checked before anything is read."""
    return formats.detect(path).open(path)


# ---------------------------------------------------------------- inspect


def inspect_checkpoint(path: str | Path, *, deep: bool = False, start: Start = _no_progress) -> dict[str, tp.Any]:
    """What ``hpcx ckpt inspect`` shows: format, meta, train state, tensors, total size, what was checked.

    ``deep`` also reads every byte: recorded digests are checked, every tensor is read whole and
    its NaN/Inf elements are counted.
    """
    reader = open_checkpoint(path)  # raises CheckpointError when incomplete
    try:
        if isinstance(reader, DcpReader):
            reader.check_items()
        info = _summary(path, reader)
        info["digests"] = _digests(reader, check=deep)
        if deep:
            info["nonfinite"] = _read_everything(reader, start(info["total_bytes"]))
        info["checked"] = formats.get(reader.format).checked + ("; deep: digests and every byte" if deep else "")
        return info
    finally:
        reader.close()


def _summary(path: str | Path, reader: Reader) -> dict[str, tp.Any]:
    train = {k[len("train."):]: reader.read(k) for k in reader.entries
             if k.startswith("train.") and not reader.entries[k].is_tensor}
    names: dict[tp.Any, str] = {}  # one dtype string per dtype, not per tensor (headers of a million tensors)
    tensors = [{"key": e.key, "dtype": names.setdefault(e.dtype, str(e.dtype).removeprefix("torch.")),
                "shape": list(e.shape or ()), "bytes": e.nbytes} for e in reader.entries.values() if e.is_tensor]
    return {"path": str(path), "format": reader.format, "complete": True,
            "step": reader.meta.get("step", train.get("step")),
            "tokens_seen": reader.meta.get("tokens_seen", train.get("tokens_seen")),
            "world_size": reader.meta.get("world_size"), "strategy": reader.meta.get("strategy"),
            "meta": jsonable(reader.meta), "train": jsonable(train), "tensors": tensors,
            "objects": sorted(k for k, e in reader.entries.items() if not e.is_tensor),
            "total_bytes": sum(t["bytes"] for t in tensors)}


def _digests(reader: Reader, check: bool) -> dict[str, tp.Any] | None:
    """Digests of a DCP folder's shard files: how many are recorded, and (``check``) verified."""
    if not formats.get(reader.format).digests:
        return None
    assert isinstance(reader, DcpReader)  # the one format with digests
    files = reader.shard_files()
    if check:
        result = check_digests(reader.path, files)
        return {"files": len(files), "recorded": len(result["checked"]), "verified": len(result["checked"])}
    recorded = sum(recorded_digest(reader.path / name) is not None for name in files)
    return {"files": len(files), "recorded": recorded, "verified": None}


def _read_everything(reader: Reader, progress: Progress) -> dict[str, int]:
    """Read every entry whole; the number of NaN/Inf elements of each float tensor that has any."""
    scratch, nonfinite = Scratch(), {}
    for key, e in reader.entries.items():
        if not e.is_tensor:
            reader.read(key)
            continue
        assert e.dtype is not None and e.shape is not None  # a tensor entry
        data = scratch.view(e.dtype, e.shape, f"{getattr(reader, 'path', '?')}: tensor {key!r}")
        reader.read_into(key, data)
        bad = nonfinite_count(data)
        if bad:
            nonfinite[key] = bad
        progress(e.nbytes)
    return nonfinite


NATIVE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def computable(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` in a dtype that CPU kernels compute on (fp8 widened to float32, complex32 to complex64),
    or None where no arithmetic is defined (packed float4, bit types): those compare by bytes only."""
    if t.dtype == torch.complex32:
        return t.to(torch.complex64)
    if str(t.dtype).startswith("torch.bits"):
        return None
    if t.is_complex() or not t.is_floating_point() or t.dtype in NATIVE_FLOATS:
        return t
    try:
        return t.float()
    except (RuntimeError, NotImplementedError):
        return None


def nonfinite_count(t: torch.Tensor) -> int:
    """NaN and ±Inf elements of a floating or complex tensor (0 for other dtypes and for formats
    that have neither, such as packed float4), counted a slice at a time."""
    if not (t.is_floating_point() or t.is_complex()) or not t.numel():
        return 0
    flat, bad = t.reshape(-1), 0
    for first in range(0, flat.numel(), COMPARE_ELEMENTS):
        part = computable(flat[first:first + COMPARE_ELEMENTS])
        if part is None:
            return 0
        bad += int((~torch.isfinite(part)).sum())
    return bad


# ---------------------------------------------------------------- convert


def selected_keys(reader: Reader, model_only: bool) -> list[str]:
    """The keys a conversion copies: everything, or the model's tensors only."""
    keys = [k for k in reader.entries if not model_only or k.startswith("model.")]
    if not keys:
        raise CheckpointError([f"{getattr(reader, 'path', '?')}: no {'model ' if model_only else ''}entries to convert"])
    return keys


def _check_target(src: Path, dst: Path, to: str, digest: bool) -> None:
    if to not in formats.TARGETS:
        raise ConfigError([f"--to {to!r}: expected one of {', '.join(formats.TARGETS)}"])
    if digest and not formats.get(to).digests:
        writes = " or ".join(f"--to {f.name}" for f in formats.FORMATS if f.digests)
        raise ConfigError([f"--digest: only {writes} writes digests (a DCP folder's shards); not --to {to}"])
    check_destination(dst, make_parents=True)
    if src.is_dir() and dst.resolve().parent.is_relative_to(src.resolve()):
        raise CheckpointError([f"{dst}: inside the source {src}; hpcx never writes into a checkpoint"])


def convert_checkpoint(src: str | Path, dst: str | Path, to: str, *, model_only: bool = False,
                       shard_bytes: int = DEFAULT_SHARD_BYTES, digest: bool = False,
                       start: Start = _no_progress) -> dict[str, tp.Any]:
    """Convert ``src`` (any format) to ``dst`` in format ``to``; a summary dict.

    ``dst`` is refused before ``src`` is read. Every direction is streamed: memory holds about the
    largest tensor (one reusable buffer). A torch source in a layout ``TorchZip`` does not handle
    (e.g. a legacy non-zip file) is loaded whole (``streamed`` False). ``start(total)`` is called
    once the source is checked and before anything is written; it returns the progress callback.
    ``digest`` (dcp only) writes the shard's SHA-256 beside it.
    """
    src, dst = Path(src), Path(dst)
    _check_target(src, dst, to, digest)
    reader = open_checkpoint(src)
    try:
        keys, target = selected_keys(reader, model_only), formats.get(to)
        if target.refuse is not None:
            target.refuse(reader, dst, keys, shard_bytes)
        total = sum(reader.entries[k].nbytes for k in keys)
        with parents_made(dst):  # `--to` a folder not made yet: made now, removed again if the write fails
            target.write(reader, dst, keys, model_only=model_only, shard_bytes=shard_bytes, digest=digest,
                         progress=start(total), scratch=Scratch())
        return {"src": str(src), "dst": str(dst), "from": reader.format, "to": to, "keys": len(keys),
                "bytes": total, "streamed": getattr(reader, "streamed", True)}
    finally:
        reader.close()


# ---------------------------------------------------------------- verify

COMPARE_ELEMENTS = 1 << 22  # compared per slice, so a tolerance check needs bounded extra memory


def compare_values(a: tp.Any, b: tp.Any, atol: float) -> str | None:
    """None when equal (bit-exact for tensors when ``atol`` is 0), else what differs.

    With ``atol`` > 0, NaN must be at the same positions on both sides, infinities must be equal,
    and every other element pair within ``atol``. Objects compare by value, NaN equal to NaN.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{type(a).__name__} vs {type(b).__name__}"
        return compare_tensors(a, b, atol)
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        return next((f"[{k!r}]: {d}" for k in a if (d := compare_values(a[k], b[k], atol))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{len(a)} items vs {len(b)}"
        return next((f"[{i}]: {d}" for i, (x, y) in enumerate(zip(a, b)) if (d := compare_values(x, y, atol))), None)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if type(a) is type(b) and a == b else f"{a!r} vs {b!r}"


def compare_tensors(a: torch.Tensor, b: torch.Tensor, atol: float) -> str | None:
    """None when equal within ``atol`` (see ``compare_values``), else the first or largest difference."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{_dtype(a)}{list(a.shape)} vs {_dtype(b)}{list(b.shape)}"
    fa, fb = a.reshape(-1), b.reshape(-1)
    worst: tuple[float, int] | None = None
    for first in range(0, fa.numel(), COMPARE_ELEMENTS):
        found = _compare_slice(fa[first:first + COMPARE_ELEMENTS], fb[first:first + COMPARE_ELEMENTS], atol)
        if found is None:
            continue
        what, index = found
        if isinstance(what, str):
            return f"{what}, first at flat index {first + index}"
        if worst is None or what > worst[0]:
            worst = (what, first + index)
    return None if worst is None else f"max |a-b| = {worst[0]:.3g} at flat index {worst[1]}"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _compare_slice(x: torch.Tensor, y: torch.Tensor, atol: float) -> tuple[str | float, int] | None:
    """None when the slices match; else (what differs, index) or (largest distance, its index)."""
    if atol == 0 and (not x.numel() or torch.equal(_bytes(x), _bytes(y))):
        return None
    cx, cy = computable(x), computable(y)
    if cx is None or cy is None:  # no arithmetic: the first element whose bytes differ
        return None if torch.equal(_bytes(x), _bytes(y)) else _first_bit_difference(x, y, "bytes differ")
    if x.is_floating_point() or x.is_complex():
        return _float_distance(cx, cy, atol) or (_first_bit_difference(x, y) if atol == 0 else None)
    over = (x != y) if atol == 0 else _int_over(x, y, atol)
    index = over.nonzero()
    return None if not len(index) else (f"{index.numel()} elements differ by more than {atol:g}", int(index[0]))


def _int_over(x: torch.Tensor, y: torch.Tensor, atol: float) -> torch.Tensor:
    """Where integers (any width, signed or not) differ by more than ``atol``, exactly: the
    wrapped 64-bit difference is exact below 2^62, and doubles tell the larger ones apart."""
    near = (x.long() - y.long()).abs().double()
    far = (x.double() - y.double()).abs() > 2.0**62
    return (x != y) & (far | (near > atol))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


EQUAL_BUT_BITS = "bits differ between equal values (-0.0 vs 0.0 or NaN payloads)"


def _first_bit_difference(x: torch.Tensor, y: torch.Tensor, what: str = EQUAL_BUT_BITS) -> tuple[str, int]:
    """Where the bytes of two same-shaped tensors first differ (-0.0 vs 0.0, NaN payloads, or
    dtypes without arithmetic)."""
    bx = _bytes(x).reshape(x.numel(), -1)
    by = _bytes(y).reshape(y.numel(), -1)
    return what, int((bx != by).any(dim=1).nonzero()[0])


def _float_distance(x: torch.Tensor, y: torch.Tensor, atol: float) -> tuple[str | float, int] | None:
    """NaN at the same places, equal infinities, then the largest |x-y| if it exceeds ``atol``."""
    if x.is_complex():
        x, y = torch.view_as_real(x).reshape(-1), torch.view_as_real(y).reshape(-1)
    nan_x, nan_y = x.isnan(), y.isnan()
    if not torch.equal(nan_x, nan_y):
        i = int((nan_x != nan_y).nonzero()[0])
        return f"NaN in {'A' if bool(nan_x[i]) else 'B'} only", i
    xd, yd = x.double(), y.double()
    bad_inf = (xd.isinf() | yd.isinf()) & (xd != yd)
    if bool(bad_inf.any()):
        i = int(bad_inf.nonzero()[0])
        return f"{float(xd[i]):.6g} vs {float(yd[i]):.6g}", i
    d = torch.where(nan_x | xd.isinf(), 0.0, (xd - yd).abs())
    i = int(d.argmax()) if d.numel() else 0
    return (float(d[i]), i) if d.numel() and float(d[i]) > atol else None


def verify_checkpoints(a: str | Path, b: str | Path, *, atol: float = 0.0, model_only: bool = False,
                       limit: int = 10, start: Start = _no_progress) -> dict[str, tp.Any]:
    """Compare two checkpoints of any formats key by key; equal, and the first ``limit`` differences.

    Digests recorded in either (DCP) checkpoint are checked first; a file that no longer matches
    its digest is a CheckpointError.
    """
    ra = open_checkpoint(a)
    try:
        rb = open_checkpoint(b)
    except BaseException:
        ra.close()
        raise
    try:
        for r in (ra, rb):
            if isinstance(r, DcpReader):
                r.check_items()  # a torn item is an error (exit 2) whatever else differs
        digests = {"a": _digests(ra, check=True), "b": _digests(rb, check=True)}
        ka, kb = (set(selected_keys(r, model_only)) for r in (ra, rb))
        diffs = [f"{k}: only in A" for k in sorted(ka - kb)] + [f"{k}: only in B" for k in sorted(kb - ka)]
        diffs += _compare_all(ra, rb, sorted(ka & kb), atol, start(sum(ra.entries[k].nbytes for k in ka & kb)))
        return {"a": str(a), "b": str(b), "equal": not diffs, "compared": len(ka & kb), "atol": atol,
                "differences": diffs[:limit], "more": len(diffs) > limit, "total_differences": len(diffs),
                "digests": digests}
    finally:
        ra.close()
        rb.close()


def _compare_all(ra: Reader, rb: Reader, keys: list[str], atol: float, progress: Progress) -> list[str]:
    """Every key compared (never stopping at the first differences, so a torn item later on is still
    read and reported as the error it is); what differs, key by key."""
    diffs, scratch_a, scratch_b = [], Scratch(), Scratch()
    for key in keys:
        ea, eb = ra.entries[key], rb.entries[key]
        if ea.is_tensor and eb.is_tensor and (ea.dtype, ea.shape) == (eb.dtype, eb.shape):
            what = f"{getattr(ra, 'path', '?')}: tensor {key!r}"
            assert ea.dtype is not None and ea.shape is not None and eb.dtype is not None and eb.shape is not None
            va, vb = scratch_a.view(ea.dtype, ea.shape, what), scratch_b.view(eb.dtype, eb.shape, what)
            ra.read_into(key, va)
            rb.read_into(key, vb)
        else:
            va, vb = ra.read(key), rb.read(key)
        problem = compare_values(va, vb, atol)
        if problem:
            diffs.append(f"{key}: {problem}")
        progress(ea.nbytes)
    return diffs


def largest(entries: tp.Iterable[Entry]) -> int:
    """Bytes of the largest tensor."""
    return max((e.nbytes for e in entries if e.is_tensor), default=0)
