"""Running the groups of a plan on this machine: in this process (one worker) or in ``--workers``
spawned processes, with one progress line fed by all of them."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import typing as tp
from pathlib import Path

from hpc.data.prepare import pending_groups, run_group
from hpc.data.progress import Progress

# per process by nature: a pool initializer hands a spawned worker its queue only through a global
_QUEUE: tp.Any = None  # the progress queue of a worker process


def _init_worker(q: tp.Any, threads: int) -> None:
    """Before tokenizers is imported here: its thread pool takes this process's share of the CPUs."""
    global _QUEUE
    _QUEUE = q
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))


def _report(nbytes: int, tokens: int) -> None:
    _QUEUE.put((nbytes, tokens))


def _worker_group(out: str, plan: dict, group: int) -> int:
    run_group(Path(out), plan, group, _report)
    return group


def run_groups(out: Path, plan: dict, workers: int, progress: Progress) -> None:
    """Every unfinished group of ``plan``; the first failure stops the others and is raised here."""
    todo = pending_groups(out, plan)
    done_bytes = sum(plan["inputs"][i]["bytes"] for g in range(len(plan["groups"])) if g not in todo
                     for i in plan["groups"][g])
    progress.update(done_bytes, 0)
    if workers <= 1 or len(todo) <= 1:
        for g in todo:
            run_group(out, plan, g, progress.update)
        return
    ctx = mp.get_context("spawn")  # tokenizers' thread pool does not survive a fork
    q = ctx.Queue()
    procs = min(workers, len(todo))
    threads = max(1, len(os.sched_getaffinity(0)) // procs)
    with ctx.Pool(procs, initializer=_init_worker, initargs=(q, threads)) as pool:
        results = [pool.apply_async(_worker_group, (str(out), plan, g)) for g in todo]
        while not all(r.ready() for r in results):
            _drain(q, progress, timeout=0.2)
            for r in results:
                if r.ready() and not r.successful():
                    pool.terminate()
                    r.get()  # re-raises the worker's exception here
        _drain(q, progress, timeout=0.0)
        for r in results:
            r.get()


def _drain(q: tp.Any, progress: Progress, timeout: float) -> None:
    try:
        while True:
            nbytes, tokens = q.get(timeout=timeout)
            progress.update(nbytes, tokens)
            timeout = 0.0
    except queue_mod.Empty:
        return
