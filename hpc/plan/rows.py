"""The planner's rows: every candidate layout evaluated on a site (memory per rank and communication
per step), and the choice among those that fit."""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass, field, replace
from typing import Any

from hpc.plan.comm import Comm, step_comm
from hpc.core.dims import ParallelDims, parallel_dims
from hpc.plan.memory import HOST_USABLE, Config, Memory, estimate, headroom_gb
from hpc.core.models import ModelFacts
from hpc.core.site import SiteProfile, nvlink_domain as of_node
from hpc.core.tensor_parallel import allowed_degrees
from hpc.core.optim import state_bytes
from hpc.core.spec import JobSpec, compute_precision

from hpc.plan.timing import StepTime, host_step_seconds, step_time

MFU_DEFAULT = 0.4  # assumed model FLOPs utilisation where the site sets no node.mfu
TIE = 0.05  # within 5% of the fastest estimated step counts as a tie; the simplest tied row wins
MARGIN = 0.85  # a row that needs more than this share of the GPU's memory is tight: it loses every tie to one that
# leaves a margin (the first tie-break)
# Simplicity, the first tie-break: one process < whole replicas < sharded (any FSDP/HSDP layout);
# then no offload before offload, then all-gathers inside one node (its NVLink domain) before
# all-gathers across nodes, then the least communication.
SIMPLICITY = {"none": 0, "ddp": 1, "fsdp": 2, "hsdp": 2}
SIMPLICITY_TEXT = (f"a memory margin first (at most {MARGIN:.0%} of the GPU's memory with headroom), then none < ddp < "
                   "fsdp/hsdp, without offload before with, then all-gathers inside one node before across nodes, "
                   "then the least communication")


@dataclass
class Row:
    """One strategy evaluated on the site."""

    cfg: Config
    memory: Memory | None
    comm: Comm | None
    capacity_gb: float | None  # device memory per rank (host share on CPU sites); None = unknown
    host_capacity_gb: float | None  # usable host memory per node, for offload
    gpu: bool
    time: StepTime | None = None  # None where compute or a bandwidth is unknown
    illegal: str = ""  # why this layout cannot run the spec (its global batch does not divide); "" if it can

    @property
    def dims(self) -> ParallelDims:
        return self.cfg.dims

    @property
    def label(self) -> str:
        return self.family.replace("hsdp", f"hsdp {self.dims.dp_shard} {self.dims.sharding}") \
            + (f" × tp {self.dims.tp}" if self.dims.tp > 1 else "") + (" + offload" if self.cfg.offload else "")

    @property
    def family(self) -> str:
        d = self.dims
        return d.strategy if not d.fsdp_enabled or d.hsdp_enabled else f"fsdp {d.sharding}"

    @property
    def gathers_cross_nodes(self) -> bool:
        """Whether every micro-batch's all-gathers leave the node (a shard group wider than a node)."""
        return self.comm is not None and any(p.kind == "all_gather" and p.nodes > 1 for p in self.comm.parts)

    @property
    def step_s(self) -> float | None:
        return None if self.time is None else self.time.step_s

    @property
    def peak_gb(self) -> float | None:
        """The larger of the training total and the start-up (init) peak, per rank; on CPU sites,
        where the host is the rank's memory, plus what checkpoint staging keeps there."""
        m = self.memory
        if m is None:
            return None
        return max(m.total, m.init) + (0.0 if self.gpu else m.staging)

    @property
    def need_gb(self) -> float | None:
        """Peak plus headroom, per rank."""
        peak = self.peak_gb
        return None if peak is None else peak + headroom_gb(peak, self.gpu)

    @property
    def host_need_gb(self) -> float:
        """Host memory per node on GPU sites: offloaded states plus checkpoint staging buffers."""
        if self.memory is None or not self.gpu:
            return 0.0
        return self.memory.host_per_node + self.memory.staging_per_node

    @property
    def host_fits(self) -> bool | None:
        if self.memory is None or not self.host_need_gb:
            return True
        if not self.host_capacity_gb:
            return None if self.cfg.offload else True  # staging alone on a site of unknown RAM: not checked
        return self.host_need_gb <= self.host_capacity_gb

    @property
    def fits(self) -> bool | None:
        if self.illegal:
            return False
        if self.need_gb is None or self.capacity_gb is None:
            return None
        if self.need_gb > self.capacity_gb or self.host_fits is False:
            return False
        return self.host_fits  # True, or None: offloaded states and unknown host memory

    def to_dict(self) -> dict[str, tp.Any]:
        m, c = self.memory, self.comm
        return {
            "strategy": self.dims.strategy, "sharding": self.dims.sharding, "shard": self.dims.dp_shard,
            "dims": self.dims.to_dict(), "cpu_offload": self.cfg.offload, "label": self.label,
            "memory_gb": None if m is None else {
                "params": m.params, "grads": m.grads, "optimizer": m.optimizer, "buffers": m.buffers,
                "activations": m.activations, "total": m.total,
                "headroom": self.need_gb - self.peak_gb,  # type: ignore[operator]  # both known where m is
                "host_per_node": m.host_per_node, "notes": list(m.notes),
                "init": m.init, "peak": self.peak_gb, "staging_per_rank": m.staging,
                "staging_per_node": m.staging_per_node, "host_need_per_node": self.host_need_gb},
            "capacity_gb": self.capacity_gb, "host_capacity_gb": self.host_capacity_gb, "fits": self.fits,
            "illegal": self.illegal or None, "margin": None if self.need_gb is None else roomy(self),
            "comm": None if c is None else {
                "gb_per_step": c.gb, "seconds_per_step": c.seconds, "cross_node_gb_per_node": c.cross_node_gb,
                "gathers_cross_nodes": self.gathers_cross_nodes, "parts": [p.to_dict() for p in c.parts]},
            "step": None if self.time is None else self.time.to_dict(),
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
    offload_allowed: bool = False  # the spec's cpu_offload under auto: offload variants are candidates
    tp: int = 1  # the tensor-parallel degree of the rows (the spec's, or the chosen one under auto)
    tp_rows: list[Row] = field(default_factory=list)  # the chosen family at every degree the site allows
    tp_cross_domain: bool = False  # parallel.tp_cross_domain: degrees across NVLink islands were planned
    nvlink_domain: int = 1  # GPUs per NVLink island of the site (hpc.core.site.nvlink_domain)
    mfu_source: str = "assumed"
    recommendation: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    def to_dict(self) -> dict[str, Any]:  # (``tp`` is a field here, not the typing module)
        return {
            "job": self.job, "site": self.site, "model": self.model, "n_params": self.n_params,
            "nodes": self.nodes, "tasks_per_node": self.tasks_per_node, "world_size": self.world,
            "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "tp": self.tp,
            "mixed_precision": self.mixed_precision, "activation_checkpointing": self.checkpointing,
            "compute_seconds_per_step": self.compute_s, "mfu": self.mfu, "mfu_source": self.mfu_source,
            "rows": [r.to_dict() for r in self.rows], "compared_by": measure(eligible(self.rows)), "tie": TIE,
            "eligible": [r.label for r in eligible(self.rows)], "tie_break": SIMPLICITY_TEXT,
            "nvlink_domain": self.nvlink_domain, "tp_cross_domain": self.tp_cross_domain,
            "tp_degrees": [degree_dict(r, self.nvlink_domain) for r in self.tp_rows],
            "choice": None if self.choice is None else self.choice.to_dict(),
            "recommendation": self.recommendation, "advice": self.advice, "notes": self.notes,
        }


def degree_dict(row: Row, domain: int) -> dict[str, tp.Any]:
    """One tensor-parallel degree of the chosen family, for ``--json`` (``hpc.plan.degrees``)."""
    return {"tp": row.dims.tp, "label": row.label, "need_gb": row.need_gb, "capacity_gb": row.capacity_gb,
            "fits": row.fits, "margin": roomy(row) if row.need_gb is not None else None,
            "illegal": row.illegal or None, "step_s": row.step_s, "tp_comm_s": tp_seconds(row),
            "intra_node_gb_per_gpu": intra_gb(row), "network_gb_per_node": network_gb(row),
            "crosses_nvlink_domain": crosses_domain_by(row, domain)}



def intra_gb(row: Row) -> float:
    """GB each GPU sends per step inside its node (NVLink or PCIe; host copies aside)."""
    return sum(p.gb for p in row.comm.parts if p.nodes <= 1 and p.kind != "host_copy") if row.comm else 0.0


def network_gb(row: Row) -> float:
    """GB through each node's network links per step (InfiniBand, RoCE …)."""
    return row.comm.cross_node_gb if row.comm else 0.0


def crosses_domain_by(row: Row, domain: int) -> bool:
    """Whether the row's tensor-parallel groups span NVLink islands of ``domain`` GPUs."""
    return row.dims.tp > max(1, domain)


def tp_seconds(row: Row) -> float:
    """Seconds per step of the tensor-parallel collectives (none of which hides)."""
    return sum(p.seconds or 0.0 for p in row.comm.parts if p.what.startswith("tp ")) if row.comm else 0.0



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
    async_save: bool = False
    document_mask: bool = False  # data.packing = "document"
    tp: int = 1  # tensor-parallel degree: tp ranks share each micro-batch, world / tp take different ones
    tp_cross_domain: bool = False  # parallel.tp_cross_domain: tp groups may span NVLink islands (within a node)
    reshard_after_forward: bool = True  # parallel.reshard_after_forward (false: units stay gathered all step)
    batch_checked: bool = False  # mark rows whose global batch does not divide illegal (the tp search of `auto`;
    # the advice's changes say the global_batch they need instead)
    optimizer_bytes: int = 8  # optimizer state per trained parameter (hpc.core.optim.state_bytes)

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def dp_world(self) -> int:
        """Ranks that take different samples (the data-parallel ranks)."""
        return max(1, self.world // self.tp)

    @property
    def grad_accum(self) -> int:
        return max(1, self.global_batch // (self.dp_world * self.micro_batch))

    @property
    def batch_problem(self) -> str:
        """Why ``global_batch`` does not split into whole micro-batches over the data-parallel ranks ("" if it does)."""
        per_step = self.dp_world * self.micro_batch
        if self.global_batch % per_step == 0:
            return ""
        ranks = f"{self.world} ranks / tp {self.tp}" if self.tp > 1 else f"{self.world} ranks"
        return (f"global_batch {self.global_batch} is not divisible by {ranks} × micro_batch {self.micro_batch} "
                f"= {per_step}")


def setup_of(spec: JobSpec, site: SiteProfile, nodes: int | None) -> Setup:
    return Setup(nodes=nodes or spec.job.nodes, tasks_per_node=spec.job.tasks_per_node or site.default_tasks_per_node(),
                 micro_batch=spec.train.micro_batch, checkpointing=spec.parallel.activation_checkpointing,
                 global_batch=spec.train.global_batch,
                 mixed_precision=compute_precision(spec.parallel.mixed_precision, site.node.gpus > 0),
                 dropout=spec.model.dropout, async_save=spec.checkpoint.async_save,
                 document_mask=spec.data.packing == "document", tp=spec_tp(spec),
                 tp_cross_domain=spec.parallel.tp_cross_domain,
                 reshard_after_forward=spec.parallel.reshard_after_forward, optimizer_bytes=state_bytes(spec))


def spec_tp(spec: JobSpec) -> int:
    """``parallel.tp`` of the spec (1 where the spec has no such field)."""
    return int(getattr(spec.parallel, "tp", 1) or 1)


Candidate = tuple[ParallelDims, bool]  # (layout, cpu offload)


def candidates(setup: Setup, offload: bool, gpu: bool) -> list[Candidate]:
    """(layout, offload) to evaluate. ``offload`` (the spec's cpu_offload) allows offload: every
    FSDP/HSDP layout is then evaluated with and without it, since offload is a cost, not a goal."""
    world, tpn = setup.world, setup.tasks_per_node
    if setup.tp > 1:
        return tp_candidates(setup, offload, gpu)
    if world == 1:
        layouts = [parallel_dims("none", "full_shard", 1)]
        sharded = [parallel_dims("fsdp", "full_shard", 1)] if offload and gpu else []
        return [(d, False) for d in layouts] + [(d, True) for d in sharded]
    layouts = [parallel_dims("ddp", "full_shard", world)]
    layouts += [parallel_dims("fsdp", s, world) for s in ("no_shard", "shard_grad_op", "full_shard")]
    if setup.nodes > 1:
        layouts += [parallel_dims("hsdp", s, world, tpn, tpn * k) for k in range(1, setup.nodes)
                    if setup.nodes % k == 0 for s in ("shard_grad_op", "full_shard")]
    out = [(d, False) for d in layouts]
    if offload and gpu:
        out += [(d, True) for d in layouts if d.fsdp_enabled]
    return out


def tp_candidates(setup: Setup, offload: bool, gpu: bool) -> list[Candidate]:
    """Layouts with tensor parallelism inside a node: FSDP (full_shard, shard_grad_op) over the
    data-parallel ranks, and HSDP with shard groups of whole nodes, each × tp."""
    world, tpn, t = setup.world, setup.tasks_per_node, setup.tp
    layouts = [parallel_dims("fsdp", s, world, tpn, tp=t) for s in ("shard_grad_op", "full_shard")]
    if setup.nodes > 1:
        per_node = max(1, tpn // t)
        layouts += [parallel_dims("hsdp", s, world, tpn, per_node * k, tp=t) for k in range(1, setup.nodes)
                    if setup.nodes % k == 0 for s in ("shard_grad_op", "full_shard")]
    out = [(d, False) for d in layouts]
    return out + ([(d, True) for d in layouts] if offload and gpu else [])


def tp_degrees(facts: ModelFacts, site: SiteProfile, tasks_per_node: int, cross_domain: bool = False) -> list[int]:
    """The tensor-parallel degrees a plan may use (``hpc.core.tensor_parallel.allowed_degrees``)."""
    return allowed_degrees(facts, site, tasks_per_node, cross_domain)


def nvlink_domain(site: SiteProfile) -> int:
    """GPUs of one NVLink domain (``hpc.core.site.nvlink_domain``); 0 GPUs: 1."""
    return of_node(site.node) if site.node.gpus else 1


def evaluate(facts: ModelFacts, cand: Candidate, setup: Setup, site: SiteProfile) -> Row:
    dims, offload = cand
    if dims.tp != setup.tp:
        setup = replace(setup, tp=dims.tp)
    cfg = Config(dims, offload, setup.mixed_precision, setup.checkpointing, setup.micro_batch, setup.dropout,
                 setup.async_save, setup.grad_accum, setup.document_mask, site.node.gpus > 0,
                 setup.reshard_after_forward, setup.optimizer_bytes)
    gpu = site.node.gpus > 0
    tpn = setup.tasks_per_node
    memory = estimate(facts, cfg, tpn)
    comm = step_comm(facts, cfg, site, setup.nodes, tpn, setup.grad_accum)
    host = site.node.memory_gb * HOST_USABLE if site.node.memory_gb else None
    if gpu:
        capacity = site.node.gpu_memory_gb or None
    else:
        capacity = site.node.memory_gb / tpn if site.node.memory_gb else None
    host_s = host_step_seconds((facts.n_params or 0) / (dims.dp_shard * dims.tp), site.node.cpus // tpn) \
        if offload else 0.0
    time = step_time(comm, compute_seconds(facts, setup, site, mfu_of(site)[0]), setup.grad_accum,
                     setup.checkpointing, host_s)
    return Row(cfg, memory, comm, capacity, host, gpu, time, setup.batch_problem if setup.batch_checked else "")


def mfu_of(site: SiteProfile) -> tuple[float, str]:
    """The MFU the compute time uses and where it came from: the site's ``node.mfu``, else MFU_DEFAULT."""
    if site.node.mfu:
        return site.node.mfu, site.node.mfu_source or f"node.mfu of site {site.name!r}"
    return MFU_DEFAULT, f"assumed: site {site.name!r} sets no node.mfu"


def compute_seconds(facts: ModelFacts, setup: Setup, site: SiteProfile, mfu: float) -> float | None:
    """6N(+attention) FLOPs per token × tokens per rank per step / (peak × MFU); × 4/3 with recompute."""
    if facts.flops_per_token is None or not site.node.gpus or not site.node.gpu_peak_tflops:
        return None
    flops = facts.flops_per_token * facts.seq_len * setup.micro_batch * setup.grad_accum / setup.tp
    flops *= 4 / 3 if setup.checkpointing else 1.0
    return flops / (site.node.gpu_peak_tflops * 1e12 * mfu)


# --- the choice ------------------------------------------------------------------------------

def measure(rows: list[Row]) -> str:
    """What the choice compares: "step" (estimated step seconds) where every row has one, else
    "comm s" (communication seconds), else "comm GB" (no bandwidths in the site)."""
    if rows and all(r.time is not None for r in rows):
        return "step"
    if rows and all(r.comm is not None and r.comm.seconds is not None for r in rows):
        return "comm s"
    return "comm GB"


def comm_cost(row: Row) -> float:
    """Communication per step: seconds where the site gives bandwidths, else GB."""
    if row.comm is None:
        return 0.0
    return row.comm.seconds if row.comm.seconds is not None else row.comm.gb


def cost(row: Row, by: str) -> float:
    if by == "step":
        return row.step_s or 0.0
    return comm_cost(row) if by == "comm s" else (row.comm.gb if row.comm is not None else 0.0)


def fitting(rows: list[Row]) -> list[Row]:
    """Rows that fit; rows of unknown fit only when none is known to fit."""
    known = [r for r in rows if r.fits]
    return known or [r for r in rows if r.fits is None]


def eligible(rows: list[Row]) -> list[Row]:
    """What the choice picks from: the rows that fit without CPU offload, or, when none does, the
    offload rows that fit (offload is used only when nothing fits without it)."""
    fit = fitting(rows)
    return [r for r in fit if not r.cfg.offload] or fit


def roomy(row: Row) -> bool:
    """Whether the row leaves a margin: it needs at most MARGIN of the memory per rank (unknown: yes)."""
    if row.need_gb is None or not row.capacity_gb:
        return True
    return row.need_gb <= MARGIN * row.capacity_gb


def tied(rows: list[Row]) -> list[Row]:
    """The eligible rows whose cost is within TIE of the cheapest."""
    fit = eligible(rows)
    if not fit:
        return []
    by = measure(fit)
    best = min(cost(r, by) for r in fit)
    return [r for r in fit if cost(r, by) <= best * (1 + TIE) + 1e-9]


def simplicity(row: Row) -> tuple[bool, int, bool, bool, float]:
    """The tie-break key, in SIMPLICITY_TEXT's order (smaller wins): a tight row loses to one with margin."""
    return not roomy(row), SIMPLICITY[row.dims.strategy], row.cfg.offload, row.gathers_cross_nodes, comm_cost(row)


def pick(rows: list[Row]) -> Row | None:
    """The simplest of the rows that fit and are within TIE of the fastest (see SIMPLICITY)."""
    near = tied(rows)
    return min(near, key=simplicity) if near else None
