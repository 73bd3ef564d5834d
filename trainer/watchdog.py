"""The hang watchdog of one rank: no step boundary for too long → stacks dumped, the rank that hung named,
the job step ended (Slurm then requeues it, and the next start resumes from the newest checkpoint).

A thread in every rank wakes every ``poll_s``. The loop calls ``beat(step)`` after each step boundary
(``trainer.loop.step_boundary``) and suspends the watchdog around work that may rightly take long
(checkpoint saves, evaluations). The timeout is ``health.hang_timeout_s``, else ``hang_factor`` × the
median interval between boundaries measured so far, at least ``hang_floor_s`` and below the collective
timeout (``parallel.step_timeout_s``, which would otherwise end the waiting ranks first, naming no one);
it is armed once one interval was measured (start-up, resume and the first step are the long timeout's).

A save or an evaluation suspends the step clock, not the watch: each rank's thread keeps its heartbeat fresh
(every ``BEAT_EVERY_S``), and a rank suspended for longer than the timeout reads the heartbeat of one neighbour
(rank + 1, around the ring: one file per rank per poll at any scale). A neighbour silent for longer than the
timeout (and ``SILENT_S``) is stopped or gone, and the rank fires: a node that stops during a save is found
in the hang timeout, not the long collective timeout of saves (``parallel.timeout_s``). Suspended ranks join
a firing as the others do, so that only the silent ones are named.

When it fires, a rank writes into ``RUN/hangs/INCARNATION/`` its Python stacks (faulthandler, every
thread: the collective it waits in is the innermost ``torch.distributed`` frame) and its account (step,
where its main thread is). A rank that has waited half the timeout joins as soon as that folder exists,
so every rank still able to answer does (one ``stat`` per poll, and only while waiting long). After a
grace period the lowest answering rank decides (``hpc.core.health.hang_verdict``): the ranks that did not
answer hung (their node is to blame: stopped, or stuck in the kernel or the driver), else the one
furthest behind; it writes the verdict (``hang.json``) and the failure report of the hung rank
("hang at step N, rank R (last seen in …)") for the check after srun. Then each answering rank ends its
process (``on_fire``: on Slurm, exit status ``HANG_EXIT``; srun's ``--kill-on-bad-exit`` ends the rest).

Torch-free; the clock and the sleep are injected (tests drive ``check`` and ``fire`` by hand).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
import traceback
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

from hpc.core import health, requeue
from hpc.core.health import Health

if tp.TYPE_CHECKING:  # pragma: no cover
    from trainer.resilience import Resilience
    from trainer.run import Run

log = logging.getLogger("hpcx.trainer")
CAP = 0.9  # of the collective timeout: the watchdog fires before it
BEAT_EVERY_S = health.BEAT_EVERY_S
MEASURED = 50  # intervals the median is taken over
SILENT_S = 3 * BEAT_EVERY_S  # a neighbour's heartbeat older than this (and the timeout) while suspended: silent


@dataclass
class Watchdog:
    run_dir: Path
    rank: int
    world: int
    incarnation: str
    settings: Health
    collective_timeout_s: float  # parallel.step_timeout_s (the short collective timeout)
    on_fire: tp.Callable[[dict], None]  # ends the process; gets the verdict when this rank decided
    host: str = field(default_factory=lambda: os.uname().nodename)
    clock: tp.Callable[[], float] = time.monotonic
    wall: tp.Callable[[], float] = time.time
    sleep: tp.Callable[[float], None] = time.sleep
    poll_s: float = 1.0
    step: int = 0  # the last step boundary seen
    last: float | None = None  # when (``clock``), None before the first
    intervals: list[float] = field(default_factory=list)
    paused: int = 0  # nesting of ``suspended``
    paused_at: float = 0.0  # when (``clock``) the outermost suspension began
    tainted: bool = False  # a suspension fell in the current interval: it is not measured
    beat_written: float = float("-inf")
    fired: bool = False
    silent: int | None = None  # the neighbour found silent while suspended, for the log
    stopped: threading.Event = field(default_factory=threading.Event)
    writing: threading.Lock = field(default_factory=threading.Lock)  # the loop's heartbeat and the thread's

    # ------------------------------------------------------------ the loop's side

    def beat(self, step: int) -> None:
        """A step boundary: measure the interval since the last one, write the heartbeat when due."""
        now = self.clock()
        if self.last is not None and not self.tainted:
            self.intervals = [*self.intervals[-(MEASURED - 1):], now - self.last]
        self.step, self.last, self.tainted = step, now, False
        self.keep_alive()

    def keep_alive(self) -> None:
        """Write the heartbeat when due (at most every ``BEAT_EVERY_S``), from the first step boundary on."""
        now = self.clock()
        if self.last is not None and now - self.beat_written >= BEAT_EVERY_S:
            self.beat_written = now
            self._write_beat()

    @contextlib.contextmanager
    def suspended(self) -> tp.Iterator[None]:
        """Work that may rightly take long (a save, an evaluation): not a hang unless a neighbour falls silent
        meanwhile; the interval is not measured."""
        if not self.paused:
            self.paused_at = self.clock()
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1
            self.tainted = True
            if self.last is not None:
                self.last = self.clock()

    def timeout(self) -> float | None:
        """Seconds without a boundary that make a hang; None until armed (one interval measured)."""
        if self.settings.hang_timeout_s:
            return self.settings.hang_timeout_s if self.last is not None else None
        if not self.intervals:
            return None
        auto = max(self.settings.hang_floor_s, self.settings.hang_factor * statistics.median(self.intervals))
        return min(auto, CAP * self.collective_timeout_s)

    def due(self) -> bool:
        """Whether to fire now: past the timeout, or past half of it while another rank fired already."""
        limit = self.timeout()
        if limit is None or self.last is None or self.fired:
            return False
        if self.paused:
            waited = self.clock() - self.paused_at
            return waited > limit / 2 and (self.hang_folder.is_dir() or (waited > limit and self._neighbour_silent(limit)))
        waited = self.clock() - self.last
        return waited > limit or (waited > limit / 2 and self.hang_folder.is_dir())

    def _neighbour_silent(self, limit: float) -> bool:
        """Whether the next rank around the ring has written no heartbeat of this start for ``limit`` (and
        ``SILENT_S``): stopped, or gone. No heartbeat of this start at all is no evidence (it may not have
        been written); a heartbeat of another start is not this start's neighbour."""
        if self.world < 2:
            return False
        neighbour = (self.rank + 1) % self.world
        beat = health.read_beat(self.run_dir, neighbour)
        if beat.get("incarnation") != self.incarnation or not isinstance(beat.get("time"), (int, float)):
            return False
        if self.wall() - float(beat["time"]) <= max(limit, SILENT_S):
            return False
        self.silent = neighbour
        return True

    # ------------------------------------------------------------ the thread

    def start(self) -> Watchdog:
        threading.Thread(target=self._run, name="hpcx-watchdog", daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            self.keep_alive()
            if self.due():
                self.fire()
                return

    # ------------------------------------------------------------ firing

    @property
    def hang_folder(self) -> Path:
        return health.hang_dir(self.run_dir, self.incarnation)

    def fire(self) -> None:
        """Dump, answer, let the others answer, decide (lowest answering rank), then end the process."""
        self.fired = True
        waited = self.clock() - (self.last or self.clock())
        if self.silent is not None:
            log.error("watchdog: suspended (a save or an evaluation) for %.0f s after step %d while rank %d wrote "
                      "no heartbeat: dumping stacks into %s", self.clock() - self.paused_at, self.step, self.silent,
                      self.hang_folder)
        else:
            log.error("watchdog: no step boundary for %.0f s after step %d: dumping stacks into %s", waited,
                      self.step, self.hang_folder)
        self.hang_folder.mkdir(parents=True, exist_ok=True)
        self._dump()
        answers = self._await_answers()
        if self.rank == min(answers, default=self.rank):
            self.on_fire(self._decide(answers))
            return
        self._await_verdict()  # the decider's report must be written before srun ends the step
        self.on_fire(read_verdict(self.hang_folder))

    def _await_verdict(self) -> None:
        deadline = self.clock() + self.grace_s()
        while not (self.hang_folder / "hang.json").is_file() and self.clock() < deadline:
            self.sleep(0.2)

    def _dump(self) -> None:
        with open(self.hang_folder / f"rank-{self.rank}.stacks.txt", "w") as f:
            f.write(f"rank {self.rank} on {self.host}, pid {os.getpid()}, last step boundary: step {self.step}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        where, collective = main_thread_place()
        record = {"rank": self.rank, "host": self.host, "step": self.step, "where": where, "collective": collective,
                  "time": self.wall()}
        health.write_json_atomic(self.hang_folder / f"rank-{self.rank}.json", record)

    def _await_answers(self) -> dict[int, dict]:
        """The answers in the folder once every rank answered or the grace period passed."""
        deadline = self.clock() + self.grace_s()
        while True:
            answers = read_answers(self.hang_folder)
            if len(answers) >= self.world or self.clock() >= deadline:
                return answers
            self.sleep(min(1.0, max(0.0, deadline - self.clock())))

    def grace_s(self) -> float:
        """How long the answering ranks wait for each other: a quarter of the timeout, 5 to 30 s."""
        return min(30.0, max(5.0, (self.timeout() or 0.0) / 4))

    def _decide(self, answers: dict[int, dict]) -> dict:
        verdict = health.hang_verdict(self.world, answers, health.read_beats(self.run_dir))
        lost = round(self.clock() - (self.last if self.last is not None else self.clock()), 3)  # since the boundary
        verdict.update(time=self.wall(), answered=sorted(answers), timeout_s=self.timeout(), lost_s=lost,
                       incarnation=self.incarnation)
        health.write_json_atomic(self.hang_folder / "hang.json", verdict)
        log.error("watchdog: %s", verdict["error"])
        requeue.report_failure(self.run_dir, self.incarnation, verdict["rank"], step=verdict["step"] - 1,
                               error=verdict["error"], terminated=False, host=verdict["host"], phase="train",
                               repeats=False, node_fault=verdict["node_fault"],
                               hang={k: verdict[k] for k in ("ranks", "step", "where", "timeout_s", "lost_s")})
        return verdict

    def _write_beat(self) -> None:
        try:
            with self.writing:
                health.write_beat(self.run_dir, self.rank, self.step, self.incarnation, self.wall(), self.host)
        except OSError as exc:  # a heartbeat is a help; training goes on without it
            log.warning("watchdog: could not write the heartbeat: %s", exc)


def paused(watchdog: Watchdog | None) -> tp.ContextManager:
    """``watchdog.suspended()``, or nothing without a watchdog."""
    return watchdog.suspended() if watchdog is not None else contextlib.nullcontext()


def read_verdict(folder: Path) -> dict:
    try:
        found = json.loads((folder / "hang.json").read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_answers(folder: Path) -> dict[int, dict]:
    found: dict[int, dict] = {}
    for path in folder.glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found[int(record["rank"])] = record
    return found


def main_thread_place() -> tuple[str, str]:
    """(where the main thread is: its innermost frame, and the innermost frame of hpcx's or the user's code
    below it; the ``torch.distributed`` function it waits in, "" when none)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return "an unknown place (no main thread)", ""
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    ours = next((f for f in reversed(stack) if "/torch/" not in f.filename and "threading" not in f.filename), inner)
    collective = next((f.name for f in reversed(stack) if "torch/distributed" in f.filename), "")
    where = f"{inner.name} ({short(inner.filename)}:{inner.lineno})"
    if ours is not inner:
        where += f" from {ours.name} ({short(ours.filename)}:{ours.lineno})"
    return where, collective


def short(path: str) -> str:
    """The last three parts of a file's path."""
    return "/".join(Path(path).parts[-3:])


# ---------------------------------------------------------------- in a rank of hpcx's trainer


class HangError(TimeoutError):
    """A hang the watchdog found (a ``TimeoutError``: the machine's or the network's, not the code's)."""


def watchdog_for(run: Run, world: int, guard: Resilience) -> Watchdog | None:
    """This rank's watchdog, started (``health.watchdog``), once ``guard`` knows this start's number."""
    settings = run.spec.health
    if not settings.watchdog:
        return None
    short = min(run.spec.parallel.step_timeout_s, run.spec.parallel.timeout_s)
    return Watchdog(run.run_dir, guard.rank, world, guard.incarnation, settings, short,
                    on_fire=lambda verdict: end_rank(guard, verdict)).start()


def end_rank(guard: Resilience, verdict: dict) -> None:
    """End this process after a hang: on Slurm with status ``HANG_EXIT`` (the check after srun records the
    failure from the verdict's report); elsewhere rank 0 first records it as any failure (``failed``), and
    leaves with the status that scheduler restarts the tasks on when it requeues."""
    code = health.HANG_EXIT
    deciding = guard.side is not None and guard.side.decides_failures
    if not deciding:  # nobody ends the rest of the step (srun does on Slurm): end the hung ranks here
        end_hung(guard.run_dir, verdict)
    if guard.rank == 0 and not deciding:
        try:
            guard.failed(HangError(verdict.get("error") or "hang: no step boundary within the watchdog's timeout"))
        except SystemExit as exc:  # the local scheduler's requeue status (``JobSide.leave_for_requeue``)
            code = exc.code if isinstance(exc.code, int) else code
        except Exception:  # noqa: BLE001 - the process ends regardless
            log.exception("watchdog: could not record the hang")
    for handler in log.handlers:
        handler.flush()
    os._exit(code)


def end_hung(run_dir: Path, verdict: dict) -> None:
    """SIGKILL the hung ranks that run on this host (their heartbeats say where): under a scheduler that
    restarts the tasks only once all have ended (submitit's local controller), a stopped rank would
    hold the job forever."""
    beats = health.read_beats(run_dir)
    for rank in verdict.get("ranks", []):
        beat = beats.get(rank, {})
        if beat.get("incarnation") != verdict.get("incarnation"):
            continue  # a heartbeat of an earlier start: its pid may be another process's by now
        if beat.get("host") == os.uname().nodename and isinstance(beat.get("pid"), int) and beat["pid"] != os.getpid():
            with contextlib.suppress(OSError):
                os.kill(beat["pid"], signal.SIGKILL)
