"""The hostile-input corpus of the data path (issue 35), generated: one class of defect per folder,
one case per sub-folder, never committed (the big ones are hundreds of MB once expanded).

    python -m tests.tokens.hostile OUT [CLASS]   # write the cases under OUT/CLASS/NAME/ to look at

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
    stdin_null: bool = True


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


def main(argv: list[str]) -> int:
    """Write the cases (of one class, or all) under a folder, one sub-folder each, with the command."""
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    root, classes = Path(argv[0]), argv[1:] or list(CLASSES)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
