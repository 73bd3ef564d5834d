"""``checkpoint.init_from`` under tensor parallelism reads each rank's block only: rows and, for the
row-wise matrices (``wo``, ``w2``), columns (tp 2 × fsdp 2 on 4 gloo ranks): every byte of the source
read by exactly one rank (the norms, replicated over tp, by one rank of each tp position), about a
quarter each, and the loaded weights bit-identical to the file's."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from tests.extras import extra

extra("transformers")

from hpc.ckpt.init_source import open_source  # noqa: E402

from tests.hf.hf_helpers import LLAMA, hf_folder, hf_tensors  # noqa: E402
from tests.trainer.trainer_testlib import make_run, torchrun  # noqa: E402

pytestmark = pytest.mark.slow
WIDE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=16384, max_position_embeddings=256)
WIDE_SETS = ["model.size='small'", "model.dim=512", "model.vocab_size=16384", "model.n_heads=8", "model.n_kv_heads=4"]


def test_tp2_fsdp2_reads_a_quarter_each_and_loads_the_files_bits(tmp_path):
    from hpc.core.models import model_facts
    from trainer.run import load_run

    wide = hf_folder(tmp_path / "hf", shard="40MB", **WIDE)
    run = make_run(tmp_path, "tp2", "fsdp", 4, [*LLAMA, *WIDE_SETS, "parallel.tp=2", "parallel.tp_on_cpu=true",
                                                 f"checkpoint.init_from={str(wide)!r}"])
    out = tmp_path / "reports.json"
    result = torchrun(4, ["tests/hf/init_worker.py", str(out), str(run), "digests"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = json.loads(out.read_text())
    source = reports[0]["source_bytes"]
    norms = (2 * WIDE["num_hidden_layers"] + 1) * WIDE["hidden_size"] * 4  # replicated over tp: read by both ranks
    assert sum(r["bytes_read"] for r in reports) == source + norms  # every other byte once, by exactly one rank
    for r in reports:
        assert r["bytes_read"] <= source / 4 * 1.05, r  # model / (dp shard × tp), not model / dp shard
    shape = model_facts(load_run(run).spec.model).shape
    hf = hf_tensors(wide)
    expected = {n: hashlib.sha256(hf[t.key].contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
                for n, t in open_source(wide, "llama", shape).tensors.items()}
    assert reports[0]["digests"] == expected
