"""The pre-flight check at a job's start (``health.preflight``): this rank's device, then timed collectives.

``check_start`` runs on every rank after the process group is up and before the model is built
(``train.run_rank``). Each rank checks its device (``device_problem``), and the ranks post what they
found in the job's store (``exchange``: it names a rank that posts nothing within
``health.preflight_timeout_s``, where a collective would only time out on everyone). With every device
fine, they time an all-reduce of a few MB and, across nodes, a shift to the next node and to the previous
one, and post those too. Every rank then reaches the same verdict (``hpc.core.preflight.verdict``). A
node that failed is named; the lowest rank present writes the failure reports of that node's ranks
(``node_fault``, ``preflight``: what the check after srun turns into the stop line and the exclusion),
and every rank raises ``PreflightFailed``: the job is requeued without the node instead of training.

Drill hook: ``PREFLIGHT_DRILL_FAIL_HOST=NAME`` (set in the job's environment, e.g. the spec's
``env.set``) makes the device check of every rank on the node named NAME fail (``@first``: on whichever
node the job's first start landed), so that the path can be rehearsed on a real cluster
(tests/slurm/test_preflight_slurm.py). Nothing else reads it. (Not ``HPCX_``-prefixed: ``env.set`` refuses
the names hpcx owns.)
"""

from __future__ import annotations

import json
import logging
import os
import time
import typing as tp
from datetime import timedelta

import torch
import torch.distributed as dist

from hpc.core import preflight as pf
from hpc.core import requeue
from hpc.core.procs import process_start_time
from hpc.core.site import Node, nvlink_bandwidth

if tp.TYPE_CHECKING:  # pragma: no cover
    from trainer.resilience import Resilience
    from trainer.run import Run

log = logging.getLogger("hpcx.trainer")
DRILL_HOST = "PREFLIGHT_DRILL_FAIL_HOST"
DeviceCheck = tp.Callable[[torch.device, Node, str], str]


# ---------------------------------------------------------------- this rank's device


def device_problem(device: torch.device, node: Node, host: str) -> str:
    """What is wrong with this rank's device ("" when nothing): the drill hook, then on CUDA the device
    visible, a small matmul right and its memory as the site says; on the CPU the matmul."""
    if drilled(os.environ.get(DRILL_HOST, ""), host, os.environ.get("SLURM_RESTART_COUNT", "0")):
        return f"{device} failed the drill ({DRILL_HOST}={os.environ[DRILL_HOST]})"
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return f"{device} not visible"
        problem = pf.memory_problem(torch.cuda.mem_get_info(index)[1], node.gpu_memory_gb)
        if problem:
            return f"{device} {problem}"
    return "" if matmul_right(device) else f"{device} matmul wrong"


def drilled(value: str, host: str, restart: str) -> bool:
    """Whether the drill hook fails this node: ``value`` names it, or is ``@first`` and this is the job's
    first start (Slurm's restart count 0: wherever the scheduler put it, so a test need not know)."""
    return bool(value) and (value == host or (value == "@first" and restart in ("", "0")))


def matmul_right(device: torch.device) -> bool:
    """A 64×64 product of small integers, exact in float32, compared with the value known in closed form."""
    a = torch.arange(64, dtype=torch.float32, device=device).remainder(7).expand(64, 64)
    got = (a @ a.T).cpu()
    want = float(sum((i % 7) ** 2 for i in range(64)))
    return bool(torch.all(got == want))


# ---------------------------------------------------------------- the ranks' results, through the store


def exchange(store: tp.Any, phase: str, mine: dict, world: int, timeout_s: float) -> tuple[list[dict], dict[int, str]]:
    """Post this rank's ``mine`` under ``phase`` and read every rank's: (results, rank → host of the ranks
    that posted nothing within ``timeout_s``: ``host_of``)."""
    store.set(f"preflight/{phase}/{mine['rank']}", json.dumps(mine))
    keys = [f"preflight/{phase}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        present = keys
    except RuntimeError:  # the store's timeout: name the ranks that are not there
        present = [k for k in keys if store.check([k])]
    results = [json.loads(v) for v in store.multi_get(present)] if present else []
    gone = sorted(set(range(world)) - {int(r["rank"]) for r in results})
    return results, {r: host_of(store, r) for r in gone}


def host_of(store: tp.Any, rank: int) -> str:
    """A rank's host as it posted it on entering the check, else "?" (it never came)."""
    key = f"preflight/host/{rank}"
    return store.get(key).decode() if store.check([key]) else "?"


# ---------------------------------------------------------------- timed collectives


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_allreduce(nbytes: int, device: torch.device, warmup: int = 2, iters: int = 5) -> float:
    """The median time of an all-reduce of ``nbytes`` on the default group, after ``warmup`` ones."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    times = []
    for i in range(warmup + iters):
        sync(device)
        tic = time.perf_counter()
        dist.all_reduce(x)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - tic)
    return pf.median(times)


def shift_gbs(nbytes: int, device: torch.device, step: int, warmup: int = 1, iters: int = 3) -> float:
    """What this rank receives from rank − ``step`` while sending to rank + ``step``, GB/s (median)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    times = []
    for i in range(warmup + iters):
        sync(device)
        tic = time.perf_counter()
        works = [dist.isend(send, (rank + step) % world), dist.irecv(recv, (rank - step) % world)]
        for work in works:
            if work is not None:  # None only for a rank outside the group: never here
                work.wait()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - tic)
    return send.numel() * 4 / pf.median(times) / 1e9


def measure(hosts: list[str], device: torch.device, nbytes: int) -> dict[str, float]:
    """This rank's figures: the all-reduce's median seconds and, over several nodes in equal blocks,
    the two shifts' GB/s."""
    found = {"allreduce_s": timed_allreduce(nbytes, device)}
    blocks = pf.shift_peers(hosts)
    if blocks is not None:
        per = blocks[0]
        found.update(fwd_gbs=shift_gbs(nbytes, device, per), bwd_gbs=shift_gbs(nbytes, device, -per))
    return found


# ---------------------------------------------------------------- the check


def check_start(run: Run, rank: int, host: str, device: torch.device, guard: Resilience | None = None,
                device_check: DeviceCheck = device_problem, nbytes: int = pf.NBYTES) -> pf.Verdict | None:
    """The pre-flight check (collective; None when ``health.preflight`` is off). Raises ``PreflightFailed``
    on every rank when it names a node (or every node's device failed)."""
    settings = run.spec.health
    if not settings.preflight:
        log.info("preflight: off (health.preflight = false)")
        return None
    tic = time.monotonic()
    store = job_store()
    if store is not None:  # first of all: a rank stuck in its device check is still named by its host
        store.set(f"preflight/host/{rank}", host)
    results, missing = gather(run, store, rank, host, device, device_check, nbytes)
    hosts = pf.nodes_of([*results, *({"rank": r, "host": h} for r, h in missing.items())])
    want = pf.expected(run.site.node.gpus, nvlink_bandwidth(run.site.node), run.site.network.bandwidth_gbs,
                       len(hosts), max((len(r) for r in hosts.values()), default=1))
    found = pf.verdict(results, missing, want, settings.preflight_min_bandwidth_fraction, settings.exclude_nodes,
                       nbytes)
    took = time.monotonic() - tic
    log_verdict(found, want, took, len(results) + len(missing))
    if not found.ok:
        fail(run, store, found, results, missing, guard, took)
    return found


def job_store() -> tp.Any:
    """The job's store when several ranks take part, else None."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from hpc.compat import default_store

    return default_store()


def gather(run: Run, store: tp.Any, rank: int, host: str, device: torch.device, device_check: DeviceCheck,
           nbytes: int) -> tuple[list[dict], dict[int, str]]:
    """Every rank's results and the ranks missing: the device checks, then (all fine) the timings. A rank
    that comes after the others decided (it was stuck, then came back) takes their verdict."""
    mine: dict[str, tp.Any] = {"rank": rank, "host": host, "device": device_check(device, run.site.node, host) or None}
    if store is None:
        return [mine], {}
    world, timeout_s = dist.get_world_size(), run.spec.health.preflight_timeout_s
    results, missing = exchange(store, "dev", mine, world, timeout_s)
    if missing or any(r.get("device") for r in results):
        return results, missing
    adopt_decided(store)
    hosts = [r["host"] for r in sorted(results, key=lambda r: r["rank"])]
    mine.update(timed(hosts, device, nbytes, timeout_s, run.spec.parallel.timeout_s))
    return exchange(store, "net", mine, world, timeout_s)


def timed(hosts: list[str], device: torch.device, nbytes: int, timeout_s: float, usual_s: float) -> dict:
    """``measure`` under the check's timeout (the default group's own afterwards); a collective that failed
    or timed out is this rank's ``error``."""
    from trainer.dist import set_timeout

    world = dist.group.WORLD
    assert world is not None  # set once the group is up
    set_timeout([world], timeout_s)
    try:
        return measure(hosts, device, nbytes)
    except RuntimeError as exc:
        return {"error": f"all-reduce did not complete: {str(exc).splitlines()[0][:200]}"}
    finally:
        set_timeout([world], usual_s)


def log_verdict(found: pf.Verdict, want: pf.Expected, took: float, world: int) -> None:
    bw = "" if found.busbw_gbs is None else f", all-reduce bus bandwidth {found.busbw_gbs:.3g} GB/s"
    of = f" (site: {want.allreduce_gbs:g} GB/s)" if want.allreduce_gbs and found.busbw_gbs is not None else ""
    log.info("preflight: %d rank(s) in %.2f s%s%s", world, took, bw, of)
    if found.warning:
        log.warning("%s", found.warning)
    for words in found.words().split("; ") if found.blamed else []:
        log.error("%s", words)


# ---------------------------------------------------------------- a failed check


def fail(run: Run, store: tp.Any, found: pf.Verdict, results: list[dict], missing: dict[int, str],
         guard: Resilience | None, took: float) -> tp.NoReturn:
    """The first rank to get here writes the blamed ranks' failure reports and posts the verdict; the others
    wait for it (a rank that exits first must not let the scheduler kill the writer before it wrote them)
    and take it. Every rank raises ``PreflightFailed``."""
    if not found.blamed:  # every node failed: not one node's fault; each rank reports its own failure
        raise pf.PreflightFailed(found.warning, verdict={"warning": found.warning})
    reported = guard is not None and guard.side is not None
    if store is not None and store.add("preflight/claim", 1) != 1:
        adopt_decided(store, wait_s=run.spec.health.preflight_timeout_s)
    record = {"nodes": list(found.blamed), "reasons": found.blamed, "check_s": round(took, 3),
              "lost_s": round(time.time() - process_start_time(), 3)}
    if reported:
        write_reports(run, found, results, missing, guard, record)
    if store is not None:
        store.set("preflight/verdict", json.dumps({"words": found.words(), "record": record, "reported": reported}))
    raise pf.PreflightFailed(found.words(), verdict=record, reported=reported)


def write_reports(run: Run, found: pf.Verdict, results: list[dict], missing: dict[int, str],
                  guard: tp.Any, record: dict) -> None:
    """The failure report of each rank of a blamed node (``node_fault``: excluded on the requeue)."""
    hosts = {int(r["rank"]): str(r["host"]) for r in results} | dict(missing)
    for rank in pf.blamed_ranks(results, missing, found):
        requeue.report_failure(run.run_dir, guard.side.incarnation(guard.restart), rank, step=guard.step,
                               error=f"preflight: {hosts[rank]} failed: {found.blamed[hosts[rank]]}"[:300],
                               terminated=False, host=hosts[rank], save_s=0.0, saves=0, phase="join",
                               repeats=False, node_fault=True, preflight=record)


def adopt_decided(store: tp.Any, wait_s: float = 0.0) -> None:
    """Raise the verdict another rank posted (waiting up to ``wait_s`` for it); nothing when none is there."""
    key = "preflight/verdict"
    if wait_s:
        try:
            store.wait([key], timedelta(seconds=wait_s))
        except RuntimeError as exc:  # the writer is gone: this rank fails on its own words
            raise pf.PreflightFailed(f"preflight: the verdict was not posted: {exc}") from None
    if store.check([key]):
        posted = json.loads(store.get(key))
        raise pf.PreflightFailed(posted["words"], verdict=posted["record"], reported=posted["reported"])
