"""The planner's words: a recommendation that cites its numbers, the choice rule and the tie, the
rules of thumb it agrees with or departs from (and why, with the deciding numbers), the bound, and
what would fit when nothing does."""

from __future__ import annotations

import math

from hpc.plan.comm import HOST_LINK_GBS
from hpc.core.dims import parallel_dims
from hpc.plan.memory import FRAGMENTATION, GB
from hpc.core.models import ModelFacts, count_text
from hpc.core.site import SiteProfile

from hpc.plan.rows import (SIMPLICITY_TEXT, TIE, Plan, Row, Setup, cost, eligible, evaluate, fitting,
                           measure, pick, simplicity, tied)
from hpc.plan.timing import CPU_ADAM_PARAMS_PER_CORE_S, phases


def plan_notes(site: SiteProfile, setup: Setup, facts: ModelFacts, strategy: str = "auto") -> list[str]:
    gpu = site.node.gpus > 0
    notes = [f"memory in GB (1e9 bytes) per rank; headroom = {2.0 if gpu else 0.5:g} GB "
             f"{'CUDA context + NCCL buffers' if gpu else 'per process'} + {FRAGMENTATION:.0%} fragmentation"]
    if not gpu:
        notes.append(f"CPU site: each rank's share of host memory is {site.node.memory_gb:g} GB / "
                     f"{setup.tasks_per_node} tasks" if site.node.memory_gb else
                     "CPU site with unknown node.memory_gb: memory not planned")
    if site.node.gpus and not site.node.gpu_peak_tflops:
        notes.append("node.gpu_peak_tflops unknown: compute time not estimated, the choice compares communication")
    elif gpu:
        notes.append("step s = compute + the communication its own micro-batch's forward or backward cannot hide "
                     "(+ the CPU optimizer step under offload)")
    if gpu:
        notes.append("comm s = NCCL's own cost model per call: hierarchical ring, tree or NVLS with LL, LL128 or "
                     "Simple, the fastest for the call's size (hpc/plan/collectives.py; `--json` has each part's pick)")
    if facts.n_params is None:
        notes.append(f"user model {facts.label}: set model.n_params, n_layers and dim, or run "
                     "`hpcx plan --count-params` where torch is installed")
    elif facts.source and not facts.builtin:
        notes.append(f"parameter count {facts.source}")
    if strategy != "auto":
        notes.append(f"the spec sets parallel.strategy = {strategy!r}: submit runs that, not the recommendation")
    return notes


def unknown_model(plan: Plan, setup: Setup) -> list[str]:
    if setup.world == 1:
        return ["one rank and a user model of unknown size: none"]
    return [f"{plan.model}: the planner cannot count its parameters without torch, so it picks fsdp full_shard, "
            "the strategy with the lowest per-GPU memory (state model.n_params, n_layers and dim to plan it)"]


# --- formatting -------------------------------------------------------------------------------

def gb_text(x: float) -> str:
    """GB with a digit that shows (below 0.1 GB in MB or kB, three significant digits), so that two
    different sizes never print alike as 0.0 GB."""
    if x >= 100:
        return f"{x:.0f} GB"
    if x >= 0.1 or x == 0:
        return f"{x:.1f} GB"
    return f"{x * 1e3:.3g} MB" if x >= 1e-4 else f"{x * 1e6:.3g} kB"


def secs(x: float) -> str:
    """Seconds with enough digits that two different times never print alike as 0.00 s."""
    if x >= 10:
        return f"{x:.1f} s"
    if x >= 0.1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    return f"{x * 1e6:.3g} µs"


def _pct(a: float, b: float) -> str:
    """How much larger a is than b, in words."""
    if b <= 0:
        return "more"
    x = a / b - 1
    return f"{x:.0%} more" if x >= 0.01 else f"{x:.1%} more"


def _comm_text(row: Row) -> str:
    c = row.comm
    if c is None:
        return "unknown"
    if c.seconds is None:
        return f"{gb_text(c.gb)} per step"
    return f"{gb_text(c.gb)}, {secs(c.seconds)} per step"


def _cost_text(row: Row, by: str) -> str:
    if by == "step":
        return f"{secs(row.step_s or 0.0)} per step"
    return _comm_text(row)


def fit_text(row: Row) -> str:
    where = "GPU" if row.gpu else "rank"
    return f"{gb_text(row.need_gb or 0)} of {gb_text(row.capacity_gb or 0)} per {where}"


def _row(rows: list[Row], family: str) -> Row | None:
    found = [r for r in rows if r.family == family and not r.cfg.offload]
    return found[0] if found else None


# --- the recommendation -----------------------------------------------------------------------

def recommend(plan: Plan, site: SiteProfile, facts: ModelFacts, setup: Setup) -> list[str]:
    """The choice with its numbers, the rule that made it, the rules of thumb, offload and the bound."""
    choice = plan.choice
    assert choice is not None and choice.memory is not None
    out = [_choice_line(plan, choice)]
    out += [_parts_line(choice)] if choice.comm is not None and choice.comm.parts else []
    out.append(_rule_line(plan, choice))
    replica = _row(plan.rows, "ddp") or _row(plan.rows, "none")
    if choice.dims.dp_shard > 1 and replica is not None and replica.fits is False and replica.memory is not None:
        m = replica.memory
        out.append(f"A full replica ({replica.label}) does not fit: {gb_text(m.params + m.grads + m.optimizer)} of "
                   f"model states alone on one GPU, {gb_text(replica.need_gb or 0)} in all.")
    out += rules_of_thumb(plan, site, facts, setup)
    if plan.offload_allowed:
        out.append(_offload_line(plan, facts, setup, site))
    bound = _bound(plan, site)
    if bound:
        out.append(bound)
    return out


def _choice_line(plan: Plan, choice: Row) -> str:
    m = choice.memory
    assert m is not None
    text = f"{choice.label}: {fit_text(choice)} with headroom ("
    if choice.cfg.offload:
        text += (f"model states on the host: {gb_text(m.host_per_node)} per node of {gb_text(choice.host_capacity_gb or 0)} "
                 "usable)")
    else:
        text += f"model states {gb_text(m.params + m.grads + m.optimizer)}"
        text += f" of {gb_text(16 * (plan.n_params or 0) / GB)} total)" if choice.dims.dp_shard > 1 else ")"
    t = choice.time
    if t is None:
        return text + f"; communication {_comm_text(choice)}."
    text += (f"; estimated step {secs(t.step_s)} = compute {secs(t.compute_s)} + {secs(t.exposed_s)} of its "
             f"{secs(t.comm_s)} of communication not hidden")
    if t.host_s:
        text += f" + CPU optimizer step {secs(t.host_s)}"
    return text + f" ({gb_text(choice.comm.gb if choice.comm else 0)} sent per GPU per step)."


def _parts_line(row: Row) -> str:
    """Each collective of the choice as NCCL would run it: calls, algorithm, group, and its time split
    into latency and bandwidth."""
    texts = []
    for p in row.comm.parts if row.comm else []:
        text = f"{p.what} {gb_text(p.gb)}"
        if p.kind == "host_copy":
            texts.append(text + (f", {secs(p.seconds)}" if p.seconds is not None else ""))
            continue
        where = f"{p.group} ranks on {p.nodes} node{'s' if p.nodes > 1 else ''}"
        text += f" in {p.calls * p.repeat} calls ({p.algorithm or 'NCCL'} over {where})"
        if p.seconds is not None and p.latency_s is not None and p.bandwidth_s is not None:
            text += f": {secs(p.seconds)} = {secs(p.latency_s)} latency + {secs(p.bandwidth_s)} bandwidth"
        texts.append(text)
    return "Communication per step (NCCL's pick per call): " + "; ".join(texts) + "."


def _rule_line(plan: Plan, choice: Row) -> str:
    """The choice rule, said with this plan's numbers: the fastest, the tie and who was in it."""
    fit = eligible(plan.rows)
    by = measure(fit)
    what = {"step": "estimated step", "comm s": "communication time", "comm GB": "communication volume"}[by]
    left, plain = _offload_left_out(plan.rows, fit), " without offload" if _offload_left_out(plan.rows, fit) else ""
    if len(fit) == 1:
        return (f"Choice: the only one of the {len(plan.rows)} evaluated that fits{plain} "
                f"({_cost_text(fit[0], by)}).{left}")
    fastest = min(fit, key=lambda r: cost(r, by))
    near = tied(plan.rows)
    others = [r for r in near if r is not fastest]
    best, shown = _tie_figures(fastest, others, by) if others else ("", [])
    figure = f"{best}{' per step' if by != 'comm GB' else ''}" if others else _cost_text(fastest, by)
    text = f"Choice rule: the least {what} of the {len(fit)} that fit{plain} is {fastest.label}'s, {figure}"
    if others:
        verb = "is" if len(others) == 1 else "are"
        text += (f"; {', '.join(f'{r.label} ({x})' for r, x in zip(others, shown))} {verb} within "
                 f"{TIE:.0%} of it and tie, and the simplest tied one wins ({SIMPLICITY_TEXT})")
    else:
        text += f"; nothing else is within {TIE:.0%} of it"
    nxt = _runner_up(fit, choice, by)
    return text + "." + (" " + _versus(choice, nxt, by) if nxt is not None else "") + left


def _offload_left_out(rows: list[Row], fit: list[Row]) -> str:
    """How many rows that fit with offload the choice left aside, since rows fit without it."""
    aside = [r for r in fitting(rows) if r.cfg.offload and r not in fit]
    if not aside:
        return ""
    many = len(aside) > 1
    return (f" {len(aside)} offload row{'s' if many else ''} that fit {'are' if many else 'is'} left aside: "
            "offload is used only when nothing fits without it.")


def _tie_figures(fastest: Row, others: list[Row], by: str) -> tuple[str, list[str]]:
    """The fastest row's figure and the tied rows', all with as many digits as it takes to tell each tied
    row from the fastest (so no tied row prints like the fastest unless they are equal)."""
    unit = "GB" if by == "comm GB" else "s"
    a = cost(fastest, by)
    scale, unit = (1e3, "ms") if unit == "s" and max([a] + [cost(r, by) for r in others]) < 0.1 else (1.0, unit)
    decimals = max(_decimals(a * scale, cost(r, by) * scale) for r in others)
    return f"{a * scale:.{decimals}f} {unit}", [f"{cost(r, by) * scale:.{decimals}f} {unit}" for r in others]


def _decimals(x: float, y: float) -> int:
    """The decimals ``_apart`` would print ``x`` and ``y`` with."""
    fx, _ = _apart(x, y, "")
    text = fx.strip()
    return len(text.split(".")[1]) if "." in text else 0


def _kind(row: Row) -> tuple[bool, bool, bool]:
    """Whole replicas (ddp, fsdp no_shard) or shards, hybrid or not, offloaded or not."""
    return row.dims.dp_shard > 1, row.dims.hsdp_enabled, row.cfg.offload


def _runner_up(fit: list[Row], choice: Row, by: str) -> Row | None:
    """What the choice would flip to: each other kind's own pick (its fastest, ties to the simplest),
    and of those the fastest."""
    kinds = {_kind(r) for r in fit} - {_kind(choice)}
    picks = [pick([r for r in fit if _kind(r) == k]) for k in kinds]
    return min((r for r in picks if r is not None), key=lambda r: cost(r, by), default=None)


def _versus(choice: Row, other: Row, by: str) -> str:
    """How the choice compares with ``other``, in the numbers the choice used; never calls more less."""
    a, b = cost(choice, by), cost(other, by)
    head = f"Runner-up of another kind: {other.label}, {_cost_text(other, by)}"
    if b > a * (1 + TIE):
        return f"{head}, {_pct(b, a)} than {choice.label}{_driver(choice, other, by)}."
    why = _tie_reason(choice, other)
    if b >= a:
        return f"{head}, {_pct(b, a)} than {choice.label}, within the {TIE:.0%} tie; {choice.label} is {why}."
    return (f"{head}, {_pct(a, b).replace('more', 'less')} than {choice.label} but within the {TIE:.0%} tie; "
            f"{choice.label} is {why}.")


def _tie_reason(choice: Row, other: Row) -> str:
    """What broke the tie between two rows: the first term of ``simplicity`` in which they differ."""
    mine, theirs = simplicity(choice), simplicity(other)
    if mine[0] != theirs[0]:
        return f"the one that leaves a memory margin ({_margin_text(choice)}; {other.label} {_margin_text(other)})"
    if mine[1:3] != theirs[1:3]:
        return "the simpler one"
    if mine[3] != theirs[3]:
        links = {p.link for p in (choice.comm.parts if choice.comm else []) if p.kind == "all_gather"}
        where = "one node's NVLink domain" if links & {"nvlink", "nvswitch"} else "one node"
        return f"the one that keeps every micro-batch's all-gathers inside {where} ({_gather_text(choice, other)})"
    return _less_communication(choice, other)


def _margin_text(row: Row) -> str:
    """How much of the GPU's memory a row needs: "39.2 GB of 40.0 GB per GPU, 98%"."""
    share = (row.need_gb or 0.0) / row.capacity_gb if row.capacity_gb else 0.0
    return f"{fit_text(row)}, {share:.0%}"


def _less_communication(a: Row, b: Row) -> str:
    """The last tie-break, said with what actually differs: time where the site gives bandwidths, else bytes;
    with as many digits as it takes to tell the two apart."""
    ca, cb = a.comm, b.comm
    if ca is None or cb is None:
        return "the one that communicates less"
    gb_a, gb_b = _apart(ca.gb, cb.gb, "GB")
    if ca.seconds is None or cb.seconds is None:
        return f"the one that sends fewer bytes per step ({gb_a} vs {gb_b})"
    s_a, s_b = _apart(ca.seconds, cb.seconds, "s")
    sends = "fewer" if ca.gb < cb.gb else "more" if ca.gb > cb.gb else "as many"
    return (f"the one whose communication takes less time per step ({s_a} vs {s_b}; it sends {sends} bytes: "
            f"{gb_a} vs {gb_b})")


def _gather_text(inside: Row, across: Row) -> str:
    """Where each row's all-gathers run: one node's link against the fabric, with their times."""
    mine = [p for p in (inside.comm.parts if inside.comm else []) if p.kind == "all_gather"]
    theirs = [p for p in (across.comm.parts if across.comm else []) if p.kind == "all_gather"]
    t_in, t_out = sum(p.seconds or 0.0 for p in mine), sum(p.seconds or 0.0 for p in theirs)
    nodes = max((p.nodes for p in theirs), default=1)
    there = f"{across.label}'s cross {nodes} nodes on {theirs[0].link if theirs else 'the fabric'}, {secs(t_out)}"
    if not mine:
        return f"it has none: whole replicas; {there}"
    return f"{mine[0].link}, {secs(t_in)} per step; {there}"


def _apart(x: float, y: float, unit: str) -> tuple[str, str]:
    """``x`` and ``y`` with three significant digits, or as many more decimals as it takes to print
    them differently (fixed-point, never an exponent)."""
    if unit == "s" and max(abs(x), abs(y)) < 0.1:
        return _apart(x * 1e3, y * 1e3, "ms")
    top = max(abs(x), abs(y))
    decimals = max(0, 2 - math.floor(math.log10(top))) if top > 0 else 0
    fx, fy = f"{x:.{decimals}f}", f"{y:.{decimals}f}"
    while fx == fy and x != y and decimals < 9:
        decimals += 1
        fx, fy = f"{x:.{decimals}f}", f"{y:.{decimals}f}"
    return f"{fx} {unit}", f"{fy} {unit}"


def _driver(choice: Row, other: Row, by: str) -> str:
    """What makes ``other`` slower: exposed communication, the CPU step, or plain communication."""
    if by != "step" or other.time is None or choice.time is None:
        return f"; {other.label} communicates {_comm_text(other)} vs {_comm_text(choice)}"
    o = other.time
    if o.host_s > choice.time.host_s:
        return f": its CPU optimizer step takes {secs(o.host_s)} and {secs(o.exposed_s)} of its communication is not hidden"
    return f": {secs(o.exposed_s)} of its {secs(o.comm_s)} of communication is not hidden under compute"


# --- rules of thumb ---------------------------------------------------------------------------

def rules_of_thumb(plan: Plan, site: SiteProfile, facts: ModelFacts, setup: Setup) -> list[str]:
    """The rules of thumb that apply here, and where the numbers depart from them and why."""
    choice = plan.choice
    assert choice is not None
    if plan.world == 1:
        if not choice.cfg.offload:
            return [f"Rule of thumb 'fits one GPU → no parallelism': {choice.label} agrees ({fit_text(choice)})."]
        return ["Rule of thumb 'over 10B or short of memory → FSDP + CPU offload': agrees; on one GPU "
                f"{_leanest_text(plan.rows)}, so the states go to the host."]
    lines = [_size_rule(plan, site, facts, setup)]
    if site.node.gpus and site.node.gpu_memory_gb < 40:
        lines.append(_small_gpu_rule(plan, choice))
    if site.node.intra_link == "pcie":
        lines.append(_pcie_rule(plan, choice, site))
    if plan.nodes > 1:
        lines.append(_hsdp_rule(plan, choice, plan.rows))
    return lines


def _size_rule(plan: Plan, site: SiteProfile, facts: ModelFacts, setup: Setup) -> str:
    n, choice = plan.n_params or 0, plan.choice
    assert choice is not None
    if n < 1e9:
        rule, want = "under 1B parameters → DDP", "ddp"
    elif n <= 10e9:
        rule, want = "1–10B parameters → FSDP", "fsdp"
    else:
        rule, want = "over 10B parameters → FSDP + CPU offload", "offload"
    head = f"Rule of thumb '{rule}' ({count_text(n)} here)"
    got = "ddp" if choice.dims.ddp_enabled else ("offload" if choice.cfg.offload else "fsdp")
    if got == want:
        return f"{head}: agrees{_agrees(want, plan)}."
    return f"{head}: departs, because {_departs(want, plan, site, facts, setup)}."


def _agrees(want: str, plan: Plan) -> str:
    choice, rows = plan.choice, plan.rows
    assert choice is not None
    if want == "offload":
        return f" — {_leanest_text(rows)}"
    if want == "ddp":
        return f" — {choice.label} fits ({fit_text(choice)})"
    ddp = _row(rows, "ddp")
    if ddp is None:
        return ""
    if ddp.fits is False:
        return f" — DDP does not fit ({fit_text(ddp)})"
    by = measure(eligible(rows))
    return f" — DDP fits ({fit_text(ddp)}) but takes {_cost_text(ddp, by)} vs {_cost_text(choice, by)}"


def _departs(want: str, plan: Plan, site: SiteProfile, facts: ModelFacts, setup: Setup) -> str:
    choice, rows = plan.choice, plan.rows
    assert choice is not None
    by = measure(eligible(rows))
    if choice.cfg.offload:
        return _leanest_text(rows) + ", so the states go to the host"
    if want == "ddp":
        ddp = _row(rows, "ddp")
        if ddp is None or ddp.fits is False:
            return f"DDP does not fit: it needs {fit_text(ddp)}" if ddp else "DDP is not a candidate here"
        return (f"DDP fits ({fit_text(ddp)}) but is slower beyond the {TIE:.0%} tie: {_cost_text(ddp, by)} vs "
                f"{_cost_text(choice, by)} for {choice.label}{_ddp_exposure(ddp, plan)}")
    if want == "fsdp":
        return _ddp_kept(plan, by)
    return _offload_not_needed(choice, facts, setup, site)


def _ddp_exposure(ddp: Row, plan: Plan) -> str:
    if ddp.time is None:
        return ""
    _, bwd = phases(ddp.time.compute_s, plan.grad_accum, plan.checkpointing)
    return (f"; DDP's all-reduce takes {secs(ddp.time.comm_s)} and can overlap only the last micro-batch's backward "
            f"({secs(bwd)}), so {secs(ddp.time.exposed_s)} of it is not hidden")


def _ddp_kept(plan: Plan, by: str) -> str:
    """1–10B, and DDP chosen: it fits and its step ties with (or beats) the best FSDP layout."""
    choice = plan.choice
    assert choice is not None
    sharded = [r for r in eligible(plan.rows) if r.dims.dp_shard > 1]
    best = min(sharded, key=lambda r: cost(r, by)) if sharded else None
    text = f"DDP fits ({fit_text(choice)})"
    if best is None:
        return text + " and no sharded layout does"
    a, b = cost(choice, by), cost(best, by)
    relation = "is faster than any sharded layout" if a <= b else f"is within the {TIE:.0%} tie of the fastest sharded layout"
    text += f" and {relation}: {_cost_text(choice, by)} vs {_cost_text(best, by)} for {best.label}"
    if choice.time is not None and best.time is not None:
        text += (f" (communication {secs(choice.time.comm_s)} vs {secs(best.time.comm_s)}, of which "
                 f"{secs(choice.time.exposed_s)} vs {secs(best.time.exposed_s)} is not hidden under "
                 f"{secs(choice.time.compute_s)} of compute)")
    return text + "; DDP is the simpler one (whole replicas, plain checkpoints)"


def _offload_not_needed(choice: Row, facts: ModelFacts, setup: Setup, site: SiteProfile) -> str:
    off = _offload_variant(choice, facts, setup, site)
    text = f"{choice.label} fits on the GPU ({fit_text(choice)})"
    if off is None or off.memory is None:
        return text
    text += f"; offloading ({off.label}) would need {gb_text(off.memory.host_per_node)} of host memory per node"
    if off.time is not None and choice.time is not None:
        text += (f" and take {secs(off.time.step_s)} per step instead of {secs(choice.time.step_s)} "
                 f"(host copies {secs(_host_copy_s(off))} at an assumed {HOST_LINK_GBS:g} GB/s, CPU AdamW "
                 f"{secs(off.time.host_s)} at an assumed {CPU_ADAM_PARAMS_PER_CORE_S:.0e} parameters/s per core)"
                 .replace("e+0", "e"))
    return text


def _offload_variant(choice: Row, facts: ModelFacts, setup: Setup, site: SiteProfile) -> Row | None:
    if not site.node.gpus:
        return None
    dims = choice.dims if choice.dims.fsdp_enabled else parallel_dims("fsdp", "full_shard", setup.world)
    return evaluate(facts, (dims, True), setup, site)


def _host_copy_s(row: Row) -> float:
    return sum(p.seconds or 0.0 for p in row.comm.parts if p.link == "pcie-host") if row.comm else 0.0


def _leanest_text(rows: list[Row]) -> str:
    plain = [r for r in rows if not r.cfg.offload and r.need_gb is not None]
    if not plain:
        return "nothing fits on the GPU alone"
    leanest = min(plain, key=lambda r: r.need_gb or 0.0)
    return f"nothing fits on the GPU alone (the leanest, {leanest.label}, needs {fit_text(leanest)})"


def _small_gpu_rule(plan: Plan, choice: Row) -> str:
    head = f"Rule of thumb 'GPUs under 40 GB → FSDP' ({gb_text(choice.capacity_gb or 0)} here)"
    if choice.dims.fsdp_enabled:
        return f"{head}: agrees."
    return f"{head}: departs, because {choice.label} fits ({fit_text(choice)})."


def _pcie_rule(plan: Plan, choice: Row, site: SiteProfile) -> str:
    head = "Rule of thumb 'PCIe only → weigh the communication'"
    t = choice.time
    if t is None:
        return f"{head}: weighed by bytes ({_comm_text(choice)}; no compute estimate)."
    return (f"{head}: weighed — inside a node the GPUs share pcie ({site.node.intra_bandwidth_gbs:g} GB/s per GPU); "
            f"{choice.label} communicates {secs(t.comm_s)} per step, {secs(t.exposed_s)} of it not hidden under "
            f"{secs(t.compute_s)} of compute.")


def _hsdp_rule(plan: Plan, choice: Row, rows: list[Row]) -> str:
    head = "Rule of thumb 'many nodes → HYBRID_SHARD'"
    by = measure(eligible(rows))
    nodal = [r for r in rows if r.dims.hsdp_enabled and r.dims.dp_shard * r.dims.tp == plan.tasks_per_node
             and not r.cfg.offload]  # shard groups of one node (under tp, its tasks / tp data-parallel ranks)
    fit = [r for r in nodal if r.fits is not False]
    node = min(fit, key=lambda r: cost(r, by)) if fit else min(nodal, key=lambda r: r.need_gb or 0.0, default=None)
    if choice.dims.hsdp_enabled:
        per_node = max(1, plan.tasks_per_node // choice.dims.tp)  # data-parallel ranks of a node (tp ranks share one)
        if choice.dims.dp_shard <= per_node:
            return (f"{head}: agrees; the shard group of {choice.dims.dp_shard} keeps all-gathers inside one node"
                    f"{_cross_node_text(plan, choice, _flat(plan, rows, by))}.")
        why = f" (sharded over one node it needs {fit_text(node)})" if node is not None and node.fits is False else ""
        return (f"{head}: agrees, but the shard group of {choice.dims.dp_shard} spans "
                f"{choice.dims.dp_shard // per_node} nodes{why}.")
    if node is None:
        return f"{head}: no node-sized shard group here."
    if node.fits is False:
        return f"{head}: departs, because sharded over one node ({node.dims.dp_shard} GPUs) it needs {fit_text(node)}."
    a, b = cost(choice, by), cost(node, by)
    if b > a * (1 + TIE):
        return (f"{head}: departs, because {node.label} is slower: {_cost_text(node, by)} vs {_cost_text(choice, by)} "
                f"for {choice.label}{_cross_node_text(plan, node, choice)}.")
    return (f"{head}: departs, because {node.label} ({_cost_text(node, by)}) ties with {choice.label} "
            f"({_cost_text(choice, by)}) within {TIE:.0%}, and {choice.label} is {_tie_reason(choice, node)}.")


def _flat(plan: Plan, rows: list[Row], by: str) -> Row | None:
    """The fastest eligible layout that is not hybrid: what HSDP is weighed against."""
    flat = [r for r in eligible(rows) if not r.dims.hsdp_enabled and r.comm is not None]
    return min(flat, key=lambda r: cost(r, by), default=None)


def _cross_node_text(plan: Plan, row: Row, other: Row | None) -> str:
    """Bytes through each node's network per step, as multiples of the fp32 gradients, for two rows."""
    grads = 4 * (plan.n_params or 0) / GB
    if other is None or row.comm is None or other.comm is None or not grads:
        return ""
    x, y = row.comm.cross_node_gb, other.comm.cross_node_gb
    fewer = "fewer" if x < y else "more" if x > y else "as many"
    return (f"; across nodes {row.label} moves {fewer} bytes: {x / grads:.2f}× the fp32 gradients through each "
            f"node's network per step ({gb_text(x)}), {other.label} {y / grads:.2f}× ({gb_text(y)})")


# --- offload and the bound --------------------------------------------------------------------

def _offload_line(plan: Plan, facts: ModelFacts, setup: Setup, site: SiteProfile) -> str:
    """`cpu_offload = true` under auto allows offload; say whether it was used and why, with numbers."""
    choice = plan.choice
    assert choice is not None
    head = "`parallel.cpu_offload = true` allows offload"
    if choice.cfg.offload:
        m = choice.memory
        host = f"; the host holds {gb_text(m.host_per_node)} per node of {gb_text(choice.host_capacity_gb or 0)} usable" \
            if m is not None else ""
        return f"{head}, and auto uses it: {_leanest_text(plan.rows)}{host}."
    offloaded = [r for r in plan.rows if r.cfg.offload]
    fit = [r for r in offloaded if r.fits]
    if not offloaded:
        return f"{head}; auto does not use it."
    by = measure(eligible(plan.rows))
    best = min(fit, key=lambda r: cost(r, by)) if fit else min(offloaded, key=lambda r: r.need_gb or 0.0)
    text = f"{head}; auto does not use it: {choice.label} fits on the GPU ({fit_text(choice)})"
    if best.memory is not None:
        host = "fits" if best.host_fits else "does not fit"
        text += (f", and the best offload row, {best.label}, takes {_cost_text(best, by)} vs "
                 f"{_cost_text(choice, by)} and needs {gb_text(best.memory.host_per_node)} of host memory per node "
                 f"({host} in {gb_text(best.host_capacity_gb or 0)} usable)")
    return text + "."


def _bound(plan: Plan, site: SiteProfile) -> str:
    c = plan.choice
    if c is None or c.comm is None or c.time is None or not c.comm.parts:
        return ""
    link = c.comm.slowest_link
    if link == site.node.intra_link:
        link = f"{link} ({site.node.intra_bandwidth_gbs:g} GB/s per GPU)"
    elif link == site.network.fabric:
        link = f"{link} ({site.network.bandwidth_gbs:g} GB/s per node)"
    elif link == "pcie-host":
        link = f"the host link ({HOST_LINK_GBS:g} GB/s per GPU, assumed)"
    t = c.time
    kind = "Warning: the step is communication-bound" if t.comm_s > t.compute_s else "compute-bound"
    return (f"{kind} on {link}: communication {secs(t.comm_s)} vs compute {secs(t.compute_s)} per step, "
            f"{secs(t.exposed_s)} not hidden (MFU {plan.mfu:.2f}, {plan.mfu_source}; each collective overlaps only "
            "its own micro-batch's forward or backward)")
