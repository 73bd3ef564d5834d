"""What the document mask costs (``data.packing = "document"``, issue 32 item 3): the planner counts one
boolean ``micro_batch × seq_len²`` per micro-batch in its buffers, and ``hpcx dryrun`` builds the models'
own mask on the meta device at the job's real size and shows both."""

from __future__ import annotations

import dataclasses

import pytest

from hpc.cli import load_job
from hpc.core.models import model_facts
from hpc.dryrun import dryrun, format_dryrun
from hpc.plan.memory import Config, estimate, mask_bytes
from tests.conftest import REPO

JOBS = REPO / "jobs"


def _job(path: str, sets: list[str]):
    spec, site, launch = load_job(str(JOBS / path), "dgx-h100", sets)
    return spec, site, launch


@pytest.mark.parametrize("micro_batch, seq_len", [(1, 2048), (4, 4096), (2, 8192)])
def test_the_mask_is_counted_once_per_micro_batch_in_the_buffers(micro_batch, seq_len):
    spec, site, launch = _job("llama3-8b-finetune.toml", [f"model.seq_len={seq_len}",
                                                          f"train.micro_batch={micro_batch}"])
    facts = model_facts(spec.model)
    plain = Config(launch.dims, False, "bf16", True, micro_batch)
    packed = dataclasses.replace(plain, document_mask=True)
    a, b = estimate(facts, plain, 8), estimate(facts, packed, 8)
    assert a is not None and b is not None
    assert (b.buffers - a.buffers) * 1e9 == pytest.approx(micro_batch * seq_len ** 2)
    assert mask_bytes(micro_batch, seq_len) == micro_batch * seq_len ** 2
    assert any("document mask" in n for n in b.notes) and not any("document mask" in n for n in a.notes)
    assert (b.params, b.grads, b.optimizer, b.activations) == (a.params, a.grads, a.optimizer, a.activations)


def test_the_plan_of_a_packed_spec_counts_the_mask(monkeypatch):
    from hpc.plan import launch_row

    spec, site, launch = _job("llama3-8b-finetune.toml", ["model.seq_len=8192", "train.micro_batch=2"])
    plain = launch_row(spec, site, launch)
    spec.data.packing = "document"  # a prepared folder would be checked at load; the planner reads the field
    packed = launch_row(spec, site, launch)
    assert plain.memory is not None and packed.memory is not None
    assert (packed.memory.buffers - plain.memory.buffers) * 1e9 == pytest.approx(2 * 8192 ** 2)
    assert packed.need_gb > plain.need_gb


@pytest.mark.parametrize("path, sets", [
    ("llama3-8b-finetune.toml", ["model.seq_len=8192", "train.micro_batch=2"]),
    ("gpt-13b-auto.toml", ["parallel.strategy='fsdp'", "train.micro_batch=1"]),
])
def test_dryrun_builds_the_mask_on_meta_beside_the_plan(path, sets):
    spec, site, launch = _job(path, sets)
    spec.data.packing = "document"
    spec.checkpoint.init_from = ""  # the weights' headers are not what this checks
    result = dryrun(spec, site, launch, rank=0)
    seq = model_facts(spec.model).seq_len
    assert result.mask == {"micro_batch": spec.train.micro_batch, "seq_len": seq,
                           "bytes": spec.train.micro_batch * seq * seq, "planned": spec.train.micro_batch * seq * seq}
    assert result.problems == []
    assert f"document mask (data.packing = document): [{spec.train.micro_batch}, 1, {seq}, {seq}] bool" in \
        format_dryrun(result)


def test_dryrun_without_packing_shows_no_mask():
    spec, site, launch = _job("gpt-13b-auto.toml", ["parallel.strategy='fsdp'"])
    result = dryrun(spec, site, launch, rank=0)
    assert result.mask is None and "document mask" not in format_dryrun(result)
