"""The pre-flight check at a job's start (``health.preflight``): this rank's device, then timed collectives.

``check_start`` runs on every rank after the process group is up and before the model is built
(``train.run_rank``). Each rank posts its host in the job's store, checks its device (``device_problem``)
and posts what it found; rank 0 reads every rank's (a rank that posts nothing within
``health.preflight_timeout_s`` is named, where a collective would only time out on everyone), decides
(``hpc.core.preflight.verdict``) and posts the verdict, which the others take: one rank reads the results,
so the store carries O(world), not O(world²). With every device fine the ranks time an all-reduce of a few
MB and, across nodes, a shift to the next node and to the previous one, and rank 0 decides again. A node
that failed is named: rank 0 writes the failure reports of that node's ranks (``node_fault``,
``preflight``: what the check after srun turns into the stop line and the exclusion) before it posts the
verdict, and every rank raises ``PreflightFailed``: the job is requeued without the node instead of
training. Should rank 0 itself be stuck, the others decide without it after twice the timeout.

Drill hook: ``PREFLIGHT_DRILL_FAIL_HOST=NAME`` (set in the job's environment, e.g. the spec's
``env.set``) makes the device check of every rank on the node named NAME fail (``@first``: on whichever
node the job's first start landed), so that the path can be rehearsed on a real cluster
(tests/slurm/test_preflight_slurm.py). Nothing else reads it. (Not ``HPCX_``-prefixed: ``env.set`` refuses
the names hpcx owns.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import typing as tp
from datetime import timedelta

import torch
import torch.distributed as dist

from hpc import schedulers
from hpc.compat import default_store
from hpc.core import preflight as pf
from hpc.core import requeue
from hpc.core.procs import process_start_time
from hpc.core.site import Node, nvlink_bandwidth
from trainer.dist import set_timeout

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
    side = schedulers.job_side()
    if drilled(os.environ.get(DRILL_HOST, ""), host, str(side.restart_count() if side else 0)):
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
    first start (the scheduler's restart count 0: wherever the scheduler put it, so a test need not know)."""
    return bool(value) and (value == host or (value == "@first" and restart in ("", "0")))


def matmul_right(device: torch.device) -> bool:
    """A 64×64 product of small integers, exact in float32, compared with the value known in closed form."""
    a = torch.arange(64, dtype=torch.float32, device=device).remainder(7).expand(64, 64)
    got = (a @ a.T).cpu()
    want = float(sum((i % 7) ** 2 for i in range(64)))
    return bool(torch.all(got == want))


# ---------------------------------------------------------------- the ranks' results, through the store


def decide(run: Run, store: tp.Any, phase: str, mine: dict, world: int, nbytes: int,
           guard: Resilience | None) -> tuple[pf.Verdict, dict]:
    """Post this rank's ``mine`` under ``phase``; rank 0 reads every rank's (``read_all``), decides, writes
    the blamed ranks' failure reports and posts the verdict; the others take it. Store traffic is O(world):
    one rank reads the results. A rank that sees no verdict within twice the check's timeout (rank 0 stuck)
    reads and decides itself, and the first of those to claim the phase posts. (verdict, failure record)."""
    timeout_s = run.spec.health.preflight_timeout_s
    store.set(f"preflight/{phase}/{mine['rank']}", json.dumps(mine))
    posted = f"preflight/decided/{phase}"
    if mine["rank"] != 0 and waited(store, posted, 2 * timeout_s):
        return taken(store, posted)
    results, missing = read_all(store, phase, world, timeout_s)
    found = judged(run, results, missing, nbytes)
    if store.add(f"preflight/claim/{phase}", 1) != 1:  # another rank decides this phase: take its verdict
        if waited(store, posted, timeout_s):
            return taken(store, posted)
    record = reported(run, found, results, missing, guard)
    store.set(posted, json.dumps({"verdict": dataclasses.asdict(found), "record": record}))
    return found, record


def reported(run: Run, found: pf.Verdict, results: list[dict], missing: dict[int, str],
             guard: Resilience | None) -> dict:
    """The failure record of a failed verdict ({} when ok), after writing the blamed ranks' reports."""
    record = failure_record(found) if not found.ok else {}
    if found.blamed and guard is not None and guard.side is not None:
        write_reports(run, found, results, missing, guard, record)
    return record


def waited(store: tp.Any, key: str, timeout_s: float) -> bool:
    """Whether ``key`` is in the store within ``timeout_s``."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError:  # the store's timeout
        return False
    return True


def taken(store: tp.Any, key: str) -> tuple[pf.Verdict, dict]:
    """The verdict and failure record another rank posted under ``key``."""
    posted = json.loads(store.get(key))
    return pf.Verdict(**posted["verdict"]), posted["record"]


def read_all(store: tp.Any, phase: str, world: int, timeout_s: float) -> tuple[list[dict], dict[int, str]]:
    """Every rank's results under ``phase`` and (rank → host) those that posted nothing within ``timeout_s``."""
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


def judged(run: Run, results: list[dict], missing: dict[int, str], nbytes: int) -> pf.Verdict:
    """``hpc.core.preflight.verdict`` against this site's figures and the spec's floor and cap."""
    hosts = pf.nodes_of([*results, *({"rank": r, "host": h} for r, h in missing.items())])
    node, settings = run.site.node, run.spec.health
    per_node = max((len(r) for r in hosts.values()), default=1)
    want = pf.expected(node.gpus, nvlink_bandwidth(node), run.site.network.bandwidth_gbs, len(hosts), per_node)
    modelled = run.launch.preflight_busbw_gbs if node.gpus else None  # decided at resolve (hpc.plan.resolve)
    if modelled and want.allreduce_gbs:  # what NCCL reaches at this size (latency counts at a few MB)
        want = pf.Expected(allreduce_gbs=modelled, link_gbs=want.link_gbs)
    found = pf.verdict(results, missing, want, settings.preflight_min_bandwidth_fraction, settings.exclude_nodes,
                       nbytes)
    found.expected_gbs = want.allreduce_gbs
    blocks = pf.shift_peers([str(r["host"]) for r in sorted(results, key=lambda r: r["rank"])])
    found.shift = blocks[0] if blocks is not None and not missing else 0
    return found


def failure_record(found: pf.Verdict) -> dict:
    """The ``preflight`` record of the stop line: the nodes, why, and the seconds this start lost."""
    return {"nodes": list(found.blamed), "reasons": found.blamed,
            "lost_s": round(time.time() - process_start_time(), 3)}


def write_reports(run: Run, found: pf.Verdict, results: list[dict], missing: dict[int, str],
                  guard: tp.Any, record: dict) -> None:
    """The failure report of each rank of a blamed node (``node_fault``: excluded on the requeue)."""
    hosts = {int(r["rank"]): str(r["host"]) for r in results} | dict(missing)
    for rank in pf.blamed_ranks(results, missing, found):
        requeue.report_failure(run.run_dir, guard.side.incarnation(guard.restart), rank, step=guard.step,
                               error=f"preflight: {hosts[rank]} failed: {found.blamed[hosts[rank]]}"[:300],
                               terminated=False, host=hosts[rank], save_s=0.0, saves=0, phase="join",
                               repeats=False, node_fault=True, preflight=record)


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


def measure(shift: int, device: torch.device, nbytes: int) -> dict[str, float]:
    """This rank's figures: the all-reduce's median seconds and, when ``shift`` (ranks per node, over
    several nodes in equal blocks), the GB/s received in a shift to the next node and to the previous."""
    found = {"allreduce_s": timed_allreduce(nbytes, device)}
    if shift:
        found.update(fwd_gbs=shift_gbs(nbytes, device, shift), bwd_gbs=shift_gbs(nbytes, device, -shift))
    return found


# ---------------------------------------------------------------- the check


def check_start(run: Run, rank: int, host: str, device: torch.device, guard: Resilience | None = None,
                device_check: DeviceCheck = device_problem, nbytes: int = pf.NBYTES) -> pf.Verdict | None:
    """The pre-flight check (collective; None when ``health.preflight`` is off). Raises ``PreflightFailed``
    on every rank when it names a node (or every node's device failed)."""
    if not run.spec.health.preflight:
        log.info("preflight: off (health.preflight = false)")
        return None
    tic = time.monotonic()
    found, record = verdict_of(run, rank, host, device, guard, device_check, nbytes)
    log_verdict(found, time.monotonic() - tic, dist.get_world_size() if job_store() is not None else 1)
    if found.blamed:  # the reports are out (``decide``): the job is requeued without the nodes
        raise pf.PreflightFailed(found.words(), verdict=record, reported=guard is not None and guard.side is not None)
    if found.failed:  # every node failed: not one node's fault; each rank reports its own failure
        raise pf.PreflightFailed(found.warning)
    return found


def verdict_of(run: Run, rank: int, host: str, device: torch.device, guard: Resilience | None,
               device_check: DeviceCheck, nbytes: int) -> tuple[pf.Verdict, dict]:
    """The device checks, then (all fine, several ranks) the timings: the verdict and failure record."""
    store = job_store()
    if store is not None:  # first of all: a rank stuck in its device check is still named by its host
        store.set(f"preflight/host/{rank}", host)
    mine: dict[str, tp.Any] = {"rank": rank, "host": host, "device": device_check(device, run.site.node, host) or None}
    if store is None:
        found = judged(run, [mine], {}, nbytes)
        return found, reported(run, found, [mine], {}, guard)
    found, record = decide(run, store, "dev", mine, dist.get_world_size(), nbytes, guard)
    if not found.ok:
        return found, record
    mine.update(timed(found.shift, device, nbytes, run.spec.health.preflight_timeout_s, run.spec.parallel.timeout_s))
    return decide(run, store, "net", mine, dist.get_world_size(), nbytes, guard)


def job_store() -> tp.Any:
    """The job's store when several ranks take part, else None."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return default_store()


def timed(shift: int, device: torch.device, nbytes: int, timeout_s: float, usual_s: float) -> dict:
    """``measure`` under the check's timeout (the default group's own afterwards); a collective that failed
    or timed out is this rank's ``error``."""
    world = dist.group.WORLD
    assert world is not None  # set once the group is up
    set_timeout([world], timeout_s)
    try:
        return measure(shift, device, nbytes)
    except RuntimeError as exc:
        return {"error": f"all-reduce did not complete: {str(exc).splitlines()[0][:200]}"}
    finally:
        set_timeout([world], usual_s)


def log_verdict(found: pf.Verdict, took: float, world: int) -> None:
    bw = "" if found.busbw_gbs is None else f", all-reduce bus bandwidth {found.busbw_gbs:.3g} GB/s"
    of = f" (site: {found.expected_gbs:g} GB/s)" if found.expected_gbs and found.busbw_gbs is not None else ""
    log.info("preflight: %d rank(s) in %.2f s%s%s", world, took, bw, of)
    if found.warning:
        log.warning("%s", found.warning)
    for words in found.words().split("; ") if found.blamed else []:
        log.error("%s", words)
