"""Distributed setup and teardown, from submitit/Slurm, torchrun, or nothing.

Order inside a rank: ``detect_rank_env`` → ``apply_job_env`` → ``init_distributed``
(our own store rendezvous that names missing ranks, then the process group,
then an all-reduce of 1 that every rank logs) → … → ``shutdown``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hpc import runs

log = logging.getLogger("hpcx.trainer")
PORT_BASE = 20000
PORT_SPAN = 20000


@dataclass
class RankEnv:
    """Where this process sits in the job, and how to reach rank 0."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    hostname: str = field(default_factory=socket.gethostname)
    local_world_size: int = 1
    launcher: str = "single"  # "submitit", "torchrun" or "single"
    agent_store: bool = False  # torchrun's agent already hosts the TCPStore at master_port

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def rendezvous_port(job_id: str) -> int:
    """A port from the job id, so two jobs sharing a node do not collide: 20000 + digits % 20000."""
    digits = re.sub(r"\D", "", job_id)
    return PORT_BASE + (int(digits) % PORT_SPAN if digits else 0)


def detect_rank_env() -> RankEnv:
    """submitit (``SUBMITIT_EXECUTOR`` set), else torchrun's variables, else one process."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        return _submitit_env()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun_env()
    return RankEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=0)


def _submitit_env() -> RankEnv:
    import submitit

    job = submitit.JobEnvironment()
    return RankEnv(rank=job.global_rank, local_rank=job.local_rank, world_size=job.num_tasks,
                   master_addr=job.hostnames[0], master_port=rendezvous_port(str(job.job_id)),
                   local_world_size=max(1, job.num_tasks // job.num_nodes), launcher="submitit")


def _torchrun_env() -> RankEnv:
    env = os.environ
    return RankEnv(rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)),
                   world_size=int(env["WORLD_SIZE"]), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(env.get("MASTER_PORT", 29500)),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), launcher="torchrun",
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def apply_job_env(nccl: dict[str, str], env_set: dict[str, str]) -> None:
    """The site's NCCL variables (a value already in the environment, e.g. NCCL_DEBUG, wins), then
    the spec's ``env.set`` (explicit for this job, so it overrides)."""
    for name, value in nccl.items():
        os.environ.setdefault(name, value)
    os.environ.update(env_set)


def device_for(backend: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK under NCCL, the CPU under gloo."""
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("the site has GPUs (backend nccl) but CUDA is not available in this process")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


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


def bound_device(device: torch.device | None) -> dict[str, torch.device]:
    """``init_process_group``'s ``device_id`` argument: the rank's GPU on CUDA, nothing elsewhere."""
    return {"device_id": device} if device is not None and device.type == "cuda" else {}


def init_single(backend: str) -> list[str]:
    """A one-process group on an in-memory store (FSDP and DDP need one even at world size 1)."""
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
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
    group = None if dist.get_backend() == "gloo" else _gloo_group()
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)


_GLOO_GROUP = None


def _gloo_group():
    global _GLOO_GROUP
    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.new_group(backend="gloo")
    return _GLOO_GROUP


def shutdown(timeout_s: int) -> None:
    """Wait for every rank (bounded), then destroy the process group. Never raises: the work is done."""
    global _GLOO_GROUP
    if not dist.is_initialized():
        return
    try:
        monitored_barrier(timeout_s)
    except Exception as e:  # a rank that died is reported by that rank; this one finished its work
        log.warning("teardown barrier failed (%s); destroying the process group anyway", e)
    try:
        dist.destroy_process_group()
    except Exception as e:
        log.warning("destroy_process_group failed: %s", e)
    _GLOO_GROUP = None
