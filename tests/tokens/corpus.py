"""Corpora and tokenizers the data tests make for themselves: text from the Python standard
library's own source files, and a small byte-level BPE tokenizer trained on it with ``tokenizers``.
Nothing is downloaded."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

VOCAB = 600


def stdlib_sources(count: int, start: int = 0) -> list[Path]:
    """``count`` of the standard library's top-level .py files, sorted by name."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[start:start + count]


def text_corpus(folder: Path, count: int = 12) -> Path:
    """``count`` .txt files (standard-library sources) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for src in stdlib_sources(count):
        (folder / f"{src.stem}.txt").write_text(src.read_text(encoding="utf-8"), encoding="utf-8")
    return folder


def train_tokenizer(path: Path, files: list[Path] | None = None, vocab: int = VOCAB) -> Path:
    """A byte-level BPE tokenizer with ``<|endoftext|>`` (id 1), saved as ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(f) for f in (files or stdlib_sources(4))], trainer)
    tok.save(str(path))
    return path


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path
