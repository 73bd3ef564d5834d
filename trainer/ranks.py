"""Which rank this process is, and the job's environment: torch-free (``trainer.dist`` and the script mode).

submitit (``SUBMITIT_EXECUTOR`` set), else torchrun's variables, else a task a scheduler started itself
(a plain srun), else one process.
"""

from __future__ import annotations

import os

from hpc import schedulers
from hpc.schedulers import RankEnv, rendezvous_port


def detect_rank_env() -> RankEnv:
    """submitit (``SUBMITIT_EXECUTOR`` set), else torchrun's variables, else a task a scheduler started
    itself (``hpc.schedulers.rank_env``: a task of a plain srun), else one process."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        return _submitit_env()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun_env()
    started = schedulers.rank_env(os.environ)
    if started is not None:
        return started
    return RankEnv(rank=0, local_rank=0, world_size=1, master_addr="127.0.0.1", master_port=0)


def _submitit_env() -> RankEnv:
    import submitit  # lazy: submitit

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


def export_rank_variables(env: RankEnv) -> None:
    """Task mode: this rank's torchrun variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and the group/role ones) in ``os.environ``, as
    torchrun would set them, for a task's code that reads them (``int(os.environ["RANK"])``, a library that
    picks its device by ``LOCAL_RANK``). Under torchrun they are already torchrun's own: unchanged."""
    if env.launcher == "torchrun":
        return
    os.environ.update(rank_variables(env.rank, env.local_rank, env.world_size, env.local_world_size,
                                     env.master_addr, env.master_port))


def rank_variables(rank: int, local_rank: int, world: int, local_world: int, master_addr: str,
                   master_port: int) -> dict[str, str]:
    """What torchrun gives each worker (its ``GROUP_RANK`` is the node's index: ranks are node-major)."""
    nodes = max(1, world // max(1, local_world))
    values = {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": local_world,
              "GROUP_RANK": rank // max(1, local_world), "GROUP_WORLD_SIZE": nodes, "ROLE_RANK": rank,
              "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default", "MASTER_ADDR": master_addr,
              "MASTER_PORT": master_port}
    return {name: str(value) for name, value in values.items()}
