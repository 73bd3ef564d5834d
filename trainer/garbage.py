"""Python's garbage collector under the training loop: off, and collected every N steps on every rank.

An automatic collection starts whenever allocations cross a threshold, so it runs at a different
moment on each rank; a rank collecting a large heap stalls the collective the others already wait
in, and every step is as slow as the slowest rank's pause. With ``train.gc_every = N`` the
automatic collector is off for the loop and each rank collects (the young generations, as
torchtitan does) after the same step boundaries, so the pauses coincide. 0 leaves Python's own.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("hpcx.trainer")


class GarbageCollection:
    """``gc.disable`` for the loop and ``gc.collect(1)`` every ``every`` steps (0: Python's automatic GC)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.was_enabled = gc.isenabled()
        if every > 0:
            gc.disable()
            collect("before the first step")

    def step(self, step: int) -> bool:
        """After step ``step``'s boundary: collect when it is a multiple of ``every``; whether it did."""
        if self.every <= 0 or step % self.every:
            return False
        collect(f"step {step}")
        return True

    def close(self) -> None:
        """Give the automatic collector back as it was (tests and benches run several loops)."""
        if self.every > 0 and self.was_enabled:
            gc.enable()


def collect(reason: str) -> None:
    """One collection of generations 0 and 1, logged with its time."""
    tic = time.perf_counter()
    gc.collect(1)
    log.debug("gc.collect(1) %s: %.3f s", reason, time.perf_counter() - tic)
