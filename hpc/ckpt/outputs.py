"""Outputs that appear whole or not at all: a temporary name beside the destination, renamed
only when complete. Torch-free."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hpc.errors import CheckpointError


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_path(dst: Path) -> Path:
    """The temporary name this process writes ``dst`` under."""
    return dst.parent / f".{dst.name}.partial-{os.getpid()}"


def remove(path: Path) -> None:
    """Remove a file or a folder tree, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def commit(tmp: Path, dst: Path) -> Path:
    """Rename the finished ``tmp`` to ``dst`` (refusing an existing ``dst``) and sync the parent."""
    if dst.exists():
        remove(tmp)
        raise CheckpointError([f"{dst}: already exists; hpcx never writes into an existing checkpoint"])
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
    return dst


def fresh(dst: Path) -> Path:
    """A new temp path beside ``dst``; refuses when ``dst`` exists."""
    if dst.exists():
        raise CheckpointError([f"{dst}: already exists; choose a new destination (outputs are never overwritten)"])
    if not dst.parent.is_dir():
        raise CheckpointError([f"{dst.parent}: no such folder for the output"])
    tmp = partial_path(dst)
    remove(tmp)
    return tmp
