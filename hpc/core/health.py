"""Node health across the starts of a job: which node a failure came from, and which nodes to keep out.

A failed start's stop line (written by the batch script's check after srun, ``hpc.schedulers.slurm.requeue``)
names the nodes of its failed ranks (``failed_nodes``) and whether the node is to blame (``node_fault``):

- a failed rank ended by a signal (SIGKILL, SIGBUS, SIGSEGV …: the kernel, the OOM killer, a lost GPU;
  a Python error is the code's and excludes nothing),
- a rank that hung and did not answer the watchdog (``trainer.watchdog``: its process never dumped its
  stacks: stopped, or stuck in the kernel or the driver),
- an error whose words blame the hardware (``HARDWARE``: an uncorrectable ECC error, a GPU fallen off the bus).

On the requeue after such a failure the job excludes the nodes that failed it within the last
``health.exclude_minutes`` (newest first, at most ``health.exclude_nodes``, and never so many that the job
no longer fits its partition: ``JobSide.spare_nodes``); the stop line records the list
(``excluded_nodes``) and until when (``excluded_until``). Each requeue after a failure sets the list anew,
so a node whose window has passed comes back then. Torch-free and pure but for ``Health`` defaults.
"""

from __future__ import annotations

import json
import os
import re
import typing as tp
from dataclasses import dataclass, fields
from pathlib import Path

from hpc.core.config import field

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.schedulers.base import JobSide

# Words of an error that blame the node's hardware rather than the code.
HARDWARE = re.compile(r"uncorrectable ECC|ECC error|fallen off the bus|GPU is lost|Xid \d+|"
                      r"CUDA-capable device.*(busy|unavailable)|NVLink (error|failure)|Bus error", re.I)
HANG_EXIT = 86  # the status a rank's watchdog ends it with (``trainer.watchdog``): srun names it first


@dataclass
class Health:
    exclude_nodes: int = field(2, doc="Nodes the job keeps out at once after they failed it (a rank killed by "
                               "a signal, a hang its rank did not answer, a failed pre-flight check): each "
                               "requeue after a failure asks the scheduler to exclude them (Slurm: `scontrol "
                               "update ExcNodeList`), never so many that the job no longer fits its partition. "
                               "0: exclude none.", minimum=0, maximum=1024)
    exclude_minutes: float = field(60.0, doc="How long a node that failed the job stays excluded; it comes "
                                   "back at the first requeue after that.", minimum=0)
    hang_timeout_s: float = field(0.0, doc="Hang watchdog: no step boundary on a rank for this long dumps "
                                  "every rank's Python stacks into `RUN/hangs/`, names the rank that hung and "
                                  "ends the job step, which is requeued. 0: `hang_factor` × the median step "
                                  "time measured so far, at least `hang_floor_s` and below "
                                  "`parallel.step_timeout_s` (the collective timeout would fire first).",
                                  minimum=0)
    hang_factor: float = field(10.0, doc="The automatic hang timeout in step times (see `hang_timeout_s`).",
                               minimum=1)
    hang_floor_s: float = field(60.0, doc="The automatic hang timeout's least value in seconds.", minimum=1)
    watchdog: bool = field(True, doc="Run the hang watchdog in every rank (hpcx's trainer).")
    straggler_every: int = field(50, doc="Straggler report: every this many steps each rank's compute and wait "
                                 "in collectives over the interval are gathered (one small all-gather) and rank 0 "
                                 "writes them to `metrics.jsonl` (`kind = \"ranks\"`). 0: off.", minimum=0)
    straggler_factor: float = field(1.5, doc="A rank whose compute exceeds the median of the other ranks' by "
                                    "more than this factor for `straggler_intervals` intervals in a row is named "
                                    "a straggler (rank 0's log, `hpcx status`, the ledger's stop line).",
                                    minimum=1)
    straggler_intervals: int = field(3, doc="Intervals in a row over `straggler_factor` that name a straggler.",
                                     minimum=1, maximum=1000)
    exclude_stragglers: bool = field(False, doc="A straggler's node joins the nodes the job excludes on its "
                                     "next requeue (after a failure, a preemption or the time limit; same window "
                                     "and cap: `exclude_nodes`, `exclude_minutes`).")
    preflight: bool = field(True, doc="Pre-flight check before the first step of each start (hpcx's trainer): "
                            "each rank's device (visible, a small matmul right, memory as `node.gpu_memory_gb` "
                            "says), then a timed all-reduce of a few MB and, across nodes, a shift to each "
                            "neighbouring node, against the site's `node.intra_bandwidth_gbs` and "
                            "`network.bandwidth_gbs`. A node that fails is named in the ledger (cause "
                            "`preflight`) and the job is requeued without it (see `exclude_nodes`) instead of "
                            "training. A slow fabric on every node only warns.")
    preflight_min_bandwidth_fraction: float = field(0.25, doc="The pre-flight floor: measured bandwidth below "
                                                    "this fraction of the site's expected figure fails the "
                                                    "node. Sites without a figure (CPU/gloo) only log it.",
                                                    minimum=0, maximum=1)
    preflight_timeout_s: float = field(120.0, doc="How long the pre-flight check waits for every rank's "
                                       "results; the node of a rank that posts none by then (stuck, gone) "
                                       "failed it.", minimum=1, maximum=3600)


def health_of(spec: tp.Mapping[str, tp.Any]) -> Health:
    """The ``[health]`` section of a resolved spec as a dict (a run folder from before it: the defaults)."""
    given = spec.get("health") if isinstance(spec.get("health"), dict) else {}
    names = {f.name for f in fields(Health)}
    return Health(**{k: v for k, v in (given or {}).items() if k in names})


# ---------------------------------------------------------------- one failure (pure)


def failed_nodes(failed_ranks: tp.Sequence[int], reports: tp.Sequence[dict],
                 task_ends: tp.Sequence[dict]) -> list[str]:
    """The nodes of the failed ranks: where srun saw them end, else where they reported from."""
    failed = set(failed_ranks)
    nodes = [e["host"] for e in task_ends if e.get("host") and set(e.get("ranks", [])) & failed]
    nodes += [r["host"] for r in reports if r.get("host") and r.get("rank") in failed]
    return list(dict.fromkeys(nodes))


def node_fault(account: tp.Mapping[str, tp.Any], reports: tp.Sequence[dict]) -> bool:
    """Whether the failure in ``account`` (``hpc.core.failures.failure_account``) is the node's: a failed
    rank ended by a signal, a failed rank's report that says so (a hang without an answer, a pre-flight
    check), or an error whose words blame the hardware."""
    failed = set(account.get("failed_ranks", []))
    if account.get("signal"):
        return True
    if any(r.get("node_fault") and r.get("rank") in failed for r in reports):
        return True
    return bool(HARDWARE.search(str(account.get("error") or "")))


# ---------------------------------------------------------------- exclusions across starts (pure)


def faults(ledger: tp.Sequence[dict], stragglers: bool = False) -> list[tuple[str, float]]:
    """(node, time) of each failure the ledger blames on a node, oldest first; with ``stragglers``
    (``exclude_stragglers``) also the node of each straggler a stop line names (``hpc.core.straggler``)."""
    found = [(node, float(e.get("time", 0.0))) for e in ledger
             if e.get("event") == "stop" and e.get("node_fault") for node in e.get("failed_nodes", [])]
    if stragglers:
        found += straggler_nodes(ledger)
    return sorted(found, key=lambda f: f[1])


def straggler_nodes(ledger: tp.Sequence[dict]) -> list[tuple[str, float]]:
    """(node, time of the stop line) of each straggler the ledger's stop lines name."""
    return [(str(s["host"]), float(e.get("time", 0.0))) for e in ledger if e.get("event") == "stop"
            for s in e.get("stragglers") or [] if isinstance(s, dict) and s.get("host")]


def exclusions(found: tp.Sequence[tuple[str, float]], now: float, health: Health,
               spare: int | None) -> dict[str, float]:
    """Node → until when it is excluded: those that failed within the window, newest first, at most
    ``health.exclude_nodes`` and ``spare`` (the partition's nodes the job does not need; None: unknown)."""
    window = 60.0 * health.exclude_minutes
    cap = health.exclude_nodes if spare is None else min(health.exclude_nodes, max(0, spare))
    latest: dict[str, float] = {}
    for node, when in found:
        latest[node] = max(when, latest.get(node, when))
    recent = sorted(((when, node) for node, when in latest.items() if when + window > now), reverse=True)
    return {node: round(when + window, 3) for when, node in recent[:cap]}


def exclude(ledger: tp.Sequence[dict], found: tp.Sequence[tuple[str, float]], now: float, health: Health,
            side: JobSide) -> dict[str, tp.Any]:
    """Ask the scheduler to keep the nodes of ``found`` (``exclusions``) out of the next start: the stop
    line's ``excluded_nodes``, ``excluded_until`` and ``exclude_failed`` (why it could not). The list is set
    anew each time, so that a node whose window has passed comes back; {} when nothing is excluded now or
    was before (nothing to ask)."""
    until = exclusions(found, now, health, side.spare_nodes() if found else None)
    if not until and not active(ledger, 0.0):
        return {}
    why_not = side.exclude(list(until))
    return {"excluded_nodes": list(until), "excluded_until": until, **({"exclude_failed": why_not} if why_not else {})}


def active(ledger: tp.Sequence[dict], now: float) -> dict[str, float]:
    """The nodes still excluded at ``now`` by the newest stop line that set the list (for ``hpcx status``)."""
    for e in reversed(ledger):
        if e.get("event") == "stop" and "excluded_until" in e:
            return {n: float(t) for n, t in (e.get("excluded_until") or {}).items() if float(t) > now}
    return {}


def exclusion_words(until: tp.Mapping[str, float], now: float) -> str:
    """``excluded n1 (41 min more), n3 (5 min more)``; "" when none."""
    if not until:
        return ""
    return "excluded " + ", ".join(f"{n} ({max(1, round((t - now) / 60))} min more)" for n, t in until.items())


# ---------------------------------------------------------------- heartbeats and hangs (the run folder)


def beats_dir(run_dir: Path) -> Path:
    """``RUN/health/``: each rank's heartbeat (``rank-R.json``: rank, host, pid, the step of its last boundary,
    the time it was written, incarnation), rewritten every few seconds by ``trainer.watchdog`` while the rank
    lives (from its first step boundary on); what ``hpcx drill`` aims at."""
    return Path(run_dir) / "health"


def hang_dir(run_dir: Path, incarnation: str) -> Path:
    """``RUN/hangs/INCARNATION/``: each answering rank's stacks (``rank-R.stacks.txt``) and account
    (``rank-R.json``), and the verdict (``hang.json``)."""
    return Path(run_dir) / "hangs" / incarnation


BEAT_EVERY_S = 5.0  # heartbeats reach the run folder at most this often (a few per minute per rank)


def write_beat(run_dir: Path, rank: int, step: int, incarnation: str, wall: float, host: str | None = None) -> None:
    """This process's heartbeat as ``rank`` at ``step`` (the last step boundary): what ``hpcx drill`` aims at
    and the watchdog reads. One definition for a trainer rank (``trainer.watchdog``) and a script's
    (``hpc.job.log``)."""
    folder = beats_dir(run_dir)
    folder.mkdir(exist_ok=True)
    write_json_atomic(folder / f"rank-{rank}.json", {
        "rank": rank, "host": host or os.uname().nodename, "pid": os.getpid(), "step": step, "time": wall,
        "incarnation": incarnation})


def read_beats(run_dir: Path) -> dict[int, dict]:
    """Rank → its last heartbeat (unreadable ones left out: a rank may be writing)."""
    found: dict[int, dict] = {}
    for path in sorted(beats_dir(run_dir).glob("rank-*.json")):
        beat = _beat(path)
        if beat:
            found[beat["rank"]] = beat
    return found


def read_beat(run_dir: Path, rank: int) -> dict:
    """One rank's last heartbeat; {} when it has none that can be read."""
    beat = _beat(beats_dir(run_dir) / f"rank-{rank}.json")
    return beat if beat.get("rank") == rank else {}


def _beat(path: Path) -> dict:
    try:
        beat = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return beat if isinstance(beat, dict) and isinstance(beat.get("rank"), int) else {}


def write_json_atomic(path: Path, record: dict) -> None:
    """Write ``record`` beside ``path`` and rename it there: a reader sees the old line or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def hang_verdict(world: int, answers: tp.Mapping[int, dict], beats: tp.Mapping[int, dict]) -> dict[str, tp.Any]:
    """Which ranks hung, from the accounts of the ranks whose watchdog fired (``answers``: rank → step,
    where, collective) and the heartbeats: the ranks that did not answer (stopped, or stuck in the kernel
    or the driver: their node is to blame), else those furthest behind, preferring one that is not waiting
    in a collective (a stuck data loader, a deadlock of its own)."""
    silent = [r for r in range(world) if r not in answers]
    if silent:
        hung, fault = silent, True
    else:
        low = min(int(a.get("step", 0)) for a in answers.values())
        behind = [r for r, a in sorted(answers.items()) if int(a.get("step", 0)) == low]
        hung, fault = [r for r in behind if not answers[r].get("collective")] or behind, False
    first = hung[0]
    beat, answer = beats.get(first, {}), answers.get(first, {})
    step = hung_step(first, answers, beats)
    where = answer.get("where") or (f"no answer to the watchdog (stopped, or stuck in the kernel or the driver); "
                                    f"its last heartbeat was at step {beat.get('step', '?')}")
    return {"ranks": hung, "rank": first, "step": step + 1, "host": answer.get("host") or beat.get("host"),
            "where": where, "node_fault": fault,
            "error": f"hang at step {step + 1}, rank {first} (last seen in {where})"[:300]}


def hung_step(rank: int, answers: tp.Mapping[int, dict], beats: tp.Mapping[int, dict]) -> int:
    """The last step boundary of a hung rank: its own account; else, for a silent one, at least the slowest
    answering rank's (the ranks step together through their collectives, and a heartbeat may lag a few
    seconds); else its heartbeat."""
    if rank in answers:
        return int(answers[rank].get("step", 0))
    beat = int(beats.get(rank, {}).get("step", 0))
    return max(beat, min(int(a.get("step", 0)) for a in answers.values())) if answers else beat
