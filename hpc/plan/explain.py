"""The planner's words: a recommendation that cites its numbers, the rule of thumb it agrees with or
departs from (and why), the bound, and what would fit when nothing does."""

from __future__ import annotations

from dataclasses import replace

from hpc.dims import parallel_dims
from hpc.memory import FRAGMENTATION, GB
from hpc.models import ModelFacts
from hpc.site import SiteProfile

from hpc.plan.rows import TIE, Candidate, Plan, Row, Setup, comm_cost, evaluate


def plan_notes(site: SiteProfile, setup: Setup, facts: ModelFacts) -> list[str]:
    gpu = site.node.gpus > 0
    notes = [f"memory in GB (1e9 bytes) per rank; headroom = {2.0 if gpu else 0.5:g} GB "
             f"{'CUDA context + NCCL buffers' if gpu else 'per process'} + {FRAGMENTATION:.0%} fragmentation"]
    if not gpu:
        notes.append(f"CPU site: each rank's share of host memory is {site.node.memory_gb:g} GB / "
                     f"{setup.tasks_per_node} tasks" if site.node.memory_gb else
                     "CPU site with unknown node.memory_gb: memory not planned")
    if site.node.gpus and not site.node.gpu_peak_tflops:
        notes.append("node.gpu_peak_tflops unknown: compute time not estimated")
    if facts.n_params is None:
        notes.append(f"user model {facts.label}: parameter count unknown to the planner (no torch on login nodes)")
    return notes


def unknown_model(plan: Plan, setup: Setup) -> list[str]:
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
    """One or two sentences that cite the numbers, then the rule of thumb and the bound."""
    choice, rows = plan.choice, plan.rows
    assert choice is not None and choice.memory is not None
    fitting = [r for r in rows if r.fits is not False]
    states = choice.memory.params + choice.memory.grads + choice.memory.optimizer
    where = "host" if choice.cfg.offload else ("GPU" if choice.gpu else "rank")
    first = (f"{choice.label}: {_gb(choice.need_gb)} of {_gb(choice.capacity_gb or 0)} per {where if where != 'host' else 'GPU'} "
             f"with headroom (model states {_gb(states)}")
    first += f" of {_gb(16 * plan.n_params / GB)} total)" if choice.dims.dp_shard > 1 or choice.cfg.offload else ")"
    if choice.comm is not None and len(fitting) > 1:
        first += (f", and the least communication of the {len(fitting)} strategies that fit: "
                  f"{_comm_text(choice)}")
    out = [first + "."]
    replica = _row(rows, "ddp") or _row(rows, "none")
    if choice.dims.dp_shard > 1 and replica is not None and replica.fits is False and replica.memory is not None:
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
    """The rule of thumb for this size, and where the numbers depart from it."""
    n, choice, rows = plan.n_params or 0, plan.choice, plan.rows
    assert choice is not None
    if plan.world == 1:
        return [f"Rule of thumb 'fits one GPU → no parallelism': {choice.label} agrees."] \
            if not choice.cfg.offload else \
            ["Rule of thumb 'over 10B or short of memory → FSDP + CPU offload': on one GPU offload is what fits."]
    if n < 1e9:
        rule, want = "under 1B parameters → DDP", "ddp"
    elif n <= 10e9:
        rule, want = "1–10B parameters → FSDP", "fsdp"
    else:
        rule, want = "over 10B parameters → FSDP + CPU offload", "offload"
    head = f"Rule of thumb '{rule}'"
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
    head = "Rule of thumb 'many nodes → HYBRID_SHARD'"
    nodal = [r for r in rows if r.dims.hsdp_enabled and r.dims.dp_shard == plan.tasks_per_node]
    fit = [r for r in nodal if r.fits is not False]
    node = min(fit, key=comm_cost) if fit else min(nodal, key=lambda r: r.need_gb or 0.0, default=None)
    if choice.dims.hsdp_enabled:
        if choice.dims.dp_shard <= plan.tasks_per_node:
            return f"{head}: agrees; the shard group of {choice.dims.dp_shard} keeps all-gathers inside one node."
        why = f" (sharded over one node it needs {_gb(node.need_gb or 0)} > {_gb(node.capacity_gb or 0)})" \
            if node is not None and node.fits is False else ""
        return (f"{head}: agrees, but the shard group of {choice.dims.dp_shard} spans "
                f"{choice.dims.dp_shard // plan.tasks_per_node} nodes{why}.")
    if node is None:
        return f"{head}: no node-sized shard group here."
    if node.fits is False:
        return (f"{head}: departs — sharded over one node ({node.dims.dp_shard} GPUs) it needs {_gb(node.need_gb or 0)} "
                f"> {_gb(node.capacity_gb or 0)}.")
    return f"{head}: departs — {_versus(choice, node)}."


def _versus(choice: Row, other: Row | None) -> str:
    """Why ``choice`` beat ``other`` on communication (or on simplicity, within the tie margin)."""
    if other is None:
        return f"{choice.label} communicates least"
    if comm_cost(choice) <= comm_cost(other):
        return f"{choice.label} moves less ({_comm_text(choice)} vs {_comm_text(other)} for {other.label})"
    return (f"{other.label} would move slightly less ({_comm_text(other)} vs {_comm_text(choice)}), a "
            f"near-tie (under {TIE:.0%} of the step), so the simpler {choice.label} is kept")


def advise(facts: ModelFacts, setup: Setup, site: SiteProfile, rows: list[Row]) -> list[str]:
    """Nothing fits: what would, with numbers."""
    leanest = min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb or 0.0)
    out = [f"Nothing fits: the leanest, {leanest.label}, needs {_gb(leanest.need_gb or 0)} of "
           f"{_gb(leanest.capacity_gb or 0)} per {'GPU' if leanest.gpu else 'rank'}."]
    cand = (leanest.dims, leanest.cfg.offload)
    if not setup.checkpointing:
        out.append(_try("with parallel.activation_checkpointing = true", facts, cand, replace(setup, checkpointing=True), site))
    if setup.micro_batch > 1:
        smaller = replace(setup, micro_batch=1, checkpointing=True)
        out.append(_try("with train.micro_batch = 1 and activation checkpointing", facts, cand, smaller, site))
    if site.node.gpus and not leanest.cfg.offload:
        full = parallel_dims("fsdp", "full_shard", setup.world)
        out.append(_try("with parallel.cpu_offload = true", facts, (full, True), setup, site))
    more = _more_nodes(facts, setup, site)
    if more:
        out.append(more)
    return out


def _try(what: str, facts: ModelFacts, cand: Candidate, setup: Setup, site: SiteProfile) -> str:
    row = evaluate(facts, cand, setup, site)
    verdict = "fits" if row.fits else "still does not fit"
    text = f"{what}: {row.label} {verdict} ({_gb(row.need_gb or 0)} of {_gb(row.capacity_gb or 0)} per GPU"
    if row.cfg.offload and row.memory is not None:
        text += f"; host {_gb(row.memory.host_per_node)} per node of {_gb(row.host_capacity_gb or 0)} usable"
    return text + ")."


def _more_nodes(facts: ModelFacts, setup: Setup, site: SiteProfile) -> str:
    if not site.multi_node or not site.node.gpus:
        return ""
    limit = site.scheduler.max_nodes or 1024
    nodes = setup.nodes * 2
    while nodes <= limit:
        bigger = replace(setup, nodes=nodes)
        row = evaluate(facts, (parallel_dims("fsdp", "full_shard", bigger.world), False), bigger, site)
        if row.fits:
            return (f"with job.nodes = {nodes}: fsdp full_shard over {bigger.world} GPUs fits "
                    f"({_gb(row.need_gb or 0)} of {_gb(row.capacity_gb or 0)} per GPU).")
        nodes *= 2
    return f"more nodes alone do not help up to {limit} nodes."
