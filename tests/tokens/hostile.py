"""The hostile-input corpus of the data path (issue 35), generated: one class of defect per folder,
one case per sub-folder, never committed (the big ones are hundreds of MB once expanded).

    python -m tests.tokens.hostile OUT [CLASS]   # write the cases under OUT/CLASS/NAME/ to look at

The classes of issue 47 (chat templates, PEFT adapters, tasks, types, keys that mean nothing, one
line per problem) are built by ``tests/tokens/hostile_surfaces.py`` and registered here.

A case is a function that writes its files into an empty folder and returns the ``hpcx`` command
line and what it must give: the exit code and, for a refusal, words the one ``error:`` line must
hold (the file, and the key or line). ``test_hostile`` runs each through the real CLI in a fresh
process and checks also: no traceback, nothing left behind and no input changed (the folder is the
same before and after, but for the output of a case that succeeds), peak memory under 600 MB.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import sys
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

CLASSES = ("valid-input", "broken-input", "non-regular", "lies", "takeover", "bounds")


@dataclass
class Expect:
    """What a case's command must give."""

    argv: list[str]
    code: int = 2
    words: list[str] = field(default_factory=list)  # in the error line (code != 0) or on stdout (code 0)
    creates: tuple[str, ...] = ()  # paths (relative to the case folder) a successful case may create
    env: dict[str, str] = field(default_factory=dict)


CASES: dict[str, dict[str, tp.Callable[[Path, Path], Expect]]] = {c: {} for c in CLASSES}


def case(cls: str) -> tp.Callable:
    def register(fn: tp.Callable[[Path, Path], Expect]) -> tp.Callable:
        CASES[cls][fn.__name__.replace("_", "-")] = fn
        return fn
    return register


def prepare(tok: Path, *inputs: str | Path, out: str | Path = "out", extra: tp.Sequence[str] = ()) -> list[str]:
    return ["data", "prepare", *map(str, inputs), "--tokenizer", str(tok), "--out", str(out), *extra]


def zst(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


TEXT = b"The quick brown fox jumps over the lazy dog.\nA second line of the paragraph.\n\nAnother paragraph.\n"
JSONL = b"".join(json.dumps({"text": f"document number {i}: " + "words " * 20}).encode() + b"\n" for i in range(50))


# ------------------------------------------------------------------------------------- valid input

@case("valid-input")
def zst_txt_last_paragraph_without_blank_line(d: Path, tok: Path) -> Expect:
    (d / "a.txt.zst").write_bytes(zst(TEXT + b"last paragraph, no newline"))
    return Expect(prepare(tok, d / "a.txt.zst", out=d / "out"), 0, ["manifest.json"], ("out",))


@case("valid-input")
def gz_txt_last_paragraph_without_blank_line(d: Path, tok: Path) -> Expect:
    (d / "a.txt.gz").write_bytes(gzip.compress(TEXT + b"last paragraph\n"))
    return Expect(prepare(tok, d / "a.txt.gz", out=d / "out"), 0, ["manifest.json"], ("out",))


@case("valid-input")
def zst_jsonl_without_final_newline(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl.zst").write_bytes(zst(JSONL.rstrip(b"\n")))
    return Expect(prepare(tok, d / "a.jsonl.zst", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def hf_cache_symlink_without_extension(d: Path, tok: Path) -> Expect:
    (d / "blobs").mkdir()
    (d / "blobs" / "3f2a9c0e1b").write_bytes(JSONL)
    (d / "snap").mkdir()
    (d / "snap" / "data.jsonl").symlink_to("../blobs/3f2a9c0e1b")
    return Expect(prepare(tok, d / "snap" / "data.jsonl", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def hf_cache_symlinks_in_a_folder(d: Path, tok: Path) -> Expect:
    (d / "blobs").mkdir()
    (d / "blobs" / "aa11").write_bytes(zst(JSONL))
    (d / "blobs" / "bb22").write_bytes(TEXT)
    (d / "snap").mkdir()
    (d / "snap" / "train.jsonl.zst").symlink_to("../blobs/aa11")
    (d / "snap" / "notes.txt").symlink_to("../blobs/bb22")
    return Expect(prepare(tok, d / "snap", out=d / "out"), 0, ["52 documents"], ("out",))


@case("valid-input")
def symlink_with_extension_to_compressed_blob(d: Path, tok: Path) -> Expect:
    (d / "blob").write_bytes(gzip.compress(JSONL))
    (d / "data.jsonl.gz").symlink_to("blob")
    return Expect(prepare(tok, d / "data.jsonl.gz", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def jsonl_with_byte_order_mark(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + JSONL)
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def jsonl_crlf_lines(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL.replace(b"\n", b"\r\n"))
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def multi_member_gzip(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl.gz").write_bytes(gzip.compress(JSONL[:len(JSONL) // 2 + 3]) + gzip.compress(JSONL[len(JSONL) // 2 + 3:]))
    return Expect(prepare(tok, d / "a.jsonl.gz", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def multi_frame_zst(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl.zst").write_bytes(zst(JSONL[:1000]) + zst(JSONL[1000:]))
    return Expect(prepare(tok, d / "a.jsonl.zst", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def upper_case_extension(d: Path, tok: Path) -> Expect:
    (d / "A.JSONL.ZST").write_bytes(zst(JSONL))
    return Expect(prepare(tok, d / "A.JSONL.ZST", out=d / "out"), 0, ["50 documents"], ("out",))


@case("valid-input")
def zst_txt_crlf_and_trailing_spaces(d: Path, tok: Path) -> Expect:
    (d / "a.txt.zst").write_bytes(zst(TEXT.replace(b"\n", b"\r\n") + b"tail  \r\n   "))
    return Expect(prepare(tok, d / "a.txt.zst", out=d / "out"), 0, ["2 documents"], ("out",))


@case("valid-input")
def zst_txt_many_paragraphs_workers(d: Path, tok: Path) -> Expect:
    (d / "in").mkdir()
    for i in range(3):
        (d / "in" / f"p{i}.txt.zst").write_bytes(zst(TEXT * 300 + b"end without newline"))
    return Expect(prepare(tok, d / "in", out=d / "out", extra=["--workers", "2", "--group-bytes", "100"]), 0,
                  ["manifest.json"], ("out",))


@case("valid-input")
def path_with_spaces_and_unicode(d: Path, tok: Path) -> Expect:
    (d / "my data é").mkdir()
    (d / "my data é" / "ünï côdé.jsonl").write_bytes(JSONL)
    return Expect(prepare(tok, d / "my data é", out=d / "out dir"), 0, ["50 documents"], ("out dir",))


@case("valid-input")
def empty_out_folder_is_taken(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    (d / "out").mkdir()
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 0, ["50 documents"], ("out",))


# ------------------------------------------------------------------------------------ broken input

def _broken(name: str, data: bytes, *words: str, extra: tp.Sequence[str] = ()) -> tp.Callable:
    def make(d: Path, tok: Path) -> Expect:
        (d / name).write_bytes(data)
        return Expect(prepare(tok, d / name, out=d / "out", extra=extra), 2, [str(d / name), *words])
    return make


_GZ = gzip.compress(JSONL * 20)
_ZST = zst(JSONL * 20)
BROKEN = {
    "gz-truncated-half": ("a.jsonl.gz", _GZ[:len(_GZ) // 2], "truncated"),
    "gz-truncated-trailer": ("a.jsonl.gz", _GZ[:-4], "truncated"),
    "gz-truncated-header": ("a.jsonl.gz", _GZ[:5], "truncated"),
    "gz-corrupt-middle": ("a.jsonl.gz", _GZ[:40] + b"\xff" * 64 + _GZ[104:], "corrupt"),
    "gz-bad-crc": ("a.jsonl.gz", _GZ[:-8] + b"\0\0\0\0" + _GZ[-4:], "corrupt"),
    "gz-not-gzip": ("a.txt.gz", b"plain text, not gzip at all\n" * 10, "corrupt"),
    "gz-trailing-garbage": ("a.jsonl.gz", _GZ + b"garbage after the member", "corrupt"),
    "zst-truncated-half": ("a.jsonl.zst", _ZST[:len(_ZST) // 2], "truncated"),
    "zst-truncated-last-byte": ("a.jsonl.zst", _ZST[:-1], "truncated"),
    "zst-truncated-header": ("a.txt.zst", _ZST[:3], "truncated"),
    "zst-corrupt-middle": ("a.jsonl.zst", _ZST[:30] + b"\xff" * 64 + _ZST[94:], "corrupt"),
    "zst-not-zstd": ("a.txt.zst", b"plain text, not zstd\n" * 10, "corrupt"),
    "zst-trailing-garbage": ("a.jsonl.zst", _ZST + b"garbage", "corrupt"),
    "parquet-not-parquet": ("a.parquet", b"PAR1 but not really", "not a parquet file"),
    "parquet-zst-garbage": ("a.parquet.zst", zst(b"not parquet"), "not a parquet file"),
    "jsonl-latin1": ("a.jsonl", b'{"text": "caf\xe9"}\n', ":1", "UTF-8"),
    "jsonl-line-2-bad": ("a.jsonl", JSONL.split(b"\n")[0] + b"\n{oops\n", ":2", "not JSON"),
    "jsonl-array-line": ("a.jsonl", b"[1, 2]\n", ":1", "JSON list"),
    "jsonl-deep-nesting": ("a.jsonl", b"[" * 100000 + b"]" * 100000 + b"\n", ":1", "JSON"),
    "jsonl-text-not-string": ("a.jsonl", b'{"text": 3}\n', ":1", "'text'"),
    "txt-zst-latin1-line-3": ("a.txt.zst", zst(b"one\ntwo\nthr\xe9e\n"), ":3", "UTF-8"),
}
for _name, (_file, _data, *_words) in BROKEN.items():
    CASES["broken-input"][_name] = _broken(_file, _data, *_words)


@case("broken-input")
def empty_jsonl(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(b"")
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 2, [str(d / "a.jsonl"), "no documents"])


@case("broken-input")
def every_row_bad_with_skip(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(b"{bad\n[1]\n{\"text\": 1}\n")
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out", extra=["--errors", "skip"]), 2,
                  [str(d / "a.jsonl") + ":1", "every other"])


@case("broken-input")
def every_row_bad_with_skip_many_groups(d: Path, tok: Path) -> Expect:
    (d / "in").mkdir()
    for i in range(3):
        (d / "in" / f"a{i}.jsonl").write_bytes(b"{bad\n")
    return Expect(prepare(tok, d / "in", out=d / "out", extra=["--errors", "skip", "--group-bytes", "1", "--workers", "2"]),
                  2, [":1", "every other"])


@case("broken-input")
def workers_negative(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out", extra=["--workers", "-1"]), 2, ["--workers -1"])


@case("broken-input")
def max_document_bytes_zero(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out", extra=["--max-document-bytes", "0"]), 2,
                  ["--max-document-bytes 0"])


@case("broken-input")
def tokenizer_not_json(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    (d / "tokenizer.json").write_bytes(b"{not json")
    return Expect(prepare(d / "tokenizer.json", d / "a.jsonl", out=d / "out"), 2, [str(d / "tokenizer.json")])


@case("broken-input")
def tokenizer_nested_deep(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    (d / "tokenizer.json").write_bytes(b"[" * 50000 + b"]" * 50000)
    return Expect(prepare(d / "tokenizer.json", d / "a.jsonl", out=d / "out"), 2, [str(d / "tokenizer.json")])


# ------------------------------------------------------------------------------- non-regular files

def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


@case("non-regular")
def fifo_input(d: Path, tok: Path) -> Expect:
    _fifo(d / "a.jsonl")
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 2, [str(d / "a.jsonl"), "FIFO"])


@case("non-regular")
def fifo_compressed_input(d: Path, tok: Path) -> Expect:
    _fifo(d / "a.txt.zst")
    return Expect(prepare(tok, d / "a.txt.zst", out=d / "out"), 2, [str(d / "a.txt.zst"), "FIFO"])


@case("non-regular")
def symlink_to_dev_zero_input(d: Path, tok: Path) -> Expect:
    (d / "a.txt").symlink_to("/dev/zero")
    return Expect(prepare(tok, d / "a.txt", out=d / "out"), 2, [str(d / "a.txt"), "character device"])


@case("non-regular")
def symlink_to_dev_zero_gz_input(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl.gz").symlink_to("/dev/zero")
    return Expect(prepare(tok, d / "a.jsonl.gz", out=d / "out"), 2, [str(d / "a.jsonl.gz"), "character device"])


@case("non-regular")
def socket_input(d: Path, tok: Path) -> Expect:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(d / "a.jsonl"))
    s.close()
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 2, [str(d / "a.jsonl"), "socket"])


@case("non-regular")
def fifo_tokenizer(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    _fifo(d / "tokenizer.json")
    return Expect(prepare(d / "tokenizer.json", d / "a.jsonl", out=d / "out"), 2, [str(d / "tokenizer.json"), "FIFO"])


@case("non-regular")
def tokenizer_dev_zero(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").symlink_to("/dev/zero")
    return Expect(prepare(d / "tok", d / "a.jsonl", out=d / "out"), 2, ["tokenizer.json", "character device"])


@case("non-regular")
def tokenizer_config_fifo(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").write_bytes(tok.read_bytes())
    _fifo(d / "tok" / "tokenizer_config.json")
    return Expect(prepare(d / "tok", d / "a.jsonl", out=d / "out"), 2, ["tokenizer_config.json", "FIFO"])


@case("non-regular")
def fifo_in_input_folder_is_left_out(d: Path, tok: Path) -> Expect:
    (d / "in").mkdir()
    (d / "in" / "a.jsonl").write_bytes(JSONL)
    _fifo(d / "in" / "b.jsonl")
    return Expect(prepare(tok, d / "in", out=d / "out"), 0, ["50 documents"], ("out",))


# ------------------------------------------------------------------------ outputs that take over

def _inputs(d: Path) -> Path:
    (d / "in").mkdir()
    (d / "in" / "a.jsonl").write_bytes(JSONL)
    return d / "in"


@case("takeover")
def out_is_the_input_folder(d: Path, tok: Path) -> Expect:
    return Expect(prepare(tok, _inputs(d), out=d / "in"), 2, ["--out", "is the input folder"])


@case("takeover")
def out_inside_the_input_folder(d: Path, tok: Path) -> Expect:
    return Expect(prepare(tok, _inputs(d), out=d / "in" / "tokens"), 2, ["--out", "inside the input folder"])


@case("takeover")
def out_inside_the_input_folder_through_a_symlink(d: Path, tok: Path) -> Expect:
    _inputs(d)
    (d / "link").symlink_to(d / "in")
    return Expect(prepare(tok, d / "link", out=d / "in" / "x"), 2, ["--out", "inside the input folder"])


@case("takeover")
def out_holds_the_input_file(d: Path, tok: Path) -> Expect:
    _inputs(d)
    return Expect(prepare(tok, d / "in" / "a.jsonl", out=d / "in"), 2, ["--out", "holds the input"])


@case("takeover")
def out_holds_the_input_deeper(d: Path, tok: Path) -> Expect:
    (d / "a" / "b").mkdir(parents=True)
    (d / "a" / "b" / "x.jsonl").write_bytes(JSONL)
    return Expect(prepare(tok, d / "a" / "b" / "x.jsonl", out=d / "a"), 2, ["--out", "holds the input"])


@case("takeover")
def out_is_another_tools_folder(d: Path, tok: Path) -> Expect:
    (d / "theirs").mkdir()
    (d / "theirs" / "manifest.json").write_text('{"tool": "someone else"}')
    return Expect(prepare(tok, _inputs(d), out=d / "theirs"), 2, ["--out", "holds other files"])


@case("takeover")
def out_is_a_non_empty_folder(d: Path, tok: Path) -> Expect:
    (d / "theirs").mkdir()
    (d / "theirs" / "notes.txt").write_text("mine")
    return Expect(prepare(tok, _inputs(d), out=d / "theirs"), 2, ["--out", "holds other files"])


@case("takeover")
def out_with_a_foreign_prepare_folder_only(d: Path, tok: Path) -> Expect:
    (d / "theirs" / ".prepare").mkdir(parents=True)
    return Expect(prepare(tok, _inputs(d), out=d / "theirs"), 2, ["--out", "holds other files"])


@case("takeover")
def out_is_a_file(d: Path, tok: Path) -> Expect:
    (d / "out").write_text("a file")
    return Expect(prepare(tok, _inputs(d), out=d / "out"), 2, ["--out", "not a folder"])


@case("takeover")
def out_is_a_symlink_to_a_folder(d: Path, tok: Path) -> Expect:
    (d / "real").mkdir()
    (d / "out").symlink_to(d / "real")
    return Expect(prepare(tok, _inputs(d), out=d / "out"), 2, ["--out", "a symlink"])


@case("takeover")
def bad_line_2_leaves_nothing(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL.split(b"\n")[0] + b"\n{broken\n")
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 2, [str(d / "a.jsonl") + ":2"])


@case("takeover")
def bad_line_2_into_an_empty_folder_leaves_it_empty(d: Path, tok: Path) -> Expect:
    (d / "out").mkdir()
    (d / "a.jsonl").write_bytes(JSONL.split(b"\n")[0] + b"\n{broken\n")
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 2, [str(d / "a.jsonl") + ":2"])


@case("takeover")
def bad_file_in_a_later_group_with_workers(d: Path, tok: Path) -> Expect:
    (d / "in").mkdir()
    (d / "in" / "a.jsonl").write_bytes(b"{broken\n")
    (d / "in" / "b.jsonl").write_bytes(b"{broken\n")
    return Expect(prepare(tok, d / "in", out=d / "out", extra=["--group-bytes", "1", "--workers", "2"]), 2, [":1"])


# --------------------------------------------------------------- prepared folders that lie or break

def prepared(d: Path, tok: Path, masked: bool = False) -> Path:
    """A real prepared folder ``d/p`` (made in this process), for the cases to break."""
    from hpc.data.inputs import Format
    from hpc.data.prepare import Options, make_plan, merge, run_group, start

    (d / "src").mkdir()
    records = [{"prompt": f"question {i}?", "response": "answer " * 30} for i in range(40)]
    (d / "src" / "a.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) if masked else JSONL)
    out = d / "p"
    plan = make_plan([str(d / "src")], str(tok), Options(Format("prompt-response" if masked else "text"),
                                                         val_fraction=0.2, shard_tokens=400))
    start(out, plan)
    for g in range(len(plan["groups"])):
        run_group(out, plan, g)
    merge(out)
    return out


def edit_manifest(folder: Path, change: tp.Callable[[dict], tp.Any]) -> None:
    doc = json.loads((folder / "manifest.json").read_text())
    change(doc)
    (folder / "manifest.json").write_text(json.dumps(doc))


def spec(d: Path, source: Path, vocab: int = 600, seq_len: int = 8) -> Path:
    (d / "job.toml").write_text(f'[data]\nsource = "{source}"\n[model]\nvocab_size = {vocab}\n'
                                f'seq_len = {seq_len}\n')
    return d / "job.toml"


def _first_shard(doc: dict) -> dict:
    return doc["splits"]["train"]["shards"][0]


LIES: dict[str, tuple[tp.Callable[[dict], tp.Any], tuple[str, ...]]] = {
    "dtype-int8": (lambda m: m.update(dtype="int8"), ("dtype = 'int8'",)),
    "dtype-missing": (lambda m: m.pop("dtype"), ("dtype = None",)),
    "vocab-size-string": (lambda m: m.update(vocab_size="300"), ("vocab_size = '300'",)),
    "vocab-size-zero": (lambda m: m.update(vocab_size=0), ("vocab_size = 0",)),
    "vocab-size-past-uint16": (lambda m: m.update(vocab_size=70000), ("vocab_size = 70000",)),
    "vocab-size-bool": (lambda m: m.update(vocab_size=True), ("vocab_size = True",)),
    "eos-at-vocab": (lambda m: m.update(eos_id=600), ("eos_id = 600",)),
    "splits-empty": (lambda m: m.update(splits={}), ("splits = {}",)),
    "splits-list": (lambda m: m.update(splits=[]), ("splits = []",)),
    "splits-unknown-name": (lambda m: m["splits"].update(test=m["splits"]["val"]), ("splits = ",)),
    "split-not-table": (lambda m: m["splits"].update(val=3), ("splits.val = 3",)),
    "train-split-empty": (lambda m: m["splits"].update(train={"tokens": 0, "documents": 0, "shards": []}),
                          ("splits.train.shards = []",)),
    "split-tokens-disagree": (lambda m: m["splits"]["train"].update(tokens=m["splits"]["train"]["tokens"] + 5),
                              ("splits.train.tokens", "the shards hold")),
    "split-documents-disagree": (lambda m: m["splits"]["train"].update(documents=1), ("splits.train.documents = 1",)),
    "split-tokens-string": (lambda m: m["splits"]["train"].update(tokens="many"), ("splits.train.tokens = \"many\"",)),
    "shard-without-file": (lambda m: _first_shard(m).pop("file"), ("splits.train.shards[0]", "'file'")),
    "shard-without-index-sha": (lambda m: _first_shard(m).pop("index_sha256"), ("shards[0]", "'index_sha256'")),
    "shard-not-table": (lambda m: m["splits"]["train"]["shards"].__setitem__(0, "train.bin"), ("shards[0] = \"train.bin\"",)),
    "shard-tokens-string": (lambda m: _first_shard(m).update(tokens=str(_first_shard(m)["tokens"])), ("shards[0].tokens = \"",)),
    "shard-tokens-negative": (lambda m: _first_shard(m).update(tokens=-4), ("shards[0].tokens = -4",)),
    "shard-documents-above-tokens": (lambda m: _first_shard(m).update(documents=10 ** 6), ("shards[0].documents",)),
    "shard-absolute-path": (lambda m: _first_shard(m).update(file="/etc/passwd"), ("shards[0].file = \"/etc/passwd\"",)),
    "shard-dotdot-path": (lambda m: _first_shard(m).update(file="../src/a.jsonl"), ("shards[0].file = \"../src/a.jsonl\"",)),
    "shard-subfolder-path": (lambda m: _first_shard(m).update(file="sub/train.bin"), ("shards[0].file = \"sub/train.bin\"",)),
    "shard-dot-name": (lambda m: _first_shard(m).update(file=".."), ("shards[0].file = \"..\"",)),
    "shard-listed-twice": (lambda m: m["splits"]["train"]["shards"].append(dict(_first_shard(m))), ("listed twice",)),
    "shard-sha-not-hex": (lambda m: _first_shard(m).update(file_sha256="z" * 64), ("shards[0].file_sha256",)),
    "max-id-past-vocab-size": (lambda m: _first_shard(m).update(max_id=600), ("shards[0].max_id = 600",)),
    "version-2": (lambda m: m.update(version=2), ("version = 2",)),
    "masked-string": (lambda m: m.update(masked="yes"), ("masked = \"yes\"",)),
    "tokenizer-not-table": (lambda m: m.update(tokenizer="gpt2"), ("tokenizer = \"gpt2\"",)),
}


def _lie(change: tp.Callable[[dict], tp.Any], words: tuple[str, ...], command: str) -> tp.Callable:
    def make(d: Path, tok: Path) -> Expect:
        folder = prepared(d, tok)
        edit_manifest(folder, change)
        argv = ["data", "verify", str(folder)] if command == "verify" else ["render", str(spec(d, folder))]
        return Expect(argv, 2, [str(folder / "manifest.json"), *words])
    return make


for _name, (_change, _words) in LIES.items():
    CASES["lies"][f"verify-{_name}"] = _lie(_change, _words, "verify")
    CASES["lies"][f"render-{_name}"] = _lie(_change, _words, "render")


@case("lies")
def verify_symlink_out_of_the_folder(d: Path, tok: Path) -> Expect:
    folder = prepared(d, tok)
    shard = folder / _first_shard(json.loads((folder / "manifest.json").read_text()))["file"]
    (d / "elsewhere.bin").write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(d / "elsewhere.bin")
    return Expect(["data", "verify", str(folder)], 1, [shard.name, "a symlink"])


@case("lies")
def render_symlink_out_of_the_folder(d: Path, tok: Path) -> Expect:
    folder = prepared(d, tok)
    shard = folder / _first_shard(json.loads((folder / "manifest.json").read_text()))["file"]
    (d / "elsewhere.bin").write_bytes(shard.read_bytes())
    shard.unlink()
    shard.symlink_to(d / "elsewhere.bin")
    return Expect(["render", str(spec(d, folder))], 2, [shard.name, "a symlink"])


@case("lies")
def verify_max_id_understated(d: Path, tok: Path) -> Expect:
    folder = prepared(d, tok)
    edit_manifest(folder, lambda m: _first_shard(m).update(max_id=2))
    return Expect(["data", "verify", str(folder)], 1, ["max_id says 2"])


@case("lies")
def render_ids_past_the_model_vocabulary(d: Path, tok: Path) -> Expect:
    folder = prepared(d, tok)
    edit_manifest(folder, lambda m: m.update(vocab_size=300, eos_id=1))  # the shards' max_id stay ~590
    return Expect(["render", str(spec(d, folder, vocab=300))], 2, [str(folder / "manifest.json"), "max_id"])


@case("lies")
def render_model_vocabulary_below_max_id(d: Path, tok: Path) -> Expect:
    folder = prepared(d, tok)
    edit_manifest(folder, lambda m: [s.update(max_id=599) for s in m["splits"]["train"]["shards"]])
    return Expect(["render", str(spec(d, folder, vocab=600))], 0, [], ())


@case("lies")
def verify_changed_shard_is_a_mismatch(d: Path, tok: Path) -> Expect:
    folder = prepared(d, tok)
    shard = folder / _first_shard(json.loads((folder / "manifest.json").read_text()))["file"]
    data = bytearray(shard.read_bytes())
    data[0] ^= 1
    shard.write_bytes(bytes(data))
    return Expect(["data", "verify", str(folder)], 1, [str(shard), "sha256"])


@case("broken-input")
def manifest_nested_10000_deep(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    (d / "p" / "manifest.json").write_text("[" * 10000 + "]" * 10000)
    return Expect(["data", "verify", str(d / "p")], 2, [str(d / "p" / "manifest.json"), "nested"])


@case("broken-input")
def manifest_not_json(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    (d / "p" / "manifest.json").write_text('{"format": "hpcx-tokens", ')
    return Expect(["data", "verify", str(d / "p")], 2, [str(d / "p" / "manifest.json"), "JSON"])


@case("broken-input")
def render_manifest_not_json(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    (d / "p" / "manifest.json").write_text('{"format": "hpcx-tokens", ')
    return Expect(["render", str(spec(d, d / "p"))], 2, [str(d / "p" / "manifest.json"), "JSON"])


@case("broken-input")
def manifest_not_utf8(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    (d / "p" / "manifest.json").write_bytes(b'{"format": "hpcx-tok\xffens"}')
    return Expect(["data", "verify", str(d / "p")], 2, [str(d / "p" / "manifest.json"), "UTF-8"])


@case("non-regular")
def manifest_fifo_verify(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    _fifo(d / "p" / "manifest.json")
    return Expect(["data", "verify", str(d / "p")], 2, [str(d / "p" / "manifest.json"), "FIFO"])


@case("non-regular")
def manifest_dev_zero_render(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    (d / "p" / "manifest.json").symlink_to("/dev/zero")
    return Expect(["render", str(spec(d, d / "p"))], 2, [str(d / "p" / "manifest.json"), "character device"])


@case("non-regular")
def manifest_json_named_directly_fifo(d: Path, tok: Path) -> Expect:
    _fifo(d / "manifest.json")
    return Expect(["render", str(spec(d, d / "manifest.json"))], 2, [str(d / "manifest.json"), "FIFO"])


def _shard_replaced(d: Path, tok: Path, how: str, index: bool = False) -> tuple[Path, Path]:
    folder = prepared(d, tok)
    name = _first_shard(json.loads((folder / "manifest.json").read_text()))["index" if index else "file"]
    (folder / name).unlink()
    if how == "fifo":
        _fifo(folder / name)
    else:
        (folder / name).symlink_to("/dev/zero")
    return folder, folder / name


@case("non-regular")
def shard_fifo_verify(d: Path, tok: Path) -> Expect:
    folder, shard = _shard_replaced(d, tok, "fifo")
    return Expect(["data", "verify", str(folder)], 1, [shard.name, "FIFO"])


@case("non-regular")
def shard_dev_zero_verify(d: Path, tok: Path) -> Expect:
    folder, shard = _shard_replaced(d, tok, "zero")
    return Expect(["data", "verify", str(folder)], 1, [shard.name, "symlink"])


@case("non-regular")
def index_fifo_render(d: Path, tok: Path) -> Expect:
    folder, shard = _shard_replaced(d, tok, "fifo", index=True)
    return Expect(["render", str(spec(d, folder))], 2, [shard.name, "FIFO"])


@case("bounds")
def manifest_past_the_shard_bound(d: Path, tok: Path) -> Expect:
    folder = prepared(d, tok)
    edit_manifest(folder, lambda m: m["splits"]["train"]["shards"].extend(
        dict(_first_shard(m), file=f"x{i}.bin", index=f"x{i}.idx") for i in range(12)))
    return Expect(["data", "verify", str(folder)], 2, [str(folder / "manifest.json"), "HPCX_MAX_SHARDS"],
                  env={"HPCX_MAX_SHARDS": "10"})


@case("bounds")
def manifest_of_40_mb(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    with open(d / "p" / "manifest.json", "w") as f:
        f.write('{"format": "hpcx-tokens", "pad": "')
        for _ in range(40):
            f.write("x" * (1 << 20))
        f.write('"}')
    return Expect(["data", "verify", str(d / "p")], 2, [str(d / "p" / "manifest.json"), "over"],
                  env={"HPCX_MAX_SHARDS": "100000"})


# ------------------------------------------------------------------------------ model.hf_config

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False}


QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}


def hf_job(d: Path, config: Path | str) -> list[str]:
    (d / "job.toml").write_text(f'[model]\nhf_config = "{config}"\n[train]\nglobal_batch = 8\n')
    return ["render", str(d / "job.toml")]


def _config_case(change: tp.Callable[[dict], tp.Any] | None, words: tuple[str, ...], raw: bytes | None = None) -> tp.Callable:
    def make(d: Path, tok: Path) -> Expect:
        (d / "m").mkdir()
        doc = dict(LLAMA)
        if change:
            change(doc)
        (d / "m" / "config.json").write_bytes(raw if raw is not None else json.dumps(doc).encode())
        return Expect(hf_job(d, d / "m"), 2, [str(d / "m" / "config.json"), *words])
    return make


HF_CONFIGS: dict[str, tuple] = {
    "zero-layers": (lambda c: c.update(num_hidden_layers=0), ("num_hidden_layers = 0",)),
    "negative-layers": (lambda c: c.update(num_hidden_layers=-2), ("num_hidden_layers = -2",)),
    "layers-string": (lambda c: c.update(num_hidden_layers="2"), ("num_hidden_layers = '2'",)),
    "layers-float": (lambda c: c.update(num_hidden_layers=2.0), ("num_hidden_layers = 2.0",)),
    "layers-bool": (lambda c: c.update(num_hidden_layers=True), ("num_hidden_layers = True",)),
    "zero-heads": (lambda c: c.update(num_attention_heads=0), ("num_attention_heads = 0",)),
    "kv-heads-not-dividing": (lambda c: c.update(num_key_value_heads=3), ("num_key_value_heads = 3",)),
    "kv-heads-zero": (lambda c: c.update(num_key_value_heads=0), ("num_key_value_heads = 0",)),
    "kv-heads-above-heads": (lambda c: c.update(num_key_value_heads=8), ("num_key_value_heads = 8",)),
    "intermediate-size-zero": (lambda c: c.update(intermediate_size=0), ("intermediate_size = 0",)),
    "intermediate-size-negative": (lambda c: c.update(intermediate_size=-1), ("intermediate_size = -1",)),
    "vocab-size-zero": (lambda c: c.update(vocab_size=0), ("vocab_size = 0",)),
    "vocab-size-huge": (lambda c: c.update(vocab_size=10 ** 12), ("vocab_size = 1000000000000",)),
    "vocab-size-null": (lambda c: c.update(vocab_size=None), ("vocab_size = None",)),
    "hidden-not-multiple-of-heads": (lambda c: c.update(hidden_size=66), ("hidden_size = 66",)),
    "max-positions-zero": (lambda c: c.update(max_position_embeddings=0), ("max_position_embeddings = 0",)),
    "eps-negative": (lambda c: c.update(rms_norm_eps=-1), ("rms_norm_eps = -1",)),
    "eps-string": (lambda c: c.update(rms_norm_eps="1e-5"), ("rms_norm_eps = '1e-5'",)),
    "bert": (lambda c: (c.clear(), c.update(architectures=["BertModel"], model_type="bert", hidden_size=768)),
             ("BertModel",)),
    "bert-model-type-only": (lambda c: (c.clear(), c.update(model_type="bert", hidden_size=768)), ("bert",)),
    "architectures-empty": (lambda c: (c.update(architectures=[], model_type="gpt2")), ("gpt2",)),
    "architectures-string": (lambda c: c.update(architectures="LlamaForCausalLM"), ("architectures = 'LlamaForCausalLM'",)),
    "architectures-two": (lambda c: c.update(architectures=["LlamaForCausalLM", "X"]), ("architectures",)),
    "layers-missing": (lambda c: c.pop("num_hidden_layers"), ("num_hidden_layers is missing",)),
    "nested-10000": (None, ("nested",), b'{"a": ' + b"[" * 10000 + b"]" * 10000 + b"}"),
    "not-json": (None, ("JSON",), b"{'single': 'quotes'}"),
    "not-utf8": (None, ("UTF-8",), b'{"a": "\xff"}'),
    "json-list": (None, ("JSON object",), b"[1, 2]"),
    "over-a-mib": (None, ("1 MiB",), b'{"a": "' + b"x" * (2 << 20) + b'"}'),
    # the Qwen2 and Mistral families read the same keys, and refuse what they do not implement by name
    "qwen2-sliding-window": (lambda c: c.update(QWEN2, use_sliding_window=True), ("use_sliding_window = True",)),
    "qwen2-sliding-layer": (lambda c: c.update(QWEN2, layer_types=["full_attention", "sliding_attention"]),
                            ("layer_types",)),
    "qwen2-yarn": (lambda c: c.update(QWEN2, rope_scaling={"rope_type": "yarn", "factor": 4.0}), ("rope_scaling",)),
    "qwen2-zero-layers": (lambda c: c.update(QWEN2, num_hidden_layers=0), ("num_hidden_layers = 0",)),
    "mistral-window-zero": (lambda c: c.update(MISTRAL, sliding_window=0), ("sliding_window = 0",)),
    "mistral-window-string": (lambda c: c.update(MISTRAL, sliding_window="4096"), ("sliding_window = '4096'",)),
    "mistral-window-bool": (lambda c: c.update(MISTRAL, sliding_window=True), ("sliding_window = True",)),
    "mistral-head-dim-odd": (lambda c: c.update(MISTRAL, head_dim=7), ("head_dim = 7",)),
    "mistral-head-dim-huge": (lambda c: c.update(MISTRAL, head_dim=10 ** 9), ("head_dim = 1000000000",)),
    "mistral-gelu": (lambda c: c.update(MISTRAL, hidden_act="gelu"), ("hidden_act = 'gelu'",)),
}
for _name, (_change, _words, *_raw) in HF_CONFIGS.items():
    CASES["broken-input" if _raw or _name.startswith(("bert", "arch", "layers-missing")) else "lies"][
        f"hf-config-{_name}"] = _config_case(_change, _words, *_raw)


@case("valid-input")
def hf_config_llama(d: Path, tok: Path) -> Expect:
    (d / "m").mkdir()
    (d / "m" / "config.json").write_text(json.dumps(LLAMA))
    return Expect(hf_job(d, d / "m"), 0)


@case("valid-input")
def hf_config_qwen2_and_mistral(d: Path, tok: Path) -> Expect:
    """A Mistral config with a window and its own head width renders (it was refused, Llama only, before)."""
    (d / "m").mkdir()
    (d / "m" / "config.json").write_text(json.dumps({**LLAMA, **MISTRAL, "sliding_window": 16, "head_dim": 8}))
    return Expect(hf_job(d, d / "m"), 0)


@case("non-regular")
def hf_config_dev_zero(d: Path, tok: Path) -> Expect:
    (d / "m").mkdir()
    (d / "m" / "config.json").symlink_to("/dev/zero")
    return Expect(hf_job(d, d / "m"), 2, [str(d / "m" / "config.json"), "character device"])


@case("non-regular")
def hf_config_fifo(d: Path, tok: Path) -> Expect:
    _fifo(d / "config.json")
    return Expect(hf_job(d, d / "config.json"), 2, [str(d / "config.json"), "FIFO"])


@case("non-regular")
def hf_config_folder_without_config(d: Path, tok: Path) -> Expect:
    (d / "m").mkdir()
    return Expect(hf_job(d, d / "m"), 2, [str(d / "m" / "config.json"), "no such file"])


# ---------------------------------------------------------------------------- memory and time bounds

def _frames(byte: bytes, frame_mib: int, count: int, tail: bytes = b"") -> bytes:
    """``count`` zstd frames of ``frame_mib`` MiB of one byte each: a small file, a huge expansion."""
    return zst(byte * (frame_mib << 20)) * count + (zst(tail) if tail else b"")


@case("bounds")
def zst_one_4_gib_line(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl.zst").write_bytes(_frames(b"a", 64, 64))
    return Expect(prepare(tok, d / "a.jsonl.zst", out=d / "out"), 2, [str(d / "a.jsonl.zst"), "--max-expansion"])


@case("bounds")
def zst_one_1_gib_line_expansion_raised(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl.zst").write_bytes(_frames(b"a", 64, 16))
    return Expect(prepare(tok, d / "a.jsonl.zst", out=d / "out", extra=["--max-expansion", "10000000"]), 2,
                  [str(d / "a.jsonl.zst") + ":1", "--max-document-bytes"])


@case("bounds")
def jsonl_200_mb_line(d: Path, tok: Path) -> Expect:
    with open(d / "a.jsonl", "wb") as f:
        f.write(b'{"text": "')
        for _ in range(200):
            f.write(b"w" * (1 << 20))
        f.write(b'"}\n')
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out"), 2, [str(d / "a.jsonl") + ":1", "--max-document-bytes"])


@case("bounds")
def jsonl_long_line_skipped(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(b'{"text": "' + b"w" * (9 << 20) + b'"}\n' + JSONL)
    return Expect(prepare(tok, d / "a.jsonl", out=d / "out", extra=["--errors", "skip"]), 0, ["50 documents"], ("out",))


@case("bounds")
def txt_paragraph_of_20_mb(d: Path, tok: Path) -> Expect:
    (d / "a.txt").write_bytes(b"a line of a paragraph that never ends\n" * ((20 << 20) // 38))
    return Expect(prepare(tok, d / "a.txt", out=d / "out"), 2, [str(d / "a.txt") + ":1", "--max-document-bytes"])


@case("bounds")
def gzip_bomb_of_zeros(d: Path, tok: Path) -> Expect:
    (d / "a.txt.gz").write_bytes(gzip.compress(b"\0" * (200 << 20), 9))
    return Expect(prepare(tok, d / "a.txt.gz", out=d / "out"), 2, [str(d / "a.txt.gz"), "--max-expansion"])


@case("bounds")
def gzip_bomb_of_newlines(d: Path, tok: Path) -> Expect:
    (d / "a.txt.gz").write_bytes(gzip.compress(b"\n" * (50 << 20), 9))
    return Expect(prepare(tok, d / "a.txt.gz", out=d / "out"), 2, [str(d / "a.txt.gz"), "--max-expansion"])


@case("bounds")
def zst_bomb_of_newlines_jsonl(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl.zst").write_bytes(_frames(b"\n", 64, 8))
    return Expect(prepare(tok, d / "a.jsonl.zst", out=d / "out", extra=["--errors", "skip"]), 2,
                  [str(d / "a.jsonl.zst"), "--max-expansion"])


@case("bounds")
def parquet_zst_read_whole(d: Path, tok: Path) -> Expect:
    (d / "a.parquet.zst").write_bytes(_frames(b"\0", 64, 5))
    return Expect(prepare(tok, d / "a.parquet.zst", out=d / "out", extra=["--max-expansion", "10000000"]), 2,
                  [str(d / "a.parquet.zst"), "decompress it first"])


@case("bounds")
def tokenizer_of_5m_entries(d: Path, tok: Path) -> Expect:
    (d / "a.jsonl").write_bytes(JSONL)
    with open(d / "tokenizer.json", "w") as f:
        f.write('{"version": "1.0", "model": {"type": "WordLevel", "unk_token": "<unk>", "vocab": {')
        for start in range(0, 5_000_000, 100_000):
            f.write(", ".join(f'"t{i}": {i}' for i in range(start, start + 100_000)) + (", " if start < 4_900_000 else ""))
        f.write("}}}")
    return Expect(prepare(d / "tokenizer.json", d / "a.jsonl", out=d / "out"), 2,
                  [str(d / "tokenizer.json"), "--max-vocab"])


@case("bounds")
def manifest_of_200k_shards(d: Path, tok: Path) -> Expect:
    (d / "p").mkdir()
    entry = {"tokens": 100, "documents": 1, "file": "x.bin", "index": "x.idx", "file_sha256": "0" * 64,
             "index_sha256": "0" * 64, "max_id": 5}
    with open(d / "p" / "manifest.json", "w") as f:
        f.write('{"format": "hpcx-tokens", "version": 1, "splits": {"train": {"shards": [')
        f.write(", ".join(json.dumps(dict(entry, file=f"s{i}.bin", index=f"s{i}.idx")) for i in range(200_000)))
        f.write("]}}}")
    return Expect(["data", "verify", str(d / "p")], 2, [str(d / "p" / "manifest.json"), "HPCX_MAX_SHARDS"])


def main(argv: list[str]) -> int:
    """Write the cases (of one class, or all) under a folder, one sub-folder each, with the command."""
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root, classes = Path(argv[0]), argv[1:] or list(CASES)
    tok = root / "tokenizer.json"
    if not tok.exists():
        from tests.tokens.corpus import train_tokenizer

        root.mkdir(parents=True, exist_ok=True)
        train_tokenizer(tok)
    for cls in classes:
        for name, make in CASES[cls].items():
            folder = root / cls / name
            folder.mkdir(parents=True)
            expect = make(folder, tok)
            (folder.parent / f"{name}.cmd").write_text(" ".join(["hpcx", *expect.argv]) + "\n")
    return 0


from tests.tokens import hostile_surfaces  # noqa: E402,F401  (registers issue 47's classes into CASES)

if __name__ == "__main__":  # through the module as imported, where hostile_surfaces registered its classes
    from tests.tokens.hostile import main as imported_main

    sys.exit(imported_main(sys.argv[1:]))
