"""What packed documents' attention holds (``data.packing = "document"``, issues 32 and 44): the planner
counts the kernel the trainer picks (``hpc.core.models.decoder.document_kernel``) and no dense mask. On a
GPU flex_attention's BlockMask: int32 counts and indices of 128-token blocks, O(seq²/128²), in the
buffers; on a CPU (or with dropout) SDPA per document span: no mask, one more attention output per block
in the activations. ``hpcx dryrun`` builds the BlockMask on the meta device at the job's size and shows
both."""

from __future__ import annotations

import dataclasses

import pytest

from hpc.cli import load_job
from hpc.core.models import model_facts
from hpc.core.models.decoder import block_mask_bytes
from hpc.dryrun import dryrun, format_dryrun
from hpc.plan.memory import Config, estimate
from tests.conftest import REPO

JOBS = REPO / "jobs"


def _job(path: str, sets: list[str], site: str = "dgx-h100"):
    spec, site, launch = load_job(str(JOBS / path), site, sets)
    return spec, site, launch


@pytest.mark.parametrize("micro_batch, seq_len", [(1, 2048), (4, 4096), (2, 8192), (2, 1000)])
def test_a_gpu_plan_counts_the_block_mask_once_per_micro_batch(micro_batch, seq_len):
    spec, site, launch = _job("llama3-8b-finetune.toml", [f"model.seq_len={seq_len}",
                                                          f"train.micro_batch={micro_batch}"])
    facts = model_facts(spec.model)
    plain = Config(launch.dims, False, "bf16", True, micro_batch)
    packed = dataclasses.replace(plain, document_mask=True)
    a, b = estimate(facts, plain, 8), estimate(facts, packed, 8)
    assert a is not None and b is not None
    n = -(-seq_len // 128)
    assert (b.buffers - a.buffers) * 1e9 == pytest.approx(16 * micro_batch * (n + n * n))
    assert block_mask_bytes(micro_batch, seq_len) == 16 * micro_batch * (n + n * n)
    assert block_mask_bytes(micro_batch, seq_len) < micro_batch * seq_len ** 2 / 500  # ~1/1024 of the dense mask's
    assert any("BlockMask" in note for note in b.notes) and not any("BlockMask" in note for note in a.notes)
    assert (b.params, b.grads, b.optimizer, b.activations) == (a.params, a.grads, a.optimizer, a.activations)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("gpu, dropout", [(False, 0.0), (True, 0.1)])
def test_the_span_kernel_keeps_one_attention_output_per_block(checkpointing, gpu, dropout):
    """A CPU site, or a GPU with dropout (flex_attention has none): no mask in the buffers, one
    [tokens, q_dim] output per block in the activations (one block's when checkpointed)."""
    spec, site, launch = _job("llama3-8b-finetune.toml", ["model.seq_len=4096", "train.micro_batch=2"])
    facts = model_facts(spec.model)
    plain = Config(launch.dims, False, "bf16", checkpointing, 2, dropout, gpu=gpu)
    a, b = estimate(facts, plain, 8), estimate(facts, dataclasses.replace(plain, document_mask=True), 8)
    assert a is not None and b is not None and a.activations is not None and b.activations is not None
    blocks = 1 if checkpointing else facts.shape.n_layers
    assert (b.activations - a.activations) * 1e9 == pytest.approx(blocks * 2 * 4096 * facts.shape.q_dim * 2)
    assert b.buffers == a.buffers
    assert any("SDPA per span" in note for note in b.notes)


def test_the_plan_of_a_packed_spec_counts_the_block_mask():
    from hpc.plan import launch_row

    spec, site, launch = _job("llama3-8b-finetune.toml", ["model.seq_len=8192", "train.micro_batch=2"])
    plain = launch_row(spec, site, launch)
    spec.data.packing = "document"  # a prepared folder would be checked at load; the planner reads the field
    packed = launch_row(spec, site, launch)
    assert plain.memory is not None and packed.memory is not None
    assert (packed.memory.buffers - plain.memory.buffers) * 1e9 == pytest.approx(block_mask_bytes(2, 8192))
    assert packed.need_gb >= plain.need_gb


@pytest.mark.parametrize("path, sets", [
    ("llama3-8b-finetune.toml", ["model.seq_len=8192", "train.micro_batch=2"]),
    ("gpt-13b-auto.toml", ["parallel.strategy='fsdp'", "train.micro_batch=1"]),
])
def test_dryrun_builds_the_block_mask_on_meta_beside_the_plan(path, sets):
    spec, site, launch = _job(path, sets)
    spec.data.packing = "document"
    spec.checkpoint.init_from = ""  # the weights' headers are not what this checks
    result = dryrun(spec, site, launch, rank=0)
    seq, batch = model_facts(spec.model).seq_len, spec.train.micro_batch
    assert result.mask == {"kernel": "flex", "micro_batch": batch, "seq_len": seq,
                           "bytes": block_mask_bytes(batch, seq), "planned": block_mask_bytes(batch, seq)}
    assert result.problems == []
    n = -(-seq // 128)
    assert f"flex_attention, BlockMask [{batch}, 1, {n}, {n}] int32" in format_dryrun(result)


def test_dryrun_on_a_cpu_site_names_the_span_kernel():
    spec, site, launch = _job("tiny-llama.toml", [], "sandbox")
    spec.data.packing = "document"
    result = dryrun(spec, site, launch, rank=0)
    assert result.mask is not None and result.mask["kernel"] == "segments" and result.mask["bytes"] == 0
    assert "SDPA per document span, no mask" in format_dryrun(result)


def test_dryrun_without_packing_shows_no_mask():
    spec, site, launch = _job("gpt-13b-auto.toml", ["parallel.strategy='fsdp'"])
    result = dryrun(spec, site, launch, rank=0)
    assert result.mask is None and "document attention" not in format_dryrun(result)
