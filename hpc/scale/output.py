"""The report for people and tools: a terminal table with notes, report.csv, report.md and report.png.
matplotlib (the ``plot`` extra) is imported only inside ``plot``."""

from __future__ import annotations

import csv
import io
import typing as tp
from pathlib import Path

from hpc.core import runs
from hpc.core.errors import UserError
from hpc.scale.predict import ASSUMED_MFU
from hpc.scale.report import SPLIT_KEYS


# ---------------------------------------------------------------- output

COLUMNS = ("nodes", "ranks", "state", "global_batch", "tokens_per_s", "tokens_per_s_per_rank", "efficiency",
           "step_time_s", *SPLIT_KEYS, "predicted_tokens_per_s", "predicted_efficiency", "predicted_comm_s",
           "limiting_link", "verdict", "run_dir")
TABLE = (("nodes", "nodes", "{}"), ("ranks", "ranks", "{}"), ("state", "state", "{}"),
         ("tokens_per_s", "tok/s", "{:,.0f}"), ("tokens_per_s_per_rank", "tok/s/rank", "{:,.0f}"),
         ("efficiency", "eff", "{:.0%}"), ("step_time_s", "step ms", "{:.1f}"),
         ("split", "compute/comm/data ms", "{}"), ("predicted_tokens_per_s", "pred tok/s", "{:,.0f}"),
         ("predicted_efficiency", "pred eff", "{:.0%}"))


def cell(row: dict, key: str, fmt: str) -> str:
    if key == "split":
        if all(row[k] is None for k in SPLIT_KEYS):
            return "not measured"
        return "/".join("-" if row[k] is None else f"{row[k] * 1e3:.1f}" for k in SPLIT_KEYS)
    value = row.get(key)
    if value is None:
        return "-"
    return fmt.format(value * 1e3 if key == "step_time_s" else value)


def table_lines(report: dict) -> list[str]:
    cells = [[title for _, title, _ in TABLE]] + [[cell(r, k, f) for k, _, f in TABLE] for r in report["points"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE))]
    return ["  ".join(c.rjust(w) if i != 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in cells]


def notes(report: dict) -> list[str]:
    """Lines under the table: baseline, basis, verdicts, advice, transports, unmeasured points."""
    out = []
    base = report["baseline_nodes"]
    out.append(f"efficiency: tok/s per rank against the smallest measured point ({base} nodes)" if base
               else "efficiency: no point has measured steps yet")
    anchored = report["prediction_basis"] == "anchored"
    out.append("prediction: NCCL-model communication + compute measured at the smallest point" if anchored
               else f"prediction: planner model (NCCL-model communication + compute at the site MFU or {ASSUMED_MFU:.0%} of peak)")
    for r in report["points"]:
        head = f"{r['nodes']} nodes: "
        if r.get("error"):
            out.append(head + r["error"])
        elif not r["tokens_per_s"]:
            out.append(head + f"{r['state']}, nothing measured after warm-up")
        if r.get("verdict"):
            out.append(head + r["verdict"])
            out += [f"    try: {a}" for a in r["advice"]]
        if r.get("predicted_comm_s") is None and r.get("error") is None:
            out.append(head + "no predicted communication: the model needs the model's size and the site's "
                       "bandwidths (node.intra_bandwidth_gbs, network.bandwidth_gbs)")
        elif r.get("predicted_tokens_per_s") is None and r.get("error") is None:
            out.append(head + "no predicted throughput: no compute figure (node.gpu_peak_tflops unset, "
                       "and no measured smallest point with known communication to anchor on)")
        if r.get("nccl"):
            out.append(head + "NCCL " + r["nccl"])
        out += [f"    transport mismatch: {p}" for p in r.get("nccl_problems", [])]
    return out


def write_csv(report: dict, path: Path, mode: int = 0o600) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in report["points"]:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in COLUMNS})
    runs.write_atomic(path, buf.getvalue(), mode)


def markdown(report: dict) -> str:
    head = [title for _, title, _ in TABLE]
    lines = [f"# Scaling study {report['name']} ({report['mode']} scaling, site {report['site']})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in TABLE) + " |" for r in report["points"]]
    lines += [""] + [f"- {n.strip()}" for n in notes(report)]
    return "\n".join(lines + ["", "![throughput and efficiency](report.png)", ""])


def plot(report: dict, path: Path | None = None, mode: int = 0o600) -> tp.Any:
    """Throughput and efficiency vs nodes, measured beside predicted (and linear); returns the Figure.
    Needs matplotlib (``pip install 'hpcx[plot]'``); without it, UserError naming the extra."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib
        from matplotlib.figure import Figure  # lazy: matplotlib
    except ImportError:
        raise UserError(["the scaling plot (report.png) needs matplotlib: pip install 'hpcx[plot]' "
                         "(report.csv and report.md need nothing more)"]) from None

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    rows = report["points"]
    nodes = [r["nodes"] for r in rows]
    base = next((r for r in rows if r["nodes"] == report["baseline_nodes"]), None)
    for i, (key, title) in enumerate((("tokens_per_s", "throughput (tokens/s)"), ("efficiency", "scaling efficiency"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for prefix, style, label in (("", "o-", "measured"), ("predicted_", "s--", "predicted")):
            pts = [(r["nodes"], r[prefix + key]) for r in rows if r.get(prefix + key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label if pts else f"{label} (none)")
        if base:
            ideal = [base["tokens_per_s_per_rank"] * r["ranks"] if key == "tokens_per_s" else 1.0 for r in rows]
            ax.plot(nodes, ideal, ":", color="gray", label="linear")
        ax.set_xscale("log", base=2)
        ax.set_xticks(nodes, [str(n) for n in nodes])
        ax.set_xlabel("nodes")
        ax.set_title(title)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.axes[1].set_ylim(bottom=0)
    fig.suptitle(f"{report['name']}: {report['mode']} scaling on {report['site']}")
    if path is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        runs.write_atomic(Path(path), buf.getvalue(), mode)
    return fig


def write_report(report: dict, study_dir: Path, group_readable: bool = False) -> tuple[dict[str, str], list[str]]:
    """report.csv, report.md and report.png in the study folder (0600, or 0640): (their paths, warnings).
    Without matplotlib the PNG is left out with a warning naming the ``plot`` extra."""
    study_dir, mode = Path(study_dir), runs.modes(group_readable)[2]
    files = {"csv": study_dir / "report.csv", "md": study_dir / "report.md", "png": study_dir / "report.png"}
    write_csv(report, files["csv"], mode)
    runs.write_atomic(files["md"], markdown(report), mode)
    warnings = []
    try:
        plot(report, files["png"], mode)
    except UserError as exc:
        del files["png"]
        warnings += exc.messages
    return {k: str(v) for k, v in files.items()}, warnings
