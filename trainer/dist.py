"""Distributed setup and teardown, from submitit, torchrun, a scheduler's own task (a plain srun), or nothing.

Order inside a rank: ``detect_rank_env`` → ``apply_job_env`` → ``device_for`` (and, on NCCL,
``apply_nccl_trace``) → ``init_distributed`` (our own store rendezvous that names missing ranks, then
the process group, then an all-reduce of 1 that every rank logs) → ``open_side_groups`` (the gloo side
groups, before the model exists) → … → ``shutdown``.

After the first step ``CollectiveTimeouts`` shortens the collective timeout from ``parallel.timeout_s``
(start-up: compiling, loading, a slow rank arriving) to ``parallel.step_timeout_s``, and lengthens it
again around checkpoint saves; a collective that times out on NCCL leaves the flight recorder's dump
in ``RUN/nccl-trace/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import typing as tp
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpc.compat import set_pg_timeout
from hpc.core import runs
from hpc.schedulers import RankEnv
from trainer.optim import forget_host_groups
from trainer.ranks import apply_job_env, detect_rank_env  # noqa: F401  (torch-free: the script mode reads them too)

log = logging.getLogger("hpcx.trainer")


def gpu_index(local_rank: int, local_world: int, visible: int) -> int:
    """Which visible GPU a rank drives: the only one when one is visible (Slurm bound one to each task:
    ``--gpus-per-task``, ``--gpu-bind``, or a one-GPU machine), else the one at its local rank when every
    local rank has its own; ValueError with the numbers otherwise."""
    if visible == 1:
        return 0
    if visible >= local_world and 0 <= local_rank < visible:
        return local_rank
    shown = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else ""
    raise ValueError(f"local rank {local_rank} of {local_world} tasks on {socket.gethostname()} sees {visible} "
                     f"GPU(s){where}: expected 1 (a GPU bound to each task) or at least {local_world} (one each)")


def device_for(backend: str, local_rank: int, local_world: int = 1) -> torch.device:
    """The GPU of ``gpu_index`` under NCCL (made current), the CPU under gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = f" (CUDA_VISIBLE_DEVICES={shown!r} hides them)" if shown is not None and not shown.strip() else ""
        raise RuntimeError(f"the site has GPUs (backend nccl) but CUDA sees none in this process{hidden}")
    index = gpu_index(local_rank, local_world, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# The NCCL flight recorder: the last collectives of each rank, dumped when one times out (torch 2.13
# reads the buffer size under its old and its new name).
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
# Pinned whatever the site or user set: with 1 the watchdog aborts the communicator and cleans up
# before the flight recorder dumps; 3 (skip cleanup) keeps the dumps (torchtitan forces it too).
PINNED_NCCL = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def nccl_trace_env(run_dir: str | Path) -> dict[str, str]:
    """Variables that make a timed-out NCCL collective leave ``RUN/nccl-trace/rank-R`` (the flight
    recorder's dump; torch reads the file prefix under both its old and its new name)."""
    prefix = str(runs.RunDir(Path(run_dir)).nccl_trace / "rank-")
    return {**FLIGHT_RECORDER, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}


def apply_nccl_trace(run_dir: str | Path) -> None:
    """Set ``nccl_trace_env`` before the NCCL process group exists (a value the user exported wins)."""
    runs.RunDir(Path(run_dir)).nccl_trace.mkdir(exist_ok=True)
    for name, value in nccl_trace_env(run_dir).items():
        os.environ.setdefault(name, value)
    pin_nccl_env()


def pin_nccl_env() -> None:
    """Set ``PINNED_NCCL`` before the NCCL group exists; a different value (the site profile's, one
    exported, or the spec's ``env.set``) is overridden with a warning."""
    for name, value in PINNED_NCCL.items():
        if os.environ.get(name, value) != value:
            log.warning("%s=%s overridden to %s: the flight recorder dumps only with %s", name,
                        os.environ[name], value, value)
        os.environ[name] = value


def init_distributed(env: RankEnv, backend: str, timeout_s: int, device: torch.device | None = None) -> list[str]:
    """Rendezvous, then the default process group; returns the hostname of every rank (by rank).

    Raises RuntimeError naming the ranks that did not arrive within ``timeout_s``. On CUDA, give
    ``device``: the group is bound to it (NCCL connects eagerly, and the mesh's sub-groups split
    its communicator instead of bootstrapping new ones).
    """
    timeout = timedelta(seconds=timeout_s)
    store = _connect_store(env, timeout)
    hosts = _rendezvous(store, env, timeout_s)
    dist.init_process_group(backend=backend, store=dist.PrefixStore("hpcx/pg", store), rank=env.rank,
                            world_size=env.world_size, timeout=timeout, **bound_device(device))
    return hosts


def bound_device(device: torch.device | None) -> dict[str, tp.Any]:
    """``init_process_group``'s ``device_id`` argument: the rank's GPU on CUDA, nothing elsewhere."""
    return {"device_id": device} if device is not None and device.type == "cuda" else {}


def init_single(backend: str, timeout_s: int | None = None, device: torch.device | None = None) -> list[str]:
    """A one-process group on an in-memory store (FSDP and DDP need one even at world size 1), with the
    spec's collective timeout (``timeout_s``; torch's default without) and, on CUDA, bound to ``device``
    as ``init_distributed`` binds a group of several ranks."""
    timeout: dict[str, tp.Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **timeout,
                            **bound_device(device))
    return [socket.gethostname()]


def _connect_store(env: RankEnv, timeout: timedelta) -> dist.Store:
    is_master = env.is_rank0 and not env.agent_store
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, world_size=None, is_master=is_master,
                              timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if is_master:
            raise RuntimeError(f"rank 0 could not host the rendezvous on {env.master_addr}:{env.master_port} "
                               f"(port in use by another job?): {e}") from e
        raise RuntimeError(f"rank {env.rank} on {env.hostname}: rank 0 did not arrive: no rendezvous at "
                           f"{env.master_addr}:{env.master_port} within {timeout.total_seconds():.0f} s "
                           f"(missing ranks: [0]): {e}") from e
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"hpcx/{restarts}", store)


def _rendezvous(store: dist.Store, env: RankEnv, timeout_s: int) -> list[str]:
    """Each rank posts its hostname, waits for every rank's and reads them all back.

    Three store requests per rank whatever the world size (set, one ``wait`` on all keys that the
    store answers when the last one arrives, one ``multi_get``): O(world) for the store in all,
    where polling each key would be O(world²). Only on a timeout are the keys checked one by one,
    to name the ranks that did not come.
    """
    store.set(f"arrived/{env.rank}", env.hostname)
    keys = [f"arrived/{r}" for r in range(env.world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:  # DistStoreError: the timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if missing:
            raise RuntimeError(f"rendezvous at {env.master_addr}:{env.master_port} timed out after {timeout_s} s: "
                               f"ranks {missing} of {env.world_size} did not arrive (this is rank {env.rank} "
                               f"on {env.hostname})") from None
    return [host.decode() for host in store.multi_get(keys)]


def check_world(env: RankEnv, hosts: list[str], device: torch.device) -> int:
    """All-reduce a 1 on every rank and log it; the answer must be the world size."""
    one = torch.ones(1, device=device)
    if dist.is_initialized():
        dist.all_reduce(one)
    total = int(one.item())
    log.info("rank %d/%d on %s: all_reduce(1) = %d", env.rank, env.world_size, env.hostname, total)
    if total != env.world_size:
        raise RuntimeError(f"all_reduce(1) = {total} but the world size is {env.world_size}")
    return total


def write_world(run_dir: Path, hosts: list[str], total: int, backend: str) -> None:
    """Rank 0's ``world.json``: who took part, and what the all-reduce gave."""
    runs.write_json(runs.RunDir(run_dir).world,
                    {"world_size": len(hosts), "all_reduce": total, "hosts": hosts, "backend": backend})


def write_mesh(run_dir: Path, groups: dict[str, list[list[int]]]) -> None:
    """Rank 0's ``mesh.json``: the rank groups of each mesh dimension (hosts are in world.json)."""
    runs.write_json(runs.RunDir(run_dir).mesh, groups)


def monitored_barrier(timeout_s: int) -> None:
    """A barrier that names absent ranks instead of hanging (gloo; on NCCL a gloo side group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    group = None if dist.get_backend() == "gloo" else side_group()
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


# per process by nature: gloo groups of torch's process-wide default group, made collectively, dropped by shutdown
_SIDE_GROUPS: dict[str, dist.ProcessGroup] = {}
SIDE_CONNECT_S = 30  # a gloo side group that cannot connect in this long is a wrong interface, not a slow rank


def side_group(purpose: str = "steps") -> dist.ProcessGroup:
    """A gloo group over all ranks beside the training group, one per purpose: ``steps`` for CPU
    collectives that never wait for the GPU (the step-boundary vote, the teardown barrier), ``saves``
    for async checkpoints (which run in a background thread: on one group with the vote, their
    collectives would interleave differently on different ranks). ``open_side_groups`` makes them
    right after ``init_process_group``; otherwise made collectively on first use."""
    if purpose not in _SIDE_GROUPS:
        _SIDE_GROUPS[purpose] = dist.new_group(backend="gloo")
    return _SIDE_GROUPS[purpose]


def side_purposes(async_saves: bool) -> tuple[str, ...]:
    """The side groups a job uses, in the order every rank makes them."""
    return ("steps", "saves") if async_saves else ("steps",)


def open_side_groups(timeout_s: int, async_saves: bool) -> None:
    """Right after ``init_process_group``, on every rank in the same order: each side group, which
    must connect within ``SIDE_CONNECT_S`` seconds (an interface the other ranks cannot reach fails
    here, in seconds, not at the first step boundary after compile and step 1), then gets ``timeout_s``."""
    connect_s = min(SIDE_CONNECT_S, timeout_s)
    for purpose in side_purposes(async_saves):
        if purpose not in _SIDE_GROUPS:
            _SIDE_GROUPS[purpose] = _connect_gloo(purpose, connect_s)
            set_timeout([_SIDE_GROUPS[purpose]], timeout_s)


def _connect_gloo(purpose: str, connect_s: int) -> dist.ProcessGroup:
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=connect_s))
    except RuntimeError as exc:
        shown = os.environ.get("GLOO_SOCKET_IFNAME")
        raise RuntimeError(f"the gloo side group ({purpose}) did not connect within {connect_s} s on "
                           f"{socket.gethostname()} (GLOO_SOCKET_IFNAME={shown!r}): set GLOO_SOCKET_IFNAME to an "
                           f"interface every node reaches (`ip -br addr`; a name, not NCCL's ^exclusions): "
                           f"{exc}") from exc


def process_groups(model: torch.nn.Module) -> list[dist.ProcessGroup]:
    """The groups training collectives run on: the default group, the side group, and the device-mesh
    groups of the model's sharded (DTensor) parameters."""
    groups = [dist.group.WORLD, side_group()]
    param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if param is not None:
        groups += param.device_mesh.get_all_groups()
    return [g for g in {id(g): g for g in groups}.values() if g is not None]  # WORLD: set once initialized


def set_timeout(groups: tp.Iterable[dist.ProcessGroup], seconds: float) -> None:
    """The timeout of collectives issued from now on in ``groups``. torch has no public switch for an
    existing group: ``hpc.compat.set_pg_timeout`` reaches its private one (tests/test_compat.py)."""
    for group in groups:
        set_pg_timeout(group, seconds)


class CollectiveTimeouts:
    """``long_s`` (``parallel.timeout_s``) for start-up, resume and saves; ``short_s``
    (``parallel.step_timeout_s``) once every rank finished its first step, so that a rank that hangs
    mid-run is noticed in minutes. Collective: call ``shorten`` on every rank at the same boundary."""

    def __init__(self, long_s: float, short_s: float) -> None:
        self.long_s, self.short_s = long_s, min(short_s, long_s)
        self.groups: list[dist.ProcessGroup] = []

    def shorten(self, model: torch.nn.Module) -> None:
        """After the first step: wait for every rank (under the long timeout), then shorten."""
        if self.groups or not dist.is_initialized() or dist.get_world_size() == 1 or self.short_s >= self.long_s:
            return
        dist.monitored_barrier(side_group(), timeout=timedelta(seconds=self.long_s), wait_all_ranks=True)
        self.groups = process_groups(model)
        set_timeout(self.groups, self.short_s)
        log.info("collective timeout %g s from now on (%g s around saves)", self.short_s, self.long_s)

    @contextlib.contextmanager
    def lengthened(self) -> tp.Iterator[None]:
        """The long timeout for a block of work (a checkpoint save: ranks wait on the slowest writer)."""
        if not self.groups:
            yield
            return
        set_timeout(self.groups, self.long_s)
        try:
            yield
        finally:
            set_timeout(self.groups, self.short_s)


def shutdown(timeout_s: int, waiting: tp.ContextManager | None = None) -> None:
    """Wait for every rank (bounded; inside ``waiting``: the watchdog's suspension, under which a rank stopped
    here is found by its neighbour), then destroy the process group. Never raises: the work is done."""
    if not dist.is_initialized():
        return
    try:
        with waiting if waiting is not None else contextlib.nullcontext():
            monitored_barrier(timeout_s)
    except Exception as e:  # noqa: BLE001  (a rank that died is reported by that rank; this one finished its work)
        log.warning("teardown barrier failed (%s); destroying the process group anyway", e)
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001  (teardown goes on whatever failed)
        log.warning("destroy_process_group failed: %s", e)
    _SIDE_GROUPS.clear()
    forget_host_groups()
