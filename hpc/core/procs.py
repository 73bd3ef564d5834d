"""Processes on this host, by PID: used by the local scheduler (is a job's task still running) and by
checkpoint conversion (is the writer of a ``.partial-HOST-PID`` output still alive); when this process
started (queue wait and start-up figures)."""

from __future__ import annotations

import os
import time


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
