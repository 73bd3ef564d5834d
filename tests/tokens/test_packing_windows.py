"""``hpcx data prepare --window SEQ_LEN`` and ``data.packing = "document"`` on prepared shards (issue 32
item 3): windows hold whole examples (padded, an example longer than the window cut to it and counted),
the padding fraction is reported, and the trainer's packed samples give the loss of the same examples
run one by one, each alone."""

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
from trainer_testlib import child_env, make_run  # noqa: E402

SEQ = 48
RECORDS = ([{"prompt": f"Question {i}: what is {i} plus {i}?", "response": f" It is {2 * i}."} for i in range(30)]
           + [{"prompt": "a long one " * (4 + i), "response": " yes" * (2 + 3 * i)} for i in range(8)]
           + [{"prompt": "q", "response": "a"}] * 5)


def _prepare(folder: Path, tokenizer: Path, name: str, *extra: str) -> Path:
    code, out = run_prepare(str(folder / "in"), "--tokenizer", str(tokenizer), "--out", str(folder / name),
                            "--format", "prompt-response", "--shard-tokens", "300", *extra)
    assert code == 0, out
    return folder / name


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer) -> tuple[Path, Path]:
    """(end to end, windowed) preparations of the same examples."""
    folder = tmp_path_factory.mktemp("pack")
    (folder / "in").mkdir()
    write_jsonl(folder / "in/pairs.jsonl", RECORDS)
    return _prepare(folder, tokenizer, "plain"), _prepare(folder, tokenizer, "windows", "--window", str(SEQ))


def _documents(folder: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every document of the train split as (tokens, mask), in order, from the shards and their index."""
    manifest = json.loads((folder / "manifest.json").read_text())
    docs = []
    for shard in manifest["splits"]["train"]["shards"]:
        tokens = np.fromfile(folder / shard["file"], dtype=manifest["dtype"])
        mask = np.fromfile(folder / shard["mask"], dtype=np.uint8)
        offsets = np.fromfile(folder / shard["index"], dtype=np.uint64).astype(np.int64)
        docs += [(tokens[a:b], mask[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    return docs


def test_windows_hold_whole_examples_and_count_their_padding(prepared):
    plain, windows = prepared
    manifest = json.loads((windows / "manifest.json").read_text())
    assert manifest["window"] == SEQ and manifest["pad_id"] == manifest["eos_id"]
    split = manifest["splits"]["train"]
    original, laid = _documents(plain), _documents(windows)
    assert len(original) == len(laid) == split["documents"] == len(RECORDS)
    cut = 0
    for (tokens, mask), (wtokens, wmask) in zip(original, laid):
        n = min(len(tokens), SEQ)
        cut += len(tokens) > SEQ
        assert wtokens[:n].tolist() == tokens[:n].tolist() and wmask[:n].tolist() == mask[:n].tolist()
        assert (wmask[n:] == 0).all() and (wtokens[n:] == manifest["pad_id"]).all()  # what follows is padding
    assert cut == split["truncated"] > 0
    from hpc.core.manifest import verify

    assert verify(windows)["train"]["documents"] == len(RECORDS)  # `hpcx data verify` reads it as any other
    pad = sum(len(w) for w, _ in laid) - sum(min(len(t), SEQ) for t, _ in original)
    assert pad == split["padding"] == sum(s["padding"] for s in split["shards"])
    for shard in split["shards"]:  # whole windows, and one token more: the last sample's final target
        assert shard["tokens"] % SEQ == 1
    starts = np.concatenate([[0], np.cumsum([len(w) for w, _ in laid])])
    shard_starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in split["shards"]])])
    for a in starts[:-1]:  # every example starts inside one window and ends in it
        base = shard_starts[np.searchsorted(shard_starts, a, side="right") - 1]
        assert (a - base) % SEQ + 1 <= SEQ


def test_the_summary_reports_the_padding_fraction(prepared, tmp_path, tokenizer):
    _, windows = prepared
    split = json.loads((windows / "manifest.json").read_text())["splits"]["train"]
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in/pairs.jsonl", RECORDS)
    code, out = run_prepare(str(tmp_path / "in"), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--format", "prompt-response", "--shard-tokens", "300", "--window", str(SEQ), "--json")
    assert code == 0, out
    got = json.loads(out[out.index("{"):])["splits"]["train"]  # after the progress line (stderr)
    assert got["padding"] == split["padding"] and got["truncated"] == split["truncated"]
    assert got["padding_fraction"] == pytest.approx(split["padding"] / split["tokens"])
    code, out = run_prepare(str(tmp_path / "in"), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            "--format", "prompt-response", "--shard-tokens", "300", "--window", str(SEQ))
    assert code == 0 and "% padding" in out and f"windows of {SEQ} tokens" in out


@pytest.mark.parametrize("args, words", [
    (["--format", "text", "--window", "32"], "--window 32: expected --format prompt-response"),
    (["--format", "prompt-response", "--window", "1"], "--window 1: expected the model's seq_len"),
    (["--format", "prompt-response", "--window", "-4"], "--window -4: expected the model's seq_len"),
])
def test_window_options_are_refused_in_one_line(tmp_path, tokenizer, args, words):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "response": "r", "text": "t"}])
    code, out = run_prepare(str(tmp_path / "a.jsonl"), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "o"),
                            *args)
    assert code == 2 and words in out and len(out.strip().splitlines()) == 1


def _llama(vocab: int) -> torch.nn.Module:
    from hpc.core.models.llama import LlamaShape
    from trainer.models.llama import Llama

    torch.manual_seed(1)
    model = Llama(LlamaShape(2, 32, 4, 2, 64, SEQ, vocab)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0)
    return model


def test_packed_samples_give_the_one_by_one_loss(prepared):
    """The trainer's samples of the windowed set (``ManifestTokens`` with documents), through the loop's
    loss, equal each example of the end-to-end set run alone (its own mask, no padding) to 1e-5."""
    from trainer.objective import batch_documents, counted_targets, masked_scale, micro_loss, split_batch, token_losses
    from trainer.tokens import ManifestTokens

    plain, windows = prepared
    vocab = json.loads((plain / "manifest.json").read_text())["vocab_size"]
    model = _llama(vocab)
    data = ManifestTokens(windows, "train", SEQ, documents=True)
    samples = [data[i] for i in range(len(data))]
    batch = tuple(torch.stack(parts) for parts in zip(*samples))
    (tokens, mask), documents = split_batch(batch), batch_documents(batch)
    with torch.no_grad():
        packed = float(micro_loss(model(tokens[:, :-1], documents[:, :-1]), tokens, mask,
                                  masked_scale(counted_targets([batch], 1), 1)))
        unmasked = float(micro_loss(model(tokens[:, :-1]), tokens, mask, masked_scale(counted_targets([batch], 1), 1)))
    total, count = 0.0, 0
    for ids, counted in _documents(plain):
        ids, counted = torch.from_numpy(ids[:SEQ].astype(np.int64)), torch.from_numpy(counted[:SEQ].astype(bool))
        with torch.no_grad():
            losses = token_losses(model(ids[None, :-1]), ids[None])
        total += float((losses[0] * counted[1:]).sum())
        count += int(counted[1:].sum())
    assert int(counted_targets([batch], 1)) == count
    assert packed == pytest.approx(total / count, rel=1e-5)
    assert abs(unmasked - total / count) > 1e-2  # without the document mask, examples see each other


def test_documents_laid_end_to_end_number_each_position(prepared):
    """Without --window, a sample's document numbers follow the shard's index: a document cut by the
    window's start restarts there, and no target across a boundary is counted."""
    from trainer.tokens import ManifestTokens

    plain, _ = prepared
    data = ManifestTokens(plain, "train", 16, documents=True)
    plain_data = ManifestTokens(plain, "train", 16)
    shard = json.loads((plain / "manifest.json").read_text())["splits"]["train"]["shards"][0]
    offsets = np.fromfile(plain / shard["index"], dtype=np.uint64).astype(np.int64)
    import pickle

    data[0]  # opens shard 0 and reads its index
    assert data._offsets
    copy = pickle.loads(pickle.dumps(data))  # a DataLoader worker's copy: no memory map or index travels
    assert copy._offsets == {} and all(a.equal(b) for a, b in zip(copy[3], data[3]))
    for i in (0, 1, 5):
        tokens, counted, numbers = data[i]
        same_tokens, mask = plain_data[i]
        assert tokens.equal(same_tokens)
        want = np.searchsorted(offsets, np.arange(16 * i, 16 * i + 17), side="right") - 1
        assert numbers.tolist() == want.tolist()
        boundary = torch.zeros(17, dtype=torch.bool)
        boundary[1:] = numbers[1:] != numbers[:-1]
        assert not counted[0] and not counted[boundary].any() and counted.equal(mask & ~boundary & (torch.arange(17) > 0))


def test_a_windowed_set_needs_its_seq_len(prepared):
    from hpc.core.manifest import check_source

    _, windows = prepared
    assert check_source(windows / "manifest.json", SEQ, 0, "src") == []
    problems = check_source(windows / "manifest.json", 2 * SEQ, 0, "src")
    assert any(f"prepared with --window {SEQ}: expected `model.seq_len` = {SEQ}" in p for p in problems)


@pytest.mark.slow
def test_training_with_document_packing_on_a_windowed_set(prepared, tmp_path):
    _, windows = prepared
    vocab = json.loads((windows / "manifest.json").read_text())["vocab_size"]
    run_dir = make_run(tmp_path, "pack", "none", 1, [f"data.source={str(windows)!r}", f"model.vocab_size={vocab}",
                                                     "train.steps=3", "train.global_batch=4", f"model.seq_len={SEQ}",
                                                     "data.packing='document'", "train.log_every=1"])
    proc = subprocess.run([sys.executable, "-m", "trainer", str(run_dir)], env=child_env(), capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    losses = [r["loss"] for r in lines]
    assert len(losses) == 3 and all(math.isfinite(x) and 0 < x < 10 for x in losses)
    assert all(0 < r["counted_fraction"] < 1 for r in lines)  # the share of targets counted: no prompt, no padding
    data = json.loads((run_dir / "data.json").read_text())
    assert data["packing"] == "document" and data["window"] == SEQ
    assert 0 < data["splits"]["train"]["padding_fraction"] < 1
    assert f"data: windows of {SEQ} tokens" in proc.stderr and "% padding" in proc.stderr
    for r in lines:  # issue 44: real tokens/s beside tokens/s, the windows' padding taken out
        assert 0 < r["padding_fraction"] < 1
        assert r["real_tokens_per_s"] == pytest.approx(r["tokens_per_s"] * (1 - r["padding_fraction"]))
    from hpc.login.status import format_status
    from hpc.login.submit import summary
    from hpc.schedulers.base import JobState

    info = summary(run_dir, JobState("COMPLETED"))
    assert info["padding_fraction"] == lines[-1]["padding_fraction"]
    assert f"{lines[-1]['real_tokens_per_s']:,.0f} real tokens/s ({lines[-1]['padding_fraction']:.1%} padding)" in \
        format_status(info)


def test_the_pad_count_of_the_windows_is_what_prepare_wrote(prepared):
    """``padding_tokens`` (each window's trailing pad ids under a zero mask) over every sample of a
    windowed split gives the manifest's own padding count, less the one pad token each shard holds
    after its last window (the last sample's final target, no input)."""
    from trainer.objective import padding_tokens
    from trainer.tokens import ManifestTokens

    _, windows = prepared
    manifest = json.loads((windows / "manifest.json").read_text())
    for documents in (False, True):
        ds = ManifestTokens(windows, "train", SEQ, documents=documents)  # (the val split is under a window)
        batches = [tuple(t[None] for t in ds[i]) for i in range(len(ds))]
        shards = len(manifest["splits"]["train"]["shards"])
        assert int(padding_tokens(batches, manifest["pad_id"], 1)) == manifest["splits"]["train"]["padding"] - shards > 0


def test_pad_tokens_are_the_trailing_pad_ids_the_loss_does_not_count():
    import torch

    from trainer.objective import padding_tokens

    tokens = torch.tensor([[5, 0, 7, 0, 0, 0, 9],  # a pad id inside (a prompt's) is no padding; the inputs end at 0 0 0
                           [5, 6, 7, 8, 0, 0, 0],  # counted pad ids (an EOS the loss counts) are no padding
                           [0, 0, 0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 0, 1, 0, 0, 0, 1], [1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert int(padding_tokens([(tokens, mask)], 0, 1)) == 3 + 1 + 6
    assert int(padding_tokens([(tokens[:1], mask[:1]), (tokens[1:], mask[1:])], 0, 1)) == 10
    assert int(padding_tokens([tokens], 0, 1)) == 3 + 2 + 6  # without a mask, every trailing pad id
    assert int(padding_tokens([(tokens, mask)], 9, 1)) == 0


@pytest.mark.slow
def test_an_unwindowed_run_shows_its_real_tokens_with_no_padding(prepared, tmp_path):
    plain, _ = prepared
    vocab = json.loads((plain / "manifest.json").read_text())["vocab_size"]
    run_dir = make_run(tmp_path, "plain", "none", 1, [f"data.source={str(plain)!r}", f"model.vocab_size={vocab}",
                                                      "train.steps=2", "train.global_batch=2", f"model.seq_len={SEQ}",
                                                      "data.packing='document'", "train.log_every=1"])
    proc = subprocess.run([sys.executable, "-m", "trainer", str(run_dir)], env=child_env(), capture_output=True,
                          text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert lines and all(r["padding_fraction"] == 0 and r["real_tokens_per_s"] == r["tokens_per_s"] for r in lines)


def _spec_problems(sets: list[str]) -> list[str]:
    from hpc.core.errors import ConfigError
    from hpc.core.spec import load_spec
    from trainer_testlib import TINY

    try:
        load_spec(TINY, sets)
    except ConfigError as exc:
        return exc.messages
    return []


def test_document_packing_is_checked_where_the_spec_loads(prepared, tmp_path):
    _, windows = prepared
    vocab = f"model.vocab_size={json.loads((windows / 'manifest.json').read_text())['vocab_size']}"
    good = [f"data.source={str(windows)!r}", vocab, f"model.seq_len={SEQ}", "data.packing='document'"]
    assert _spec_problems(good) == []
    (tmp_path / "t.bin").write_bytes(np.arange(4000, dtype=np.uint16).tobytes())
    cases = {
        "data.source='synthetic'": "`data.packing` = 'document': `data.source` = 'synthetic' is synthetic samples",
        f"data.source={str(tmp_path / 't.bin')!r}": "is a flat token file, which records no document boundaries",
    }
    for source, words in cases.items():
        problems = _spec_problems([source, "data.packing='document'", "model.vocab_size=8192"])
        assert len(problems) == 1 and words in problems[0], problems
    problems = _spec_problems([f"data.source={str(windows)!r}", 'model.arch="tests.gated_model:build"',
                               f"model.seq_len={SEQ}", vocab, "data.packing='document'"])
    assert len(problems) == 1 and "`model.arch` = 'tests.gated_model:build' is a user model" in problems[0], problems
    problems = _spec_problems([f"data.source={str(windows)!r}", vocab, "data.packing='documents'"])
    assert len(problems) == 1 and "data.packing" in problems[0] and "'causal'" in problems[0], problems
    problems = _spec_problems([f"data.source={str(windows)!r}", vocab, "data.packing='document'",
                               f"model.seq_len={2 * SEQ}"])
    assert any(f"prepared with --window {SEQ}" in p for p in problems), problems


def test_the_loop_and_the_evaluator_pass_the_documents(prepared):
    """``forward_backward`` (the training loss) and the evaluator's sums on packed samples give the
    one-by-one loss: both hand the document numbers to the model."""
    from types import SimpleNamespace

    from torch.utils.data import default_collate

    from trainer.evaluate import _sums, build_evaluator
    from trainer.loop import forward_backward
    from trainer.metrics import PhaseClock
    from trainer.objective import counted_targets, masked_scale, token_losses
    from trainer.tokens import ManifestTokens

    plain, windows = prepared
    model = _llama(json.loads((plain / "manifest.json").read_text())["vocab_size"])
    data = ManifestTokens(windows, "train", SEQ, documents=True)
    total, count = 0.0, 0
    for ids, counted in _documents(plain):
        ids, counted = torch.from_numpy(ids[:SEQ].astype(np.int64)), torch.from_numpy(counted[:SEQ].astype(bool))
        with torch.no_grad():
            total += float((token_losses(model(ids[None, :-1]), ids[None])[0] * counted[1:]).sum())
        count += int(counted[1:].sum())
    from hpc.core.dims import parallel_dims
    from trainer.tasks.lm import token_task

    # the loop's view of a trainer: the language-model task (its terms read no spec) on one process
    t = SimpleNamespace(model=model, device=torch.device("cpu"), amp_dtype=None, scaler=None, clock=PhaseClock(),
                        task=token_task(), dims=parallel_dims("none", "full_shard", 1), straggler=None)
    batch = default_collate([data[i] for i in range(len(data))])
    loss = forward_backward(t, batch, masked_scale(counted_targets([batch], 1), 1))
    assert float(loss) == pytest.approx(total / count, rel=1e-5)
    ev = build_evaluator(data, global_batch=4, micro_batch=2, rank=0, world_size=1, every=1, steps=0)
    ev.task = t.task
    with torch.no_grad():
        loss_sum, counted_sum = (float(x) for x in _sums(t, ev))
    assert counted_sum == count and loss_sum / counted_sum == pytest.approx(total / count, rel=1e-5)


@pytest.mark.slow
def test_packed_training_is_the_same_on_one_rank_and_two_fsdp_ranks(prepared, tmp_path):
    """FSDP2 units and activation checkpointing pass the documents through the blocks: two ranks log
    the losses one rank does (to rounding)."""
    from trainer_testlib import read_losses, torchrun

    _, windows = prepared
    vocab = json.loads((windows / "manifest.json").read_text())["vocab_size"]
    sets = [f"data.source={str(windows)!r}", f"model.vocab_size={vocab}", "train.steps=3", "train.global_batch=4",
            f"model.seq_len={SEQ}", "data.packing='document'", "train.micro_batch=2"]
    one = make_run(tmp_path, "one", "none", 1, sets)
    two = make_run(tmp_path, "two", "fsdp", 2, sets + ["parallel.activation_checkpointing=true"])
    single = subprocess.run([sys.executable, "-m", "trainer", str(one)], env=child_env(), capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert single.returncode == 0, single.stderr[-3000:]
    pair = torchrun(2, ["-m", "trainer", str(two)])
    assert pair.returncode == 0, pair.stderr[-3000:]
    assert read_losses(two) == pytest.approx(read_losses(one), rel=1e-4) and len(read_losses(one)) == 3
