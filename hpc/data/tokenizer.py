"""The tokenizer of a preparation: a local Hugging Face ``tokenizer.json`` (or a folder holding one),
loaded with ``tokenizers``; nothing is fetched. Its SHA-256, vocabulary size and EOS id go into the
manifest, so a run can name and export exactly the tokenizer its tokens came from."""

from __future__ import annotations

import hashlib
import os
import typing as tp
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc.core.config import load_json_bounded
from hpc.core.errors import UserError
from hpc.core.validate import check_regular, open_regular

# Where a folder's tokenizer_config.json names no EOS, the first of these in the vocabulary is it.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")


@dataclass(frozen=True)
class TokenizerInfo:
    """What the manifest records about the tokenizer."""

    path: str
    sha256: str
    vocab_size: int
    eos_id: int
    eos_token: str

    @property
    def dtype(self) -> str:
        """uint16 while every id fits in 16 bits, else uint32."""
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def to_dict(self) -> dict[str, tp.Any]:
        return asdict(self)


MAX_VOCAB = 1 << 20  # tokens of a tokenizer at most (--max-vocab); the largest published ones hold ~262k
MAX_FILE_BYTES = 48 << 20  # bytes of a tokenizer.json at most, or 48 per allowed token if that is more
# (parsed, a tokenizer takes ~12 times its file: 48 MiB stays under 600 MB; Llama 3's is 9 MB, Gemma 3's 33 MB)
EXPECTED = "a Hugging Face tokenizer.json or a folder holding one"


def tokenizer_file(path: str | Path) -> Path:
    """``tokenizer.json`` itself, or the one inside a folder: a regular file (a FIFO or a device is
    refused before it is opened)."""
    p = Path(os.path.abspath(os.path.expanduser(path)))
    if p.is_dir():
        p = p / "tokenizer.json"
    check_regular(p, f"--tokenizer {p}", EXPECTED, UserError)
    return p


def read_tokenizer(path: str | Path, max_vocab: int = MAX_VOCAB) -> tuple[Path, bytes, tp.Any]:
    """(file, its bytes, the ``tokenizers.Tokenizer``): read once, bounded in bytes and vocabulary; a
    file it cannot read is a UserError naming it."""
    file = tokenizer_file(path)
    limit = max(MAX_FILE_BYTES, 48 * max_vocab)
    with open_regular(file, f"--tokenizer {file}", EXPECTED, UserError) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError([f"{file}: over {limit:,} bytes: expected a tokenizer of at most {max_vocab:,} tokens "
                         "(raise --max-vocab)"])
    from tokenizers import Tokenizer  # lazy: tokenizers

    try:
        text = data.decode("utf-8")
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001  (tokenizers raises a plain Exception for every parse error)
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise UserError([f"{file}: not a tokenizer ({first}): expected {EXPECTED}"]) from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > max_vocab:
        raise UserError([f"{file}: {size:,} tokens: expected at most {max_vocab:,} (raise --max-vocab)"])
    return file, data, tok


def load_tokenizer(path: str | Path) -> tp.Any:
    """A ``tokenizers.Tokenizer`` from a local file (``read_tokenizer``)."""
    return read_tokenizer(path)[2]


def describe_tokenizer(path: str | Path, eos: str | None = None, max_vocab: int = MAX_VOCAB,
                       loaded: list | None = None) -> TokenizerInfo:
    """Path, hash, vocabulary and EOS of a tokenizer (``eos``: the EOS token's text, if given); the
    tokenizer, read once, is appended to ``loaded`` when given."""
    file, data, tok = read_tokenizer(path, max_vocab)
    name = eos or _config_eos(file.parent) or next((n for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    eos_id = tok.token_to_id(name) if name else None
    if eos_id is None or name is None:
        raise UserError([f"{file}: {'no token ' + repr(name) if name else 'no end-of-text token'} in the vocabulary: "
                         f"expected one of {', '.join(EOS_NAMES)}, or name it with --eos"])
    if loaded is not None:
        loaded.append(tok)
    return TokenizerInfo(str(file), hashlib.sha256(data).hexdigest(), tok.get_vocab_size(with_added_tokens=True),
                         eos_id, name)


def _config_eos(folder: Path) -> str | None:
    """``eos_token`` of a ``tokenizer_config.json`` beside the tokenizer, when there is one."""
    path = folder / "tokenizer_config.json"
    if not path.exists():
        return None
    with open_regular(path, str(path), "a regular JSON file", UserError) as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise UserError([f"{path}: over {MAX_FILE_BYTES:,} bytes: expected a tokenizer_config.json of a few KB"])
    doc = load_json_bounded(data, str(path), UserError)
    value = doc.get("eos_token") if isinstance(doc, dict) else None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
