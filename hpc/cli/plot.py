"""``hpcx plot RUN… [--out PNG]``: a run's curves against step — train and eval loss, learning rate,
accuracy and other fractions, tokens/s, a task's own metrics — from its ``metrics.jsonl``, each kind on an
axis of its own (``metric_kind``), and where its time went by cause (``hpc.core.goodput``, from the
ledger); several runs on one figure to compare them. Torch-free;
matplotlib (the ``plot`` extra) is imported only to draw."""

from __future__ import annotations

import io
import typing as tp
from pathlib import Path

import click

from hpc.cli import run_roots
from hpc.core.errors import UserError

# Each metric is drawn on the axis of its kind (``metric_kind``), never beside another kind's scale.
KINDS = (("loss", "loss"), ("lr", "learning rate"), ("fraction", "accuracy and fractions"),
         ("throughput", "throughput"), ("other", "other metrics"))
FRACTION_WORDS = ("acc", "frac", "precision", "recall", "f1", "auc", "rate", "ratio", "share", "iou")
LEFT_OUT = ("step", "start", "time", "step_time_s", "data_s", "mem_gb", "grad_norm", "phases_s",
            "eval_tokens", "eval_samples", "eval_s")


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the lines that carry ``key`` (train lines carry loss, lr, tokens/s; eval lines
    eval_loss), in step order. A step logged more than once (recomputed after a restart resumed from an
    earlier checkpoint: each line's ``start`` says which start wrote it) is drawn with its last value."""
    last = {r["step"]: r[key] for r in records if isinstance(r.get(key), (int, float)) and "step" in r}
    steps = sorted(last)
    return steps, [last[s] for s in steps]


def metric_kind(key: str, values: tp.Sequence[float]) -> str:
    """The axis a metric belongs on: ``loss`` (any ``*loss*``), ``lr``, ``throughput`` (``*_per_s``),
    ``fraction`` (accuracy-like names, or values all within [0, 1]: counted_fraction, a task's accuracy),
    else ``other`` (perplexity, a task's own scalars of any scale)."""
    name = key.removeprefix("eval_").removeprefix("train_").lower()
    if "loss" in name:
        return "loss"
    if name in ("lr", "learning_rate"):
        return "lr"
    if name.endswith("_per_s") or "throughput" in name:
        return "throughput"
    if any(w in name for w in FRACTION_WORDS) or (values and all(0.0 <= v <= 1.0 for v in values)):
        return "fraction"
    return "other"


def plotted_keys(records: list[dict]) -> dict[str, list[str]]:
    """kind → the numeric keys of ``records`` drawn on that axis, in first-seen order (train loss first)."""
    keys = dict.fromkeys(k for r in records for k, v in r.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in LEFT_OUT)
    out: dict[str, list[str]] = {kind: [] for kind, _ in KINDS}
    for key in keys:
        out[metric_kind(key, series(records, key)[1])].append(key)
    return out


def draw(curves: list[tuple[str, list[dict]]], path: Path, causes: list[tuple[str, dict]] | None = None) -> None:
    """``figure(curves, causes)`` as a PNG, written atomically to ``path``; with ``causes``
    (``hpc.core.goodput.by_cause`` of each run) a last panel of where each run's time went."""
    fig = figure(curves, causes)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    from hpc.core.runs import write_atomic  # lazy: startup

    write_atomic(path, buf.getvalue())


def figure(curves: list[tuple[str, list[dict]]], causes: list[tuple[str, dict]] | None = None) -> tp.Any:
    """One panel per kind of metric present (loss with eval loss, learning rate, accuracy and fractions,
    throughput, other), with a line per run and metric; with ``causes`` a last panel of time by cause."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: matplotlib
        from matplotlib.figure import Figure  # lazy: matplotlib
    except ImportError:
        raise UserError(["hpcx plot needs matplotlib: pip install 'hpcx[plot]'"]) from None
    found = [plotted_keys(records) for _, records in curves]
    kinds = [(kind, title) for kind, title in KINDS if kind in ("loss", "lr", "throughput") or any(f[kind] for f in found)]
    panels = len(kinds) + bool(causes)
    fig = Figure(figsize=(5 * panels, 4.2))
    FigureCanvasAgg(fig)
    axes = {kind: fig.add_subplot(1, panels, i + 1) for i, (kind, _) in enumerate(kinds)}
    if causes:
        draw_causes(fig.add_subplot(1, panels, panels), causes)
    for n, ((name, records), keys) in enumerate(zip(curves, found)):
        for kind, ax in axes.items():
            for key in keys[kind]:
                style = "o--" if key.startswith("eval_") else "-"
                label = f"{name} train" if key == "loss" else name if key in ("lr", "tokens_per_s") else f"{name} {key}"
                ax.plot(*series(records, key), style, color=f"C{n % 10}", label=label)
    for kind, title in kinds:
        axes[kind].set_xlabel("step")
        axes[kind].set_title(title)
        axes[kind].grid(True, alpha=0.3)
        if axes[kind].lines and (kind not in ("lr", "throughput") or len(curves) > 1):
            axes[kind].legend(fontsize="small")
    fig.tight_layout()
    return fig


def draw_causes(ax: tp.Any, causes: list[tuple[str, dict]]) -> None:
    """A stacked bar per run: its seconds by cause (productive first), goodput in the run's label."""
    from hpc.core.goodput import CAUSES  # lazy: startup

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
    from hpc.core import runs  # lazy: startup

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
    """Draw train and eval loss, learning rate, accuracy, tokens/s and a task's metrics against step for RUN…
    (folders, names or job ids), each kind of metric on an axis of its own."""
    from hpc.core import runs  # lazy: startup
    from hpc.core.goodput import by_cause  # lazy: startup

    roots = run_roots()
    curves = run_curves(refs, roots)
    causes = [(name, by_cause(runs.RunDir(runs.find_run(ref, roots)).read_ledger(), records))
              for ref, (name, records) in zip(refs, curves)]
    draw(curves, Path(out), causes if any(c["goodput"] is not None for _, c in causes) else None)
    click.echo(f"{out}: {', '.join(name for name, _ in curves)}")
