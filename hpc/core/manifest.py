"""Reading a prepared folder's ``manifest.json``: where it is, the login-node checks (tokenizer
against the model's vocabulary, every listed file present with the size the manifest says) and
the full check of ``hpcx data verify`` (every SHA-256, document offsets, token ids). Torch-free;
numpy only for ``verify``."""

from __future__ import annotations

import json
import os
import stat
import typing as tp
from pathlib import Path

from hpc.core.config import load_json_bounded
from hpc.core.errors import ConfigError, UserError
from hpc.core.runs import write_json
from hpc.core.validate import expand_path, file_kind, largest_token, open_regular, shown

MANIFEST = "manifest.json"
TOKEN_BYTES = {"uint16": 2, "uint32": 4}


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """SHA-256 of a regular file (a FIFO or device is refused before it is opened), read in 4 MiB pieces."""
    import hashlib  # lazy: startup (only `verify` and `prepare` hash; loading OpenSSL costs every spec load ~4 ms)

    h = hashlib.sha256()
    with open_regular(path, str(path), "a regular shard file", UserError) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Mismatch(UserError):
    """``hpcx data verify``: a file differs from its manifest (exit 1, not 2)."""

    exit_code = 1


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
    p = Path(source)  # a manifest.json that is no regular file is found, and refused when it is read
    if p.is_dir() and ((p / MANIFEST).exists() or (p / MANIFEST).is_symlink()):
        return p / MANIFEST
    if p.name == MANIFEST and (p.exists() or p.is_symlink()):
        return p
    return None


MAX_SHARDS = 100_000  # shards a manifest lists at most ($HPCX_MAX_SHARDS): 6.4T tokens at the default 64M a shard
SHARD_BYTES = 320  # manifest bytes allowed per shard (an entry is ~260)
HEX = frozenset("0123456789abcdef")


def max_shards() -> int:
    """The shard bound, ``$HPCX_MAX_SHARDS`` when set."""
    raw = os.environ.get("HPCX_MAX_SHARDS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else MAX_SHARDS


def load_manifest(path: str | Path) -> dict[str, tp.Any]:
    """The manifest as a dict, checked (``manifest_problem``); one that is not ours, or lies about its
    shards, is a one-line UserError naming the file and the key. A FIFO or device is refused before it
    is opened, a file past the shard bound before it is read."""
    p = Path(path)
    limit = (1 << 20) + max_shards() * SHARD_BYTES
    with open_regular(p, str(p), "a regular manifest.json written by `hpcx data prepare`", UserError) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError([f"{p}: over {limit:,} bytes: expected a manifest of at most {max_shards():,} shards "
                         "(raise $HPCX_MAX_SHARDS)"])
    doc = load_json_bounded(data, str(p), UserError)
    if not isinstance(doc, dict) or doc.get("format") != "hpcx-tokens" or "splits" not in doc:
        raise UserError([f"{p}: not a token manifest: expected one written by `hpcx data prepare`"])
    problem = manifest_problem(doc)
    if problem:
        raise UserError([f"{p}: {problem}"])
    return doc


def _is_int(value: tp.Any, low: int = 0, high: int = 1 << 63) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _plain_name(value: tp.Any) -> bool:
    """A file name in the folder itself: no separator, not ``.``/``..``, no NUL (prepare writes such)."""
    return isinstance(value, str) and bool(value) and "/" not in value and "\0" not in value and value not in (".", "..")


def manifest_problem(doc: dict[str, tp.Any]) -> str | None:
    """The first key of a manifest that is not what ``hpcx data prepare`` writes, or totals that
    disagree with the shards (``key = value: expected …``); None when it holds together."""
    if doc.get("version") != 1:
        return f"version = {doc.get('version')!r}: expected 1 (this hpcx reads version 1 manifests)"
    if doc.get("dtype") not in TOKEN_BYTES:
        return f"dtype = {doc.get('dtype')!r}: expected 'uint16' or 'uint32'"
    vocab = doc.get("vocab_size")
    if not _is_int(vocab, 1, (1 << (16 if doc["dtype"] == "uint16" else 32)) + 1):
        return f"vocab_size = {vocab!r}: expected a positive integer that {doc['dtype']} ids reach"
    if not _is_int(doc.get("eos_id"), 0, tp.cast(int, vocab)):
        return f"eos_id = {doc.get('eos_id')!r}: expected an id below vocab_size = {vocab}"
    if not isinstance(doc.get("tokenizer"), dict) or not isinstance(doc["tokenizer"].get("path"), str):
        return f"tokenizer = {shown_value(doc.get('tokenizer'))}: expected a table with the tokenizer's path"
    if not isinstance(doc.get("masked", False), bool):
        return f"masked = {shown_value(doc.get('masked'))}: expected true or false"
    if "window" in doc and not _is_int(doc["window"], 2):
        return f"window = {shown_value(doc['window'])}: expected the window's tokens (at least 2)"
    splits = doc["splits"]
    if not isinstance(splits, dict) or "train" not in splits or not set(splits) <= {"train", "val"}:
        return (f"splits = {shown_value(splits)}: expected a 'train' split (and a 'val' one), each with its "
                "tokens, documents and shards")
    count = sum(len(split["shards"]) for split in splits.values()
                if isinstance(split, dict) and isinstance(split.get("shards"), list))
    if count > max_shards():
        return f"splits: {count:,} shards, over {max_shards():,}: expected at most that (raise $HPCX_MAX_SHARDS)"
    for name, split in splits.items():
        problem = _split_problem(f"splits.{name}", split, doc, name == "train")
        if problem:
            return problem
    return None


def shown_value(value: tp.Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "…"


def _split_problem(where: str, split: tp.Any, doc: dict, required: bool) -> str | None:
    if not isinstance(split, dict) or not isinstance(split.get("shards"), list):
        return f"{where} = {shown_value(split)}: expected a table of tokens, documents and a list of shards"
    for key in ("tokens", "documents"):
        if not _is_int(split.get(key)):
            return f"{where}.{key} = {shown_value(split.get(key))}: expected a whole number"
    if required and not split["shards"]:
        return f"{where}.shards = []: an empty train split: expected at least one shard"
    names: set[str] = set()
    for i, shard in enumerate(split["shards"]):
        problem = _shard_problem(f"{where}.shards[{i}]", shard, doc, names)
        if problem:
            return problem
    for key in ("tokens", "documents"):
        total = sum(s[key] for s in split["shards"])
        if total != split[key]:
            return f"{where}.{key} = {split[key]}: the shards hold {total}: expected the totals of its shards"
    return None


def _shard_problem(where: str, shard: tp.Any, doc: dict, names: set[str]) -> str | None:
    if not isinstance(shard, dict):
        return f"{where} = {shown_value(shard)}: expected a table"
    keys = ("file", "index") + (("mask",) if doc.get("masked") else ())
    for key in keys:
        if key not in shard or f"{key}_sha256" not in shard:
            return f"{where}: no key {key if key not in shard else key + '_sha256'!r}: expected {', '.join(keys)} and their sha256"
        name, digest = shard[key], shard[f"{key}_sha256"]
        if not _plain_name(name):
            return (f"{where}.{key} = {shown_value(name)}: expected the name of a file in the prepared folder "
                    "(no path: not absolute, no '/', no '..')")
        if name in names:
            return f"{where}.{key} = {name!r}: listed twice: expected each file once"
        names.add(name)
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= HEX):
            return f"{where}.{key}_sha256 = {shown_value(digest)}: expected 64 hex digits"
    if not _is_int(shard.get("tokens"), 1):
        return f"{where}.tokens = {shown_value(shard.get('tokens'))}: expected a positive whole number"
    if not _is_int(shard.get("documents"), 1, shard["tokens"] + 1):
        return (f"{where}.documents = {shown_value(shard.get('documents'))}: expected a positive whole number, "
                f"at most its tokens ({shard['tokens']})")
    if "max_id" in shard and not _is_int(shard["max_id"], 0, doc["vocab_size"]):
        return f"{where}.max_id = {shown_value(shard['max_id'])}: expected an id below vocab_size = {doc['vocab_size']}"
    return None


def shard_files(manifest: dict, split: str) -> tp.Iterator[tuple[str, str, int]]:
    """(file name, its sha256, expected bytes) of every file a split lists."""
    width = TOKEN_BYTES[manifest["dtype"]]
    for shard in manifest["splits"][split]["shards"]:
        yield shard["file"], shard["file_sha256"], shard["tokens"] * width
        yield shard["index"], shard["index_sha256"], (shard["documents"] + 1) * 8
        if "mask" in shard:
            yield shard["mask"], shard["mask_sha256"], shard["tokens"]


def size_problems(folder: Path, manifest: dict, label: str) -> list[str]:
    """Files missing, not regular files in the folder itself (a symlink, a FIFO, a device) or of another
    size than the manifest says."""
    out = []
    for split in manifest["splits"]:
        for name, _, size in shard_files(manifest, split):
            try:
                info = os.lstat(folder / name)
            except OSError:
                out.append(f"{label}: {name} is missing: expected {size} bytes (run `hpcx data verify {folder}`)")
                continue
            if not stat.S_ISREG(info.st_mode):
                what = "a symlink" if stat.S_ISLNK(info.st_mode) else file_kind(info.st_mode)
                out.append(f"{label}: {name} is {what}: expected a regular file in {folder} (prepare writes no other)")
            elif info.st_size != size:
                out.append(f"{label}: {name} has {info.st_size} bytes: expected {size} as the manifest says")
    return out[:10]


def check_source(path: Path, seq_len: int, vocab: int, label: str) -> list[str]:
    """Login-node checks of a manifest for a model: its tokenizer fits the vocabulary, so do the ids
    each shard holds (``max_id``, recorded as it was written), the train split holds a sample of
    ``seq_len + 1`` tokens, every file has the size the manifest says."""
    try:
        manifest = load_manifest(path)
    except UserError as exc:
        return [f"{label}: {m}" for m in exc.messages]
    problems = []
    if vocab and manifest["vocab_size"] > vocab:
        problems.append(f"{label}: the tokenizer {manifest['tokenizer']['path']} has {manifest['vocab_size']} "
                        f"tokens, more than the model's vocabulary of {vocab}: expected `model.vocab_size` "
                        f">= {manifest['vocab_size']}")
    high = next(((split, s) for split in manifest["splits"] for s in manifest["splits"][split]["shards"]
                 if vocab and s.get("max_id", -1) >= vocab), None)
    if high and not problems:
        problems.append(f"{label}: {path.parent / high[1]['file']} holds token id {high[1]['max_id']} (max_id in "
                        f"{path}): expected ids below the model's vocabulary of {vocab} (`model.vocab_size`)")
    if seq_len and manifest.get("window") and manifest["window"] != seq_len:
        problems.append(f"{label}: prepared with --window {manifest['window']}: expected `model.seq_len` = "
                        f"{manifest['window']} (its windows hold whole examples; got {seq_len}), or prepare again")
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
    if problems:  # one line: the first file that differs, and how many more do
        raise Mismatch([problems[0] + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")])
    recorded = record_max_ids(path, manifest)
    return {split: {k: manifest["splits"][split][k] for k in ("tokens", "documents")} | {
        "shards": len(manifest["splits"][split]["shards"])} for split in manifest["splits"]} | (
        {"max_id_recorded": recorded} if recorded else {})


def record_max_ids(path: Path, manifest: dict) -> int:
    """A manifest from before shards recorded ``max_id`` (which ``check_source`` compares with the
    model's vocabulary at submit) gets each shard's, as ``verify`` just read it, once every file
    matched: written atomically; the number of shards that got one."""
    missing = [(split, s) for split in manifest["splits"] for s in manifest["splits"][split]["shards"]
               if "max_id" not in s]
    for split, shard in missing:
        shard["max_id"] = _shard_max(path.parent / shard["file"], manifest["dtype"])
    if missing:
        write_json(path, manifest)
    return len(missing)


def _shard_max(file: Path, dtype: str) -> int:
    import numpy as np  # lazy: numpy

    tokens = np.memmap(file, dtype=dtype, mode="r")
    return int(tokens.max()) if len(tokens) else 0


def _hash_problems(folder: Path, manifest: dict) -> list[str]:
    return [f"{folder / name}: sha256 {digest[:12]}… differs from the manifest's {want[:12]}…: the file changed"
            for split in manifest["splits"] for name, want, _ in shard_files(manifest, split)
            if (digest := sha256_file(folder / name)) != want]


def _content_problems(folder: Path, manifest: dict) -> list[str]:
    """Offsets that do not end at the shard's token count; ids at or above the vocabulary."""
    import numpy as np  # lazy: numpy

    out = []
    for split in manifest["splits"]:
        for shard in manifest["splits"][split]["shards"]:
            offsets = np.fromfile(folder / shard["index"], dtype=np.uint64)
            if offsets[0] != 0 or offsets[-1] != shard["tokens"] or np.any(np.diff(offsets.astype(np.int64)) <= 0):
                out.append(f"{folder / shard['index']}: document offsets do not run from 0 up to {shard['tokens']}")
            tokens = np.memmap(folder / shard["file"], dtype=manifest["dtype"], mode="r")
            top = int(tokens.max()) if len(tokens) else -1
            if top >= manifest["vocab_size"]:
                out.append(f"{folder / shard['file']}: token id {top} is not below the vocabulary of "
                           f"{manifest['vocab_size']}")
            elif shard.get("max_id", top) != top:
                out.append(f"{folder / shard['file']}: its largest token id is {top}: the manifest's max_id says "
                           f"{shard['max_id']}")
    return out


def describe(manifest: dict) -> str:
    """One line: splits, tokens, documents, shards (a windowed split's padding), dtype, tokenizer."""
    parts = [f"{s} {m['tokens']:,} tokens / {m['documents']:,} documents / {len(m['shards'])} shards"
             + _padding_text(m) for s, m in manifest["splits"].items()]
    windows = f"; windows of {manifest['window']} tokens" if manifest.get("window") else ""
    return (f"{'; '.join(parts)}; {manifest['dtype']}, vocabulary {manifest['vocab_size']}, eos {manifest['eos_id']}"
            + windows)


def window_totals(split: dict) -> dict[str, tp.Any]:
    """A windowed split's pad tokens, their fraction of its tokens and the examples cut to a window
    (``hpcx data prepare --window``); empty for documents laid end to end."""
    if "padding" not in split:
        return {}
    return {"padding": split["padding"], "padding_fraction": split["padding"] / max(1, split["tokens"]),
            "truncated": split.get("truncated", 0)}


def _padding_text(split: dict) -> str:
    totals = window_totals(split)
    if not totals:
        return ""
    return (f" ({totals['padding_fraction']:.1%} padding, {totals['truncated']:,} examples cut to the window)")


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


# ------------------------------------------------------------------------------------------------ data

def check_data_source(source: str, dtype: str, seq_len: int, vocab: int) -> tuple[list[str], str, str]:
    """(problems, absolute path, its kind: ``hpc.core.manifest.source_kind``) for ``data.source`` on the
    login node; ``synthetic`` passes as is.

    A token file must be a readable regular file whose size is a whole number of ``dtype`` tokens and
    at least one sample (``seq_len + 1`` tokens); when ``vocab`` is known, a sample of the file spread
    over its length (the whole file up to 4 MiB) must hold no token id at or above it.
    """
    kind = source_kind(source)
    if kind == SYNTHETIC:
        return [], source, kind
    if source.strip().lower() == SYNTHETIC:
        return ([f"`data.source` = {source!r}: expected 'synthetic' (lower case) or a path to a token file"],
                source, kind)
    if not source.strip():
        return [f"`data.source` = {source!r}: expected 'synthetic' or a path to a token file"], source, kind
    try:
        path = expand_path(source if source.startswith(("/", "~", "$")) else os.path.join(os.getcwd(), source),
                           f"`data.source` = {shown(source)!r}")
    except ConfigError as exc:
        return [m for m in exc.messages], source, kind
    label, kind = f"`data.source` = {shown(source)!r}", source_kind(str(path))
    if kind == PREPARED:
        return check_prepared(path, seq_len, vocab, label), str(path), kind
    return _check_token_file(label, path, dtype, seq_len, vocab), str(path), kind


def _check_token_file(label: str, path: Path, dtype: str, seq_len: int, vocab: int) -> list[str]:
    try:
        mode = os.stat(path).st_mode  # before open: opening a socket fails, a FIFO blocks
        if not stat.S_ISREG(mode):
            return [f"{label}: {file_kind(mode)}: expected a regular file of {dtype} tokens"]
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return [f"{label}: no such file"]
    except OSError as exc:
        return [f"{label}: cannot open: {exc.strerror}"]
    info = os.fstat(fd)  # the file may have been replaced since the stat
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return [f"{label}: {file_kind(info.st_mode)}: expected a regular file of {dtype} tokens"]
    with os.fdopen(fd, "rb") as f:
        return _check_tokens(label, f, info.st_size, dtype, seq_len, vocab)


def _check_tokens(label: str, f: tp.BinaryIO, size: int, dtype: str, seq_len: int, vocab: int) -> list[str]:
    width = TOKEN_BYTES[dtype]
    if size == 0:
        return [f"{label}: the file is empty: expected {dtype} tokens"]
    if size % width:
        return [f"{label}: {size} bytes is not a whole number of {dtype} tokens ({width} bytes each): "
                "expected a flat token file (is `data.dtype` right?)"]
    if seq_len and size // width < seq_len + 1:
        return [f"{label}: {size // width} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}"]
    try:
        largest, offset = largest_token(f, size, width)
    except OSError as exc:
        return [f"{label}: cannot read: {exc.strerror}"]
    if vocab and largest >= vocab:
        return [f"{label}: token id {largest} at byte {offset} is not below the model's vocabulary of "
                f"{vocab}: expected ids < {vocab} (is `data.dtype` or `model.vocab_size` right?)"]
    return []
