"""Reading a prepared folder's ``manifest.json``: where it is, the login-node checks (tokenizer
against the model's vocabulary, every listed file present with the size the manifest says) and
the full check of ``hpcx data verify`` (every SHA-256, document offsets, token ids). Torch-free;
numpy only for ``verify``."""

from __future__ import annotations

import json
import typing as tp
from pathlib import Path

from hpc.core.errors import UserError

MANIFEST = "manifest.json"
TOKEN_BYTES = {"uint16": 2, "uint32": 4}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """SHA-256 of a file, read in 4 MiB pieces."""
    import hashlib  # only `verify` and `prepare` hash (loading OpenSSL costs every spec load ~4 ms)

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


SYNTHETIC, PREPARED, TOKEN_FILE = "synthetic", "prepared", "tokens"
SOURCE_KINDS = (SYNTHETIC, PREPARED, TOKEN_FILE)


def source_kind(source: str) -> str:
    """What ``data.source`` names, the one rule: ``synthetic`` (seeded random tokens), ``prepared`` (a
    folder, or a file named manifest.json: made by ``hpcx data prepare``) or ``tokens`` (any other
    path: a flat token file). Decided once, where the spec is loaded (``check_data_source``) and
    resolved (``Launch.data_source``); the ranks read the launch, not the string and the file system."""
    if source == SYNTHETIC:
        return SYNTHETIC
    path = Path(source)
    return PREPARED if path.is_dir() or path.name == MANIFEST else TOKEN_FILE


def manifest_path(source: str | Path) -> Path | None:
    """The manifest of ``source`` (a prepared folder or its manifest.json), or None when it is neither."""
    p = Path(source)
    if p.is_dir() and (p / MANIFEST).is_file():
        return p / MANIFEST
    if p.name == MANIFEST and p.is_file():
        return p
    return None


def load_manifest(path: str | Path) -> dict[str, tp.Any]:
    """The manifest as a dict; one that is not ours is a one-line UserError."""
    from hpc.core.config import load_json_bounded

    p = Path(path)
    try:
        doc = load_json_bounded(p.read_text(encoding="utf-8"), str(p))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError([f"{p}: cannot read: {exc}"]) from None
    if doc.get("format") != "hpcx-tokens" or "splits" not in doc:
        raise UserError([f"{p}: not a token manifest: expected one written by `hpcx data prepare`"])
    return doc


def shard_files(manifest: dict, split: str) -> tp.Iterator[tuple[str, str, int]]:
    """(file name, its sha256, expected bytes) of every file a split lists."""
    width = TOKEN_BYTES[manifest["dtype"]]
    for shard in manifest["splits"][split]["shards"]:
        yield shard["file"], shard["file_sha256"], shard["tokens"] * width
        yield shard["index"], shard["index_sha256"], (shard["documents"] + 1) * 8
        if "mask" in shard:
            yield shard["mask"], shard["mask_sha256"], shard["tokens"]


def size_problems(folder: Path, manifest: dict, label: str) -> list[str]:
    """Files missing or of another size than the manifest says."""
    out = []
    for split in manifest["splits"]:
        for name, _, size in shard_files(manifest, split):
            try:
                actual = (folder / name).stat().st_size
            except OSError:
                out.append(f"{label}: {name} is missing: expected {size} bytes (run `hpcx data verify {folder}`)")
                continue
            if actual != size:
                out.append(f"{label}: {name} has {actual} bytes: expected {size} as the manifest says")
    return out[:10]


def check_source(path: Path, seq_len: int, vocab: int, label: str) -> list[str]:
    """Login-node checks of a manifest for a model: its tokenizer fits the vocabulary, the train split
    holds a sample of ``seq_len + 1`` tokens, every file has the size the manifest says."""
    try:
        manifest = load_manifest(path)
    except UserError as exc:
        return [f"{label}: {m}" for m in exc.messages]
    problems = []
    if vocab and manifest["vocab_size"] > vocab:
        problems.append(f"{label}: the tokenizer {manifest['tokenizer']['path']} has {manifest['vocab_size']} "
                        f"tokens, more than the model's vocabulary of {vocab}: expected `model.vocab_size` "
                        f">= {manifest['vocab_size']}")
    if seq_len and longest_shard(manifest, "train") < seq_len + 1:
        problems.append(f"{label}: no train shard holds seq_len + 1 = {seq_len + 1} tokens "
                        f"(largest: {longest_shard(manifest, 'train')}): expected more text, or a shorter seq_len")
    return problems + size_problems(path.parent, manifest, label)


def val_split_source(data: tp.Any, kind: str) -> tuple[str, str] | None:
    """(folder, split) that evaluation reads: ``data.val_source`` (its val split, or its train split
    when it has no val split), else the val split of ``data.source`` when ``kind`` (``Launch.data_source``)
    is a prepared folder; None when there is none."""
    if data.val_source == "none":
        return None
    if data.val_source:
        manifest = load_manifest(manifest_path(data.val_source) or data.val_source)  # not one: load says so
        return data.val_source, "val" if manifest["splits"]["val"]["tokens"] else "train"
    if kind != PREPARED:
        return None
    manifest = load_manifest(manifest_path(data.source) or data.source)
    return (data.source, "val") if manifest["splits"]["val"]["tokens"] else None


def split_samples(folder: str | Path, split: str, seq_len: int) -> int:
    """The samples of ``seq_len + 1`` tokens a split holds, counted as ``trainer.tokens.ManifestTokens``
    cuts them (each shard on its own, windows overlapping by one token)."""
    shards = load_manifest(manifest_path(folder) or folder)["splits"][split]["shards"]
    return sum((s["tokens"] - 1) // seq_len for s in shards if s["tokens"] > seq_len)


def longest_shard(manifest: dict, split: str) -> int:
    return max((s["tokens"] for s in manifest["splits"][split]["shards"]), default=0)


def verify(folder: str | Path) -> dict[str, tp.Any]:
    """Every file of a prepared folder against its manifest: size, SHA-256, offsets, token ids.
    Returns a summary; problems are a UserError listing each."""
    path = manifest_path(folder)
    if path is None:
        raise UserError([f"{folder}: no manifest.json: expected a folder made by `hpcx data prepare`"])
    manifest = load_manifest(path)
    problems = size_problems(path.parent, manifest, str(path))
    if not problems:
        problems = _hash_problems(path.parent, manifest) + _content_problems(path.parent, manifest)
    if problems:
        raise UserError(problems)
    return {split: {k: manifest["splits"][split][k] for k in ("tokens", "documents")} | {
        "shards": len(manifest["splits"][split]["shards"])} for split in manifest["splits"]}


def _hash_problems(folder: Path, manifest: dict) -> list[str]:
    return [f"{folder / name}: sha256 {digest[:12]}… differs from the manifest's {want[:12]}…: the file changed"
            for split in manifest["splits"] for name, want, _ in shard_files(manifest, split)
            if (digest := sha256_file(folder / name)) != want]


def _content_problems(folder: Path, manifest: dict) -> list[str]:
    """Offsets that do not end at the shard's token count; ids at or above the vocabulary."""
    import numpy as np

    out = []
    for split in manifest["splits"]:
        for shard in manifest["splits"][split]["shards"]:
            offsets = np.fromfile(folder / shard["index"], dtype=np.uint64)
            if offsets[0] != 0 or offsets[-1] != shard["tokens"] or np.any(np.diff(offsets.astype(np.int64)) <= 0):
                out.append(f"{folder / shard['index']}: document offsets do not run from 0 up to {shard['tokens']}")
            tokens = np.memmap(folder / shard["file"], dtype=manifest["dtype"], mode="r")
            if len(tokens) and int(tokens.max()) >= manifest["vocab_size"]:
                out.append(f"{folder / shard['file']}: token id {int(tokens.max())} is not below the vocabulary of "
                           f"{manifest['vocab_size']}")
    return out


def describe(manifest: dict) -> str:
    """One line: splits, tokens, documents, shards, dtype, tokenizer."""
    parts = [f"{s} {m['tokens']:,} tokens / {m['documents']:,} documents / {len(m['shards'])} shards"
             for s, m in manifest["splits"].items()]
    return f"{'; '.join(parts)}; {manifest['dtype']}, vocabulary {manifest['vocab_size']}, eos {manifest['eos_id']}"


def summary_json(manifest: dict) -> str:
    return json.dumps({s: {"tokens": m["tokens"], "documents": m["documents"]} for s, m in manifest["splits"].items()})


def check_prepared(path: Path, seq_len: int, vocab: int, label: str) -> list[str]:
    """``data.source`` (or ``data.val_source``) naming a folder or a manifest.json: ``check_source``."""
    manifest = manifest_path(path)
    if manifest is None:
        what = "a directory without manifest.json" if path.is_dir() else "no such file"
        return [f"{label}: {what}: expected a folder made by `hpcx data prepare`, its manifest.json, or a "
                "regular file of tokens"]
    return check_source(manifest, seq_len, vocab, label)


def check_validation(data: tp.Any, train: tp.Any, seq_len: int, vocab: int, kind: str) -> tuple[list[str], str]:
    """(problems, absolute ``data.val_source``): a named folder is checked like ``data.source``; with
    ``train.eval_every`` there must be something to evaluate on (``kind``: ``data.source``'s, checked)."""
    source = data.val_source
    if source and source != "none":
        from hpc.core.errors import ConfigError
        from hpc.core.validate import expand_path

        try:
            path = expand_path(source if source.startswith(("/", "~", "$")) else str(Path.cwd() / source),
                               f"`data.val_source` = {source!r}")
        except ConfigError as exc:
            return exc.messages, source
        problems = check_prepared(path, seq_len, vocab, f"`data.val_source` = {source!r}")
        return problems, str(path)
    if not train.eval_every or source == "none":
        return [], source
    manifest = manifest_path(data.source) if kind == PREPARED else None
    if manifest is None or longest_shard(load_manifest(manifest), "val") < seq_len + 1:
        return [f"`train.eval_every` = {train.eval_every}: no validation split to evaluate on: expected "
                "`data.source` prepared with --val-fraction (a val shard of seq_len + 1 tokens), or a "
                "`data.val_source`"], source
    return [], source
