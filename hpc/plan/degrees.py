"""Tensor parallelism as a trade: every degree the site allows, evaluated, and the fastest that fits.

``parallel.strategy = "auto"`` with ``parallel.tp`` left at 1 plans every layout at every tensor-parallel
degree of the site's NVLink domain that divides the model's heads and KV heads (``rows.tp_degrees``;
``parallel.tp_cross_domain = true`` adds the node's wider degrees, whose groups span NVLink islands).
Each degree's rows get the plan's choice rule (``rows.pick``); across degrees the fastest pick that
fits with the memory margin wins (``rows.MARGIN``; else the fastest that fits), rows within ``TP_TIE``
(1 %) of it tie, and the tie goes to the one that needs less memory. The tie is narrower than the 5 %
within a degree (``rows.TIE``, broken towards the simpler layout): across degrees no layout is simpler,
and a step 2–5 % slower for memory that is not needed is a cost an engineer would not sign (Llama 3 8B
on one 8 × H100 node: tp 2 saves 5 GB of 80 for a 4 % longer step). A layout whose ``global_batch`` does not
divide into its data-parallel ranks × micro_batch is evaluated like the others and marked illegal
(``Row.illegal``), so a batch that divides only once tp shrinks the data-parallel degree is planned,
not refused. The plan shows the chosen family at every allowed degree (``Plan.tp_rows``), and one line
says why the choice beat the next best degree.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpc.core.models import ModelFacts
from hpc.core.site import SiteProfile
from hpc.plan.explain import fit_text, secs
from hpc.plan.rows import (MARGIN, Row, Setup, candidates, cost, crosses_domain_by, evaluate, measure, nvlink_domain,
                           pick, roomy, tp_degrees, tp_seconds)


TP_TIE = 0.01  # steps of different tensor-parallel degrees within 1 % tie; the one that needs less memory wins


@dataclass
class Degrees:
    """Every degree's rows and pick; ``best`` is the chosen degree (None: nothing fits at any)."""

    rows: dict[int, list[Row]]
    picks: dict[int, Row | None]
    best: int | None


def planned_degrees(facts: ModelFacts, setup: Setup, site: SiteProfile, searched: bool) -> list[int]:
    """The degrees the plan chooses among: every allowed one under ``auto`` at tp 1 (``searched``), else the spec's."""
    if not searched:
        return [setup.tp]
    return [t for t in tp_degrees(facts, site, setup.tasks_per_node, setup.tp_cross_domain) if setup.world % t == 0]


def rows_at(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool, t: int) -> list[Row]:
    """Every layout of ``setup`` at tensor-parallel degree ``t``."""
    at = replace(setup, tp=t)
    return [evaluate(facts, c, at, site) for c in candidates(at, allowed, site.node.gpus > 0)]


def evaluate_degrees(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool,
                     degrees: list[int]) -> Degrees:
    rows = {t: rows_at(facts, setup, site, allowed, t) for t in degrees}
    picks = {t: pick(r) for t, r in rows.items()}
    best = across([r for r in picks.values() if r is not None])
    return Degrees(rows, picks, None if best is None else best.dims.tp)


def across(picks: list[Row]) -> Row | None:
    """The degree's pick that runs: of those that fit (without offload when any does; with the margin when any
    has it), the fastest, rows within TP_TIE of it tied and broken by the memory they need."""
    fit = [r for r in picks if r.fits] or [r for r in picks if r.fits is None]
    fit = [r for r in fit if not r.cfg.offload] or fit
    fit = [r for r in fit if roomy(r)] or fit
    if not fit:
        return None
    by = measure(fit)
    best = min(cost(r, by) for r in fit)
    near = [r for r in fit if cost(r, by) <= best * (1 + TP_TIE) + 1e-9]
    return min(near, key=lambda r: (r.need_gb or 0.0, cost(r, by)))


# --- the family at every degree ------------------------------------------------------------------

def family_key(row: Row, tasks_per_node: int) -> tuple[str, str, int, bool]:
    """A layout without its tp: strategy, sharding, HSDP's shard group in nodes (0 otherwise), offload."""
    d = row.dims
    nodes = d.dp_shard * d.tp // max(1, tasks_per_node) if d.hsdp_enabled else 0
    return d.strategy, d.sharding, nodes, row.cfg.offload


def family_name(row: Row, tasks_per_node: int) -> str:
    strategy, sharding, nodes, offload = family_key(row, tasks_per_node)
    if strategy == "hsdp":
        text = f"hsdp {sharding} (shard groups of {nodes} node{'s' if nodes > 1 else ''})"
    else:
        text = row.family
    return text + (" + offload" if offload else "")


def family_rows(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool, choice: Row,
                found: Degrees) -> list[Row]:
    """The chosen layout's family at every degree the site allows (``tp_cross_domain`` included when set):
    the rows the plan evaluated, the others evaluated here. Empty for a family without tp (ddp, none)."""
    if not choice.dims.fsdp_enabled or choice.dims.sharding == "no_shard":
        return []
    key, out = family_key(choice, setup.tasks_per_node), []
    for t in tp_degrees(facts, site, setup.tasks_per_node, setup.tp_cross_domain):
        if setup.world % t:
            continue
        rows = found.rows.get(t) or rows_at(facts, replace(setup, batch_checked=True), site, allowed, t)
        out += [r for r in rows if family_key(r, setup.tasks_per_node) == key][:1]
    return out if len(out) > 1 else []


def crosses_domain(row: Row, site: SiteProfile) -> bool:
    return crosses_domain_by(row, nvlink_domain(site))


# --- words --------------------------------------------------------------------------------------

def why_line(choice: Row, found: Degrees) -> str:
    """Why the chosen degree beat the next best (each other degree's pick, or its leanest row where nothing fits
    there), in one line with the numbers."""
    candidates = [found.picks[t] or leanest(rows) for t, rows in found.rows.items() if t != choice.dims.tp]
    others = [r for r in candidates if r is not None]
    if not others:
        return ""
    nxt = _next_best(others)
    head = f"Tensor parallelism: tp {choice.dims.tp} ({choice.label}) beats tp {nxt.dims.tp}, the next best ({nxt.label}): "
    if nxt.illegal:
        return head + f"it cannot run this batch ({nxt.illegal})."
    if nxt.fits is False:
        return head + f"it does not fit ({fit_text(nxt)})."
    if roomy(choice) and not roomy(nxt):
        return head + f"it leaves no {MARGIN:.0%} memory margin ({fit_text(nxt)}; tp {choice.dims.tp} {fit_text(choice)})."
    by = measure([choice, nxt])
    a, b = cost(choice, by), cost(nxt, by)
    if b > a * (1 + TP_TIE) + 1e-9 and choice.time is not None and nxt.time is not None:
        return head + (f"it takes {secs(b)} per step vs {secs(a)} ({(b / a - 1) * 100:.1f}% more): {secs(nxt.time.exposed_s)} "
                       f"of its communication is not hidden (of it tp collectives {secs(tp_seconds(nxt))}), vs "
                       f"{secs(choice.time.exposed_s)} (tp {secs(tp_seconds(choice))}).")
    if b > a * (1 + TP_TIE) + 1e-9:
        return head + f"it costs more ({b:.3g} vs {a:.3g} {by})."
    shown = (lambda x: secs(x)) if by == "step" else (lambda x: f"{x:.3g} {by}")
    return head + (f"the two tie within {TP_TIE:.0%} (tp {nxt.dims.tp} {shown(b)}, tp {choice.dims.tp} {shown(a)}) and "
                   f"tp {choice.dims.tp} needs less memory ({fit_text(choice)} vs {nxt.need_gb or 0:.1f} GB).")


def leanest(rows: list[Row]) -> Row | None:
    """The row that needs the least memory per rank (None when no row knows its memory)."""
    return min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb or 0.0, default=None)


def cross_advice(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool) -> str:
    """When nothing fits within the NVLink islands: what ``parallel.tp_cross_domain = true`` would give, and its cost."""
    if setup.tp_cross_domain or site.node.gpus <= nvlink_domain(site) or not facts.tp_split:
        return ""
    wide = [t for t in tp_degrees(facts, site, setup.tasks_per_node, True) if t > nvlink_domain(site)
            and setup.world % t == 0]
    found = evaluate_degrees(facts, replace(setup, batch_checked=True), site, allowed, wide)
    if found.best is None:
        return ""
    row = found.picks[found.best]
    assert row is not None
    return (f"with parallel.tp_cross_domain = true: {row.label} fits ({fit_text(row)}), its tp groups spanning "
            f"NVLink islands of {nvlink_domain(site)}: {secs(tp_seconds(row))} per step of tp collectives over "
            f"{site.node.intra_link} ({site.node.intra_bandwidth_gbs:g} GB/s per GPU), not hidden"
            + (f"; estimated step {secs(row.step_s)}" if row.step_s is not None else "") + ".")


def _next_best(rows: list[Row]) -> Row:
    """The other degree that came closest: fitting with margin first, then fitting (the fastest), then the one
    that misses by the least memory."""
    def key(r: Row) -> tuple[bool, bool, float, float]:
        step = r.step_s if r.step_s is not None else float("inf")
        return (not r.fits, not roomy(r), step if r.fits else r.need_gb or 0.0, r.need_gb or 0.0)

    return min(rows, key=key)


def cross_line(choice: Row, family: list[Row], site: SiteProfile, cross: bool) -> str:
    """What a group across NVLink islands costs (``parallel.tp_cross_domain``), or that it was not planned."""
    domain = nvlink_domain(site)
    if site.node.gpus <= domain or domain < 1:
        return ""
    if not cross:
        return (f"NVLink islands of {domain} GPUs (`node.nvlink_domain`): no tensor-parallel group spans two; "
                f"`parallel.tp_cross_domain = true` would let tp reach {site.node.gpus} over {site.node.intra_link} "
                f"({site.node.intra_bandwidth_gbs:g} GB/s per GPU).")
    wide = [r for r in family if crosses_domain(r, site)]
    inside = [r for r in family if not crosses_domain(r, site)]
    if not wide:
        return ""
    w = wide[0]
    text = (f"`parallel.tp_cross_domain = true`: tp {w.dims.tp} spans NVLink islands of {domain}, so its per-layer "
            f"collectives run over {site.node.intra_link} ({site.node.intra_bandwidth_gbs:g} GB/s per GPU): "
            f"{secs(tp_seconds(w))} per step, not hidden")
    if inside:
        i = max(inside, key=lambda r: r.dims.tp)
        text += f", vs {secs(tp_seconds(i))} at tp {i.dims.tp} inside an island"
    return text + f"; {'it is the choice' if w.dims.tp == choice.dims.tp else 'it is not chosen'}."


def tried_lines(found: Degrees, tasks_per_node: int) -> list[str]:
    """When nothing runs: every layout tried and why it failed, one line per family (its degrees side by side)."""
    families: dict[tuple[str, str, int, bool], list[Row]] = {}
    names: dict[tuple[str, str, int, bool], str] = {}
    for rows in found.rows.values():
        for r in rows:
            key = family_key(r, tasks_per_node)
            families.setdefault(key, []).append(r)
            names.setdefault(key, family_name(r, tasks_per_node))
    out = []
    for key, rows in families.items():
        why = [f"tp {r.dims.tp}: " + (r.illegal if r.illegal else f"needs {fit_text(r)}" if r.fits is False
                                      else f"needs {fit_text(r)}, fit unknown") for r in rows]
        out.append(f"{names[key]}: " + "; ".join(why))
    return out
