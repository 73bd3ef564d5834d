"""Fixtures of the data tests: one tokenizer per session (training it takes a second)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tokens.corpus import text_corpus, train_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("corpus") / "txt")
