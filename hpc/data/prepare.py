"""``hpcx data prepare``: inputs → groups → token shards → ``manifest.json``.

The plan (inputs in sorted order, their sizes, the groups, the tokenizer and the options) is
decided once and written to ``DIR/.prepare/plan.json``. Each group of inputs is tokenized on its
own (``run_group``: by a worker process, or by one Slurm array task) into shards named after the
group, and finished by an atomic ``group-GGGGG.json``; ``merge`` then writes the manifest from the
finished groups in order. So the output does not depend on the number of workers or on where a
group ran, and a preparation killed and started again redoes only the unfinished groups.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import shutil
import typing as tp
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpc.core.config import load_json_bounded
from hpc.data.chat import ChatRenderer, add_config_tokens, plan_template, same_plan, template_record
from hpc.data.inputs import BadInput, Format, Limits, expand_inputs, read_documents
from hpc.data.shards import SPLITS, ShardWriter
from hpc.data.tokenizer import MAX_VOCAB, describe_tokenizer
from hpc.core.errors import UserError
from hpc.core.runs import write_json

STATE = ".prepare"
MANIFEST = "manifest.json"
BATCH_DOCS = 512  # documents per encode_batch call, at most
BATCH_CHARS = 1 << 20  # and characters per call, at most (the encodings of 1 MB of text take ~30 MB)
KEPT_EXAMPLES = 10  # skipped documents named in the manifest


@dataclass(frozen=True)
class Options:
    """Everything besides the inputs that decides the output bytes."""

    fmt: Format = Format()
    val_fraction: float = 0.0
    shard_tokens: int = 1 << 26
    group_bytes: int = 256 << 20
    errors: str = "raise"  # raise | skip
    eos: str | None = None
    limits: Limits = Limits()
    max_vocab: int = MAX_VOCAB
    chat_template: str = "auto"  # auto | tokenizer | none (hpc.data.chat.plan_template)
    window: int = 0  # --window: examples laid out in windows of this many tokens (model.seq_len), never straddling


def make_plan(inputs: tp.Sequence[str], tokenizer: str, options: Options) -> dict[str, tp.Any]:
    """The plan of a preparation as plain JSON: nothing in it depends on where it runs."""
    if not 0 <= options.val_fraction < 1:
        raise UserError([f"--val-fraction {options.val_fraction}: expected a fraction in [0, 1)"])
    files = expand_inputs(inputs)
    sizes = [f.stat().st_size for f in files]
    if options.window and options.fmt.kind == "text":
        raise UserError([f"--window {options.window}: expected --format prompt-response (the loss mask leaves "
                         "each window's padding out; plain text packs end to end)"])
    if options.window < 0 or 0 < options.window < 2:
        raise UserError([f"--window {options.window}: expected the model's seq_len, at least 2 tokens (0: off)"])
    loaded: list = []
    info = describe_tokenizer(tokenizer, options.eos, options.max_vocab, loaded)
    template = plan_template(Path(info.path).parent, loaded[0], options.fmt.kind, options.chat_template)
    windowed = {"window": options.window} if options.window else {}  # absent when off: earlier plans resume
    return {**windowed, "version": 1, "inputs": [{"path": str(f), "bytes": n} for f, n in zip(files, sizes)],
            "groups": group_inputs(sizes, options.group_bytes), "tokenizer": info.to_dict(), "dtype": info.dtype,
            "format": dataclasses.asdict(options.fmt), "val_fraction": options.val_fraction,
            "shard_tokens": options.shard_tokens, "errors": options.errors, "limits": dataclasses.asdict(options.limits),
            "chat_template": template}


def group_inputs(sizes: tp.Sequence[int], group_bytes: int) -> list[list[int]]:
    """Consecutive inputs, a group closed once it holds ``group_bytes`` (a big file is a group alone)."""
    groups: list[list[int]] = [[]]
    held = 0
    for i, size in enumerate(sizes):
        if groups[-1] and held + size > group_bytes:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    return groups


def start(out: Path, plan: dict, inputs: tp.Sequence[str] = ()) -> bool:
    """Create ``out`` and record the plan; an existing plan must be the same one (then it resumes),
    unless no group of it finished (then there is nothing to resume: the new plan replaces it).
    ``out`` must not be, or be inside, an input folder, nor hold an input, nor be a folder another tool
    filled. A plan that differs only in its template's date (``strftime_now``) is the same one: ``plan``
    takes the recorded one's. Returns whether ``out`` was created here (``abandon`` removes it then)."""
    check_out(out, plan, inputs)
    state = out / STATE
    created = not out.exists()
    try:
        state.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError([f"--out {out}: cannot create it ({exc.strerror}): expected a folder this user may write"]) from None
    path = state / "plan.json"
    if path.exists():
        old = load_json_bounded(path.read_text(encoding="utf-8"), str(path), UserError)
        if same_plan(old, plan):
            plan.update(old)  # the first plan's date for a template's strftime_now
            return created
        if any(state.glob("group-*.json")):
            key = next((k for k in plan if not isinstance(old, dict) or old.get(k) != plan[k]), "version")
            raise UserError([f"{out}: prepared before with other {key} ({path}): expected the same inputs, "
                             "tokenizer and options to resume; use another --out or delete it"])
        _remove_shards(out)
    write_json(path, plan)
    return created


def check_out(out: Path, plan: dict, inputs: tp.Sequence[str]) -> None:
    """``--out`` takes over nothing: not an input folder or a folder inside one, holding no input,
    and either new, empty, or a folder ``hpcx data prepare`` made (it holds ``.prepare/plan.json``)."""
    real = Path(os.path.realpath(out))
    for arg in inputs:
        folder = Path(os.path.realpath(os.path.expanduser(arg)))
        if folder.is_dir() and (real == folder or folder in real.parents):
            raise UserError([f"--out {out}: {'is' if real == folder else 'is inside'} the input folder {arg}: "
                             "expected an output folder apart from the inputs"])
    for item in plan["inputs"]:
        for p in {Path(item["path"]), Path(os.path.realpath(item["path"]))}:
            if real in p.parents:
                raise UserError([f"--out {out}: holds the input {item['path']}: expected an output folder apart "
                                 "from the inputs"])
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UserError([f"--out {out}: {'a symlink' if out.is_symlink() else 'not a folder'}: expected a new "
                         "folder, or one `hpcx data prepare` made"])
    if out.is_dir() and not (out / STATE / "plan.json").is_file() and any(out.iterdir()):
        raise UserError([f"--out {out}: a folder that holds other files and no {STATE}/plan.json: expected a new "
                         "or empty folder, or one `hpcx data prepare` made (nothing there is overwritten)"])


def _remove_shards(out: Path) -> None:
    """The shard files and temp files of an earlier plan (only names prepare writes)."""
    for pattern in ("train-[0-9]*-[0-9]*.*", "val-[0-9]*-[0-9]*.*", ".*-[0-9]*-[0-9]*.*.tmp-*"):
        for f in out.glob(pattern):
            if f.is_file() and not f.is_symlink():
                f.unlink(missing_ok=True)


def abandon(out: Path, created: bool) -> None:
    """After a refusal before any group finished: what this preparation wrote, and ``out`` itself when
    it was made for it, are removed (nothing is left to resume)."""
    state = out / STATE
    if (out / MANIFEST).exists() or (any(state.glob("group-*.json")) and not _nothing_prepared(out)):
        return
    _remove_shards(out)
    shutil.rmtree(state, ignore_errors=True)
    if created:
        try:
            out.rmdir()
        except OSError:
            pass


def _nothing_prepared(out: Path) -> bool:
    """Every finished group holds no token (all skipped): nothing there is worth resuming."""
    for record in (out / STATE).glob("group-*.json"):
        try:
            splits = json.loads(record.read_text())["splits"]
        except (OSError, ValueError, KeyError):
            return False
        if any(s for shards in splits.values() for s in shards):
            return False
    return True


def group_record_path(out: Path, group: int) -> Path:
    return out / STATE / f"group-{group:05d}.json"


def pending_groups(out: Path, plan: dict) -> list[int]:
    """Groups without a finished record."""
    return [g for g in range(len(plan["groups"])) if not group_record_path(out, g).is_file()]


def in_val(segments: list[tuple[str, bool]], fraction: float) -> bool:
    """The split of a document, from a hash of its text: the same wherever and in whatever order it is
    read, and a duplicate lands on the same side as its original."""
    if fraction <= 0:
        return False
    h = hashlib.blake2b(digest_size=8, person=b"hpcx-val")
    for text, counted in segments:
        h.update(b"\x01" if counted else b"\x00")
        h.update(text.encode("utf-8"))
    return int.from_bytes(h.digest(), "big") < fraction * 2.0 ** 64


class Skipped:
    """Documents left out under ``--errors=skip``: how many, and the first few by name."""

    def __init__(self, mode: str):
        self.mode, self.count, self.first = mode, 0, list[str]()

    def add(self, bad: BadInput) -> None:
        """Count a bad document, or raise it unless ``--errors=skip``."""
        if self.mode != "skip":
            raise bad
        self.count += 1
        if len(self.first) < KEPT_EXAMPLES:
            self.first.append(str(bad))

    def to_dict(self) -> dict[str, tp.Any]:
        return {"count": self.count, "first": self.first}


def one_malloc_arena() -> None:
    """glibc gives each of tokenizers' threads a malloc arena of its own, and what the encodings of a
    batch freed stays spread over them: with one arena the peak memory follows the largest batch, not
    the corpus (``bench/data_prepare``: 147 → 153 MB for twice the text, against 153 → 183 MB).
    Elsewhere than glibc, nothing."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def run_group(out: Path, plan: dict, group: int, report: tp.Callable[[int, int], None] | None = None) -> dict:
    """Tokenize one group into its shards and write its record; returns the record."""
    one_malloc_arena()
    for stale in out.glob(f".*-{group:05d}-*.tmp-*"):  # what a killed earlier attempt at this group left
        stale.unlink(missing_ok=True)
    masked = plan["format"]["kind"] == "prompt-response"
    writers = {s: ShardWriter(out, s, group, plan["dtype"], plan["shard_tokens"], masked, plan.get("window", 0),
                              plan["tokenizer"]["eos_id"]) for s in SPLITS}
    pending = Pending(_plan_tokenizer(plan), plan, writers, report or (lambda nbytes, tokens: None))
    skipped = Skipped(plan["errors"])
    limits = Limits(**plan.get("limits", {}))
    chat = ChatRenderer(plan["chat_template"], limits) if plan.get("chat_template") else None
    for i in plan["groups"][group]:
        _read_file(Path(plan["inputs"][i]["path"]), plan["inputs"][i]["bytes"], plan, pending, skipped, chat)
    pending.flush()
    for w in writers.values():
        w.flush()
    record = {"group": group, "splits": {s: w.shards for s, w in writers.items()}, "skipped": skipped.to_dict()}
    write_json(group_record_path(out, group), record)
    return record


def _plan_tokenizer(plan: dict) -> tp.Any:
    """The plan's tokenizer, refused if its file changed since the plan was made."""
    loaded: list = []
    info = describe_tokenizer(plan["tokenizer"]["path"], plan["tokenizer"]["eos_token"],
                              max(MAX_VOCAB, plan["tokenizer"]["vocab_size"]), loaded)
    if info.sha256 != plan["tokenizer"]["sha256"]:
        raise UserError([f"{info.path}: changed since this preparation started (sha256 {info.sha256[:12]}…, "
                         f"planned {plan['tokenizer']['sha256'][:12]}…): expected the same tokenizer"])
    add_config_tokens(loaded[0], Path(info.path).parent)  # as AutoTokenizer loads the folder
    return loaded[0]


class Pending:
    """Documents waiting for one ``encode_batch`` (across the files of a group, so small files still
    make full batches), and the input bytes read for them, reported once they are written."""

    def __init__(self, tok: tp.Any, plan: dict, writers: dict, report: tp.Callable[[int, int], None]):
        self.tok, self.plan, self.writers, self.report = tok, plan, writers, report
        self.docs: list[list[tuple[str, bool]]] = []
        self.nbytes = self.chars = 0

    def add(self, doc: list[tuple[str, bool]], nbytes: int) -> None:
        """One document and the input bytes read for it; encodes once a batch is full (in documents
        or in characters: memory follows the batch, so long documents make shorter batches)."""
        self.docs.append(doc)
        self.nbytes += nbytes
        self.chars += sum(len(text) for text, _ in doc)
        if len(self.docs) >= BATCH_DOCS or self.chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        """Encode and write the waiting documents; report their bytes and tokens."""
        tokens = _encode(self.tok, self.docs, self.plan, self.writers) if self.docs else 0
        self.report(self.nbytes, tokens)
        self.docs, self.nbytes, self.chars = [], 0, 0


def _read_file(path: Path, size: int, plan: dict, pending: Pending, skipped: Skipped,
               chat: ChatRenderer | None = None) -> None:
    """All documents of one input into ``pending``; an input without any is bad input."""
    documents, bad, read = 0, 0, 0
    for doc, pos in read_documents(path, Format(**plan["format"]), Limits(**plan.get("limits", {})), chat):
        if isinstance(doc, BadInput):
            skipped.add(doc)
            bad += 1
            continue
        documents += 1
        pending.add(doc, max(0, pos - read))
        read = max(read, pos)
    pending.nbytes += size - read
    if documents == 0 and bad == 0:
        skipped.add(BadInput(str(path), "no documents (an empty input): expected at least one"))


def _encode(tok: tp.Any, batch: list[list[tuple[str, bool]]], plan: dict, writers: dict) -> int:
    """Encode a batch of documents (each one text: its segments joined, in one ``encode_batch``), add each
    to its split's writer; returns the tokens written. A chat-template rendering is tokenized as
    ``apply_chat_template`` tokenizes it (no special tokens added: the template wrote them) and kept
    as it is; other documents as ``AutoTokenizer(text)`` does (the post-processor's BOS/EOS), then
    ended by the EOS unless they end with it already."""
    texts = ["".join(text for text, _ in doc) for doc in batch]
    eos, masked, total = plan["tokenizer"]["eos_id"], plan["format"]["kind"] != "text", 0
    templated = masked and bool(plan.get("chat_template"))
    if masked:  # the offsets tell which tokens hold counted characters
        encoded = tok.encode_batch(texts, add_special_tokens=not templated)
    else:
        encoded = getattr(tok, "encode_batch_fast", tok.encode_batch)(texts, add_special_tokens=True)
    for doc, enc in zip(batch, encoded):
        ids = list(enc.ids)
        mask = counted_tokens(enc.offsets, doc) if masked else None
        if not templated and (not ids or ids[-1] != eos):
            ids.append(eos)
            mask = None if mask is None else np.append(mask, np.uint8(1))
        elif mask is not None and not templated:
            mask[-1] = 1  # the post-processor's EOS ends the response
        tokens = np.array(ids, dtype=writers["train"].dtype)
        writers["val" if in_val(doc, plan["val_fraction"]) else "train"].add(tokens, mask)
        total += len(tokens)
    return total


def counted_tokens(offsets: list[tuple[int, int]], doc: list[tuple[str, bool]]) -> np.ndarray:
    """1 for each token whose characters overlap a counted segment (transformers' rule for the
    assistant mask), else 0."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not offsets:
        return mask
    bounds = np.array(offsets, dtype=np.int64).reshape(-1, 2)
    pos = 0
    for text, counted in doc:
        if counted and text:
            mask |= ((bounds[:, 1] > pos) & (bounds[:, 0] < pos + len(text))).astype(np.uint8)
        pos += len(text)
    return mask


def merge(out: Path) -> dict:
    """Write ``manifest.json`` from the plan and every finished group, in group order."""
    plan = json.loads((out / STATE / "plan.json").read_text())
    missing = pending_groups(out, plan)
    if missing:
        raise UserError([f"{out}: groups {missing[:10]} of {len(plan['groups'])} are not finished: "
                         "expected every group before the merge (run prepare again to finish them)"])
    records = [json.loads(group_record_path(out, g).read_text()) for g in range(len(plan["groups"]))]
    manifest = manifest_of(plan, records)
    if not any(manifest["splits"][s]["tokens"] for s in SPLITS):
        first = manifest["skipped"]["first"][:1] or [" ".join(i["path"] for i in plan["inputs"][:3])]
        raise UserError([f"{first[0]} (and every other of the {manifest['skipped']['count']} documents: "
                         "--errors=skip left out all): expected at least one good document"])
    write_json(out / MANIFEST, manifest)
    return manifest


def manifest_of(plan: dict, records: list[dict]) -> dict:
    """The manifest: the tokenizer, dtype, inputs and options, and per split its shards and totals."""
    splits = {}
    for s in SPLITS:
        shards = [dict(shard, group=r["group"]) for r in records for shard in r["splits"][s]]
        splits[s] = {"tokens": sum(x["tokens"] for x in shards), "documents": sum(x["documents"] for x in shards),
                     "shards": shards}
        if plan.get("window"):
            splits[s].update(padding=sum(x["padding"] for x in shards), truncated=sum(x["truncated"] for x in shards))
    skipped = [r["skipped"] for r in records]
    tokenizer = plan["tokenizer"]
    windowed = {"window": plan["window"], "pad_id": tokenizer["eos_id"]} if plan.get("window") else {}
    return {**windowed, "format": "hpcx-tokens", "version": 1, "tokenizer": tokenizer, "vocab_size": tokenizer["vocab_size"],
            "eos_id": tokenizer["eos_id"], "dtype": plan["dtype"], "masked": plan["format"]["kind"] != "text",
            "document_format": plan["format"], "chat_template": template_record(plan.get("chat_template")),
            "inputs": plan["inputs"], "groups": plan["groups"],
            "val_fraction": plan["val_fraction"], "shard_tokens": plan["shard_tokens"], "splits": splits,
            "skipped": {"count": sum(x["count"] for x in skipped),
                        "first": [m for x in skipped for m in x["first"]][:KEPT_EXAMPLES]}}


def cpu_workers(requested: int) -> int:
    """``--workers 0``: one per CPU this process may use."""
    return requested if requested > 0 else max(1, len(os.sched_getaffinity(0)))
