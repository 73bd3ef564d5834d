"""``hpcx ckpt inspect | convert | verify``: look inside, convert and compare checkpoints.

These commands need torch, so they import it (through ``hpc.ckpt.convert``)
inside each command, never at module import: ``hpcx --help`` on a login node
stays torch-free. Problems with the input (incomplete checkpoint, missing or
truncated file, a pickle naming anything outside the allow-list, a wrong path)
print one ``error:`` line each and exit 2, with no traceback and no output left
behind. ``verify`` exits 1 when the checkpoints differ.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import typing as tp
from contextlib import contextmanager

import click

from hpc.ckpt.formats import TARGETS  # torch-free: the formats --to writes
from hpc.cli.clickutil import ErrorsGroup, echo_json, json_option
from hpc.core.errors import ConfigError

if tp.TYPE_CHECKING:  # pragma: no cover
    from click._termui_impl import ProgressBar  # what click.progressbar returns

SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
         "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``1048576``, ``500MB``, ``5GiB`` ...; ConfigError otherwise."""
    m = SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else ""
    if not m or unit not in UNITS or float(m.group(1)) <= 0:
        raise ConfigError([f"--shard-size {text!r}: expected a positive size such as 1048576, 500MB or 5GiB"])
    return int(float(m.group(1)) * UNITS[unit])


def human(n: float) -> str:
    """``1.5 MiB`` & co."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@click.group("ckpt", cls=ErrorsGroup)
def ckpt_group() -> None:
    """Inspect, convert and compare checkpoints (DCP folders, torch.save files, safetensors)."""


@ckpt_group.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--deep", is_flag=True,
              help="Also read every byte: check the SHA-256 digests recorded beside a DCP folder's shards, "
                   "read every tensor whole and count its NaN/Inf elements.")
@json_option
def inspect_cmd(path: str, deep: bool, as_json: bool) -> None:
    """Show a checkpoint: step, world size and strategy at save, tokens seen, tensors, total size.

    Checks the whole structure first and reports what it checked: a DCP folder's .metadata
    (entries, chunks tiling every tensor, storage records, file sizes) and every item's zip
    directory and pickle against its chunk; a torch file's zip directory, data.pkl and record
    bounds; a safetensors header against its file. Without --deep it reads no tensor data, so a
    flipped byte inside a tensor goes unseen: --deep checks the recorded digests and reads it all.
    Anything incomplete, damaged or inconsistent is an error (exit 2).
    """
    from hpc.ckpt.convert import inspect_checkpoint  # lazy: torch

    with Progress("inspect") as bar:
        info = inspect_checkpoint(path, deep=deep, start=bar.start)
    if as_json:
        echo_json_streamed(info)
    else:
        _print_inspect(info, deep)


def echo_json_streamed(obj: tp.Any) -> None:
    """``echo_json``'s output, written a piece at a time: a header of a million tensors never
    becomes one string of a hundred megabytes."""
    batch: list[str] = []
    size = 0
    for chunk in json.JSONEncoder(indent=2, sort_keys=True, default=str).iterencode(obj):
        batch.append(chunk)
        size += len(chunk)
        if size > 1 << 20:
            click.echo("".join(batch), nl=False)
            batch, size = [], 0
    click.echo("".join(batch))


def _print_inspect(info: dict, deep: bool) -> None:
    for label, key in (("format", "format"), ("complete", "complete"), ("step", "step"),
                       ("tokens seen", "tokens_seen"), ("world size", "world_size"), ("strategy", "strategy")):
        click.echo(f"{label + ':':13} {info[key] if info[key] is not None else '-'}")
    click.echo(f"{'checked:':13} {info['checked']}")
    if info["digests"] is not None:
        d = info["digests"]
        verified = f", {d['verified']} verified" if d["verified"] is not None else " (not checked; --deep checks them)"
        click.echo(f"{'digests:':13} {d['recorded']} of {d['files']} shard files recorded{verified}")
    if deep:
        bad = ", ".join(f"{k} ({n})" for k, n in info["nonfinite"].items()) or "none"
        click.echo(f"{'NaN/Inf:':13} {bad}")
    click.echo(f"{'tensors:':13} {len(info['tensors'])}, {human(info['total_bytes'])} ({info['total_bytes']} bytes)")
    click.echo(f"{'objects:':13} {len(info['objects'])}")
    width = max((len(t["key"]) for t in info["tensors"]), default=0)
    dwidth = max((len(t["dtype"]) for t in info["tensors"]), default=9)
    for t in info["tensors"]:
        click.echo(f"  {t['key']:{width}}  {t['dtype']:{dwidth}} {str(t['shape']):20} {human(t['bytes'])}")


class Progress:
    """A progress bar on stderr when it is a terminal (nothing otherwise), started only once the
    inputs are checked, and wiped on an error so the ``error:`` line stands alone."""

    def __init__(self, label: str):
        self.label = label
        self.bar: ProgressBar[int] | None = None

    def start(self, total: int) -> tp.Callable[[int], None]:
        if not sys.stderr.isatty():
            return lambda n: None
        self.bar = click.progressbar(length=max(total, 1), label=self.label, file=sys.stderr,
                                     show_eta=True, show_percent=True)
        return self.bar.__enter__().update

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: tp.Any, *rest: tp.Any) -> None:
        if self.bar is None:
            return
        if exc_type is None:
            self.bar.__exit__(None, None, None)
        else:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


@contextmanager
def cleanup_on_sigterm() -> tp.Iterator[None]:
    """SIGTERM raises SystemExit (and Ctrl-C KeyboardInterrupt) while the block runs, so partial outputs
    are removed as on any error; while torch's C++ zip code runs, the stop waits for it to return
    (``hpc.ckpt.outputs.stops_deferred``)."""
    from hpc.ckpt.outputs import stop_now_or_later  # lazy: startup

    def stop(signum: int, frame: tp.Any) -> None:
        stop_now_or_later(SystemExit(128 + signum))

    def interrupt(signum: int, frame: tp.Any) -> None:
        stop_now_or_later(KeyboardInterrupt())

    try:
        before = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    before_int = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)


@ckpt_group.command("convert")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--to", "to", required=True, type=click.Choice([*TARGETS, "hf", "peft"]),
              help="Output format. Every direction is streamed: memory holds about the largest tensor "
                   "(a legacy non-zip torch source is the exception: it is loaded whole). hf: SRC is a run "
                   "or step folder of the built-in llama or gpt; DST a folder transformers' from_pretrained "
                   "loads (config.json, safetensors shards + index, the tokenizer's files when the run's "
                   "data names one). peft: SRC is a LoRA run; DST a PEFT adapter folder (adapter_config.json, "
                   "adapter_model.safetensors) that peft.PeftModel.from_pretrained loads on its base.")
@click.option("--merge-lora", is_flag=True,
              help="hf, of a LoRA run: the full model with each adapter merged into its weight (W + alpha/r·BA), "
                   "the base read from the run's checkpoint.init_from.")
@click.option("--model-only", is_flag=True,
              help="Only the model's weights: a plain model.state_dict() (torch), plain FQN keys (safetensors), "
                   "or a DCP folder of the model.* entries under their model. keys (dcp; load_checkpoint reads "
                   "it into a model).")
@click.option("--shard-size", default=None, metavar="SIZE",
              help="safetensors (default 5GiB) and hf (default 5GB): largest shard; bigger outputs become a "
                   "folder of shards plus model.safetensors.index.json.")
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"]),
              help="hf: the dtype of the weights written.")
@click.option("--digest", is_flag=True,
              help="dcp: also write the shard's SHA-256 beside it (as training saves do), for verify and inspect "
                   "--deep to check later. Costs a hash of every byte (half the throughput on a busy 2-core machine).")
def convert_cmd(src: str, dst: str, to: str, merge_lora: bool, model_only: bool, shard_size: str | None, dtype: str,
                digest: bool) -> None:
    """Convert SRC (DCP folder, torch.save file or safetensors) to DST in another format.

    DST must not exist; it appears only when complete. For safetensors, a DST ending in
    .safetensors is one file; any other DST is a folder (model.safetensors, or shards + index).
    """
    from hpc.ckpt.convert import convert_checkpoint  # lazy: torch

    shard_bytes = parse_size(shard_size or ("5GB" if to == "hf" else "5GiB"))
    if merge_lora and to != "hf":
        raise click.UsageError(f"--merge-lora writes --to hf, not --to {to}")
    if to == "hf":
        return _export_hf(src, dst, dtype, shard_bytes, merge_lora)
    if to == "peft":
        from hpc.ckpt.peft_export import export_peft  # lazy: torch

        summary = export_peft(src, dst)
        click.echo(f"wrote {summary['dst']} ({summary['arch']}, {summary['tensors']} tensors, "
                   f"{human(summary['bytes'])}) from {summary['src']}")
        return None
    with cleanup_on_sigterm(), Progress(to) as bar:
        summary = convert_checkpoint(src, dst, to, model_only=model_only, shard_bytes=shard_bytes, digest=digest,
                                     start=bar.start)
    note = "" if summary["streamed"] else " (source not streamed: held in memory)"
    click.echo(f"wrote {summary['dst']} ({summary['to']}, {summary['keys']} entries, "
               f"{human(summary['bytes'])}){note}")


def _export_hf(src: str, dst: str, dtype: str, shard_bytes: int, merge_lora: bool = False) -> None:
    from hpc.ckpt.hf import export_hf  # lazy: torch

    with cleanup_on_sigterm(), Progress("hf") as bar:
        summary = export_hf(src, dst, dtype=dtype, shard_bytes=shard_bytes, start=bar.start, merge_lora=merge_lora)
    click.echo(f"wrote {summary['dst']} ({summary['arch']}, {summary['tensors']} tensors in {summary['files']} "
               f"file(s), {summary['dtype']}, {human(summary['bytes'])}) from {summary['src']}")


@ckpt_group.command("verify")
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--atol", default=0.0, show_default=True, type=click.FloatRange(min=0),
              help="Absolute tolerance; 0 means bit-exact.")
@click.option("--model-only", is_flag=True, help="Compare only the model's weights.")
@json_option
def verify_cmd(a: str, b: str, atol: float, model_only: bool, as_json: bool) -> None:
    """Compare two checkpoints of any formats tensor by tensor; exit 1 when they differ.

    Bit-exact by default. With --atol, NaN must be at the same places in both, infinities equal,
    and every other pair within the tolerance. SHA-256 digests recorded beside a DCP folder's
    shards are checked first: a shard that no longer matches is an error (exit 2). Every entry is
    read, however many differ: a torn or lying entry is an error (exit 2), never a difference.
    """
    from hpc.ckpt.convert import verify_checkpoints  # lazy: torch

    with Progress("verify") as bar:
        result = verify_checkpoints(a, b, atol=atol, model_only=model_only, start=bar.start)
    if as_json:
        echo_json(result)
    elif result["equal"]:
        exact = "bit-exact" if atol == 0 else f"within atol={atol}"
        click.echo(f"equal: {result['compared']} entries, {exact}")
    else:
        shown = len(result["differences"])
        click.echo(f"differ (first {shown} of {result['total_differences']} shown):" if result["more"]
                   else f"differ ({shown} shown):")
        for line in result["differences"]:
            click.echo(f"  {line}")
    if not result["equal"]:
        raise SystemExit(1)
