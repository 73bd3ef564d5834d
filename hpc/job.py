"""What a script run by ``[job] command`` asks of hpcx: ``from hpc import job``. Torch-free, stdlib only.

hpcx runs your command on every rank with torchrun's variables. When the scheduler warns of a
preemption or of the time limit (or ``hpcx drill`` rehearses one), hpcx creates a flag file and forwards
the signal (USR2, or ``SUBMITIT_PREEMPT_SIGNAL``) to your process, which starts with that signal
ignored: a script that does not listen is not killed by it. The loop of a script that wants to survive
preemption reads the flag at its step boundaries::

    from hpc import job

    for step in range(start, steps):
        train_one_step()
        job.log(step + 1, loss=loss.item())      # rank 0's line in metrics.jsonl (status, plot, drills)
        if job.preempted():                       # every rank sees the same file: agree as your loop does
            save_my_checkpoint(job.run_dir() / "my-ckpt.pt")
            job.requeue()                         # ask for this start's one requeue; then exit 0
            break

Outside hpcx (``torchrun train.py``, a plain ``python train.py``) ``preempted()`` is False, ``requeue()``
returns False, ``log`` does nothing and ``run_dir()`` is None: the same script runs anywhere.

The variables read: ``HPCX_RUN_DIR``, ``HPCX_PREEMPT_FLAG``, ``HPCX_REQUEUE_FILE``, ``HPCX_RESTART``,
``HPCX_INCARNATION`` and torchrun's ``RANK``; see docs/tasks.md for the whole contract.
"""

from __future__ import annotations

import json
import os
import time
import typing as tp
from pathlib import Path

RUN_DIR = "HPCX_RUN_DIR"
PREEMPT_FLAG = "HPCX_PREEMPT_FLAG"
REQUEUE_FILE = "HPCX_REQUEUE_FILE"
RESTART = "HPCX_RESTART"
INCARNATION = "HPCX_INCARNATION"  # this start's name in the run folder's records (``hpc.core.health``)
_beat_written = float("-inf")


def under_hpcx() -> bool:
    """Whether hpcx started this process (``[job] command``)."""
    return bool(os.environ.get(RUN_DIR))


def run_dir() -> Path | None:
    """The run folder (where a script may keep its own checkpoints: it outlives every requeue), or None."""
    value = os.environ.get(RUN_DIR)
    return Path(value) if value else None


def restart() -> int:
    """This start's number: 0 the first time, 1 after the first requeue, …"""
    return int(os.environ.get(RESTART) or 0)


def rank() -> int:
    """This process's global rank (torchrun's ``RANK``; 0 when not set)."""
    return int(os.environ.get("RANK") or 0)


def preempted() -> bool:
    """Whether the scheduler asked this start to stop soon (preemption, the time limit's warning, a drill).

    The same flag file for every rank, so it is cheap enough for every step; ranks that must stop at the
    same step agree as any distributed loop does (e.g. an all-reduce of the flag)."""
    flag = os.environ.get(PREEMPT_FLAG)
    return flag is not None and flag != "" and os.path.exists(flag)


def requeue() -> bool:
    """Ask for this start's one requeue (call it after saving, then let the script end with status 0): hpcx
    requeues the job once the command has exited on every rank. Any rank may ask; asking twice is asking
    once. False outside hpcx."""
    path = os.environ.get(REQUEUE_FILE)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return True
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"rank": rank(), "time": time.time()}) + "\n")
    return True


def log(step: int, **values: tp.Any) -> None:
    """A step boundary of the script. On rank 0, one line of ``RUN/metrics.jsonl``: ``step``, this start's
    number and ``values`` (numbers: ``loss`` and ``lr`` are drawn by ``hpcx plot``, any other shows in
    ``hpcx status``); ``hpcx drill --at-step`` waits on these steps. On every rank, at most every few
    seconds, the rank's heartbeat (the trainer's: ``hpc.core.health.write_beat``), which ``hpcx drill
    --hang/--slow/--fail-node`` aims at. Does nothing outside hpcx."""
    folder = run_dir()
    if folder is None:
        return
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"hpc.job.log: step = {step!r}: expected an integer >= 0")
    _beat(folder, step)
    if rank() != 0:
        return
    line = {"step": step, "start": restart(), "time": round(time.time(), 3), **values}
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def _beat(folder: Path, step: int) -> None:
    """The heartbeat of this rank, when due; a heartbeat is a help, so a failed write is ignored."""
    global _beat_written
    from hpc.core import health  # lazy: startup

    now = time.monotonic()
    if now - _beat_written < health.BEAT_EVERY_S:
        return
    _beat_written = now
    try:
        health.write_beat(folder, rank(), step, os.environ.get(INCARNATION, ""), time.time())
    except OSError:
        pass
