"""The planner's rows: every candidate layout evaluated on a site (memory per rank and communication
per step), and the choice among those that fit."""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass, field

from hpc.comm import Comm, step_comm
from hpc.dims import ParallelDims, parallel_dims
from hpc.memory import HOST_USABLE, Config, Memory, estimate, headroom_gb
from hpc.models import ModelFacts
from hpc.site import SiteProfile
from hpc.spec import JobSpec, compute_precision

MFU_DEFAULT = 0.4  # assumed model FLOPs utilisation (no site or spec field yet)
TIE = 0.05  # communication within 5% of the best counts as a tie; the simpler strategy wins
SIMPLICITY = {"none": 0, "ddp": 1, "fsdp no_shard": 2, "fsdp shard_grad_op": 3, "fsdp full_shard": 4, "hsdp": 5}


@dataclass
class Row:
    """One strategy evaluated on the site."""

    cfg: Config
    memory: Memory | None
    comm: Comm | None
    capacity_gb: float | None  # device memory per rank (host share on CPU sites); None = unknown
    host_capacity_gb: float | None  # usable host memory per node, for offload
    gpu: bool

    @property
    def dims(self) -> ParallelDims:
        return self.cfg.dims

    @property
    def label(self) -> str:
        return self.family.replace("hsdp", f"hsdp {self.dims.dp_shard} {self.dims.sharding}") \
            + (" + offload" if self.cfg.offload else "")

    @property
    def family(self) -> str:
        d = self.dims
        return d.strategy if not d.fsdp_enabled or d.hsdp_enabled else f"fsdp {d.sharding}"

    @property
    def need_gb(self) -> float | None:
        """Estimate plus headroom, per rank."""
        if self.memory is None:
            return None
        return self.memory.total + headroom_gb(self.memory.total, self.gpu)

    @property
    def host_fits(self) -> bool | None:
        if not self.cfg.offload or self.memory is None:
            return True
        if not self.host_capacity_gb:
            return None
        return self.memory.host_per_node <= self.host_capacity_gb

    @property
    def fits(self) -> bool | None:
        if self.need_gb is None or self.capacity_gb is None:
            return None
        host = self.host_fits
        return self.need_gb <= self.capacity_gb and host is not False

    def to_dict(self) -> dict[str, tp.Any]:
        m, c = self.memory, self.comm
        return {
            "strategy": self.dims.strategy, "sharding": self.dims.sharding, "shard": self.dims.dp_shard,
            "dims": self.dims.to_dict(), "cpu_offload": self.cfg.offload, "label": self.label,
            "memory_gb": None if m is None else {
                "params": m.params, "grads": m.grads, "optimizer": m.optimizer, "buffers": m.buffers,
                "activations": m.activations, "total": m.total, "headroom": self.need_gb - m.total,
                "host_per_node": m.host_per_node, "notes": list(m.notes)},
            "capacity_gb": self.capacity_gb, "fits": self.fits,
            "comm": None if c is None else {
                "gb_per_step": c.gb, "seconds_per_step": c.seconds,
                "parts": [{"what": p.what, "gb": p.gb, "seconds": p.seconds, "link": p.link} for p in c.parts]},
        }


@dataclass
class Plan:
    """What ``hpcx plan`` prints; ``choice`` is None when nothing fits."""

    job: str
    site: str
    model: str
    n_params: int | None
    nodes: int
    tasks_per_node: int
    micro_batch: int
    grad_accum: int
    mixed_precision: str
    checkpointing: bool
    compute_s: float | None
    mfu: float
    rows: list[Row]
    choice: Row | None
    recommendation: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    def to_dict(self) -> dict[str, tp.Any]:
        return {
            "job": self.job, "site": self.site, "model": self.model, "n_params": self.n_params,
            "nodes": self.nodes, "tasks_per_node": self.tasks_per_node, "world_size": self.world,
            "micro_batch": self.micro_batch, "grad_accum": self.grad_accum,
            "mixed_precision": self.mixed_precision, "activation_checkpointing": self.checkpointing,
            "compute_seconds_per_step": self.compute_s, "mfu": self.mfu,
            "rows": [r.to_dict() for r in self.rows],
            "choice": None if self.choice is None else self.choice.to_dict(),
            "recommendation": self.recommendation, "advice": self.advice, "notes": self.notes,
        }


# --- inputs ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setup:
    """Everything a row depends on besides the strategy: the knobs the advice varies."""

    nodes: int
    tasks_per_node: int
    micro_batch: int
    checkpointing: bool
    global_batch: int
    mixed_precision: str
    dropout: float

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def grad_accum(self) -> int:
        return max(1, self.global_batch // (self.world * self.micro_batch))


def setup_of(spec: JobSpec, site: SiteProfile, nodes: int | None) -> Setup:
    return Setup(nodes=nodes or spec.job.nodes, tasks_per_node=spec.job.tasks_per_node or site.default_tasks_per_node(),
                 micro_batch=spec.train.micro_batch, checkpointing=spec.parallel.activation_checkpointing,
                 global_batch=spec.train.global_batch,
                 mixed_precision=compute_precision(spec.parallel.mixed_precision, site.node.gpus > 0),
                 dropout=spec.model.dropout)


Candidate = tuple[ParallelDims, bool]  # (layout, cpu offload)


def candidates(setup: Setup, offload: bool, gpu: bool) -> list[Candidate]:
    """(layout, offload) to evaluate; offload applies to fsdp/hsdp only."""
    world, tpn = setup.world, setup.tasks_per_node
    off = offload and gpu
    if world == 1:
        return [(parallel_dims("none", "full_shard", 1), False)] + \
            ([(parallel_dims("fsdp", "full_shard", 1), True)] if off else [])
    out = [(parallel_dims("ddp", "full_shard", world), False)] if not off else []
    out += [(parallel_dims("fsdp", s, world), off) for s in ("no_shard", "shard_grad_op", "full_shard")]
    if setup.nodes > 1:
        out += [(parallel_dims("hsdp", s, world, tpn, tpn * k), off) for k in range(1, setup.nodes)
                if setup.nodes % k == 0 for s in ("shard_grad_op", "full_shard")]
    return out


def evaluate(facts: ModelFacts, cand: Candidate, setup: Setup, site: SiteProfile) -> Row:
    dims, offload = cand
    cfg = Config(dims, offload, setup.mixed_precision, setup.checkpointing, setup.micro_batch, setup.dropout)
    gpu = site.node.gpus > 0
    tpn = setup.tasks_per_node
    memory = estimate(facts, cfg, tpn)
    comm = step_comm(facts, cfg, site, setup.nodes, tpn, setup.grad_accum)
    host = site.node.memory_gb * HOST_USABLE if site.node.memory_gb else None
    if gpu:
        capacity = site.node.gpu_memory_gb or None
    else:
        capacity = site.node.memory_gb / tpn if site.node.memory_gb else None
    return Row(cfg, memory, comm, capacity, host, gpu)


def compute_seconds(facts: ModelFacts, setup: Setup, site: SiteProfile, mfu: float) -> float | None:
    """6N(+attention) FLOPs per token × tokens per rank per step / (peak × MFU); × 4/3 with recompute."""
    if facts.flops_per_token is None or not site.node.gpus or not site.node.gpu_peak_tflops:
        return None
    flops = facts.flops_per_token * facts.seq_len * setup.micro_batch * setup.grad_accum
    flops *= 4 / 3 if setup.checkpointing else 1.0
    return flops / (site.node.gpu_peak_tflops * 1e12 * mfu)


# --- the choice ------------------------------------------------------------------------------

def comm_cost(row: Row) -> float:
    if row.comm is None:
        return 0.0
    return row.comm.seconds if row.comm.seconds is not None else row.comm.gb


def pick(rows: list[Row], compute_s: float | None = None) -> Row | None:
    """The cheapest-communication row that fits; among near-ties, the simplest.

    A near-tie is within TIE of the best, or a difference that would change the step time by
    less than TIE of the compute time even if none of it overlapped with compute.
    """
    fitting = [r for r in rows if r.fits is not False]
    if not fitting:
        return None
    best = min(comm_cost(r) for r in fitting)
    timed = all(r.comm is not None and r.comm.seconds is not None for r in fitting)
    slack = max(best * TIE, TIE * compute_s if compute_s and timed else 0.0, 1e-4)
    near = [r for r in fitting if comm_cost(r) <= best + slack]
    return min(near, key=lambda r: (SIMPLICITY[r.family], comm_cost(r)))
