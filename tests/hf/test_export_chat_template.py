"""The Hugging Face export writes the chat template the run trained with (issue 44, item 6): a
``chat_template.jinja`` beside ``tokenizer_config.json`` (and ``additional_chat_templates/NAME.jinja``),
as transformers' ``save_pretrained`` writes them today, so that
``AutoTokenizer.from_pretrained(export).apply_chat_template`` gives the ids the run trained on.

Classes of defect, each with cases of its own:

- the export has no template, or not the trained one: a Llama 3 template read from
  ``chat_template.jinja``, a ChatML one with a ``tool_use`` twin read from ``tokenizer_config.json``'s
  list, a tokenizer folder whose template was edited after the data was prepared (the export writes the
  trained one, and leaves no stale ``chat_template`` in ``tokenizer_config.json``);
- a run whose data used no template gets one; a manifest from before the templates were recorded
  exports the folder's template only while its SHA-256 is the recorded one, else one line.

The tokenizers are built in the test (``tests.tokens.test_chat_template``), the run is a tiny Llama of
the export tests copied, and ``RUN/data.json`` is the trainer's own ``data_record`` of the prepared data.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from tests.extras import extra

transformers = extra("transformers")

from hpc.ckpt.hf import export_hf  # noqa: E402
from hpc.core.errors import CheckpointError  # noqa: E402
from hpc.core.spec import Data  # noqa: E402
from hpc.core.manifest import PREPARED  # noqa: E402
from trainer.tokens import data_record  # noqa: E402

from tests.hf.test_hf_export import LLAMA, trained  # noqa: E402
from tests.tokens.test_chat_template import (CHATML, CHATML_SPECIAL, LLAMA3, LLAMA_SPECIAL, TOOL_USE,  # noqa: E402
                                             build_tokenizer, chat_rows, conversation, documents, pair_rows,
                                             prepare)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    return trained(tmp_path_factory.mktemp("chat"), "llama", LLAMA)


def with_data(run: Path, prepared: Path, where: Path) -> Path:
    """A copy of ``run`` whose ``data.json`` is the trainer's record of ``prepared``."""
    copy = Path(shutil.copytree(run, where))
    (copy / "data.json").write_text(json.dumps(data_record(Data(source=str(prepared)), PREPARED)))
    return copy


def rows(seed: str) -> list[dict]:
    rng = random.Random(seed)
    return chat_rows(rng, "tool", 12) + pair_rows(rng, 6)


def assert_trained_ids(export: Path, prepared: Path, rows_: list[dict]) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(export))
    for row, (ids, _) in zip(rows_, documents(prepared), strict=True):
        assert hf.apply_chat_template(conversation(row), tools=row.get("tools"), tokenize=True,
                                      return_dict=False) == ids, row


def test_a_llama3_template_comes_back_as_chat_template_jinja(llama_run, tmp_path):
    tok = build_tokenizer(tmp_path / "tok", LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LLAMA3)
    data = rows("llama")
    prepared = prepare(tmp_path, tok, data)
    export_hf(with_data(llama_run, prepared, tmp_path / "run"), tmp_path / "hf")
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == LLAMA3
    assert "chat_template" not in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert_trained_ids(tmp_path / "hf", prepared, data)


def test_a_config_list_with_tool_use_comes_back_as_files(llama_run, tmp_path):
    templates = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOL_USE}]
    tok = build_tokenizer(tmp_path / "tok", CHATML_SPECIAL, None, "<|im_end|>", templates, jinja_file=False)
    assert isinstance(json.loads((tok / "tokenizer_config.json").read_text())["chat_template"], list)
    data = rows("chatml")
    prepared = prepare(tmp_path, tok, data)
    export_hf(with_data(llama_run, prepared, tmp_path / "run"), tmp_path / "hf")
    out = tmp_path / "hf"
    assert (out / "chat_template.jinja").read_text() == CHATML
    assert (out / "additional_chat_templates" / "tool_use.jinja").read_text() == TOOL_USE
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())
    assert_trained_ids(out, prepared, data)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert hf.chat_template == {"default": CHATML, "tool_use": TOOL_USE} or hf.chat_template == CHATML


def test_a_template_edited_after_prepare_exports_the_trained_one(llama_run, tmp_path):
    tok = build_tokenizer(tmp_path / "tok", LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LLAMA3)
    data = rows("edited")
    prepared = prepare(tmp_path, tok, data)
    (tok / "chat_template.jinja").write_text(CHATML)  # someone changed the tokenizer's folder since
    export_hf(with_data(llama_run, prepared, tmp_path / "run"), tmp_path / "hf")
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == LLAMA3
    assert_trained_ids(tmp_path / "hf", prepared, data)


def test_text_data_exports_no_template_file(llama_run, tmp_path):
    tok = build_tokenizer(tmp_path / "tok", LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LLAMA3)
    prepared = prepare(tmp_path, tok, pair_rows(random.Random(1), 6), "--chat-template", "none")
    assert json.loads((prepared / "manifest.json").read_text())["chat_template"] is None
    export_hf(with_data(llama_run, prepared, tmp_path / "run"), tmp_path / "hf")
    assert not (tmp_path / "hf" / "chat_template.jinja").exists()


def test_a_manifest_without_the_texts_checks_the_folders_digest(llama_run, tmp_path):
    tok = build_tokenizer(tmp_path / "tok", LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LLAMA3)
    data = rows("old")
    prepared = prepare(tmp_path, tok, data)
    manifest = json.loads((prepared / "manifest.json").read_text())
    del manifest["chat_template"]["templates"]  # as hpcx wrote manifests before this issue
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    run = with_data(llama_run, prepared, tmp_path / "run")
    export_hf(run, tmp_path / "hf")
    assert (tmp_path / "hf" / "chat_template.jinja").read_text() == LLAMA3
    assert_trained_ids(tmp_path / "hf", prepared, data)
    (tok / "chat_template.jinja").write_text(CHATML)
    with pytest.raises(CheckpointError) as info:
        export_hf(run, tmp_path / "hf2")
    assert len(info.value.messages) == 1 and "no longer holds" in info.value.messages[0]
    assert not (tmp_path / "hf2").exists()
