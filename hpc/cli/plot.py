"""``hpcx plot RUN… [--out PNG]``: a run's curves against step — train and eval loss, learning rate,
tokens/s — from its ``metrics.jsonl``, and where its time went by cause (``hpc.core.goodput``, from the
ledger); several runs on one figure to compare them. Torch-free;
matplotlib (the ``plot`` extra) is imported only to draw."""

from __future__ import annotations

import io
import typing as tp
from pathlib import Path

import click

from hpc.core.errors import UserError

PANELS = (("loss", "loss"), ("lr", "learning rate"), ("tokens_per_s", "tokens/s"))


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the lines that carry ``key`` (train lines carry loss, lr, tokens/s; eval lines
    eval_loss), in step order. A step logged more than once (recomputed after a restart resumed from an
    earlier checkpoint: each line's ``start`` says which start wrote it) is drawn with its last value."""
    last = {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float)) and "step" in r}
    steps = sorted(last)
    return steps, [last[s] for s in steps]


def metric_keys(records: list[dict]) -> list[str]:
    """The ``eval_<name>`` metrics a task's eval lines carry (``eval_accuracy``), in first-seen order."""
    from hpc.login.status import eval_metrics

    return list(dict.fromkeys(k for r in records if "eval_loss" in r for k in eval_metrics(r)))


def draw(curves: list[tuple[str, list[dict]]], path: Path, causes: list[tuple[str, dict]] | None = None) -> None:
    """One row of panels (loss with eval loss, LR, tokens/s) with a line per run, and with ``causes``
    (``hpc.core.goodput.by_cause`` of each run) a panel of where each run's time went; written atomically
    to ``path``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(["hpcx plot needs matplotlib: pip install 'hpcx[plot]'"]) from None
    panels = len(PANELS) + bool(causes)
    fig = Figure(figsize=(5 * panels, 4.2))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, panels, i + 1) for i in range(panels)]
    if causes:
        draw_causes(axes.pop(), causes)
    for n, (name, records) in enumerate(curves):
        color = f"C{n % 10}"
        for ax, (key, _) in zip(axes, PANELS):
            ax.plot(*series(records, key), "-", color=color, label=name if key != "loss" else f"{name} train")
        steps, evals = series(records, "eval_loss")
        if steps:
            axes[0].plot(steps, evals, "o--", color=color, label=f"{name} eval")
        for key in metric_keys(records):  # a task's eval metrics (accuracy), beside the learning rate
            axes[1].plot(*series(records, key), "s:", color=color, label=f"{name} {key.removeprefix('eval_')}")
            axes[1].set_ylabel("lr, eval metrics")
            axes[1].legend(fontsize="small")
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    if len(curves) > 1:
        axes[2].legend(fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    from hpc.core.runs import write_atomic

    write_atomic(path, buf.getvalue())


def draw_causes(ax: tp.Any, causes: list[tuple[str, dict]]) -> None:
    """A stacked bar per run: its seconds by cause (productive first), goodput in the run's label."""
    from hpc.core.goodput import CAUSES

    names = [f"{name} ({100 * found['goodput']:.0f}%)" if found.get("goodput") is not None else name
             for name, found in causes]
    for i, cause in enumerate(CAUSES):
        widths = [found["seconds"][cause] for _, found in causes]
        lefts = [sum(found["seconds"][c] for c in CAUSES[:i]) for _, found in causes]
        ax.barh(range(len(causes)), widths, left=lefts, color=f"C{i}", label=cause)
    ax.set_yticks(range(len(causes)), names, fontsize="small")
    ax.set_xlabel("seconds")
    ax.set_title("time by cause (goodput)")
    ax.legend(fontsize="small")


def run_curves(refs: tp.Sequence[str], roots: list[Path]) -> list[tuple[str, list[dict]]]:
    """(run folder name, metrics lines) of each run; a run without metrics is a UserError."""
    from hpc.core import runs

    out = []
    for ref in refs:
        run_dir = runs.find_run(ref, roots)
        records = runs.RunDir(run_dir).read_metrics()
        if not records:
            raise UserError([f"{run_dir}: no metrics.jsonl lines yet: expected a run that has logged a step"])
        out.append((run_dir.name, records))
    return out


@click.command("plot")
@click.argument("refs", nargs=-1, required=True, metavar="RUN…")
@click.option("--out", "out", default="hpcx-plot.png", show_default=True, type=click.Path(dir_okay=False),
              help="Where the PNG goes.")
def plot_command(refs: tuple[str, ...], out: str) -> None:
    """Draw train and eval loss, learning rate and tokens/s against step for RUN… (folders, names or job ids)."""
    from hpc.cli import run_roots

    from hpc.core import runs
    from hpc.core.goodput import by_cause

    roots = run_roots()
    curves = run_curves(refs, roots)
    causes = [(name, by_cause(runs.RunDir(runs.find_run(ref, roots)).read_ledger(), records))
              for ref, (name, records) in zip(refs, curves)]
    draw(curves, Path(out), causes if any(c["goodput"] is not None for _, c in causes) else None)
    click.echo(f"{out}: {', '.join(name for name, _ in curves)}")
