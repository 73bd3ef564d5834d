"""Outputs that appear whole or not at all. Torch-free.

An output is written under a temporary name beside its destination,
``.NAME.partial-HOST-PID``, and renamed to ``NAME`` only when complete. ``staged`` removes
the temporary on every error path (an exception, Ctrl-C, a SIGTERM turned into SystemExit by
the CLI); what a SIGKILL or a crash leaves behind is swept by the next output written into the
same folder: a partial of *this* host whose process is gone. Partials of other hosts (a
shared file system) and of live processes are never touched.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import typing as tp
from contextlib import contextmanager
from pathlib import Path

from hpc.core.errors import CheckpointError, UserError
from hpc.core.procs import pid_alive

PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?:(?P<host>.+)-)?(?P<pid>\d+)$")


def _host() -> str:
    return socket.gethostname().replace("/", "_") or "localhost"


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_path(dst: Path) -> Path:
    """The temporary name this process writes ``dst`` under."""
    return dst.parent / f".{dst.name}.partial-{_host()}-{os.getpid()}"


def remove(path: Path) -> None:
    """Remove a file or a folder tree, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def stale_partials(folder: Path) -> list[Path]:
    """Partials in ``folder`` left by dead processes of this host (or, for names without a host,
    written by hpcx before partials carried one, by dead processes here)."""
    host, found = _host(), []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        m = PARTIAL.match(name)
        if m and m.group("host") in (None, host) and not pid_alive(int(m.group("pid"))):
            found.append(folder / name)
    return found


def sweep(folder: Path) -> list[Path]:
    """Remove ``stale_partials(folder)``; the paths removed."""
    stale = stale_partials(folder)
    for path in stale:
        remove(path)
    return stale


class _Stops:
    """A stop asked for by a signal (SIGTERM's SystemExit, Ctrl-C's KeyboardInterrupt) while torch's C++
    zip writer or reader runs: it calls back into Python (a file's ``write``/``read``) from C, and an
    exception a handler raised there would cross those C frames and abort the process, leaving the
    partial behind. Inside ``stops_deferred`` the handler records the stop; the block raises it on
    exit, in Python. (Blocking the signal would not do: the kernel hands a process-directed signal to
    another thread, and CPython runs the handler in the main thread wherever it is.)"""

    depth = 0
    pending: BaseException | None = None


_STOPS = _Stops()  # process-wide, as signal handlers are


def stop_now_or_later(stop: BaseException) -> None:
    """From a signal handler: raise ``stop`` now, or, inside ``stops_deferred``, when that block ends."""
    if _STOPS.depth:
        if _STOPS.pending is None:
            _STOPS.pending = stop
        return
    raise stop


@contextmanager
def stops_deferred() -> tp.Iterator[None]:
    """Run a call into torch's C++ zip code; a stop that came meanwhile is raised when it returns."""
    _STOPS.depth += 1
    try:
        yield
    finally:
        _STOPS.depth -= 1
        if not _STOPS.depth and _STOPS.pending is not None:
            stop, _STOPS.pending = _STOPS.pending, None
            raise stop


def check_destination(dst: Path, make_parents: bool = False) -> None:
    """Refuse a ``dst`` that exists or whose folder does not (before anything is read); with
    ``make_parents``, a missing folder is fine (``parents_made`` creates it), one that is a file is not."""
    if dst.exists() or dst.is_symlink():
        raise CheckpointError([f"{dst}: already exists; choose a new destination (outputs are never overwritten)"])
    if make_parents:
        above = next((p for p in dst.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise CheckpointError([f"{above}: not a folder, so {dst} cannot be made below it"])
    elif not dst.parent.is_dir():
        raise CheckpointError([f"{dst.parent}: no such folder for the output"])


@contextmanager
def parents_made(dst: Path) -> tp.Iterator[None]:
    """The folders above ``dst`` that are missing, created for the block; removed again (those left
    empty) when it raises, so a failed output leaves nothing behind."""
    missing = [p for p in reversed(dst.parents) if not p.exists()]
    try:
        for folder in missing:
            folder.mkdir()
    except OSError as exc:
        _remove_empty(missing)
        raise UserError([f"{dst.parent}: cannot create the output's folder ({describe(exc)})"]) from None
    try:
        yield
    except BaseException:
        _remove_empty(missing)
        raise


def _remove_empty(folders: list[Path]) -> None:
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            pass  # not made, or not empty: left as it is


def commit(tmp: Path, dst: Path) -> Path:
    """Rename the finished ``tmp`` to ``dst`` (refusing an existing ``dst``) and sync the parent."""
    if dst.exists() or dst.is_symlink():
        remove(tmp)
        raise CheckpointError([f"{dst}: already exists; hpcx never writes into an existing checkpoint"])
    os.rename(tmp, dst)
    fsync_dir(dst.parent)
    return dst


@contextmanager
def staged(dst: Path, *, folder: bool = False) -> tp.Iterator[Path]:
    """A temporary path (a new folder when ``folder``) that becomes ``dst`` when the block ends.

    On any exception the temporary is removed and nothing appears at ``dst``; an ``OSError``
    from writing (disk full, permission) becomes one ``UserError`` line. Stale partials of
    dead processes beside ``dst`` are swept first.
    """
    check_destination(dst)
    sweep(dst.parent)
    tmp = partial_path(dst)
    remove(tmp)
    try:
        if folder:
            tmp.mkdir()
        yield tmp
        commit(tmp, dst)
    except OSError as exc:
        remove(tmp)
        raise UserError([f"{dst}: cannot write ({describe(exc)}); nothing was written"]) from None
    except BaseException:
        remove(tmp)
        raise


def describe(exc: OSError) -> str:
    """``No space left on device`` & co.: the error without Python's decoration."""
    return exc.strerror or errno.errorcode.get(exc.errno or 0, "") or str(exc)


def fsync_file(f: tp.BinaryIO) -> None:
    """Flush Python's buffer and the kernel's for an open file."""
    f.flush()
    os.fsync(f.fileno())
