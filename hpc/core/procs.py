"""Processes on this host, by PID: used by the local scheduler (is a job's task still running) and by
checkpoint conversion (is the writer of a ``.partial-HOST-PID`` output still alive); when this process
started (queue wait and start-up figures); scheduler queries started ahead of the code that asks them
(``hpcx status``: see ``hpc.login.status``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import typing as tp


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie child of this process counts as finished);
    another user's process counts as alive; a PID no kernel can hold does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def process_start_time() -> float:
    """When this process started (epoch seconds, from /proc), else now."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            boot = time.time() - float(f.read().split()[0])  # btime is whole seconds; uptime has 10 ms
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


# ---------------------------------------------------------------- commands started ahead of their caller

# per process by nature: started by the console script before it imports the scheduler code that takes them
_AHEAD: dict[tuple[str, ...], tp.Any] = {}  # argv -> subprocess.Popen, started by start_ahead, not yet taken
asked: list[list[str]] | None = None  # a list while a caller records the commands ``try_command`` runs


def start_ahead(cmds: tp.Iterable[list[str]]) -> None:
    """Start each command (stdout and stderr piped, stdin closed) now, for ``take_ahead`` to hand to the
    caller that runs the very same argument list later: a query whose answer takes a fixed wait (slurmdbd)
    then overlaps the caller's own start-up. A command that cannot start is left to that caller."""
    for cmd in cmds:
        if tuple(cmd) in _AHEAD:
            continue
        try:
            _AHEAD[tuple(cmd)] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        except (OSError, ValueError):
            pass


def take_ahead(cmd: list[str]) -> tp.Any:
    """The process ``start_ahead`` started for exactly ``cmd``, once; None when there is none."""
    return _AHEAD.pop(tuple(cmd), None)


def stop_ahead() -> int:
    """Kill and reap the processes started ahead that nobody took, with what they started (each has a
    session of its own: a site's wrapper script around squeue and its children); how many there were.
    Their pipes are closed unread, so nothing left holding one keeps this process waiting."""
    left = list(_AHEAD.values())
    _AHEAD.clear()
    for proc in left:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()
        proc.wait()
    return len(left)
