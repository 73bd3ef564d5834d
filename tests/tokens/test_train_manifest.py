"""The trainer on a prepared folder: samples, login-node checks, validation, the run's data record
(issue 21, items 3 and 4)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hpc.core.config import ConfigError
from hpc.core.spec import load_spec
from tests.tokens.test_prepare import run_prepare

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "jobs/tiny-ddp.toml"
sys.path.insert(0, str(REPO / "tests/trainer"))
from trainer_testlib import make_run, torchrun  # noqa: E402


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, corpus, tokenizer) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    code, text = run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(out), "--val-fraction", "0.2",
                             "--group-bytes", "100000", "--shard-tokens", "20000")
    assert code == 0, text
    return out


def test_samples_are_windows_of_one_shard(prepared):
    from trainer.tokens import ManifestTokens

    ds = ManifestTokens(prepared, "train", 64)
    manifest = json.loads((prepared / "manifest.json").read_text())
    shards = [s for s in manifest["splits"]["train"]["shards"] if s["tokens"] > 64]
    assert len(ds) == sum((s["tokens"] - 1) // 64 for s in shards) and len(shards) > 1
    second = np.fromfile(prepared / shards[1]["file"], dtype=np.uint16)
    first_of_second = (shards[0]["tokens"] - 1) // 64
    assert ds[first_of_second].tolist() == second[:65].tolist()
    assert ds[first_of_second + 2].tolist() == second[128:193].tolist()
    assert ManifestTokens(prepared / "manifest.json", "val", 64)[0].shape == (65,)


def test_the_login_side_counts_a_split_as_the_trainer_does(prepared):
    from hpc.core.manifest import split_samples
    from trainer.tokens import ManifestTokens

    for split in ("train", "val"):
        assert split_samples(prepared, split, 64) == len(ManifestTokens(prepared, split, 64))


@pytest.mark.parametrize("samples,micro,world", [(7, 2, 2), (7, 2, 3), (7, 1, 4), (16, 2, 2), (1, 4, 3)])
def test_eval_counts_each_sample_once_with_as_many_passes_on_every_rank(samples, micro, world):
    from trainer.evaluate import eval_batches

    shares = [eval_batches(samples, micro, rank, world) for rank in range(world)]
    assert sorted(i for share in shares for batch in share for i in batch) == list(range(samples))
    assert len({len(share) for share in shares}) == 1  # FSDP gathers in every forward: no rank may skip one
    assert all(1 <= len(batch) <= micro for share in shares for batch in share if batch)


def test_eval_samples_never_wraps_and_zero_steps_is_the_whole_split():
    from trainer.evaluate import eval_samples

    assert eval_samples(7, 10, 8) == 7  # the issue: 7 samples were counted as 0-6, 0-6, 0, 1
    assert eval_samples(100, 2, 8) == 16 and eval_samples(100, 0, 8) == 100


def test_submit_says_when_the_split_is_smaller_than_eval_asks(prepared):
    from hpc.core.manifest import split_samples
    from hpc.core.spec import spec_warnings

    held = split_samples(prepared, "val", 64)
    sets = [f"data.source={str(prepared)!r}", "model.vocab_size=640", "train.eval_every=5", "train.global_batch=8"]
    many = spec_warnings(load_spec(TINY, [*sets, f"train.eval_steps={held}"]))
    assert [w for w in many if "eval_steps" in w] == [
        f"{TINY}: `train.eval_steps` = {held} × `train.global_batch` = 8 asks for {8 * held} validation samples, "
        f"but the val split of {prepared} holds {held}: each evaluation counts those {held} once "
        "(`train.eval_steps = 0` says the whole split)"]
    for fits in (f"train.eval_steps={held // 8}", "train.eval_steps=0"):
        assert not [w for w in spec_warnings(load_spec(TINY, [*sets, fits])) if "eval_steps" in w]


def test_login_checks_vocabulary_sizes_and_validation(prepared, tmp_path):
    spec = load_spec(TINY, [f"data.source={str(prepared)!r}", "model.vocab_size=640"])
    assert spec.data.source == str(prepared)
    with pytest.raises(ConfigError, match=r"has 600 tokens, more than the model's vocabulary of 256: expected "
                                          r"`model.vocab_size` >= 600"):
        load_spec(TINY, [f"data.source={str(prepared)!r}"])
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in prepared.iterdir():
        if f.is_file():
            (broken / f.name).write_bytes(f.read_bytes())
    (broken / "train-00000-0000.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ConfigError, match=r"train-00000-0000.bin has 2 bytes: expected \d+ as the manifest says"):
        load_spec(TINY, [f"data.source={str(broken)!r}", "model.vocab_size=640"])


def test_eval_needs_something_to_evaluate(tmp_path, corpus, tokenizer):
    out = tmp_path / "noval"
    assert run_prepare(str(corpus), "--tokenizer", str(tokenizer), "--out", str(out))[0] == 0
    with pytest.raises(ConfigError, match=r"`train.eval_every` = 5: no validation split"):
        load_spec(TINY, [f"data.source={str(out)!r}", "model.vocab_size=640", "train.eval_every=5"])
    spec = load_spec(TINY, [f"data.source={str(out)!r}", "model.vocab_size=640", "train.eval_every=5",
                            f"data.val_source={str(out)!r}"])
    assert spec.data.val_source == str(out)


@pytest.mark.slow
def test_evaluation_is_the_same_at_one_and_two_ranks(prepared, tmp_path):
    worker = str(Path(__file__).parent / "eval_worker.py")
    records = []
    for n in (1, 2):
        proc = torchrun(n, [worker, str(prepared), str(tmp_path / f"eval-{n}.json")])
        assert proc.returncode == 0, proc.stderr[-3000:]
        records.append(json.loads((tmp_path / f"eval-{n}.json").read_text()))
    one, two = records
    assert one["eval_tokens"] == two["eval_tokens"] == 3 * 4 * 64
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-12)
    assert one["eval_perplexity"] == pytest.approx(np.exp(one["eval_loss"]))


@pytest.mark.slow
def test_the_whole_split_is_evaluated_once_the_same_at_one_and_two_ranks(prepared, tmp_path):
    from trainer.tokens import ManifestTokens

    held = len(ManifestTokens(prepared, "val", 64))
    worker = str(Path(__file__).parent / "eval_worker.py")
    records = []
    for n in (1, 2):  # 2 ranks, micro-batch 1: an odd count leaves rank 1 a pass that counts nothing
        proc = torchrun(n, [worker, str(prepared), str(tmp_path / f"whole-{n}.json"), "0"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        records.append(json.loads((tmp_path / f"whole-{n}.json").read_text()))
    assert [r["eval_samples"] for r in records] == [held, held]
    assert records[0]["eval_tokens"] == records[1]["eval_tokens"] == held * 64
    assert records[1]["eval_loss"] == pytest.approx(records[0]["eval_loss"], rel=1e-12)


@pytest.mark.slow
def test_training_from_a_manifest_evaluates_and_records_its_data(prepared, tmp_path):
    from hpc.cli import format_result, format_status
    from hpc.schedulers.base import JobState
    from hpc.login.submit import summary

    run_dir = make_run(tmp_path, "manifest", "ddp", 2, [f"data.source={str(prepared)!r}", "model.vocab_size=640",
                                                        "train.steps=6", "train.eval_every=3", "train.eval_steps=2",
                                                        "train.log_every=2"])
    proc = torchrun(2, ["-m", "trainer", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6] and all(r["eval_tokens"] == 2 * 8 * 64 for r in evals)
    assert result["eval_loss"] == evals[-1]["eval_loss"] and "eval loss" in format_result(result)
    assert all(r["loss"] < 7 for r in lines if "loss" in r)
    data = json.loads((run_dir / "data.json").read_text())
    assert data["manifest"] == str(prepared / "manifest.json") and data["tokenizer"]["vocab_size"] == 600
    assert data["val_source"] == [str(prepared), "val"]
    info = summary(run_dir, JobState("COMPLETED"))
    assert info["loss"] == lines[-2]["loss"] and info["eval_loss"] == evals[-1]["eval_loss"]
    assert f"eval loss {evals[-1]['eval_loss']:.4f} (perplexity" in format_status(info)


def test_loader_workers_default_by_site_kind():
    from hpc.core.spec import Data, loader_workers

    assert Data().num_workers == -1
    assert loader_workers(-1, True, 8) == 4 and loader_workers(-1, True, 2) == 1 and loader_workers(-1, True, 32) == 4
    assert loader_workers(-1, False, 8) == 0 and loader_workers(3, False, 8) == 3 and loader_workers(0, True, 8) == 0


def test_worker_processes_read_the_same_batches(prepared):
    from hpc.core.spec import Data
    from trainer.data import GlobalSampler, build_loader
    from trainer.tokens import ManifestTokens

    ds = ManifestTokens(prepared, "train", 64)
    batches = {}
    for workers in (0, 2):
        sampler = GlobalSampler(len(ds), 4, 2, 0, 1, seed=5, shuffle=True)
        loader = build_loader(ds, sampler, Data(), 5, pin_memory=False, workers=workers)
        assert loader.persistent_workers == (workers > 0)
        stream = iter(loader)
        batches[workers] = [next(stream) for _ in range(4)]
        del stream
    assert all((a == b).all() for a, b in zip(batches[0], batches[2]))


@pytest.mark.gpu
def test_gpu_site_loads_with_workers_and_pinned_memory_and_evaluates(prepared, tmp_path):
    """On a site with GPUs the default loader has worker processes (half of the task's 4 CPUs), pinned
    memory and persistent workers; training from the manifest evaluates on the GPU."""
    import torch

    from tests.gpu.test_gpu import gpu_run
    from trainer.loop import train
    from trainer.run import load_run
    from trainer.train import build_trainer

    run_dir = gpu_run(tmp_path, "gpu-data", 1, [f"data.source={str(prepared)!r}", "model.vocab_size=640",
                                                "parallel.strategy='none'", "train.eval_every=3", "train.eval_steps=1",
                                                "job.tasks_per_node=1"])
    trainer, state = build_trainer(load_run(run_dir), 0, torch.device("cuda:0"))
    assert trainer.loader.num_workers == 2 and trainer.loader.pin_memory and trainer.loader.persistent_workers
    assert trainer.evaluator is not None and trainer.evaluator.workers == 2 and trainer.evaluator.pin_memory
    result = train(trainer, state)
    assert result["steps"] == 6 and result["eval_loss"] > 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "eval_loss" in r] == [3, 6]
    assert all(r["phases_s"]["data"] >= 0 for r in lines if "phases_s" in r)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_evaluator_loads_with_the_training_loaders_workers(prepared, tmp_path, workers):
    """``data.num_workers`` reaches the eval loader as the training's (pinned memory only with a GPU)."""
    import torch

    from trainer.run import load_run
    from trainer.train import build_trainer

    run_dir = make_run(tmp_path, "eval-workers", "none", 1, [f"data.source={str(prepared)!r}", "model.vocab_size=640",
                                                             f"data.num_workers={workers}", "train.eval_every=3"])
    trainer, _ = build_trainer(load_run(run_dir), 0, torch.device("cpu"))
    assert trainer.evaluator is not None and trainer.evaluator.workers == trainer.loader.num_workers == workers
    assert not trainer.evaluator.pin_memory
    loader = trainer.evaluator.loader(trainer.task.collate)
    assert loader.num_workers == workers and loader.persistent_workers == (workers > 0)


def test_the_source_kind_is_one_rule(prepared, tmp_path):
    from hpc.core.manifest import PREPARED, SYNTHETIC, TOKEN_FILE, source_kind

    flat = tmp_path / "tokens.bin"
    flat.write_bytes(b"\x00\x00" * 200)
    assert [source_kind(s) for s in ("synthetic", str(prepared), str(prepared / "manifest.json"), str(flat))] == [
        SYNTHETIC, PREPARED, PREPARED, TOKEN_FILE]
    assert source_kind(str(tmp_path / "missing" / "manifest.json")) == PREPARED  # the login check says what is wrong


def test_the_ranks_read_the_source_kind_recorded_at_resolve(prepared, tmp_path):
    """``Launch.data_source`` is decided at resolve and recorded in resolved.json; the rank builds its
    dataset from the record, not from the path (a record that says synthetic gets synthetic samples); a
    resolved.json from before the field is decided on read, by the same rule."""
    import torch

    from trainer.data import SyntheticTokens
    from trainer.run import load_run
    from trainer.tokens import ManifestTokens
    from trainer.train import build_trainer

    flat = tmp_path / "tokens.bin"
    flat.write_bytes((np.arange(4096) % 256).astype(np.uint16).tobytes())
    kinds = {}
    for name, source in (("synthetic", "synthetic"), ("prepared", str(prepared)), ("flat", str(flat))):
        run_dir = make_run(tmp_path, name, "none", 1, [f"data.source={source!r}", "model.vocab_size=640"])
        kinds[name] = json.loads((run_dir / "resolved.json").read_text())["launch"]["data_source"]
    assert kinds == {"synthetic": "synthetic", "prepared": "prepared", "flat": "tokens"}

    resolved = tmp_path / "prepared" / "resolved.json"
    doc = json.loads(resolved.read_text())
    trainer, _ = build_trainer(load_run(resolved.parent), 0, torch.device("cpu"))
    assert isinstance(trainer.loader.dataset, ManifestTokens)
    doc["launch"]["data_source"] = "synthetic"
    resolved.write_text(json.dumps(doc))
    trainer, _ = build_trainer(load_run(resolved.parent), 0, torch.device("cpu"))
    assert isinstance(trainer.loader.dataset, SyntheticTokens) and not trainer.sampler.shuffle
    del doc["launch"]["data_source"]
    resolved.write_text(json.dumps(doc))
    assert load_run(resolved.parent).launch.data_source == "prepared"


def test_a_padding_pass_counts_nothing(prepared):
    from types import SimpleNamespace

    import torch

    from hpc.core.spec import Model
    from trainer.evaluate import Evaluator, evaluate
    from trainer.model import build_model
    from trainer.tasks.lm import token_task
    from trainer.tokens import ManifestTokens

    torch.manual_seed(0)
    t = SimpleNamespace(model=build_model(Model(size="tiny", vocab_size=640), "cpu"), device=torch.device("cpu"),
                        amp_dtype=None, world_size=1, dims=SimpleNamespace(tp=1))
    dataset = ManifestTokens(prepared, "val", 64)
    plain, padded = (evaluate(t, Evaluator(dataset, batches, 1, 1, task=token_task()), 0) for batches in ([[1]], [[1], []]))
    assert (padded["eval_loss"], padded["eval_tokens"]) == (plain["eval_loss"], plain["eval_tokens"]) == (
        plain["eval_loss"], 64)
