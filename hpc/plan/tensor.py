"""Tensor parallelism as a choice: when nothing fits at ``tp`` 1, the smallest degree that does.

``parallel.strategy = "auto"`` with ``parallel.tp`` left at 1 first plans every data-parallel layout
without tensor parallelism. When none fits, the planner tries the tensor-parallel degrees of the
site's NVLink domain that divide the model's heads and KV heads (``rows.tp_degrees``), smallest
first, and takes the first at which the choice fits with a margin (``rows.MARGIN``; else the first
at which one fits at all): each layer split over ``tp`` GPUs of a node costs
collectives that nothing hides (``hpc.plan.comm``), so no more of it than memory needs. The lines
say so with the numbers: the leanest row at tp 1 against the GPU, each degree tried, and what the
chosen one's collectives cost per step.
"""

from __future__ import annotations

from dataclasses import replace

from hpc.core.models import ModelFacts
from hpc.core.site import SiteProfile
from hpc.plan.rows import MARGIN, Row, Setup, candidates, evaluate, pick, roomy, tp_degrees


def leanest(rows: list[Row]) -> Row | None:
    """The row that needs the least memory per rank (None when no row knows its memory)."""
    return min((r for r in rows if r.need_gb is not None), key=lambda r: r.need_gb or 0.0, default=None)


def tp_rows(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool, t: int) -> tuple[Setup, list[Row]]:
    """Every layout of ``setup`` at tensor-parallel degree ``t``."""
    at = replace(setup, tp=t)
    return at, [evaluate(facts, c, at, site) for c in candidates(at, allowed, site.node.gpus > 0)]


def smallest_tp(facts: ModelFacts, setup: Setup, site: SiteProfile, allowed: bool,
                rows: list[Row]) -> tuple[Setup, list[Row], Row, list[str]] | None:
    """(setup, rows, choice, lines) at the smallest tp whose choice fits with a margin (``rows.roomy``),
    else at the smallest that fits at all; None when no degree fits."""
    tried: list[tuple[int, Row | None]] = []
    tight = None
    for t in tp_degrees(facts, site, setup.tasks_per_node)[1:]:
        if setup.world % t:
            continue
        at, found = tp_rows(facts, setup, site, allowed, t)
        choice = pick(found)
        if choice is not None and roomy(choice):
            return at, found, choice, [tp_line(rows, tried, choice, site)]
        if choice is not None and tight is None:
            tight = (at, found, choice, list(tried))
        tried.append((t, choice or leanest(found)))
    if tight is None:
        return None
    at, found, choice, before = tight
    return at, found, choice, [tp_line(rows, before, choice, site)]


def tp_line(base: list[Row], tried: list[tuple[int, Row | None]], choice: Row, site: SiteProfile) -> str:
    """Why the plan uses tensor parallelism, and the smallest degree, with the numbers."""
    from hpc.plan.explain import fit_text, gb_text, secs

    t = choice.dims.tp
    lean = leanest(base)
    head = "Tensor parallelism: nothing fits without it"
    if lean is not None:
        head += f" (the leanest at tp 1, {lean.label}, needs {fit_text(lean)})"
    smaller = "; ".join(f"at tp {d} {r.label} needs {fit_text(r)}" + ("" if r.fits is False else
                                                                      f", above the {MARGIN:.0%} margin")
                        for d, r in tried if r is not None)
    margin = "fits with a margin" if roomy(choice) else f"fits (none leaves the {MARGIN:.0%} margin)"
    text = f"{head}; {smaller + '; ' if smaller else ''}tp {t} is the smallest degree that {margin} ({fit_text(choice)})"
    parts = [p for p in (choice.comm.parts if choice.comm else []) if p.what.startswith("tp ")]
    spent = sum(p.seconds or 0.0 for p in parts)
    if parts:
        text += (f"; each block's activations are gathered and scattered over the {t} GPUs of a node on "
                 f"{site.node.intra_link} ({gb_text(sum(p.gb for p in parts))}, {secs(spent)} per step, not hidden)")
    return text + "."
