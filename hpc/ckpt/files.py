"""Input files of a checkpoint, opened only when they are what they claim to be. Torch-free.

A checkpoint names its parts (shard files, ``.metadata``, an index's shards, digests) and hpcx
opens them. A name that is a FIFO would block the reader forever, ``/dev/zero`` or a device
would be read without end, a folder cannot be read at all: ``file_kind`` says what a path is
(from ``stat``, without opening it) and ``open_regular`` opens only regular files (with
``O_NONBLOCK``, then checked again with ``fstat`` on the open descriptor, so a path swapped
between the two is caught too). ``relative_name_problem`` tells a name inside a folder
(subfolders allowed) from one that points outside it.
"""

from __future__ import annotations

import io
import os
import stat
import typing as tp
from pathlib import Path, PurePosixPath

from hpc.core.errors import CheckpointError

METADATA_FILE = ".metadata"  # a DCP folder's metadata
INDEX_FILE = "model.safetensors.index.json"  # a sharded safetensors set's index

KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def mode_kind(mode: int) -> str | None:
    """None for a regular file, else what ``mode`` is: ``a folder``, ``a FIFO (named pipe)`` ..."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in KINDS if test(mode)), "not a regular file")


def file_kind(path: Path) -> str | None:
    """None when ``path`` is a regular file (or a symlink to one), else what it is: ``missing``,
    ``a dangling symlink``, ``a folder``, ``a FIFO (named pipe)``, ``a character device`` ..."""
    try:
        return mode_kind(os.stat(path).st_mode)
    except FileNotFoundError:
        return "a dangling symlink" if os.path.islink(path) else "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"


def not_regular(path: Path, expected: str) -> str | None:
    """One problem line when ``path`` is not a regular file: what it is and what was ``expected``."""
    kind = file_kind(path)
    if kind is None:
        return None
    if kind == "missing":
        return f"{path}: missing; expected {expected}"
    return f"{path}: is {kind}, expected {expected}; not read"


def open_regular(path: Path, expected: str) -> io.FileIO:
    """``path`` opened for reading (unbuffered) if it is a regular file; CheckpointError naming what
    it is otherwise. Never blocks on a FIFO and never reads a device."""
    problem = not_regular(path, expected)
    if problem:
        raise CheckpointError([problem])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise CheckpointError([f"{path}: cannot open ({exc.strerror or exc})"]) from None
    kind = mode_kind(os.fstat(fd).st_mode)
    if kind is not None:
        os.close(fd)
        raise CheckpointError([f"{path}: is {kind}, expected {expected}; not read"])
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)


def relative_name_problem(name: tp.Any) -> str | None:
    """None when ``name`` is a relative path inside a folder (``shard.bin``, ``sub/shard.bin``),
    else why not: not a string, empty, absolute, a ``..`` part or a NUL."""
    if not isinstance(name, str):
        return f"is {type(name).__name__}, not a file name"
    if name in ("", ".") or "\0" in name:
        return "is not a file name"
    parts = PurePosixPath(name).parts
    if name.startswith("/") or ".." in parts:
        return "points outside the folder"
    if name.endswith("/") or parts[-1] == ".":
        return "names a folder, not a file"
    return None
