"""Each rank reads only the bytes of its own shard: measured at 2 and 4 gloo ranks (bytes read and peak
RSS growth while loading) for safetensors, at 2 for a ``torch.save`` file, and the read plan of rank
127 of 128 on the fake process group."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from tests.extras import extra

extra("transformers")

from hpc.ckpt.init_source import open_source  # noqa: E402
from hpc.core.hf import tensor_plan  # noqa: E402
from hpc.core.models.llama import LLAMA_PRESETS  # noqa: E402

from tests.hf.hf_helpers import LLAMA, hf_folder  # noqa: E402
from tests.trainer.trainer_testlib import make_run, torchrun  # noqa: E402

# 28.6M parameters (114 MB in fp32): big enough that a whole copy would show in the RSS
WIDE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=16384, max_position_embeddings=256)
WIDE_SETS = ["model.size='small'", "model.dim=512", "model.vocab_size=16384", "model.n_heads=8", "model.n_kv_heads=4"]
SLACK = 16 * 2**20  # Python objects, the allocator's arenas


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("wide") / "hf", shard="40MB", **WIDE)


@pytest.mark.parametrize("ranks", [2, 4])
def test_bytes_read_and_peak_rss_per_rank(wide, tmp_path, ranks):
    run = make_run(tmp_path, f"r{ranks}", "fsdp", ranks, [*LLAMA, *WIDE_SETS, f"checkpoint.init_from={str(wide)!r}"])
    out = tmp_path / "reports.json"
    result = torchrun(ranks, ["tests/hf/init_worker.py", str(out), str(run)], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(out.read_text())
    source = reports[0]["source_bytes"]
    largest = 16384 * 512 * 4  # the embedding: the read buffer holds at most this rank's rows of it
    assert sum(r["bytes_read"] for r in reports) == source  # every byte once, by exactly one rank
    for r in reports:
        assert r["bytes_read"] <= source / ranks * 1.05, r
        assert r["rss_growth"] <= r["shard_bytes"] + largest / ranks + SLACK, r
        assert r["rss_growth"] < source / ranks + largest, r


def test_torch_file_bytes_read_per_rank_and_bit_identical(wide, tmp_path):
    from hpc.core.models import model_facts
    from trainer.run import load_run

    from tests.hf.hf_helpers import hf_tensors

    path = tmp_path / "model.pt"
    run = make_run(tmp_path, "pt2", "fsdp", 2, [*LLAMA, *WIDE_SETS, f"checkpoint.init_from={str(path)!r}"])
    shape = model_facts(load_run(run).spec.model).shape
    hf = hf_tensors(wide)
    torch.save({n: hf[t.key] for n, t in open_source(wide, "llama", shape).tensors.items()}, path)  # hpcx names
    del hf
    out = tmp_path / "reports.json"
    result = torchrun(2, ["tests/hf/init_worker.py", str(out), str(run), "digests"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(out.read_text())
    source = reports[0]["source_bytes"]
    assert reports[0]["kind"] == "torch"
    assert sum(r["bytes_read"] for r in reports) == source  # every byte once: no tensor fell back to a whole read
    for r in reports:
        assert r["bytes_read"] <= source / 2 * 1.05, r
        assert r["rss_growth"] < source / 2 + 16384 * 512 * 4, r
    whole = torch.load(path, weights_only=True)  # the whole-file load
    expected = {n: hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
                for n, t in whole.items()}
    assert reports[0]["digests"] == expected


def sparse_safetensors(path, shape, dtype="BF16", itemsize=2):
    """A safetensors file with real headers and a hole for data (sparse: no disk used)."""
    header, offset = {}, 0
    for t in tensor_plan("llama", shape):
        n = itemsize
        for s in t.shape:
            n *= s
        header[t.name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def test_read_plan_of_rank_127_of_128(tmp_path):
    from hpc.cli import load_job
    from hpc.dryrun.fake_pg import fake_process_group
    from trainer.init_from import read_plan
    from trainer.train import build_parallel_model

    from tests.conftest import REPO

    shape = LLAMA_PRESETS["llama3.2-1b"]
    source = open_source(sparse_safetensors(tmp_path / "model.safetensors", shape), "llama", shape)
    spec, _, launch = load_job(str(REPO / "jobs" / "tiny-llama.toml"), "dgx-h100",
                               ["model.size='llama3.2-1b'", "job.nodes=16", "job.tasks_per_node=8",
                                "train.global_batch=128", "train.micro_batch=1", "parallel.strategy='fsdp'"])
    with fake_process_group(128, 127):
        model, _ = build_parallel_model(spec, launch, torch.device("meta"), materialize=False)
        plan = {r.name: r for r in read_plan(model, source)}
    emb = plan["tok_emb.weight"]  # tied: one matrix for both ends
    assert (emb.start, emb.stop) == (127 * 1002, 128256)  # ceil(128256 / 128) = 1002 rows per rank
    assert emb.offset == source.tensors["tok_emb.weight"].offset + 127 * 1002 * 2048 * 2
    assert emb.length == 1002 * 2048 * 2
    norm = plan["norm.weight"]
    assert (norm.start, norm.stop, norm.length) == (2032, 2048, 16 * 2)
    for name, r in plan.items():
        t = source.tensors[name]
        row = 2 * (t.shape[1] if len(t.shape) > 1 else 1)
        assert t.offset <= r.offset and r.offset + r.length <= t.offset + t.shape[0] * row, name
    assert sum(r.length for r in plan.values()) <= source.nbytes / 128 * 1.05


def test_dryrun_reports_this_ranks_reads(tmp_path):
    from hpc.cli import load_job
    from hpc.dryrun import dryrun, format_dryrun

    from tests.conftest import REPO

    shape = LLAMA_PRESETS["llama3.2-1b"]
    path = sparse_safetensors(tmp_path / "model.safetensors", shape)
    spec, site, launch = load_job(str(REPO / "jobs" / "tiny-llama.toml"), "dgx-h100",
                                  ["model.size='llama3.2-1b'", "job.nodes=16", "job.tasks_per_node=8",
                                   "train.global_batch=128", "train.micro_batch=1", "parallel.strategy='hsdp'",
                                   f"checkpoint.init_from={str(path)!r}"])
    result = dryrun(spec, site, launch, rank=127)
    reads = result.init_from
    assert reads["kind"] == "safetensors" and reads["source_bytes"] == shape.n_params * 2
    assert reads["source_bytes"] / 8 <= reads["bytes"] <= reads["source_bytes"] / 8 * 1.05  # sharded over a node
    assert "this rank reads" in format_dryrun(result)
