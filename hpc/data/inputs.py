"""Documents out of input files: ``.txt``, ``.jsonl`` and ``.parquet``, each optionally ``.gz``/``.zst``.

A document is one paragraph of a ``.txt`` file (lines up to a blank line), one line of a ``.jsonl``
file (its ``text_key``), or one row of a ``.parquet`` file (its ``text_key`` column). A document is a
list of ``(text, counted)`` segments whose texts, joined, are what is tokenized: one counted segment
for plain text; for ``prompt-response`` a chat (or a prompt and response as a user and an assistant
turn) rendered with the tokenizer's chat template (``hpc.data.chat``), only the assistant's characters
counted, or, without a template, the prompt and the separator (not counted) and the response. Every
problem is a ``BadInput`` naming ``file:line`` and what was expected.
"""

from __future__ import annotations

import codecs
import glob
import io
import json
import os
import typing as tp
import zlib
from dataclasses import dataclass
from pathlib import Path

from hpc.core.errors import UserError
from hpc.core.validate import check_regular, open_regular

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
    separator: str = "\n"  # between a prompt and its response, without a chat template (``joined``)


class Renderer(tp.Protocol):
    """What renders chat rows (``hpc.data.chat.ChatRenderer``)."""

    def segments(self, messages: tp.Any, tools: tp.Any, where: str, key: str = "messages") -> Segments | BadInput:
        ...


def input_kind(path: str) -> tuple[str, str] | None:
    """(kind, compression) from the file name, e.g. ('.jsonl', '.zst'); None for other files."""
    name = path.lower()
    for comp in COMPRESSIONS[1:] + ("",):
        if name.endswith(comp):
            stem = name[:len(name) - len(comp)] if comp else name
            kind = next((k for k in KINDS if stem.endswith(k)), None)
            return (kind, comp) if kind else None
    return None


@dataclass(frozen=True)
class Limits:
    """What one input may hold (docs/data.md, "Bounds"): the bytes of one document (a .jsonl line, a
    .txt paragraph, a parquet cell) and how much a compressed input may expand. Both raised with
    ``hpcx data prepare`` options; memory then follows them."""

    document_bytes: int = 8 << 20  # --max-document-bytes
    expansion: int = 100  # --max-expansion: decompressed bytes per compressed byte (plus 1 MiB)
    parquet_bytes: int = 256 << 20  # a compressed .parquet is decompressed into memory, at most this


EXPECTED_INPUT = "a regular .txt, .jsonl or .parquet file (optionally .gz or .zst)"


def expand_inputs(args: tp.Sequence[str]) -> list[Path]:
    """Files, folders (searched recursively) and globs → a sorted list of absolute input files, each
    named as the user named it (a symlink keeps its own name: its kind comes from that name, as in the
    Hugging Face cache, where ``data.jsonl`` links to ``../blobs/3f2a…``)."""
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
        return {Path(os.path.abspath(p)) for p in path.rglob("*") if p.is_file() and input_kind(p.name)}
    if not input_kind(path.name):
        raise UserError([f"{path}: not a .txt, .jsonl or .parquet file (optionally .gz or .zst)"])
    check_regular(path, str(path), EXPECTED_INPUT, UserError)
    return {Path(os.path.abspath(path))}


CHUNK = 1 << 10  # compressed bytes per decompressor call: its output stays a few MB even for a bomb
DECODED = 1 << 16  # decompressed bytes handed on per read


class Decoded(io.RawIOBase):
    """The decompressed bytes of a ``.gz`` (every member) or ``.zst`` (every frame) file, read in
    bounded pieces; corrupt, truncated or over-expanding input is a ``UserError`` naming the file."""

    def __init__(self, raw: tp.BinaryIO, comp: str, name: str, limit: int):
        self.raw, self.comp, self.name, self.limit = raw, comp, name, limit
        self.pending, self.at, self.leftover, self.dec = memoryview(b""), 0, b"", self._new()
        self.total, self.ended, self.started = 0, False, False

    def _new(self) -> tp.Any:
        if self.comp == ".gz":
            return zlib.decompressobj(31)
        import zstandard  # lazy: zstandard

        return zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, buf: tp.Any) -> int:
        while self.at == len(self.pending) and not self.ended:
            self.pending, self.at = memoryview(self._more()), 0
        n = min(len(buf), len(self.pending) - self.at)
        buf[:n] = self.pending[self.at:self.at + n]
        self.at += n
        return n

    def _more(self) -> bytes:
        """The next decompressed piece (b"" while the decompressor needs input, or at the end)."""
        tail = getattr(self.dec, "unconsumed_tail", b"") if self.comp == ".gz" else b""
        data, self.leftover = tail or self.leftover or self.raw.read(CHUNK), b""
        if not data:
            self.ended = True
            if not self.dec.eof and self.started:
                raise self._bad("the file is truncated (it ends inside a compressed stream)")
            return b""
        if self.dec.eof:  # a next gzip member or zstd frame
            if not data.strip(b"\0"):
                return b""  # zero padding after the last member (tape blocks)
            self.dec = self._new()
        self.started = True
        try:
            out = self.dec.decompress(data, DECODED) if self.comp == ".gz" else self.dec.decompress(data)
        except Exception as exc:  # noqa: BLE001  (zlib.error, zstandard.ZstdError: both corrupt input)
            raise self._bad(f"corrupt {self.comp} data ({str(exc).splitlines()[0][:120]})") from None
        if self.dec.eof:
            self.leftover = self.dec.unused_data  # bytes after the end of a member: read again
        self.total += len(out)
        if self.total > self.limit:
            raise UserError([f"{self.name}: expands past {self.limit:,} bytes: expected at most --max-expansion "
                             "times its size (plus 1 MiB) of text; raise --max-expansion for such an input"])
        return out

    def _bad(self, problem: str) -> UserError:
        return UserError([f"{self.name}: {problem}: expected a whole {self.comp} file"])


def _kind_of(path: Path) -> tuple[str, str]:
    """(kind, compression) of an input file (``expand_inputs`` keeps only those)."""
    found = input_kind(path.name)
    if found is None:
        raise UserError([f"{path}: not a .txt, .jsonl or .parquet file (optionally .gz or .zst)"])
    return found


def open_binary(path: Path, limits: Limits = Limits()) -> tuple[tp.BinaryIO, tp.BinaryIO]:
    """(decompressed stream, raw file); the raw file's position is the progress through the input.
    A FIFO or device is refused before it is opened."""
    raw = open_regular(path, str(path), EXPECTED_INPUT, UserError)
    comp = _kind_of(path)[1]
    if not comp:
        return raw, raw
    size = os.fstat(raw.fileno()).st_size
    return io.BufferedReader(Decoded(raw, comp, str(path), limits.expansion * size + (1 << 20)), DECODED), raw


def read_documents(path: Path, fmt: Format, limits: Limits = Limits(),
                   chat: Renderer | None = None) -> tp.Iterator[tuple[Segments | BadInput, int]]:
    """Yield (segments or the BadInput of that document, raw bytes of the input read so far); ``chat``
    renders chat and prompt-response rows where the tokenizer has a chat template."""
    kind = _kind_of(path)[0]
    stream, raw = open_binary(path, limits)
    with raw, stream:
        try:
            if kind == ".parquet":
                yield from _parquet_documents(path, stream, raw, fmt, limits, chat)
            elif kind == ".jsonl":
                name = str(path)
                for line_no, text, pos in _lines(name, stream, raw, limits):
                    yield _json_document(name, line_no, text, fmt, chat), pos
            else:
                yield from _paragraphs(path, stream, raw, fmt, limits)
        except (OSError, EOFError) as exc:
            kind_name = _kind_of(path)[1] or "file"
            raise UserError([f"{path}: cannot read ({exc}): expected a readable {kind_name} stream"]) from None


TELL_EVERY = 256  # lines between two looks at the raw file's position (for the progress line)


def _lines(name: str, stream: tp.BinaryIO, raw: tp.BinaryIO,
           limits: Limits) -> tp.Iterator[tuple[int, str | BadInput, int]]:
    """(line number, text or BadInput, raw position, updated every few hundred lines) per line; a line
    longer than ``limits.document_bytes`` is a BadInput (read past in pieces, never held whole)."""
    pos, limit, line_no = 0, limits.document_bytes, 0
    readline = stream.readline
    while data := readline(limit + 1):
        line_no += 1
        if line_no == 1 and data.startswith(codecs.BOM_UTF8):  # a byte-order mark is no part of the text
            data = data[3:]
        if len(data) > limit and not data.endswith(b"\n"):
            while (rest := readline(limit)) and not rest.endswith(b"\n"):
                pass
            yield line_no, BadInput(f"{name}:{line_no}", f"a line of more than {limit:,} bytes: expected at most "
                                    "that (raise --max-document-bytes)"), pos
            continue
        try:
            text: str | BadInput = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            text = BadInput(f"{name}:{line_no}", f"byte 0x{data[exc.start]:02x} at column {exc.start + 1} is not "
                            "UTF-8: expected UTF-8 text")
        if line_no % TELL_EVERY == 0:
            pos = raw.tell()
        yield line_no, text, pos


def _json_document(name: str, line_no: int, text: str | BadInput, fmt: Format,
                   chat: Renderer | None = None) -> Segments | BadInput:
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
    return segments_of(obj, fmt, where, chat)


def segments_of(obj: dict, fmt: Format, where: str, chat: Renderer | None = None) -> Segments | BadInput:
    """The segments of one record (a JSON object or a parquet row)."""
    if fmt.kind == "text":
        value = obj.get(fmt.text_key)
        if not isinstance(value, str):
            return BadInput(where, f"{_found(obj, fmt.text_key)}: expected a string {fmt.text_key!r}")
        return [(value, True)]
    if fmt.messages_key in obj:
        if chat is None:
            return BadInput(where, f"a chat list {fmt.messages_key!r} and a tokenizer without a chat template (or "
                            "--chat-template none): expected a tokenizer whose chat_template renders it (in "
                            "tokenizer_config.json or chat_template.jinja), or prompt and response strings")
        return chat.segments(obj[fmt.messages_key], obj.get("tools"), where, fmt.messages_key)
    prompt, response = obj.get(fmt.prompt_key), obj.get(fmt.response_key)
    if not isinstance(prompt, str) or not isinstance(response, str):
        key = fmt.prompt_key if not isinstance(prompt, str) else fmt.response_key
        return BadInput(where, f"{_found(obj, key)}: expected strings {fmt.prompt_key!r} and "
                        f"{fmt.response_key!r}, or a chat list {fmt.messages_key!r}")
    if chat is not None:
        return chat.segments([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                             None, where)
    return joined(prompt, response, fmt.separator)


def joined(prompt: str, response: str, separator: str) -> Segments:
    """A prompt and its response without a chat template: the separator goes between them unless one of
    them is empty, the prompt ends with whitespace or the response begins with it."""
    glue = separator if prompt and response and not prompt[-1].isspace() and not response[0].isspace() else ""
    return [(prompt + glue, False), (response, True)]


def _found(obj: dict, key: str) -> str:
    return f"no key {key!r}" if key not in obj else f"{key!r} is a {type(obj[key]).__name__}"


def _paragraphs(path: Path, stream: tp.BinaryIO, raw: tp.BinaryIO, fmt: Format, limits: Limits) -> tp.Iterator[tuple]:
    """Plain text: one document per paragraph (lines up to a blank line); newlines are kept. A
    paragraph longer than ``limits.document_bytes`` is a BadInput naming its first line."""
    if fmt.kind != "text":
        raise UserError([f"{path}: a .txt file: expected .jsonl or .parquet for --format prompt-response"])
    lines: list[str] = []
    held, first, too_long = 0, 0, False
    for line_no, text, pos in _lines(str(path), stream, raw, limits):
        if isinstance(text, BadInput):
            yield text, pos
        elif text.strip():
            first = first or line_no
            held += len(text)
            too_long = too_long or held > limits.document_bytes
            if too_long:
                lines = []
            else:
                lines.append(text)
        elif lines or too_long:
            yield _paragraph(path, lines, first, too_long, limits), pos
            lines, held, first, too_long = [], 0, 0, False
    if lines or too_long:
        yield _paragraph(path, lines, first, too_long, limits), os.fstat(raw.fileno()).st_size


def _paragraph(path: Path, lines: list[str], first: int, too_long: bool, limits: Limits) -> Segments | BadInput:
    if too_long:
        return BadInput(f"{path}:{first}", f"a paragraph of more than {limits.document_bytes:,} characters: "
                        "expected at most that (a blank line ends a paragraph; raise --max-document-bytes)")
    return [("".join(lines).rstrip("\n"), True)]


def _parquet_documents(path: Path, stream: tp.BinaryIO, raw: tp.BinaryIO, fmt: Format,
                       limits: Limits, chat: Renderer | None = None) -> tp.Iterator[tuple]:
    """One document per row; columns read in batches (pyarrow), so memory stays bounded."""
    import pyarrow.parquet as pq  # lazy: pyarrow

    if stream is not raw:  # a compressed parquet file is not seekable: it is read whole, up to a bound
        data = stream.read(limits.parquet_bytes + 1)
        if len(data) > limits.parquet_bytes:
            raise UserError([f"{path}: decompresses past {limits.parquet_bytes:,} bytes: expected a plain .parquet "
                             "file (parquet compresses inside; decompress it first)"])
    try:
        table = pq.ParquetFile(raw if stream is raw else io.BytesIO(data))
    except Exception as exc:  # noqa: BLE001  (pyarrow raises its own ArrowInvalid for a file that is not parquet)
        raise UserError([f"{path}: not a parquet file ({exc}): expected a .parquet table"]) from None
    keys = [fmt.text_key] if fmt.kind == "text" else [fmt.prompt_key, fmt.response_key, fmt.messages_key]
    columns = [k for k in keys + ([] if fmt.kind == "text" else ["tools"]) if k in table.schema_arrow.names]
    if not set(columns) & set(keys):
        raise UserError([f"{path}: no column {' or '.join(map(repr, keys))}: expected it (see --text-key)"])
    row, total = 0, max(1, table.metadata.num_rows)
    for batch in table.iter_batches(batch_size=1024, columns=columns):
        for record in batch.to_pylist():
            row += 1
            obj = {k: v for k, v in record.items() if v is not None}
            yield segments_of(obj, fmt, f"{path}:row {row}", chat), raw_progress(raw, row, total)


def raw_progress(raw: tp.BinaryIO, row: int, total: int) -> int:
    """Bytes of the input counted as read after ``row`` of ``total`` rows (parquet reads by column)."""
    return os.fstat(raw.fileno()).st_size * row // total
