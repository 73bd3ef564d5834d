"""Documents out of input files: ``.txt``, ``.jsonl`` and ``.parquet``, each optionally ``.gz``/``.zst``.

A document is one paragraph of a ``.txt`` file (lines up to a blank line), one line of a ``.jsonl``
file (its ``text_key``), or one row of a ``.parquet`` file (its ``text_key`` column). A document is a
list of ``(text, counted)`` segments: one counted segment for plain text; for ``prompt-response``
the prompt (or the chat's non-assistant turns) is not counted in the loss. Every problem is a
``BadInput`` naming ``file:line`` and what was expected.
"""

from __future__ import annotations

import glob
import io
import json
import os
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc.core.errors import UserError

KINDS = (".txt", ".jsonl", ".parquet")
COMPRESSIONS = ("", ".gz", ".zst")
Segments = list[tuple[str, bool]]


class BadInput(UserError):
    """One document that cannot be read: ``where`` is ``file:line``."""

    def __init__(self, where: str, problem: str):
        self.where, self.problem = where, problem
        super().__init__(f"{where}: {problem}")

    def __reduce__(self) -> tuple:  # raised in a worker process, re-raised in the parent
        return BadInput, (self.where, self.problem)


@dataclass(frozen=True)
class Format:
    """How documents are read: plain text, or prompt and response (two keys, or a chat list)."""

    kind: str = "text"  # text | prompt-response
    text_key: str = "text"
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"


def input_kind(path: str) -> tuple[str, str] | None:
    """(kind, compression) from the file name, e.g. ('.jsonl', '.zst'); None for other files."""
    name = path.lower()
    for comp in COMPRESSIONS[1:] + ("",):
        if name.endswith(comp):
            stem = name[:len(name) - len(comp)] if comp else name
            kind = next((k for k in KINDS if stem.endswith(k)), None)
            return (kind, comp) if kind else None
    return None


def expand_inputs(args: tp.Sequence[str]) -> list[Path]:
    """Files, folders (searched recursively) and globs → a sorted list of absolute input files."""
    found: set[Path] = set()
    for arg in args:
        matches = sorted(glob.glob(os.path.expanduser(arg), recursive=True)) if glob.has_magic(arg) else [arg]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise UserError([f"{arg}: no such file or folder: expected .txt, .jsonl or .parquet inputs"])
        for m in matches:
            found |= _files_under(Path(m))
    if not found:
        raise UserError([f"{' '.join(args)}: no .txt, .jsonl or .parquet files (optionally .gz/.zst) found"])
    return sorted(found)


def _files_under(path: Path) -> set[Path]:
    if path.is_dir():
        return {p.resolve() for p in path.rglob("*") if p.is_file() and input_kind(p.name)}
    if not input_kind(path.name):
        raise UserError([f"{path}: not a .txt, .jsonl or .parquet file (optionally .gz or .zst)"])
    return {path.resolve()}


def _kind_of(path: Path) -> tuple[str, str]:
    """(kind, compression) of an input file (``expand_inputs`` keeps only those)."""
    found = input_kind(path.name)
    if found is None:
        raise UserError([f"{path}: not a .txt, .jsonl or .parquet file (optionally .gz or .zst)"])
    return found


def open_binary(path: Path) -> tuple[tp.BinaryIO, tp.BinaryIO]:
    """(decompressed stream, raw file); the raw file's position is the progress through the input."""
    raw = open(path, "rb")
    comp = _kind_of(path)[1]
    if comp == ".gz":
        import gzip

        return tp.cast(tp.BinaryIO, gzip.GzipFile(fileobj=raw)), raw  # typeshed: a GzipFile is no BinaryIO
    if comp == ".zst":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw), raw
    return raw, raw


def read_documents(path: Path, fmt: Format) -> tp.Iterator[tuple[Segments | BadInput, int]]:
    """Yield (segments or the BadInput of that document, raw bytes of the input read so far)."""
    kind = _kind_of(path)[0]
    stream, raw = open_binary(path)
    with raw, stream:
        try:
            if kind == ".parquet":
                yield from _parquet_documents(path, stream, raw, fmt)
            elif kind == ".jsonl":
                name = str(path)
                for line_no, text, pos in _lines(name, stream, raw):
                    yield _json_document(name, line_no, text, fmt), pos
            else:
                yield from _paragraphs(path, stream, raw, fmt)
        except (OSError, EOFError) as exc:
            kind_name = _kind_of(path)[1] or "file"
            raise UserError([f"{path}: cannot read ({exc}): expected a readable {kind_name} stream"]) from None


TELL_EVERY = 256  # lines between two looks at the raw file's position (for the progress line)


def _lines(name: str, stream: tp.BinaryIO, raw: tp.BinaryIO) -> tp.Iterator[tuple[int, str | BadInput, int]]:
    """(line number, text or BadInput, raw position, updated every few hundred lines) per line."""
    buffered = io.BufferedReader(stream) if not isinstance(stream, io.BufferedIOBase) else stream  # type: ignore[type-var]  # a raw stream
    pos = 0
    for line_no, data in enumerate(buffered, 1):
        try:
            text: str | BadInput = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            text = BadInput(f"{name}:{line_no}", f"byte 0x{data[exc.start]:02x} at column {exc.start + 1} is not "
                            "UTF-8: expected UTF-8 text")
        if line_no % TELL_EVERY == 0:
            pos = raw.tell()
        yield line_no, text, pos


def _json_document(name: str, line_no: int, text: str | BadInput, fmt: Format) -> Segments | BadInput:
    if isinstance(text, BadInput):
        return text
    where = f"{name}:{line_no}"
    if not text.strip():
        return BadInput(where, "an empty line: expected one JSON object per line")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        return BadInput(where, f"not JSON ({getattr(exc, 'msg', 'nested too deep')}): expected one JSON object per line")
    if not isinstance(obj, dict):
        return BadInput(where, f"a JSON {type(obj).__name__}: expected one JSON object per line")
    return segments_of(obj, fmt, where)


def segments_of(obj: dict, fmt: Format, where: str) -> Segments | BadInput:
    """The segments of one record (a JSON object or a parquet row)."""
    if fmt.kind == "text":
        value = obj.get(fmt.text_key)
        if not isinstance(value, str):
            return BadInput(where, f"{_found(obj, fmt.text_key)}: expected a string {fmt.text_key!r}")
        return [(value, True)]
    if fmt.messages_key in obj:
        return _chat_segments(obj[fmt.messages_key], fmt, where)
    prompt, response = obj.get(fmt.prompt_key), obj.get(fmt.response_key)
    if not isinstance(prompt, str) or not isinstance(response, str):
        key = fmt.prompt_key if not isinstance(prompt, str) else fmt.response_key
        return BadInput(where, f"{_found(obj, key)}: expected strings {fmt.prompt_key!r} and "
                        f"{fmt.response_key!r}, or a chat list {fmt.messages_key!r}")
    return [(prompt, False), (response, True)]


def _found(obj: dict, key: str) -> str:
    return f"no key {key!r}" if key not in obj else f"{key!r} is a {type(obj[key]).__name__}"


def _chat_segments(messages: tp.Any, fmt: Format, where: str) -> Segments | BadInput:
    """A chat list of ``{"role", "content"}``: each turn is ``role: content`` on its own line; only
    the assistant's contents count in the loss."""
    expected = f"expected {fmt.messages_key!r} to be a list of {{\"role\": …, \"content\": …}} strings"
    if not isinstance(messages, list) or not messages:
        return BadInput(where, f"{fmt.messages_key!r} is not a non-empty list: {expected}")
    out: Segments = []
    for i, turn in enumerate(messages):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            return BadInput(where, f"message {i} has no string role and content: {expected}")
        out += [(("\n" if i else "") + f"{turn['role']}: ", False), (turn["content"], turn["role"] == "assistant")]
    if not any(counted for _, counted in out):
        return BadInput(where, f"no assistant message: {expected}, one with role 'assistant'")
    return out


def _paragraphs(path: Path, stream: tp.BinaryIO, raw: tp.BinaryIO, fmt: Format) -> tp.Iterator[tuple]:
    """Plain text: one document per paragraph (lines up to a blank line); newlines are kept."""
    if fmt.kind != "text":
        raise UserError([f"{path}: a .txt file: expected .jsonl or .parquet for --format prompt-response"])
    lines: list[str] = []
    for _, text, pos in _lines(str(path), stream, raw):
        if isinstance(text, BadInput):
            yield text, pos
        elif text.strip():
            lines.append(text)
        elif lines:
            yield [("".join(lines).rstrip("\n"), True)], pos
            lines = []
    if lines:
        yield [("".join(lines).rstrip("\n"), True)], raw.tell()


def _parquet_documents(path: Path, stream: tp.BinaryIO, raw: tp.BinaryIO, fmt: Format) -> tp.Iterator[tuple]:
    """One document per row; columns read in batches (pyarrow), so memory stays bounded."""
    import pyarrow.parquet as pq

    try:
        # a compressed parquet file is not seekable: it is read whole (parquet compresses inside anyway)
        table = pq.ParquetFile(raw if stream is raw else io.BytesIO(stream.read()))
    except Exception as exc:  # noqa: BLE001  (pyarrow raises its own ArrowInvalid for a file that is not parquet)
        raise UserError([f"{path}: not a parquet file ({exc}): expected a .parquet table"]) from None
    keys = [fmt.text_key] if fmt.kind == "text" else [fmt.prompt_key, fmt.response_key, fmt.messages_key]
    columns = [k for k in keys if k in table.schema_arrow.names]
    if not columns:
        raise UserError([f"{path}: no column {' or '.join(map(repr, keys))}: expected it (see --text-key)"])
    row, total = 0, max(1, table.metadata.num_rows)
    for batch in table.iter_batches(batch_size=1024, columns=columns):
        for record in batch.to_pylist():
            row += 1
            obj = {k: v for k, v in record.items() if v is not None}
            yield segments_of(obj, fmt, f"{path}:row {row}"), raw_progress(raw, row, total)


def raw_progress(raw: tp.BinaryIO, row: int, total: int) -> int:
    """Bytes of the input counted as read after ``row`` of ``total`` rows (parquet reads by column)."""
    return os.fstat(raw.fileno()).st_size * row // total
