"""The planner: per-rank memory and per-step communication of every strategy, and a choice.

``plan_job(spec, site, nodes)`` evaluates each candidate (ddp, fsdp with each sharding,
hsdp with node-sized and multi-node shard groups, CPU offload where asked) and recommends
the cheapest-communication one that fits with headroom. ``choose`` is what ``resolve``
calls: an explicit strategy in the spec is respected, ``auto`` takes the plan's choice.
Pure Python: runs on login nodes without torch.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass, field, replace

from hpc.comm import Comm, step_comm
from hpc.config import ConfigError
from hpc.memory import (FRAGMENTATION, GB, HOST_USABLE, Config, Memory, ModelFacts, estimate, gpt_facts,
                        headroom_gb)
from hpc.models import gpt_shape
from hpc.site import SiteProfile
from hpc.spec import JobSpec

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
    def label(self) -> str:
        c = self.cfg
        name = {"none": "none", "ddp": "ddp"}.get(c.strategy) or (
            f"hsdp {c.shard} {c.sharding}" if c.strategy == "hsdp" else f"fsdp {c.sharding}")
        return name + (" + offload" if c.offload else "")

    @property
    def family(self) -> str:
        return "hsdp" if self.cfg.strategy == "hsdp" else self.label.replace(" + offload", "")

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
            "strategy": self.cfg.strategy, "sharding": self.cfg.sharding, "shard": self.cfg.shard,
            "cpu_offload": self.cfg.offload, "label": self.label,
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

def model_facts(spec: JobSpec) -> ModelFacts:
    m = spec.model
    if m.arch == "gpt":
        return gpt_facts(f"gpt {m.size}", gpt_shape(m.size, m.seq_len, m.vocab_size))
    return ModelFacts(label=m.arch, n_params=None, unit_params=None, root_params=None, n_units=0,
                      flops_per_token=None, activation_gb_per_sample=m.activation_gb)


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
                 global_batch=spec.train.global_batch, mixed_precision=spec.parallel.mixed_precision,
                 dropout=spec.model.dropout)


def candidates(setup: Setup, offload: bool, gpu: bool) -> list[tuple[str, str, int, bool]]:
    """(strategy, sharding, shard, offload) to evaluate; offload applies to fsdp/hsdp only."""
    world, tpn = setup.world, setup.tasks_per_node
    off = offload and gpu
    if world == 1:
        return [("none", "full_shard", 1, False)] + ([("fsdp", "full_shard", 1, True)] if off else [])
    out = [("ddp", "full_shard", 1, False)] if not off else []
    out += [("fsdp", s, world if s != "no_shard" else 1, off) for s in ("no_shard", "shard_grad_op", "full_shard")]
    if setup.nodes > 1:
        out += [("hsdp", s, tpn * k, off) for k in range(1, setup.nodes) if setup.nodes % k == 0
                for s in ("shard_grad_op", "full_shard")]
    return out


def evaluate(facts: ModelFacts, cand: tuple[str, str, int, bool], setup: Setup, site: SiteProfile) -> Row:
    strategy, sharding, shard, offload = cand
    cfg = Config(strategy, sharding, shard, offload, setup.mixed_precision, setup.checkpointing,
                 setup.micro_batch, setup.dropout)
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
    seq = facts.gpt.seq_len if facts.gpt else 0
    flops = facts.flops_per_token * seq * setup.micro_batch * setup.grad_accum
    flops *= 4 / 3 if setup.checkpointing else 1.0
    return flops / (site.node.gpu_peak_tflops * 1e12 * mfu)


# --- the choice ------------------------------------------------------------------------------

def _cost(row: Row) -> float:
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
    best = min(_cost(r) for r in fitting)
    timed = all(r.comm is not None and r.comm.seconds is not None for r in fitting)
    slack = max(best * TIE, TIE * compute_s if compute_s and timed else 0.0, 1e-4)
    near = [r for r in fitting if _cost(r) <= best + slack]
    return min(near, key=lambda r: (SIMPLICITY[r.family], _cost(r)))


def plan_job(spec: JobSpec, site: SiteProfile, nodes: int | None = None) -> Plan:
    """Evaluate every strategy for ``spec`` on ``site`` (``nodes`` overrides job.nodes)."""
    facts = model_facts(spec)
    setup = setup_of(spec, site, nodes)
    gpu = site.node.gpus > 0
    rows = [evaluate(facts, c, setup, site) for c in candidates(setup, spec.parallel.cpu_offload, gpu)]
    compute_s = compute_seconds(facts, setup, site, MFU_DEFAULT)
    choice = pick(rows, compute_s) if facts.n_params is not None else None
    plan = Plan(job=spec.job.name, site=site.name, model=facts.label, n_params=facts.n_params,
                nodes=setup.nodes, tasks_per_node=setup.tasks_per_node, micro_batch=setup.micro_batch,
                grad_accum=setup.grad_accum, mixed_precision=setup.mixed_precision,
                checkpointing=setup.checkpointing, compute_s=compute_s,
                mfu=MFU_DEFAULT, rows=rows, choice=choice)
    plan.notes = _notes(site, setup, facts)
    if facts.n_params is None:
        plan.recommendation = _unknown_model(plan, setup)
    elif choice is None:
        plan.advice = advise(facts, setup, site, rows)
    else:
        plan.recommendation = recommend(plan, site)
    return plan


def _notes(site: SiteProfile, setup: Setup, facts: ModelFacts) -> list[str]:
    gpu = site.node.gpus > 0
    notes = [f"memory in GB (1e9 bytes) per rank; headroom = {2.0 if gpu else 0.5:g} GB "
             f"{'CUDA context + NCCL buffers' if gpu else 'per process'} + {FRAGMENTATION:.0%} fragmentation"]
    if not gpu:
        notes.append(f"CPU site: each rank's share of host memory is {site.node.memory_gb:g} GB / "
                     f"{setup.tasks_per_node} tasks" if site.node.memory_gb else
                     "CPU site with unknown node.memory_gb: memory not planned")
    if site.node.gpus and not site.node.gpu_peak_tflops:
        notes.append("node.gpu_peak_tflops unknown: compute time not estimated")
    if facts.gpt is None and facts.n_params is None:
        notes.append(f"user model {facts.label}: parameter count unknown to the planner (no torch on login nodes)")
    return notes


def _unknown_model(plan: Plan, setup: Setup) -> list[str]:
    if setup.world == 1:
        return ["one rank and a user model of unknown size: none"]
    return [f"{plan.model}: the planner cannot count its parameters without torch, so it picks fsdp full_shard, "
            "the strategy with the lowest per-GPU memory"]


def _gb(x: float) -> str:
    return f"{x:.1f} GB" if x < 100 else f"{x:.0f} GB"


def _row(rows: list[Row], family: str) -> Row | None:
    found = [r for r in rows if r.family == family and not r.cfg.offload]
    return found[0] if found else None


def recommend(plan: Plan, site: SiteProfile) -> list[str]:
    """One or two sentences that cite the numbers, then the seeds' rule and the bound."""
    choice, rows = plan.choice, plan.rows
    assert choice is not None and choice.memory is not None
    fitting = [r for r in rows if r.fits is not False]
    states = choice.memory.params + choice.memory.grads + choice.memory.optimizer
    where = "host" if choice.cfg.offload else ("GPU" if choice.gpu else "rank")
    first = (f"{choice.label}: {_gb(choice.need_gb)} of {_gb(choice.capacity_gb or 0)} per {where if where != 'host' else 'GPU'} "
             f"with headroom (model states {_gb(states)}")
    first += f" of {_gb(16 * plan.n_params / GB)} total)" if choice.cfg.shard > 1 or choice.cfg.offload else ")"
    if choice.comm is not None and len(fitting) > 1:
        first += (f", and the least communication of the {len(fitting)} strategies that fit: "
                  f"{_comm_text(choice)}")
    out = [first + "."]
    replica = _row(rows, "ddp") or _row(rows, "none")
    if choice.cfg.shard > 1 and replica is not None and replica.fits is False and replica.memory is not None:
        m = replica.memory
        out[0] += (f" A full replica ({replica.label}) does not fit: {_gb(m.params + m.grads + m.optimizer)} of "
                   f"model states alone on one GPU, {_gb(replica.need_gb or 0)} in all.")
    out += rule_of_thumb(plan, site)
    bound = _bound(plan, site)
    if bound:
        out.append(bound)
    return out


def _comm_text(row: Row) -> str:
    c = row.comm
    if c is None:
        return "unknown"
    if c.seconds is None:
        return f"{c.gb:.1f} GB per step"
    return f"{c.gb:.1f} GB, {c.seconds:.2f} s per step"


def _bound(plan: Plan, site: SiteProfile) -> str:
    c = plan.choice
    if c is None or c.comm is None or c.comm.seconds is None or plan.compute_s is None or not c.comm.parts:
        return ""
    link = c.comm.slowest_link
    if link == site.node.intra_link:
        link = f"{link} ({site.node.intra_bandwidth_gbs:g} GB/s per GPU)"
    elif link == site.network.fabric:
        link = f"{link} ({site.network.bandwidth_gbs:g} GB/s per node)"
    kind = "communication-bound" if c.comm.seconds > plan.compute_s else "compute-bound"
    return (f"{kind} on {link}: communication {c.comm.seconds:.2f} s vs compute {plan.compute_s:.2f} s per step "
            f"(MFU {plan.mfu:.2f} assumed; overlap hides the smaller of the two)")


def rule_of_thumb(plan: Plan, site: SiteProfile) -> list[str]:
    """The seeds' rule for this size, and where the numbers depart from it."""
    n, choice, rows = plan.n_params or 0, plan.choice, plan.rows
    assert choice is not None
    if plan.world == 1:
        return [f"Seeds' decision tree (001): fits one GPU → no parallelism; {choice.label} agrees."] \
            if not choice.cfg.offload else \
            ["Seeds' rule (000): over 10B or short of memory → FSDP + CPU offload; on one GPU offload is what fits."]
    if n < 1e9:
        rule, want = "under 1B parameters → DDP", "ddp"
    elif n <= 10e9:
        rule, want = "1–10B parameters → FSDP", "fsdp"
    else:
        rule, want = "over 10B parameters → FSDP + CPU offload", "offload"
    head = f"Seeds' rule '{rule}' (000)"
    got = "ddp" if choice.family == "ddp" else ("offload" if choice.cfg.offload else "fsdp")
    lines = [f"{head}: agrees." if got == want else f"{head}: departs — {_why(want, choice, rows)}."]
    if plan.nodes > 1:
        lines.append(_hsdp_rule(plan, choice, rows))
    return lines


def _why(want: str, choice: Row, rows: list[Row]) -> str:
    if want == "ddp":
        ddp = _row(rows, "ddp")
        if ddp is not None and ddp.fits is False and ddp.need_gb is not None:
            return (f"DDP does not lower per-GPU memory: it needs {_gb(ddp.need_gb)} > {_gb(ddp.capacity_gb or 0)}, "
                    f"{choice.label} needs {_gb(choice.need_gb or 0)}")
        return _versus(choice, ddp)
    if want == "fsdp" and choice.family == "ddp":
        full = _row(rows, "fsdp full_shard")
        return (f"DDP fits ({_gb(choice.need_gb or 0)} of {_gb(choice.capacity_gb or 0)}) and moves less: "
                f"{_comm_text(choice)} vs FSDP full_shard {_comm_text(full)}, since FSDP all-gathers every micro-batch")
    if want == "offload":
        return (f"offload is not needed: {choice.label} fits on the GPU ({_gb(choice.need_gb or 0)} of "
                f"{_gb(choice.capacity_gb or 0)}), and offload would add host copies and a CPU optimizer step")
    leanest = min((r for r in rows if not r.cfg.offload and r.need_gb is not None),
                  key=lambda r: r.need_gb or 0.0, default=None)
    if leanest is not None:
        return (f"nothing fits on the GPU alone (the leanest, {leanest.label}, needs {_gb(leanest.need_gb or 0)} "
                f"of {_gb(leanest.capacity_gb or 0)}), so the states go to the host")
    return "offload is what fits"


def _hsdp_rule(plan: Plan, choice: Row, rows: list[Row]) -> str:
    head = "Seeds' rule 'many nodes → HYBRID_SHARD' (001)"
    nodal = [r for r in rows if r.cfg.strategy == "hsdp" and r.cfg.shard == plan.tasks_per_node]
    fit = [r for r in nodal if r.fits is not False]
    node = min(fit, key=_cost) if fit else min(nodal, key=lambda r: r.need_gb or 0.0, default=None)
    if choice.cfg.strategy == "hsdp":
        if choice.cfg.shard <= plan.tasks_per_node:
            return f"{head}: agrees; the shard group of {choice.cfg.shard} keeps all-gathers inside one node."
        why = f" (sharded over one node it needs {_gb(node.need_gb or 0)} > {_gb(node.capacity_gb or 0)})" \
            if node is not None and node.fits is False else ""
        return (f"{head}: agrees, but the shard group of {choice.cfg.shard} spans "
                f"{choice.cfg.shard // plan.tasks_per_node} nodes{why}.")
    if node is None:
        return f"{head}: no node-sized shard group here."
    if node.fits is False:
        return (f"{head}: departs — sharded over one node ({node.cfg.shard} GPUs) it needs {_gb(node.need_gb or 0)} "
                f"> {_gb(node.capacity_gb or 0)}.")
    return f"{head}: departs — {_versus(choice, node)}."


def _versus(choice: Row, other: Row | None) -> str:
    """Why ``choice`` beat ``other`` on communication (or on simplicity, within the tie margin)."""
    if other is None:
        return f"{choice.label} communicates least"
    if _cost(choice) <= _cost(other):
        return f"{choice.label} moves less ({_comm_text(choice)} vs {_comm_text(other)} for {other.label})"
    return (f"{other.label} would move slightly less ({_comm_text(other)} vs {_comm_text(choice)}), a "
            f"near-tie (under {TIE:.0%} of the step), so the simpler {choice.label} is kept")


def advise(facts: ModelFacts, setup: Setup, site: SiteProfile, rows: list[Row]) -> list[str]:
    """Nothing fits: what would, with numbers."""
    leanest = min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb or 0.0)
    out = [f"Nothing fits: the leanest, {leanest.label}, needs {_gb(leanest.need_gb or 0)} of "
           f"{_gb(leanest.capacity_gb or 0)} per {'GPU' if leanest.gpu else 'rank'}."]
    cand = (leanest.cfg.strategy, leanest.cfg.sharding, leanest.cfg.shard, leanest.cfg.offload)
    if not setup.checkpointing:
        out.append(_try("with parallel.activation_checkpointing = true", facts, cand, replace(setup, checkpointing=True), site))
    if setup.micro_batch > 1:
        smaller = replace(setup, micro_batch=1, checkpointing=True)
        out.append(_try("with train.micro_batch = 1 and activation checkpointing", facts, cand, smaller, site))
    if site.node.gpus and not leanest.cfg.offload:
        shard = setup.world
        out.append(_try("with parallel.cpu_offload = true", facts, ("fsdp", "full_shard", shard, True), setup, site))
    more = _more_nodes(facts, setup, site)
    if more:
        out.append(more)
    return out


def _try(what: str, facts: ModelFacts, cand: tuple[str, str, int, bool], setup: Setup, site: SiteProfile) -> str:
    row = evaluate(facts, cand, setup, site)
    verdict = "fits" if row.fits else "still does not fit"
    text = f"{what}: {row.label} {verdict} ({_gb(row.need_gb or 0)} of {_gb(row.capacity_gb or 0)} per GPU"
    if row.cfg.offload and row.memory is not None:
        text += f"; host {_gb(row.memory.host_per_node)} per node of {_gb(row.host_capacity_gb or 0)} usable"
    return text + ")."


def _more_nodes(facts: ModelFacts, setup: Setup, site: SiteProfile) -> str:
    if not site.is_slurm or not site.node.gpus:
        return ""
    limit = site.scheduler.max_nodes or 1024
    nodes = setup.nodes * 2
    while nodes <= limit:
        bigger = replace(setup, nodes=nodes)
        row = evaluate(facts, ("fsdp", "full_shard", bigger.world, False), bigger, site)
        if row.fits:
            return (f"with job.nodes = {nodes}: fsdp full_shard over {bigger.world} GPUs fits "
                    f"({_gb(row.need_gb or 0)} of {_gb(row.capacity_gb or 0)} per GPU).")
        nodes *= 2
    return f"more nodes alone do not help up to {limit} nodes."


# --- resolve's entry point -------------------------------------------------------------------

def choose(spec: JobSpec, site: SiteProfile, nodes: int) -> tuple[str, str, int, list[str]]:
    """(strategy, sharding, shard_size, reasons): the spec's explicit strategy, or the plan's for ``auto``."""
    p = spec.parallel
    tpn = spec.job.tasks_per_node or site.default_tasks_per_node()
    if p.strategy != "auto":
        shard = (p.shard_size or tpn) if p.strategy == "hsdp" else 0
        return p.strategy, p.sharding, shard, [f"strategy {p.strategy!r} set in the spec"]
    plan = plan_job(spec, site, nodes)
    if plan.n_params is None:
        strategy = "none" if plan.world == 1 else "fsdp"
        return strategy, "full_shard", 0, plan.recommendation
    if plan.choice is None:
        raise ConfigError([f"{spec.source}: `parallel.strategy` = 'auto' but no strategy fits {plan.model} on "
                           f"site {site.name!r} ({plan.nodes} nodes × {plan.tasks_per_node} ranks)"] + plan.advice)
    cfg = plan.choice.cfg
    shard = cfg.shard if cfg.strategy == "hsdp" else 0
    return cfg.strategy, cfg.sharding, shard, plan.recommendation


# --- the terminal table ----------------------------------------------------------------------

COLUMNS = ("params", "grads", "optim", "buffers", "activ", "total", "+headroom", "fits", "comm GB", "comm s")


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    if x < 1:
        return f"{x:.3f}"
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _count(n: int | None) -> str:
    if not n:
        return "parameters unknown"
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit} params"
    return f"{n} params"


def _cells(row: Row) -> list[str]:
    m, c = row.memory, row.comm
    fits = {True: "yes", False: "no", None: "?"}[row.fits]
    if row.cfg.offload and row.host_fits is False:
        fits = "no (host)"
    if m is None:
        return ["?"] * 7 + [fits] + ["?"] * 2
    secs = None if c is None else c.seconds
    return [_num(m.params), _num(m.grads), _num(m.optimizer), _num(m.buffers),
            "unknown" if m.activations is None else _num(m.activations), _num(m.total), _num(row.need_gb), fits,
            _num(None if c is None else c.gb), "?" if secs is None else f"{secs:.3f}"]


def format_plan(plan: Plan) -> str:
    """The plan as a terminal table followed by the recommendation."""
    lines = [_header(plan), ""]
    table = [["strategy", *COLUMNS]] + [[("* " if r is plan.choice else "  ") + r.label, *_cells(r)] for r in plan.rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    lines.append("")
    if plan.compute_s is not None:
        lines.append(f"compute per step: {plan.compute_s:.2f} s at MFU {plan.mfu:.2f}"
                     f"{' (+1/3 recompute)' if plan.checkpointing else ''}")
    lines += [f"note: {n}" for n in plan.notes]
    if plan.choice is not None or plan.recommendation:
        lines.append("")
        lines += ["recommendation: " + plan.recommendation[0]] + ["  " + s for s in plan.recommendation[1:]]
    if plan.advice:
        lines.append("")
        lines += [plan.advice[0]] + ["  " + s for s in plan.advice[1:]]
    return "\n".join(lines)


def _header(plan: Plan) -> str:
    return (f"plan {plan.job}: {plan.model} ({_count(plan.n_params)}) on {plan.site}: {plan.nodes} node(s) × "
            f"{plan.tasks_per_node} ranks = {plan.world}; micro_batch {plan.micro_batch} × grad_accum "
            f"{plan.grad_accum}; mixed_precision {plan.mixed_precision}; activation checkpointing "
            f"{'on' if plan.checkpointing else 'off'}")
