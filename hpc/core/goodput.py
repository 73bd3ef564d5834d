"""Goodput by cause: where a run's wall time went, from its ledger and metrics (``hpcx status``, ``hpcx plot``).

- productive: the steps the run kept (its last step) × the median step time;
- recomputed: steps done again after a restart (each start line's ``steps_recomputed``) × the median step time;
- saves: the loop blocked in checkpoint saves (stop lines' ``save_s``);
- restarts: for every start after the first, its wait in the queue (``queue_wait_s``), its start-up
  (``startup_s``: process start to training) and its load of the checkpoint (``restore_s``);
- hangs: from a hung step's last boundary to the watchdog's verdict (the stop line's ``hang.lost_s``);
- preflight: each start thrown away by a failed pre-flight check, from its process start to the verdict
  (the stop line's ``preflight.lost_s``; a passing check's seconds are part of its start-up).

The first start's queue wait and start-up are not lost to failures and are left out (a start whose
pre-flight check failed has no start line: the start after it is a restart). Torch-free and pure.
"""

from __future__ import annotations

import statistics
import typing as tp

CAUSES = ("productive", "recomputed", "saves", "queue", "startup", "restore", "hangs", "preflight")


def step_seconds(metrics: tp.Sequence[dict]) -> float:
    """The median ``step_time_s`` of the train lines; 0 when none."""
    times = [float(r["step_time_s"]) for r in metrics if isinstance(r.get("step_time_s"), (int, float))]
    return statistics.median(times) if times else 0.0


def by_cause(ledger: tp.Sequence[dict], metrics: tp.Sequence[dict]) -> dict[str, tp.Any]:
    """Seconds by cause (``CAUSES``), the steps kept and recomputed, and ``goodput``: productive over all
    (None before a step was timed)."""
    starts = [e for e in ledger if e.get("event") == "start"]
    stops = [e for e in ledger if e.get("event") == "stop"]
    step_s = step_seconds(metrics)
    kept = max([int(r["step"]) for r in metrics if isinstance(r.get("step"), int)] or [0])
    recomputed = sum(int(e.get("steps_recomputed") or 0) for e in starts)
    first = first_event(ledger)
    restarts = [e for e in starts if e is not first]
    seconds = {"productive": kept * step_s, "recomputed": recomputed * step_s,
               "saves": sum(float(e.get("save_s") or 0.0) for e in stops),
               "queue": sum(float(e.get("queue_wait_s") or 0.0) for e in restarts),
               "startup": sum(float(e.get("startup_s") or 0.0) for e in restarts),
               "restore": sum(float(e.get("restore_s") or 0.0) for e in restarts),
               "hangs": lost(stops, "hang"), "preflight": lost(stops, "preflight")}
    total = sum(seconds.values())
    return {"seconds": {k: round(v, 3) for k, v in seconds.items()}, "steps_kept": kept,
            "steps_recomputed": recomputed, "goodput": round(seconds["productive"] / total, 4) if total and step_s else None}


def first_event(ledger: tp.Sequence[dict]) -> dict | None:
    """The ledger's first start or stop line: every start after it is a restart (a start thrown away by a
    failed pre-flight check wrote only its stop line, and the start after it is a restart all the same)."""
    return next((e for e in ledger if e.get("event") in ("start", "stop")), None)


def lost(stops: tp.Sequence[dict], cause: str) -> float:
    """The seconds the stop lines' ``cause`` record says were lost (``lost_s``)."""
    return sum(float((e.get(cause) or {}).get("lost_s") or 0.0) for e in stops)


def words(found: tp.Mapping[str, tp.Any]) -> str:
    """``goodput 91.2% (lost: recomputed 12 s, saves 3 s, queue 20 s, start-up 9 s, restore 1 s, hangs 25 s,
    preflight 40 s)``."""
    if found.get("goodput") is None:
        return ""
    names = {"startup": "start-up"}
    lost = ", ".join(f"{names.get(k, k)} {v:.0f} s" for k, v in found["seconds"].items() if k != "productive" and v)
    return f"goodput {100 * found['goodput']:.1f}%" + (f" (lost: {lost})" if lost else "")
