"""One progress line for a preparation: bytes of input read, tokens written, tokens/s and ETA.

On a terminal it redraws one line in place; elsewhere (a Slurm log) it prints a line every
``quiet_interval_s``. The ETA is from the input bytes still unread at the current byte rate."""

from __future__ import annotations

import sys
import time
import typing as tp


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _size(n: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{n:.0f}"
        n /= 1000
    return f"{n:.1f}P"


class Progress:
    """Counts input bytes and tokens across all workers and draws them."""

    def __init__(self, total_bytes: int, stream: tp.TextIO | None = None, quiet_interval_s: float = 10.0):
        self.total, self.bytes, self.tokens = max(1, total_bytes), 0, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.drawn = time.monotonic()
        self.interval = 0.25 if self.tty else quiet_interval_s

    def update(self, nbytes: int, tokens: int) -> None:
        """Count input bytes read and tokens written; redraw when it is time."""
        self.bytes += nbytes
        self.tokens += tokens
        if time.monotonic() - self.drawn >= self.interval:
            self.draw()

    def line(self) -> str:
        """Share done, bytes, tokens, tokens/s and ETA."""
        elapsed = max(1e-9, time.monotonic() - self.start)
        rate = self.bytes / elapsed
        eta = (self.total - self.bytes) / rate if rate else 0.0
        return (f"prepare {100 * min(self.bytes, self.total) / self.total:5.1f}%  {_size(self.bytes)}B of "
                f"{_size(self.total)}B  {_size(self.tokens)} tokens  {_size(self.tokens / elapsed)} tokens/s  "
                f"ETA {_duration(eta)}")

    def draw(self, final: bool = False) -> None:
        """Print the line (in place on a terminal; ``final`` ends it)."""
        self.drawn = time.monotonic()
        if self.tty:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
