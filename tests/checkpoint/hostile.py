"""Builders of checkpoints that lie about sizes, pickle hostile object graphs, compress their zip
records or sit where a file should be (issue 24), and a runner of ``hpcx ckpt`` under a memory limit.

Pickles are written opcode by opcode (``pickle.dumps`` itself recurses per level and cannot
write 200,000 levels); archives are ``torch.save`` archives rebuilt with ``zipfile``.
"""

from __future__ import annotations

import io
import os
import resource
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

# ---------------------------------------------------------------- pickles, opcode by opcode

PROTO, STOP, MARK = b"\x80\x02", b".", b"("
EMPTY_LIST, EMPTY_DICT, APPEND, APPENDS, SETITEM, SETITEMS = b"]", b"}", b"a", b"e", b"s", b"u"


def text(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)  # LONG_BINPUT


def get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)  # LONG_BINGET


def integer(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)  # BININT


def deep_list(depth: int) -> bytes:
    """A list nested ``depth`` levels: ``[[[...[1]...]]]``."""
    return EMPTY_LIST * depth + integer(1) + APPEND * depth


def deep_dict(depth: int) -> bytes:
    """``{"k": {"k": ... {"k": 1}}}``, ``depth`` levels."""
    return (EMPTY_DICT + text("k")) * depth + integer(1) + SETITEM * depth


def self_list() -> bytes:
    """A list that contains itself."""
    return EMPTY_LIST + put(0) + get(0) + APPEND


def self_dict() -> bytes:
    """A dict that holds itself under ``"me"``."""
    return EMPTY_DICT + put(0) + text("me") + get(0) + SETITEM


def mutual() -> bytes:
    """Two lists that contain each other: ``a = [b]``, ``b = [a]``."""
    return EMPTY_LIST + put(0) + EMPTY_LIST + put(1) + get(0) + APPEND + APPEND


def dag(levels: int, width: int = 2, dicts: bool = False) -> bytes:
    """Level i holds ``width`` references to level i-1: ``width ** levels`` leaves along every path,
    ``levels + 1`` distinct containers."""
    # every level is pushed first (and memoized), the leaf [7] last; then each level takes the one
    # above it on the stack, and ``width - 1`` more references to it from the memo (no POP opcode:
    # torch's weights-only unpickler has none)
    if dicts:
        out = b"".join(EMPTY_DICT + put(i) + text("k0") for i in range(levels, 0, -1))
    else:
        out = b"".join(EMPTY_LIST + put(i) for i in range(levels, 0, -1))
    out += EMPTY_LIST + put(0) + integer(7) + APPEND
    for i in range(1, levels + 1):
        if dicts:
            out += SETITEM + b"".join(text(f"k{j}") + get(i - 1) + SETITEM for j in range(1, width))
        else:
            out += APPEND + (get(i - 1) + APPEND) * (width - 1)
    return out


def state_pickle(value: bytes, key: str = "train", inner: str = "x") -> bytes:
    """``{"model": {}, key: {inner: value}}`` as a whole pickle."""
    return (PROTO + EMPTY_DICT + text("model") + EMPTY_DICT + SETITEM + text(key) + EMPTY_DICT + text(inner)
            + value + SETITEM + SETITEM + STOP)


def value_pickle(value: bytes) -> bytes:
    """Just ``value`` as a whole pickle (a DCP object item or the safetensors objects dict)."""
    return PROTO + value + STOP


def torch_archive(pkl: bytes, records: dict[str, bytes] | None = None, root: str = "archive",
                  method: int = zipfile.ZIP_STORED) -> bytes:
    """A ``torch.save``-shaped zip holding ``pkl`` as ``data.pkl`` and the given storage records."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as z:
        z.writestr(f"{root}/data.pkl", pkl)
        z.writestr(f"{root}/byteorder", sys.byteorder)
        for name, data in (records or {}).items():
            z.writestr(f"{root}/data/{name}", data)
        z.writestr(f"{root}/version", "3\n")
    return buf.getvalue()


# ---------------------------------------------------------------- zip records rewritten


def rezip(data: bytes, method: int | dict[str, int], level: int | None = None) -> bytes:
    """The same archive with its records compressed by ``method`` (or a method per name suffix)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            m = method if isinstance(method, int) else next(
                (v for k, v in method.items() if info.filename.endswith(k)), zipfile.ZIP_STORED)
            zout.writestr(info.filename, zin.read(info), compress_type=m, compresslevel=level)
    return out.getvalue()


def torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def patch_central(data: bytes, name_suffix: str, *, crc: int | None = None, size: int | None = None,
                  method: int | None = None, flags: int | None = None, local: bool = True) -> bytes:
    """Patch the central directory entry (and, with ``local``, the local header) of the record whose
    name ends with ``name_suffix``: CRC-32, uncompressed size, method or flag bits."""
    out = bytearray(data)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(name_suffix))
    central = out.find(b"PK\x01\x02")
    while central >= 0:
        n = struct.unpack("<H", out[central + 28:central + 30])[0]
        if out[central + 46:central + 46 + n].decode().endswith(name_suffix):
            break
        central = out.find(b"PK\x01\x02", central + 4)
    # field offsets: (flags, method, crc, uncompressed size) in a central entry and a local header
    headers = [(central, (8, 10, 16, 24))] + ([(info.header_offset, (6, 8, 14, 22))] if local else [])
    for base, (f_at, m_at, c_at, s_at) in headers:
        for value, at, fmt in ((flags, f_at, "<H"), (method, m_at, "<H"), (crc, c_at, "<I"), (size, s_at, "<I")):
            if value is not None:
                out[base + at:base + at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(out)


def record_data_span(data: bytes, name_suffix: str) -> tuple[int, int]:
    """(offset, length) of the stored bytes of a record inside the archive bytes ``data``."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(name_suffix))
    n, m = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + n + m, info.compress_size


# ---------------------------------------------------------------- running under a memory limit


def limited_cli(*args: object, limit: int = 3 << 30, timeout: float = 120) -> tuple[int, str]:
    """``hpcx ckpt ARGS`` in a child process whose address space is capped at ``limit`` bytes: a
    path that allocates what a file declares fails there (exit 1 with a traceback) instead of
    passing by overcommit. (exit code, stdout + stderr)."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "hpc.cli", "ckpt", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cap, env=env)
    return proc.returncode, proc.stdout + proc.stderr


def one_error_line(out: str, *expect: str) -> None:
    """``out`` is ``error:`` lines only, each naming what ``expect`` says, and no traceback."""
    lines = out.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), out
    assert "Traceback" not in out, out
    for e in expect:
        assert e in out, (e, out)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
