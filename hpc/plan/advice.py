"""When nothing fits: the cheapest change that does, found by search, each tried change with its numbers.

The changes are the knobs a user has: more nodes (powers of two times ``job.nodes``, up to the
site's ``scheduler.max_nodes`` or 1024), ``parallel.cpu_offload = true``, activation checkpointing,
a smaller ``train.micro_batch`` (every one that keeps ``train.global_batch`` with more gradient
accumulation, and 1) and ``parallel.tp`` (the degrees of the site's NVLink domain the model allows).
Every combination is planned in full (all layouts, the same choice rule as ``hpcx plan``); the
cheapest that fits is the one with the fewest GPUs, then the fewest changed knobs, then the shortest
estimated step. Before the changes, the advice says why nothing fits: the per-rank floor
(``hpc.plan.floor``) against the GPU's memory, and what each lever does to it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hpc.core.models import ModelFacts
from hpc.core.site import SiteProfile
from hpc.core.validate import check_batch

from hpc.plan.explain import fit_text, gb_text, secs
from hpc.plan.rows import Row, Setup, candidates, evaluate, pick, tp_degrees

MAX_NODES = 1024  # where the site does not say how many nodes a job may have


@dataclass(frozen=True)
class Change:
    """One combination of knobs, and the row the planner would choose with it (None: nothing fits)."""

    setup: Setup
    offload: bool
    knobs: tuple[str, ...]  # the settings changed, in the spec's words
    row: Row | None
    leanest: Row | None = None  # when nothing fits: the row that needs the least memory

    @property
    def gpus(self) -> int:
        return self.setup.world


def chosen(facts: ModelFacts, setup: Setup, site: SiteProfile, offload: bool) -> tuple[Row | None, Row | None]:
    """The row ``hpcx plan`` would choose for this setup if one fits, and the leanest row."""
    rows = [evaluate(facts, c, setup, site) for c in candidates(setup, offload, site.node.gpus > 0)]
    row = pick(rows)
    leanest = min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb or 0.0, default=None)
    return (row if row is not None and row.fits else None), leanest


def _node_counts(setup: Setup, site: SiteProfile) -> list[int]:
    if not site.multi_node:
        return [setup.nodes]
    limit = site.scheduler.max_nodes or MAX_NODES
    counts, n = [], setup.nodes
    while n <= limit:
        counts.append(n)
        n *= 2
    return counts or [setup.nodes]


def _variants(setup: Setup, site: SiteProfile, allowed: bool, nodes: int,
              tp_options: tuple[int, ...] = ()) -> list[tuple[Setup, bool, tuple[str, ...]]]:
    """Every combination of the other knobs at ``nodes`` nodes, with the settings it changes."""
    gpu = site.node.gpus > 0
    offloads = [(allowed, ())] + ([(True, ("parallel.cpu_offload = true",))] if gpu and not allowed else [])
    ckpts = [(setup.checkpointing, ())] + ([(True, ("parallel.activation_checkpointing = true",))]
                                           if not setup.checkpointing else [])
    micros = [(setup.micro_batch, ())] + [(m, (f"train.micro_batch = {m}",)) for m in smaller_micro_batches(setup, nodes)]
    tps = [(setup.tp, ())] + [(t, (f"parallel.tp = {t}",)) for t in tp_options]
    base = () if nodes == setup.nodes else (f"job.nodes = {nodes}",)
    out = []
    for (off, a), (ck, b), (mb, c), (t, d) in itertools.product(offloads, ckpts, micros, tps):
        out.append((replace(setup, nodes=nodes, checkpointing=ck, micro_batch=mb, tp=t), off, base + a + b + c + d))
    return out


def smaller_micro_batches(setup: Setup, nodes: int) -> list[int]:
    """Micro batches below the spec's that keep ``train.global_batch`` at ``nodes`` nodes (it divides into
    data-parallel ranks × micro batch, the rest made up by gradient accumulation), largest first; 1 always."""
    dp = max(1, nodes * setup.tasks_per_node // setup.tp)
    keep = [m for m in range(setup.micro_batch - 1, 1, -1) if setup.global_batch % (dp * m) == 0]
    return keep + ([1] if setup.micro_batch > 1 else [])


def search(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool) -> list[Change]:
    """Every change tried, in order of cost (fits first: fewest GPUs, fewest knobs, shortest step). The
    search stops at the smallest node count where something fits, except for "more nodes alone"."""
    tried: list[Change] = []
    alone_found = False
    tps = tuple(tp_degrees(facts, site, setup.tasks_per_node)[1:]) if setup.tp == 1 else ()
    for nodes in _node_counts(setup, site):
        found = any(c.row is not None for c in tried)
        for s, off, knobs in _variants(setup, site, allowed, nodes, tps):
            alone = len(knobs) <= 1 and (not knobs or knobs[0].startswith("job.nodes"))
            if found and not (alone and not alone_found):
                continue
            change = Change(s, off, knobs, *chosen(facts, s, site, off))
            alone_found |= alone and change.row is not None
            tried.append(change)
        if alone_found:
            break
    return sorted(tried, key=_cost)


def _cost(c: Change) -> tuple:
    step = c.row.step_s if c.row is not None and c.row.step_s is not None else float("inf")
    return (c.row is None, c.gpus, len(c.knobs), step)


def change_text(c: Change, setup: Setup) -> str:
    """A change and what it gives, with the numbers."""
    what = " and ".join(c.knobs) or "as it is"
    if c.row is None:
        return f"with {what}: still nothing fits{_leanest_text(c)}"
    row = c.row
    text = f"with {what}: {row.label} fits ({fit_text(row)}{_host_text(row)})"
    if row.step_s is not None:
        text += f", estimated step {secs(row.step_s)}"
    per_step = c.setup.dp_world * c.setup.micro_batch
    if check_batch(setup.global_batch, c.setup.micro_batch, c.setup.dp_world):
        text += f" (train.global_batch {setup.global_batch} must then be a multiple of {per_step})"
    return text


def _host_text(row: Row) -> str:
    if not row.cfg.offload or row.memory is None:
        return ""
    return f"; host {gb_text(row.host_need_gb)} per node of {gb_text(row.host_capacity_gb or 0)} usable"


def _leanest_text(c: Change) -> str:
    r = c.leanest
    return "" if r is None else f" (the leanest, {r.label}, needs {fit_text(r)}{_host_text(r)})"


def advice_lines(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool) -> list[str]:
    """The cheapest change that fits first, then each knob alone, then more nodes alone."""
    tried = search(facts, setup, site, allowed)
    fits = [c for c in tried if c.row is not None]
    out = [f"Cheapest change that fits: {change_text(fits[0], setup)}."] if fits else []
    best = fits[0].knobs if fits else None
    for c in tried:
        if len(c.knobs) == 1 and not c.knobs[0].startswith("job.nodes") and c.knobs != best:
            out.append(change_text(c, setup) + ".")
    alone = _nodes_alone(tried)
    if alone is not None and alone.knobs != best:
        out.append(change_text(alone, setup) + ".")
    elif alone is None and len(_node_counts(setup, site)) > 1:
        last = [c for c in tried if len(c.knobs) == 1 and c.knobs[0].startswith("job.nodes")][-1]
        out.append(f"more nodes alone do not help: {change_text(last, setup)}.")
    if not fits:
        most = _node_counts(setup, site)[-1]
        out.append(f"nothing tried fits, up to {most} node{'s' if most > 1 else ''} with every knob changed.")
    return out


def _nodes_alone(tried: list[Change]) -> Change | None:
    alone = [c for c in tried if c.row is not None and len(c.knobs) == 1 and c.knobs[0].startswith("job.nodes")]
    return min(alone, key=_cost, default=None)


def advise(facts: ModelFacts, setup: Setup, site: SiteProfile, rows: list[Row], allowed: bool = False,
           shorter: ModelFacts | None = None) -> list[str]:
    """Nothing fits: the leanest row and why not, the per-rank floor and its levers, then what would
    fit, with numbers. ``shorter``: the model at half the sequence length (a lever the floor weighs)."""
    from hpc.plan.floor import floor_lines  # lazy: startup

    leanest = min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb or 0.0)
    head = f"Nothing fits: the leanest, {leanest.label}, needs {fit_text(leanest)}"
    if leanest.cfg.offload and leanest.memory is not None:
        head += f" and {gb_text(leanest.host_need_gb)} of host memory per node of {gb_text(leanest.host_capacity_gb or 0)} usable"
    return [head + "."] + floor_lines(facts, setup, site, shorter) + advice_lines(facts, setup, site, allowed)
