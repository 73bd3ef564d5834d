"""The tokenizer of a preparation: a local Hugging Face ``tokenizer.json`` (or a folder holding one),
loaded with ``tokenizers``; nothing is fetched. Its SHA-256, vocabulary size and EOS id go into the
manifest, so a run can name and export exactly the tokenizer its tokens came from."""

from __future__ import annotations

import hashlib
import json
import typing as tp
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc.core.errors import UserError

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


def tokenizer_file(path: str | Path) -> Path:
    """``tokenizer.json`` itself, or the one inside a folder."""
    p = Path(path).expanduser().resolve()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise UserError([f"--tokenizer {path}: no such file: expected a Hugging Face tokenizer.json "
                         "or a folder holding one"])
    return p


def load_tokenizer(path: str | Path) -> tp.Any:
    """A ``tokenizers.Tokenizer`` from a local file; a file it cannot read is a UserError."""
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001  (tokenizers raises a plain Exception for every parse error)
        raise UserError([f"{file}: not a tokenizer ({str(exc).splitlines()[0]}): expected a Hugging Face "
                         "tokenizer.json"]) from None


def describe_tokenizer(path: str | Path, eos: str | None = None) -> TokenizerInfo:
    """Path, hash, vocabulary and EOS of a tokenizer (``eos``: the EOS token's text, if given)."""
    file = tokenizer_file(path)
    tok = load_tokenizer(file)
    name = eos or _config_eos(file.parent) or next((n for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    eos_id = tok.token_to_id(name) if name else None
    if eos_id is None or name is None:
        raise UserError([f"{file}: {'no token ' + repr(name) if name else 'no end-of-text token'} in the vocabulary: "
                         f"expected one of {', '.join(EOS_NAMES)}, or name it with --eos"])
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    return TokenizerInfo(str(file), digest, tok.get_vocab_size(with_added_tokens=True), eos_id, name)


def _config_eos(folder: Path) -> str | None:
    """``eos_token`` of a ``tokenizer_config.json`` beside the tokenizer, when there is one."""
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
