"""Stragglers: a rank whose own compute is slower than the others' for several intervals in a row is named.

Every ``health.straggler_every`` steps each rank of hpcx's trainer hands in its compute and its wait in
collectives over the interval (``trainer.straggler``); rank 0 gets them all (one small all-gather) and
this module judges them. A rank's ratio is its compute over the median compute of the *other* ranks (with
two ranks the plain median is the mean, and a rank twice as slow would be only 1.33× it; at 1024 ranks
the two medians agree). A ratio above ``health.straggler_factor`` for ``health.straggler_intervals``
intervals in a row names the rank; it stays named while its ratio stays above, and a single interval at
or below the factor ends its streak. A time that is not a finite number ≥ 0 (a clock gone wrong) is
unknown: that rank's streak ends, and it is left out of the others' medians; an interval whose others'
median is 0 names no one.

The named ranks reach the run folder (``RUN/health/stragglers.json``, rewritten when the verdict
changes: ``hpcx status`` shows it) and the ledger's stop line (``stragglers``); with
``health.exclude_stragglers`` their nodes join the nodes the next requeue excludes (``hpc.core.health``:
after a failure the check after srun, after a preemption or the time limit rank 0: ``exclusion_after_requeue``). Torch-free and pure but for reading and writing that file.
"""

from __future__ import annotations

import bisect
import json
import math
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

from hpc.core import health

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.schedulers.base import JobSide

FILE = "stragglers.json"  # in ``RUN/health/`` (``hpc.core.health.beats_dir``)


def known(value: tp.Any) -> bool:
    """Whether ``value`` is a time: a finite number ≥ 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def median_of_others(times: tp.Sequence[float]) -> list[float | None]:
    """Each rank's median of the other ranks' known times (None: no other known time); O(n log n)."""
    valid = sorted(float(t) for t in times if known(t))
    out: list[float | None] = []
    for t in times:
        out.append(_median_without(valid, float(t)) if known(t) else _median(valid))
    return out


def _median_without(ordered: list[float], value: float) -> float | None:
    """The median of ``ordered`` less one element equal to ``value`` (which it holds)."""
    rest = len(ordered) - 1
    if rest < 1:
        return None
    place = bisect.bisect_left(ordered, value)
    at = lambda j: ordered[j] if j < place else ordered[j + 1]  # noqa: E731 - the list without ``place``
    return (at((rest - 1) // 2) + at(rest // 2)) / 2


def _median(ordered: list[float]) -> float | None:
    if not ordered:
        return None
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def ratios(compute: tp.Sequence[float]) -> list[float | None]:
    """Each rank's compute over the median of the others' (None: unknown own time, or no other known time,
    or the others' median is 0)."""
    out: list[float | None] = []
    for own, others in zip(compute, median_of_others(compute)):
        out.append(float(own) / others if known(own) and others else None)
    return out


def median(values: tp.Sequence[float]) -> float | None:
    """The median of the known values (None: none)."""
    return _median(sorted(float(v) for v in values if known(v)))


@dataclass
class Judge:
    """The streaks of one start (rank 0 keeps it): ``observe`` one interval at a time."""

    factor: float = 1.5
    intervals: int = 3
    streaks: list[int] = field(default_factory=list)

    def observe(self, compute: tp.Sequence[float]) -> list[float | None]:
        """Count this interval into each rank's streak; returns the ratios."""
        found = ratios(compute)
        if len(self.streaks) != len(found):  # the first interval (or a world that changed: start over)
            self.streaks = [0] * len(found)
        self.streaks = [s + 1 if r is not None and r > self.factor else 0 for s, r in zip(self.streaks, found)]
        return found

    def named(self) -> list[int]:
        """The ranks over the factor for ``intervals`` intervals in a row, now."""
        return [rank for rank, streak in enumerate(self.streaks) if streak >= self.intervals]


def interval_record(step: int, steps: int, compute: tp.Sequence[float], wait: tp.Sequence[float],
                    found: tp.Sequence[float | None]) -> dict[str, tp.Any]:
    """The metrics line of one interval: ``kind = "ranks"``, and under ``ranks`` each rank's compute and
    wait in seconds per step, their ratios and the median compute (nested: no plot or reader of train lines
    takes them for one)."""
    per = max(1, steps)
    tidy = lambda xs: [round(float(x) / per, 6) if known(x) else None for x in xs]  # noqa: E731
    middle = median(compute)
    return {"kind": "ranks", "step": step, "ranks": {
        "steps": steps, "compute_s": tidy(compute), "wait_s": tidy(wait),
        "median_compute_s": None if middle is None else round(middle / per, 6),
        "ratio": [None if r is None else round(r, 3) for r in found]}}


def stragglers(judge: Judge, found: tp.Sequence[float | None], hosts: tp.Sequence[str]) -> list[dict[str, tp.Any]]:
    """The named ranks as the run folder, status and the ledger carry them: rank, host, ratio, intervals."""
    out = []
    for rank in judge.named():
        ratio = found[rank]
        out.append({"rank": rank, "host": hosts[rank] if rank < len(hosts) else "", "intervals": judge.streaks[rank],
                    "ratio": None if ratio is None else round(ratio, 2)})
    return out


def words(found: tp.Mapping[str, tp.Any]) -> str:
    """``straggler: rank 3 on n7, 2.1× the median over the last 3 intervals``."""
    host = f" on {found['host']}" if found.get("host") else ""
    ratio = found.get("ratio")
    times = f"{ratio:.1f}× the median" if isinstance(ratio, (int, float)) else "slower than the median"
    count = int(found.get("intervals") or 0)
    span = "the last interval" if count == 1 else f"the last {count} intervals"
    return f"straggler: rank {found.get('rank', '?')}{host}, {times} over {span}"


def all_words(named: tp.Sequence[tp.Mapping[str, tp.Any]]) -> str:
    """The words of each named rank, joined with "; " ("" when none)."""
    return "; ".join(words(s) for s in named)


# ---------------------------------------------------------------- the run folder


def path_of(run_dir: Path) -> Path:
    return health.beats_dir(run_dir) / FILE


def write(run_dir: Path, record: tp.Mapping[str, tp.Any]) -> None:
    """Rank 0: the current verdict (``step``, ``time``, ``incarnation``, ``stragglers``: the ranks named
    now, ``named``: every rank named during this start, as last named), atomically."""
    path = path_of(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    health.write_json_atomic(path, dict(record))


def read(run_dir: Path) -> dict[str, tp.Any]:
    """The last verdict written ({} when none or unreadable)."""
    try:
        found = json.loads(path_of(run_dir).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) and isinstance(found.get("stragglers"), list) else {}


def of_start(run_dir: Path, incarnation: str) -> list[dict[str, tp.Any]]:
    """The ranks named during the start ``incarnation``, recovered or not (for its stop line); [] when none."""
    found = read(run_dir)
    return list(found.get("named") or []) if found.get("incarnation") == incarnation else []


def merged(before: tp.Sequence[tp.Mapping[str, tp.Any]], now: tp.Sequence[tp.Mapping[str, tp.Any]]) -> list[dict]:
    """Every rank named during a start: ``now``'s record of a rank replaces ``before``'s; in rank order."""
    out = {int(s["rank"]): dict(s) for s in before}
    out.update({int(s["rank"]): dict(s) for s in now})
    return [out[r] for r in sorted(out)]


def exclusion_after_requeue(ledger: tp.Sequence[dict], named: tp.Sequence[tp.Mapping[str, tp.Any]],
                            settings: health.Health, side: JobSide, now: float) -> dict[str, tp.Any]:
    """After a requeue rank 0 was granted (a preemption, the time limit) with ``exclude_stragglers``: the
    nodes of this start's stragglers join those node health keeps out (``hpc.core.health.exclusions``: the
    same window and cap, the ledger's failed nodes and stragglers too), asked of the scheduler; the stop
    line's fields. {} when there is nothing to add: the list the scheduler holds stays."""
    if not settings.exclude_stragglers or not named:
        return {}
    found = [*health.faults(ledger, stragglers=True), *((str(s["host"]), now) for s in named if s.get("host"))]
    return health.exclude(ledger, found, now, settings, side)
