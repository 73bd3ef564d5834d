"""Inside a Slurm step: which task this process is, from Slurm's own variables. Pure, torch-free.

``SlurmJobSide.rank_env`` asks ``rank_env`` for a task that a plain ``srun python -m trainer RUN``
started (no submitit, no torchrun): rank, local rank and world from the step's variables, rank 0's host
from its compressed node list. The batch step of a job (no ``SLURM_STEP_ID``) is one process: it has
``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` but no other tasks, so it is not read as a step.
"""

from __future__ import annotations

import re
import typing as tp

from hpc.schedulers.base import RankEnv, rendezvous_port


def rank_env(env: tp.Mapping[str, str]) -> RankEnv | None:
    """This task's place in a plain srun step, or None when this process is not one."""
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return srun_env(env)
    return None


SRUN_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
                  "SLURM_STEP_TASKS_PER_NODE", "SLURM_JOB_ID")


def srun_env(env: tp.Mapping[str, str]) -> RankEnv:
    """A task of ``srun python -m trainer RUN``: rank, local rank and world from the step's variables,
    rank 0's host from the step's node list (``MASTER_ADDR``/``MASTER_PORT`` win when set). Raises
    RuntimeError naming what is missing or malformed rather than guessing rank 0 of 1."""
    missing = [name for name in SRUN_VARIABLES if not env.get(name)]
    if missing:
        raise RuntimeError(f"started by srun (SLURM_STEP_ID is set) without {', '.join(missing)}: cannot tell this "
                           "task's rank; run it through `hpcx submit`, torchrun, or a Slurm that sets them")
    try:
        hosts = expand_hostlist(env["SLURM_STEP_NODELIST"])
        local_world = tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], int(env["SLURM_NODEID"]))
        rank, local_rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_LOCALID"]), int(env["SLURM_STEP_NUM_TASKS"])
    except ValueError as exc:
        raise RuntimeError(f"srun task: Slurm's step variables do not parse: {exc}") from None
    if not (0 <= rank < world and 0 <= local_rank < local_world and hosts):
        raise RuntimeError(f"srun task: SLURM_PROCID={rank}, SLURM_LOCALID={local_rank} do not fit "
                           f"SLURM_STEP_NUM_TASKS={world} and {local_world} tasks on this node")
    port = rendezvous_port(env["SLURM_JOB_ID"] + env.get("SLURM_STEP_ID", ""))
    return RankEnv(rank=rank, local_rank=local_rank, world_size=world, master_addr=env.get("MASTER_ADDR", hosts[0]),
                   master_port=int(env.get("MASTER_PORT", port)), local_world_size=local_world, launcher="srun")


def expand_hostlist(text: str) -> list[str]:
    """``n[1-3,7],gpu-a[01-02]`` → ``n1 n2 n3 n7 gpu-a01 gpu-a02`` (Slurm's compressed host lists;
    zero padding kept, several bracket groups per name allowed)."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text.strip()):
        hosts += _expand_one(item)
    return hosts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    out = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        width = len(low)
        for n in range(int(low), int(high or low) + 1):
            out += [f"{head}{n:0{width}d}{rest}" for rest in _expand_one(tail)]
    return out


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks of this step on node ``node_id``, from ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}: expected counts like 2(x3),1")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"node {node_id} is not among the {len(counts)} nodes of SLURM_STEP_TASKS_PER_NODE="
                         f"{tasks_per_node!r}")
    return counts[node_id]
