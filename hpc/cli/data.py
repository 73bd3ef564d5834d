"""``hpcx data prepare`` and ``hpcx data verify`` (torch-free; tokenizers and pyarrow imported lazily)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from hpc.cli.clickutil import echo_json, json_option
from hpc.core.errors import UserError


@click.group("data")
def data_group() -> None:
    """Tokenize text into sharded token datasets, and check them."""


@data_group.command("prepare")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT…")
@click.option("--tokenizer", required=True, metavar="PATH", help="A local Hugging Face tokenizer.json, or a folder with one.")
@click.option("--out", required=True, metavar="DIR", help="Output folder (resumed if it holds this preparation).")
@click.option("--format", "kind", type=click.Choice(["text", "prompt-response"]), default="text", show_default=True,
              help="prompt-response: jsonl/parquet records with a prompt and a response (or a chat list); "
                   "a loss mask counts only the response.")
@click.option("--text-key", default="text", show_default=True, help="Key of a .jsonl line / column of a .parquet file.")
@click.option("--prompt-key", default="prompt", show_default=True)
@click.option("--response-key", default="response", show_default=True)
@click.option("--messages-key", default="messages", show_default=True, help="A chat list of {role, content}.")
@click.option("--chat-template", "chat_template", type=click.Choice(["auto", "tokenizer", "none"]), default="auto",
              show_default=True, help="prompt-response rows rendered with the tokenizer's chat template (auto: where "
                                      "it has one; tokenizer: it must; none: never, and chat lists are refused).")
@click.option("--separator", default="\n", show_default="a newline",
              help="Between a prompt and its response where no chat template renders them (not added where "
                   "either side has whitespace there; in bash, $'\\n\\n' for two newlines).")
@click.option("--val-fraction", default=0.0, show_default=True, help="Share of documents held out (by a hash of each).")
@click.option("--workers", default=1, show_default=True, help="Processes (0: one per CPU).")
@click.option("--max-document-bytes", default=8 << 20, show_default=True,
              help="Bytes of one document at most (a .jsonl line, a .txt paragraph); a longer one is bad input.")
@click.option("--max-expansion", default=100, show_default=True,
              help="A .gz/.zst input decompresses to at most this many times its size (plus 1 MiB).")
@click.option("--max-vocab", default=1 << 20, show_default=True, help="Tokens of the tokenizer at most.")
@click.option("--shard-tokens", default=1 << 26, show_default=True, help="Tokens per shard (closed at a document end).")
@click.option("--group-bytes", default=256 << 20, show_default=True, help="Input bytes per group (one worker or array task each).")
@click.option("--errors", "errors", type=click.Choice(["raise", "skip"]), default="raise", show_default=True,
              help="skip: leave out bad documents, count them and name the first ones.")
@click.option("--eos", default=None, help="The end-of-document token (default: the tokenizer's).")
@click.option("--window", default=0, show_default=True, metavar="SEQ_LEN",
              help="Lay examples out in windows of SEQ_LEN tokens (the model's seq_len), none straddling two; "
                   "padded, and an example longer than a window cut to it (prompt-response only; 0: end to end).")
@click.option("--site", "site_name", default=None, metavar="NAME|PATH",
              help="Run as a Slurm job array on this site (one task per group), then a merge job.")
@click.option("--wait", is_flag=True, help="With --site: block until the merge job wrote the manifest.")
@json_option
def prepare_command(inputs: tuple[str, ...], tokenizer: str, out: str, kind: str, text_key: str, prompt_key: str,
                    response_key: str, messages_key: str, chat_template: str, separator: str, val_fraction: float,
                    workers: int, shard_tokens: int, group_bytes: int, errors: str, eos: str | None, window: int,
                    max_document_bytes: int, max_expansion: int, max_vocab: int, site_name: str | None, wait: bool,
                    as_json: bool) -> None:
    """Tokenize INPUT… (.txt, .jsonl, .parquet; .gz/.zst; folders and globs) into token shards and a
    manifest.json in --out; a killed run started again continues where it was."""
    from hpc.data.inputs import Format, Limits  # lazy: startup
    from hpc.data.prepare import Options, abandon, make_plan, pending_groups, start  # lazy: numpy

    fmt = Format(kind, text_key, prompt_key, response_key, messages_key, separator)
    if workers < 0:
        raise UserError([f"--workers {workers}: expected 0 (one per CPU) or a positive number"])
    limits = Limits(_positive("--max-document-bytes", max_document_bytes), _positive("--max-expansion", max_expansion))
    options = Options(fmt, val_fraction, _positive("--shard-tokens", shard_tokens),
                      _positive("--group-bytes", group_bytes), errors, eos, limits,
                      _positive("--max-vocab", max_vocab), chat_template, window)
    plan = make_plan(inputs, tokenizer, options)
    out_dir = Path(os.path.abspath(out))
    created = start(out_dir, plan, inputs)
    if site_name:
        _submit_array(out_dir, plan, site_name, wait)
        return
    try:
        manifest = run_local(out_dir, plan, workers)
    except UserError:
        abandon(out_dir, created)
        raise
    except KeyboardInterrupt:
        left = len(pending_groups(out_dir, plan))
        click.echo(f"\ninterrupted: {len(plan['groups']) - left} of {len(plan['groups'])} groups finished in "
                   f"{out_dir}; run the same command again to resume", err=True)
        raise SystemExit(130) from None
    _report(out_dir, manifest, as_json)


def _submit_array(out: Path, plan: dict, site_name: str, wait: bool) -> None:
    from hpc.data.array import submit_array, wait_for_manifest  # lazy: numpy

    jobs = submit_array(out, plan, site_name)
    if jobs is None:
        click.echo(f"{out / 'manifest.json'}: already prepared")
        return
    click.echo(f"submitted job array {jobs[0]} ({len(plan['groups'])} groups) and merge job {jobs[1]}; "
               f"logs in {out / '.prepare' / 'logs'}")
    if wait:
        wait_for_manifest(out, site_name, jobs[1], timeout_s=7 * 24 * 3600)
        click.echo(f"{out / 'manifest.json'}: written by job {jobs[1]}")


def _positive(name: str, value: int) -> int:
    if value < 1:
        raise UserError([f"{name} {value}: expected a positive number"])
    return value


def run_local(out: Path, plan: dict, workers: int) -> dict:
    """Every unfinished group here, then the merge."""
    from hpc.data.local import run_groups  # lazy: numpy
    from hpc.data.prepare import cpu_workers, merge  # lazy: numpy
    from hpc.data.progress import Progress  # lazy: startup

    progress = Progress(sum(i["bytes"] for i in plan["inputs"]))
    run_groups(out, plan, cpu_workers(workers), progress)
    progress.draw(final=True)
    return merge(out)


def _report(out: Path, manifest: dict, as_json: bool) -> None:
    from hpc.core.manifest import describe, window_totals  # lazy: startup

    if as_json:
        echo_json({"manifest": str(out / "manifest.json"), "splits": {s: {"tokens": m["tokens"], "documents": m["documents"],
                   "shards": len(m["shards"])} | window_totals(m) for s, m in manifest["splits"].items()},
                   "skipped": manifest["skipped"]})
        return
    click.echo(f"{out / 'manifest.json'}: {describe(manifest)}")
    skipped = manifest["skipped"]
    if skipped["count"]:
        click.echo(f"skipped {skipped['count']} bad documents (--errors=skip); the first:", err=True)
        for line in skipped["first"]:
            click.echo(f"  {line}", err=True)


@data_group.command("verify")
@click.argument("folder", metavar="DIR")
@json_option
def verify_command(folder: str, as_json: bool) -> None:
    """Check every file of a prepared folder against its manifest (sizes, SHA-256, offsets, token ids)."""
    from hpc.core.manifest import verify  # lazy: startup

    result = verify(folder)
    if as_json:
        echo_json(result)
        return
    recorded = result.pop("max_id_recorded", 0)
    parts = [f"{s}: {m['shards']} shards, {m['tokens']:,} tokens, {m['documents']:,} documents" for s, m in result.items()]
    click.echo(f"{folder}: every file matches its manifest ({'; '.join(parts)})")
    if recorded:  # an older manifest: what the login node checks against the model's vocabulary at submit
        click.echo(f"{folder}: recorded max_id (the largest token id) of {recorded} shards in its manifest.json, "
                   "which `hpcx submit` compares with `model.vocab_size`")
