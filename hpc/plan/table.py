"""``hpcx plan``'s terminal table."""

from __future__ import annotations

from hpc.plan.rows import MARGIN, Plan, Row, crosses_domain_by, intra_gb, network_gb, roomy

COLUMNS = ("params", "grads", "optim", "buffers", "activ", "total", "init", "+headroom", "host/node", "fits",
           "comm GB", "comm s", "step s")


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    if x < 1:
        return f"{x:.3f}"
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _secs(x: float | None) -> str:
    """Three significant digits, so that two different times never both print as 0.000."""
    return "?" if x is None else f"{x:.3g}"


def _cells(row: Row) -> list[str]:
    m, c = row.memory, row.comm
    fits = {True: "yes", False: "no", None: "?"}[row.fits]
    if row.host_fits is False:  # offloaded states or checkpoint staging do not fit the node's RAM
        fits = "no (host)"
    if m is None:
        return ["?"] * 9 + [fits] + ["?"] * 3
    host = _num(row.host_need_gb) if row.gpu else "-"
    return [_num(m.params), _num(m.grads), _num(m.optimizer), _num(m.buffers),
            "unknown" if m.activations is None else _num(m.activations), _num(m.total), _num(m.init),
            _num(row.need_gb), host, fits, _num(None if c is None else c.gb), _secs(None if c is None else c.seconds),
            _secs(row.step_s)]


def format_plan(plan: Plan) -> str:
    """The plan as a terminal table followed by the recommendation."""
    columns = list(COLUMNS)
    lines = [_header(plan), ""]
    table = [["strategy", *columns]] + [[("* " if r is plan.choice else "  ") + r.label, *_cells(r)]
                                       for r in plan.rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        lines.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    lines.append("")
    lines += _degree_table(plan)
    if plan.compute_s is not None:
        lines.append(f"compute per step: {_secs(plan.compute_s)} s at MFU {plan.mfu:.2f}, {plan.mfu_source}"
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
    return (f"plan {plan.job}: {plan.model} on {plan.site}: {plan.nodes} node(s) × "
            f"{plan.tasks_per_node} ranks = {plan.world}{f' (tp {plan.tp})' if plan.tp > 1 else ''}; micro_batch {plan.micro_batch} × grad_accum "
            f"{plan.grad_accum}; mixed_precision {plan.mixed_precision}; activation checkpointing "
            f"{'on' if plan.checkpointing else 'off'}")


def _degree_table(plan: Plan) -> list[str]:
    """The chosen family at every tensor-parallel degree the site allows: memory against the margin, step, and
    the bytes each GPU sends inside its node and each node sends over its network per step."""
    if not plan.tp_rows:
        return []
    head = ["tp", "layout", "+headroom", "of GPU", "fits", "step s", "tp comm s", "intra-node GB/GPU", "network GB/node"]
    table = [head]
    for r in plan.tp_rows:
        share = f"{r.need_gb / r.capacity_gb:.0%}" if r.need_gb is not None and r.capacity_gb else "?"
        fits = "no (batch)" if r.illegal else {True: "yes" if roomy(r) else f"tight (>{MARGIN:.0%})", False: "no",
                                                None: "?"}[r.fits]
        mark = "* " if r is plan.choice else "  "
        tp_s = sum(p.seconds or 0.0 for p in r.comm.parts if p.what.startswith("tp ")) if r.comm else 0.0
        table.append([mark + str(r.dims.tp) + (" (across islands)" if crosses_domain_by(r, plan.nvlink_domain) else ""),
                      r.label, _num(r.need_gb), share, fits, _secs(r.step_s), _secs(tp_s), _num(intra_gb(r)),
                      _num(network_gb(r))])
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["tensor-parallel degrees of the chosen family (the choice: the fastest that fits with the margin, "
             "ties within 1% to less memory):"]
    for row in table:
        lines.append("  " + "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return lines + [""]
