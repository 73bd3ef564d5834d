"""hpcx's per-user caches in ``$XDG_CACHE_HOME/hpcx`` (default ``~/.cache/hpcx``): small JSON files that
only make `hpcx status` faster (``hpc.login.siteroots``: each site profile's run root; ``hpc.login.status``:
the scheduler queries of the last list). Losing one costs one slower call, nothing else: a file that is
missing, torn, too large, not a regular file, another user's or writable by others reads as None; writes
are whole (``hpc.core.runs.write_atomic``) and a home that cannot be written is not an error.
"""

from __future__ import annotations

import json
import os
import stat
import typing as tp
from pathlib import Path

MAX_BYTES = 1 << 20


def cache_path(name: str) -> Path:
    """``$XDG_CACHE_HOME/hpcx/NAME``; ``~/.cache`` when the variable is unset or not absolute (XDG's rule)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "hpcx" / name


def read(name: str) -> tp.Any:
    """The cache file's JSON value; None when it cannot be trusted or read (see the module's doc)."""
    try:
        fd = os.open(cache_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022 \
                or info.st_size > MAX_BYTES:
            return None
        chunks, size = [], 0
        while chunk := os.read(fd, MAX_BYTES + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > MAX_BYTES:
                return None
        return json.loads(b"".join(chunks))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def write(name: str, value: tp.Any) -> None:
    """Replace the cache file with ``value`` as JSON (mode 0600, its folder 0700); quietly nothing when
    it cannot be written."""
    from hpc.core.runs import write_atomic  # lazy: startup (status's queries start before it is imported)

    path = cache_path(name)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, json.dumps(value, separators=(",", ":")), 0o600)
    except (OSError, ValueError):
        pass
