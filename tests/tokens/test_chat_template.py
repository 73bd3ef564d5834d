"""Chat templates in ``hpcx data prepare`` (issue 32, item 2): every row's token ids are transformers'
own — ``apply_chat_template(…, tokenize=True)`` for chats and prompt-response rows where the tokenizer
has a template, ``AutoTokenizer(text)`` (then the EOS) elsewhere — and the loss counts the assistant's
tokens only, as ``return_assistant_tokens_mask`` marks them.

The tokenizers are built here (byte-level BPE trained on the standard library's sources, Llama 3's or
ChatML's special tokens, a BOS post-processor for the Llama one) and saved with transformers'
``save_pretrained``; the templates are Meta's Llama 3 template and Qwen's ChatML one, each also in a
twin that marks the assistant's turns with ``{% generation %}`` (rendering the same characters).
"""

from __future__ import annotations

import json
import random
import shutil
import typing as tp
from pathlib import Path

import numpy as np
import pytest

from tests.extras import extra
from tests.tokens.corpus import stdlib_sources, write_jsonl
from tests.tokens.test_prepare import run_prepare

transformers = extra("transformers")

# Meta-Llama-3-8B-Instruct's template, as its tokenizer_config.json holds it.
LLAMA3 = (r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          r"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          r"'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          r"{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          r"{% endif %}")
LLAMA3_MARKED = (r"{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
                 r"'<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
                 r"{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
                 r"{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                 r"{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2.5's ChatML template without its tool branch: a default system turn where the chat has none.
CHATML = (r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
          r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_MARKED = (r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
                 r"{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}"
                 r"{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}{% else %}"
                 r"{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                 r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A tool_use template beside the default one (the list form of tokenizer_config.json): tools, tool calls
# and table contents as JSON.
TOOL_USE = (r"{% if tools %}{{ '<|im_start|>system\nTools: ' + tools | tojson + '<|im_end|>\n' }}{% endif %}"
            r"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
            r"{% if message.tool_calls is defined %}{% for call in message.tool_calls %}"
            r"{{ '<tool_call>' + call.function | tojson + '</tool_call>' }}{% endfor %}"
            r"{% elif message.content is mapping %}{{ message.content | tojson }}{% else %}{{ message.content }}"
            r"{% endif %}{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
            r"{% endif %}")
# Llama 2's rule: roles alternate, or the template raises.
ALTERNATING = (r"{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               r"{% endif %}{{ message['role'] + ': ' + message['content'] + eos_token }}{% endfor %}")

LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|python_tag|>"]
CHATML_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
UNICODE = ["naïve café", "漢字かな交じり文", "🎉🚀 emoji", "עברית ומספרים 123", "Ελληνικά", "tab\tand\nnewline",
           "  leading and trailing spaces  ", "zero\u200bwidth", "ﬁ ligature", "Ω≈ç√∫"]


def build_tokenizer(folder: Path, specials: list[str], bos: str | None, eos: str, template: tp.Any = None,
                    jinja_file: bool = True) -> Path:
    """A byte-level BPE tokenizer saved with ``save_pretrained`` (``bos``: a post-processor adding it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.read_text(encoding="utf-8") for p in stdlib_sources(3)] + UNICODE * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                                pad_token=specials[1] if bos else None, chat_template=template)
    fast.save_pretrained(str(folder), save_jinja_files=jinja_file)
    return folder


def chat_rows(rng: random.Random, tool_role: str, count: int = 48) -> list[dict]:
    """Varied conversations: system turns or none, one to six exchanges, unicode, empty and whitespace
    contents, text spelling a control token, a tool turn, long contents, extra keys, null keys."""
    words = "the model answers each question with care and a short example when it helps".split()

    def text(i: int) -> str:
        kind = rng.randrange(8)
        if kind == 0:
            return ""
        if kind == 1:
            return rng.choice(UNICODE)
        if kind == 2:
            return " ".join(rng.choice(words) for _ in range(rng.randrange(200, 900)))  # a long turn
        if kind == 3:
            return f"  {rng.choice(words)}\n\n"
        if kind == 4:
            return f"say <|eot_id|> or <|im_end|> {i}"
        return " ".join(rng.choice(words) for _ in range(rng.randrange(1, 25))) + f" {i}?"

    rows = []
    for i in range(count):
        messages = [{"role": "system", "content": text(i)}] if i % 3 == 0 else []
        for turn in range(1 + i % 6):
            messages.append({"role": "user", "content": text(i), **({"name": "ann"} if turn == 1 else {})})
            if turn == 2 and i % 4 == 1:
                messages.append({"role": tool_role, "content": json.dumps({"result": i})})
            messages.append({"role": "assistant", "content": text(i), "tool_calls": None})
        if i % 5 == 4:
            messages.append({"role": "user", "content": "one more?"})  # ends with a user turn
        rows.append({"messages": messages})
    return rows


def pair_rows(rng: random.Random, count: int = 24) -> list[dict]:
    ends = ["", " ", "\n", "### Response:\n"]
    return [{"prompt": f"Question {i}: {rng.choice(UNICODE)}{ends[i % 4]}",
             "response": [" It is", "Fine.", "", "\nYes"][i % 4] + f" {2 * i}."} for i in range(count)]


def documents(folder: Path) -> list[tuple[list[int], list[int] | None]]:
    """(ids, mask) of every document of a prepared folder's train split, in order."""
    manifest = json.loads((folder / "manifest.json").read_text())
    out = []
    for shard in manifest["splits"]["train"]["shards"]:
        tokens = np.fromfile(folder / shard["file"], dtype=manifest["dtype"])
        offsets = np.fromfile(folder / shard["index"], dtype=np.uint64).astype(int)
        mask = np.fromfile(folder / shard["mask"], dtype=np.uint8) if manifest["masked"] else None
        for a, b in zip(offsets[:-1], offsets[1:]):
            out.append((tokens[a:b].tolist(), None if mask is None else mask[a:b].tolist()))
    return out


def prepare(tmp: Path, tok: Path, rows: list[dict], *args: str, name: str = "rows") -> Path:
    write_jsonl(tmp / f"{name}.jsonl", rows)
    code, out = run_prepare(str(tmp / f"{name}.jsonl"), "--tokenizer", str(tok), "--out", str(tmp / f"{name}-out"),
                            "--format", "prompt-response", *args)
    assert code == 0, out
    return tmp / f"{name}-out"


def conversation(row: dict) -> list[dict]:
    if "messages" in row:
        return row["messages"]
    return [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]


def reference(hf: tp.Any, row: dict, marked: str | None = None) -> tuple[list[int], list[int] | None]:
    """transformers' ids of a row, and its assistant mask from the ``{% generation %}`` twin ``marked``."""
    ids = hf.apply_chat_template(conversation(row), tools=row.get("tools"), tokenize=True, return_dict=False)
    if marked is None:
        return ids, None
    out = hf.apply_chat_template(conversation(row), tools=row.get("tools"), chat_template=marked, tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"] == ids  # the twin renders the same characters
    return ids, out["assistant_masks"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("llama3"), LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>",
                           LLAMA3)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("chatml"), CHATML_SPECIAL, None, "<|im_end|>", CHATML,
                           jinja_file=False)


@pytest.mark.parametrize("which", ["llama", "chatml"])
@pytest.mark.parametrize("marked", [False, True])
def test_every_row_is_what_apply_chat_template_gives(which, marked, request, tmp_path):
    """Ids equal ``apply_chat_template(tokenize=True)`` for every row (BOS included for Llama 3), and the
    mask equals transformers' assistant mask, whether hpcx finds the assistant's turns by rendering
    prefixes (the published template) or by ``{% generation %}`` (the twin)."""
    tok = request.getfixturevalue(which)
    twin = LLAMA3_MARKED if which == "llama" else CHATML_MARKED
    if marked:
        tok = Path(shutil.copytree(tok, tmp_path / "tok"))
        (tok / "chat_template.jinja").write_text(twin, encoding="utf-8")  # ahead of tokenizer_config.json's
    hf = transformers.AutoTokenizer.from_pretrained(str(tok))
    rng = random.Random(which)
    rows = chat_rows(rng, "ipython" if which == "llama" else "tool") + pair_rows(rng)
    rng.shuffle(rows)
    docs = documents(prepare(tmp_path, tok, rows))
    assert len(docs) == len(rows)
    record = json.loads((tmp_path / "rows-out/manifest.json").read_text())["chat_template"]
    assert record["generation"] is marked and record["source"].endswith(
        "chat_template.jinja" if marked or which == "llama" else "tokenizer_config.json: chat_template")
    bos = hf.convert_tokens_to_ids("<|begin_of_text|>")
    for i, (row, (ids, mask)) in enumerate(zip(rows, docs)):
        want, want_mask = reference(hf, row, twin)
        assert ids == want, f"row {i}: {row}"
        assert mask == want_mask, f"row {i}: {row}"
        assert (ids[0] == bos) == (which == "llama")
        assert hf.decode([t for t, m in zip(ids, mask) if m]).count(hf.eos_token) >= 1  # each turn's end counts


def test_plain_text_is_what_the_tokenizer_gives_then_the_eos(llama, tmp_path):
    hf = transformers.AutoTokenizer.from_pretrained(str(llama))
    texts = UNICODE + ["", "a <|eot_id|> inside", "x" * 5000, " ".join(UNICODE) * 30]
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    code, out = run_prepare(str(tmp_path / "t.jsonl"), "--tokenizer", str(llama), "--out", str(tmp_path / "o"))
    assert code == 0, out
    docs = documents(tmp_path / "o")
    eos = hf.eos_token_id
    for text, (ids, mask) in zip(texts, docs, strict=True):
        want = hf(text)["input_ids"]
        assert want[0] == hf.bos_token_id and mask is None
        assert ids == want + ([eos] if want[-1] != eos else []), text
    assert json.loads((tmp_path / "o/manifest.json").read_text())["chat_template"] is None


def test_prompt_response_without_a_template(tmp_path):
    """No template: the prompt, the separator (unless whitespace is there already), the response, as
    ``AutoTokenizer`` tokenizes them together (BOS included), then the EOS; the response and EOS count."""
    tok = build_tokenizer(tmp_path / "base", LLAMA_SPECIAL, "<|begin_of_text|>", "<|end_of_text|>")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok))
    assert hf.chat_template is None
    rows = pair_rows(random.Random(1))
    for separator, name in (("\n", "newline"), ("", "glued"), ("\n\n### Answer: ", "custom")):
        docs = documents(prepare(tmp_path, tok, rows, "--separator", separator, name=name))
        for row, (ids, mask) in zip(rows, docs, strict=True):
            p, r = row["prompt"], row["response"]
            glue = separator if p and r and not p[-1].isspace() and not r[0].isspace() else ""
            enc = hf(p + glue + r, return_offsets_mapping=True)
            assert ids == enc["input_ids"] + [hf.eos_token_id]
            want = [int(e > len(p + glue)) for _, e in enc["offset_mapping"]] + [1]
            assert mask == want and ids[0] == hf.bos_token_id
            assert r.strip() in hf.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)


def test_templates_from_the_config_list_with_tool_use(tmp_path):
    """``chat_template`` as tokenizer_config.json's list of named templates: ``default`` for plain rows,
    ``tool_use`` for a row that carries tools (as transformers picks them)."""
    tok = build_tokenizer(tmp_path / "tools", CHATML_SPECIAL, None, "<|im_end|>",
                          {"default": CHATML, "tool_use": TOOL_USE}, jinja_file=False)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    assert isinstance(config["chat_template"], list) and not (tok / "chat_template.jinja").exists()
    hf = transformers.AutoTokenizer.from_pretrained(str(tok))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "number", "ünï": "çødé"}}}]
    rows = [dict(r, **({"tools": tools} if i % 2 else {})) for i, r in enumerate(chat_rows(random.Random(2), "tool", 12))]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "ünï": "ø"}}}
    rows += [{"tools": tools, "messages": [{"role": "user", "content": f"add {i}"},
                                           {"role": "assistant", "content": None, "tool_calls": [call] * (1 + i % 2)},
                                           {"role": "tool", "content": {"sum": i}},
                                           {"role": "assistant", "content": f"It is {i}."}]} for i in range(4)]
    for row, (ids, _) in zip(rows, documents(prepare(tmp_path, tok, rows)), strict=True):
        assert ids == reference(hf, row)[0]
    assert json.loads((tmp_path / "rows-out/manifest.json").read_text())["chat_template"]["source"].endswith(
        "tokenizer_config.json: chat_template")


def test_refusals_are_one_line(llama, chatml, tmp_path):
    """A template that raises, a message without role or content, chats without a template, a prefix
    that renders differently, a template that does not compile: each one line, exit 2."""
    def refused(tok: Path, rows: list, *args: str) -> str:
        write_jsonl(tmp_path / "r.jsonl", rows)
        code, out = run_prepare(str(tmp_path / "r.jsonl"), "--tokenizer", str(tok), "--out", str(tmp_path / "o"),
                                "--format", "prompt-response", *args)
        assert code == 2 and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
        assert not (tmp_path / "o").exists()
        return out

    alt = build_tokenizer(tmp_path / "alt", CHATML_SPECIAL, None, "<|im_end|>", ALTERNATING)
    out = refused(alt, [{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                      {"role": "assistant", "content": "c"}]}])
    assert "r.jsonl:1: the chat template" in out and "Conversation roles must alternate" in out
    assert "message 1 has no string 'role'" in refused(llama, [{"messages": [{"role": "user", "content": "a"},
                                                                             {"content": "b"}]}])
    assert "message 0 (user) has no 'content'" in refused(llama, [{"messages": [{"role": "user"}]}])
    assert "no assistant message" in refused(llama, [{"messages": [{"role": "user", "content": "a"}]}])
    assert "not a non-empty list" in refused(llama, [{"messages": []}])
    plain = build_tokenizer(tmp_path / "plain", LLAMA_SPECIAL, "<|begin_of_text|>", "<|end_of_text|>")
    chat = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    assert "tokenizer without a chat template" in refused(plain, chat)
    assert "--chat-template none" in refused(llama, chat, "--chat-template", "none")
    assert "has no chat template" in refused(plain, [{"prompt": "a", "response": "b"}], "--chat-template", "tokenizer")
    # ChatML adds its system turn only before a first message that is not one: an assistant turn first
    # renders differently alone than with what follows
    out = refused(chatml, [{"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}])
    assert "message 0 (assistant): the chat template renders the conversation up to it differently" in out
    broken = build_tokenizer(tmp_path / "broken", CHATML_SPECIAL, None, "<|im_end|>", "{% for m in messages %}")
    assert "chat_template.jinja: line 1:" in refused(broken, chat)


def test_bounds_hold_for_rendered_chats(llama, tmp_path):
    """A chat whose rendering passes --max-document-bytes (+1 MiB) and a chat of many turns (its prefixes
    rendered past the budget) are bad input; --errors=skip leaves them out and keeps the rest."""
    turn = "w " * 1000
    many = {"messages": [{"role": r, "content": turn} for _ in range(300) for r in ("user", "assistant")]}
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    write_jsonl(tmp_path / "b.jsonl", [good, many, good])
    code, out = run_prepare(str(tmp_path / "b.jsonl"), "--tokenizer", str(llama), "--out", str(tmp_path / "o"),
                            "--format", "prompt-response", "--max-document-bytes", str(1 << 21), "--errors", "skip")
    assert code == 0, out
    manifest = json.loads((tmp_path / "o/manifest.json").read_text())
    assert manifest["skipped"]["count"] == 1 and "b.jsonl:2: 600 messages" in manifest["skipped"]["first"][0]
    assert "{% generation %}" in manifest["skipped"]["first"][0]
    assert manifest["splits"]["train"]["documents"] == 2
    echo = build_tokenizer(tmp_path / "echo", CHATML_SPECIAL, None, "<|im_end|>",
                           "{% for m in messages %}{% for i in range(600) %}{{ m['content'] }}{% endfor %}{% endfor %}")
    write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user", "content": "x" * 3000},
                                                     {"role": "assistant", "content": "y"}]}])
    code, out = run_prepare(str(tmp_path / "e.jsonl"), "--tokenizer", str(echo), "--out", str(tmp_path / "o2"),
                            "--format", "prompt-response", "--max-document-bytes", "4096")
    assert code == 2 and f"e.jsonl:1: the chat renders past {4096 + (1 << 20):,} characters" in out, out


def test_parquet_rows_and_workers_give_the_same_ids(llama, tmp_path):
    """Chats in a .parquet file (a struct column: keys a row lacks read back as nulls, dropped as
    transformers drops them) are the .jsonl rows' ids, with one worker or two."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = chat_rows(random.Random(3), "ipython", 20)
    hf = transformers.AutoTokenizer.from_pretrained(str(llama))
    (tmp_path / "in").mkdir()
    half = len(rows) // 2
    pq.write_table(pa.Table.from_pylist(rows[:half]), tmp_path / "in/a.parquet")
    write_jsonl(tmp_path / "in/b.jsonl", rows[half:])
    outs = []
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        code, text = run_prepare(str(tmp_path / "in"), "--tokenizer", str(llama), "--out", str(out), "--format",
                                 "prompt-response", "--workers", workers, "--group-bytes", "1")
        assert code == 0, text
        outs.append(documents(out))
    assert outs[0] == outs[1]
    for row, (ids, mask) in zip(rows, outs[0], strict=True):
        assert (ids, mask) == reference(hf, row, LLAMA3_MARKED)


def test_a_changed_template_is_not_resumed(llama, tmp_path):
    """The plan holds the template: the same command after the template changed refuses to mix the two."""
    tok = Path(shutil.copytree(llama, tmp_path / "tok"))
    rows = chat_rows(random.Random(4), "ipython", 4)
    out = prepare(tmp_path, tok, rows)
    (tok / "chat_template.jinja").write_text(LLAMA3_MARKED, encoding="utf-8")
    code, text = run_prepare(str(tmp_path / "rows.jsonl"), "--tokenizer", str(tok), "--out", str(out),
                             "--format", "prompt-response")
    assert code == 2 and "prepared before with other chat_template" in text, text


def test_a_special_token_the_tokenizer_lacks_is_refused(chatml, tmp_path):
    tok = Path(shutil.copytree(chatml, tmp_path / "tok"))
    config = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps(dict(config, bos_token="<s>")))
    write_jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "response": "b"}])
    code, text = run_prepare(str(tmp_path / "r.jsonl"), "--tokenizer", str(tok), "--out", str(tmp_path / "o"),
                             "--format", "prompt-response")
    assert code == 2 and "bos_token '<s>' is not a token of the tokenizer" in text, text


def test_strftime_now_renders_the_plans_date(tmp_path):
    """A template that asks for the date (Llama 3.2's) renders the date the plan was made in every group
    and on resume, so the bytes do not depend on when a group ran."""
    from hpc.data.chat import ChatRenderer, same_plan

    dated = "{{ 'Today: ' + strftime_now('%d %b %Y') + '\\n' }}" + CHATML
    tok = build_tokenizer(tmp_path / "dated", CHATML_SPECIAL, None, "<|im_end|>", dated)
    out = prepare(tmp_path, tok, chat_rows(random.Random(5), "tool", 3))
    plan = json.loads((out / ".prepare/plan.json").read_text())
    entry = plan["chat_template"]
    renderer = ChatRenderer(dict(entry, now="2024-07-26T10:00:00"))
    text = "".join(t for t, _ in renderer.segments([{"role": "user", "content": "a"},
                                                   {"role": "assistant", "content": "b"}], None, "x"))
    assert text.startswith("Today: 26 Jul 2024\n<|im_start|>system")
    later = dict(plan, chat_template=dict(entry, now="2999-01-01T00:00:00"))
    assert same_plan(plan, later) and not same_plan(plan, dict(later, val_fraction=0.5))
    code, text = run_prepare(str(tmp_path / "rows.jsonl"), "--tokenizer", str(tok), "--out", str(out),
                             "--format", "prompt-response")  # resumed: nothing left to do, the date kept
    assert code == 0 and json.loads((out / ".prepare/plan.json").read_text()) == plan, text


def test_a_named_token_missing_from_added_tokens_is_added_as_transformers_adds_it(tmp_path):
    """``tokenizer_config.json`` names ``<|eot_id|>`` as the EOS, but ``tokenizer.json`` holds it only in
    its vocabulary: transformers adds it as a special token on load, and so does prepare, so text that
    spells it is that one id in plain text and in chats alike."""
    tok = build_tokenizer(tmp_path / "t", LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", LLAMA3)
    doc = json.loads((tok / "tokenizer.json").read_text())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] != "<|eot_id|>"]
    assert "<|eot_id|>" in doc["model"]["vocab"]
    (tok / "tokenizer.json").write_text(json.dumps(doc))
    hf = transformers.AutoTokenizer.from_pretrained(str(tok))
    texts = ["hello <|eot_id|> world", "<|eot_id|>", "no token here"]
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    code, out = run_prepare(str(tmp_path / "t.jsonl"), "--tokenizer", str(tok), "--out", str(tmp_path / "o"))
    assert code == 0, out
    for text, (ids, _) in zip(texts, documents(tmp_path / "o"), strict=True):
        want = hf(text)["input_ids"]
        assert ids == want + ([hf.eos_token_id] if want[-1] != hf.eos_token_id else [])
    rows = chat_rows(random.Random(6), "ipython", 8)
    for row, (ids, _) in zip(rows, documents(prepare(tmp_path, tok, rows)), strict=True):
        assert ids == reference(hf, row)[0]
