"""``--format prompt-response``: the mask beside the tokens, and a loss over response tokens only,
checked against a hand computation (issue 21, item 5)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tokens.corpus import write_jsonl
from tests.tokens.test_prepare import run_prepare

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests/trainer"))
from trainer_testlib import child_env, make_run, read_losses, torchrun  # noqa: E402

RECORDS = [{"prompt": f"Question {i}: what is {i} plus {i}?", "response": f" It is {2 * i}."} for i in range(40)]
GLUED = [{"prompt": f"Say {i}", "response": f"{i}!"} for i in range(40)]  # joined by the separator, a newline


@pytest.fixture(scope="module")
def sft(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("sft")
    (folder / "in").mkdir()
    write_jsonl(folder / "in/pairs.jsonl", RECORDS * 3)
    write_jsonl(folder / "in/glued.jsonl", GLUED * 3)
    code, out = run_prepare(str(folder / "in"), "--tokenizer", str(tokenizer), "--out", str(folder / "data"),
                            "--format", "prompt-response")
    assert code == 0, out
    return folder / "data"


def shard_arrays(folder: Path, n: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shard = json.loads((folder / "manifest.json").read_text())["splits"]["train"]["shards"][n]
    return (np.fromfile(folder / shard["file"], dtype=np.uint16), np.fromfile(folder / shard["mask"], dtype=np.uint8),
            np.fromfile(folder / shard["index"], dtype=np.uint64))


def test_mask_marks_the_response_and_the_eos(sft, tokenizer):
    """Without a chat template (this tokenizer has none): prompt, separator and response tokenized as one
    text; the response's tokens and the EOS count (tests/tokens/test_chat_template.py: with templates)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    assert json.loads((sft / "manifest.json").read_text())["masked"] is True
    tokens, mask, offsets = shard_arrays(sft)
    glued = tokens[offsets[0]:offsets[1]], mask[offsets[0]:offsets[1]]  # glued.jsonl sorts before pairs.jsonl
    assert glued[0].tolist() == tok.encode("Say 0\n0!").ids + [1]  # the EOS, <|endoftext|>, is id 1
    assert tok.decode(glued[0][glued[1] == 1].tolist()) == "0!" and glued[1][-1] == 1
    assert tok.decode(glued[0][glued[1] == 0].tolist()) == "Say 0\n"
    first = RECORDS[0]
    start = offsets[120]
    doc, doc_mask = tokens[start:offsets[121]], mask[start:offsets[121]]
    assert doc.tolist() == tok.encode(first["prompt"] + first["response"]).ids + [1]  # whitespace there: no separator
    prompt_len = len(tok.encode(first["prompt"], add_special_tokens=False).ids)
    assert (doc_mask[:prompt_len] == 0).all() and (doc_mask[prompt_len:] == 1).all()
    assert tok.decode(doc[prompt_len:-1].tolist()) == first["response"]


def test_txt_input_is_refused_for_prompt_response(tmp_path, tokenizer):
    (tmp_path / "a.txt").write_text("plain\n")
    code, out = run_prepare(str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--format", "prompt-response")
    assert code == 2 and "expected .jsonl or .parquet for --format prompt-response" in out


def test_chat_without_a_template_is_bad_input(tmp_path, tokenizer):
    """A chat list is rendered only by the tokenizer's own template (never as ``role: content`` lines)."""
    write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "x"},
                                                     {"role": "assistant", "content": "y"}]}])
    code, out = run_prepare(str(tmp_path / "c.jsonl"), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--format", "prompt-response")
    assert code == 2 and "c.jsonl:1: a chat list 'messages' and a tokenizer without a chat template" in out


def test_masked_loss_matches_a_hand_computation():
    from trainer.objective import counted_targets, masked_scale, micro_loss

    torch.manual_seed(0)
    vocab, batch, length = 11, 4, 9
    tokens = torch.randint(0, vocab, (batch, length + 1))
    mask = torch.zeros(batch, length + 1, dtype=torch.bool)
    mask[0, 3:] = True
    mask[1, 7:] = True
    mask[3, 1:4] = True  # sample 2 has no response token at all
    logits = torch.randn(batch, length, vocab)
    hand, count = 0.0, 0
    for b in range(batch):
        for j in range(1, length + 1):  # target j is predicted from position j - 1
            if mask[b, j]:
                row = logits[b, j - 1].double()
                hand += float(torch.logsumexp(row, 0) - row[tokens[b, j]])
                count += 1
    assert int(counted_targets([(tokens, mask)], 1)) == count == 7 + 3 + 3
    whole = micro_loss(logits, tokens, mask, masked_scale(count, 1))
    assert float(whole) == pytest.approx(hand / count, rel=1e-6)
    halves = [(tokens[:2], mask[:2]), (tokens[2:], mask[2:])]  # two micro-batches (or two ranks): the same mean
    scale = masked_scale(counted_targets(halves, 1), 1)
    split = sum(float(micro_loss(logits[i:i + 2], *halves[i // 2], scale)) for i in (0, 2))
    assert split == pytest.approx(hand / count, rel=1e-6)
    assert float(micro_loss(logits, tokens, None, 1.0)) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())))


@pytest.mark.slow
def test_training_on_a_masked_manifest(sft, tmp_path):
    run_dir = make_run(tmp_path, "sft", "none", 1, [f"data.source={str(sft)!r}", "model.vocab_size=640",
                                                   "train.steps=4", "train.global_batch=4", "model.seq_len=32"])
    proc = subprocess.run([sys.executable, "-m", "trainer", str(run_dir)], env=child_env(), capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and all(math.isfinite(x) and 0 < x < 8 for x in losses)
    assert json.loads((run_dir / "data.json").read_text())["masked"] is True


@pytest.mark.slow
def test_the_masked_loss_is_the_same_on_one_and_two_ranks(sft, tmp_path):
    """The count is reduced on the device over ranks (``counted_targets``): two DDP ranks log the losses
    one rank does (to rounding: the gradient all-reduce sums in another order)."""
    sets = [f"data.source={str(sft)!r}", "model.vocab_size=640", "train.steps=3", "train.global_batch=4",
            "model.seq_len=32", "train.log_every=1", "train.micro_batch=2"]
    one = make_run(tmp_path, "one", "none", 1, sets)
    two = make_run(tmp_path, "two", "ddp", 2, sets)
    single = subprocess.run([sys.executable, "-m", "trainer", str(one)], env=child_env(), capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert single.returncode == 0, single.stderr[-3000:]
    pair = torchrun(2, ["-m", "trainer", str(two)])
    assert pair.returncode == 0, pair.stderr[-3000:]
    assert read_losses(two) == pytest.approx(read_losses(one), rel=1e-5) and len(read_losses(one)) == 3
