"""Any model size: the built-in GPT by architecture, user models that state or count their size, and
the real parameter count wherever a preset's name appears."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from hpc.core.config import ConfigError
from hpc.core.models import count_text, model_facts
from hpc.core.models.gpt import GPT_PRESETS, GPTShape, spec_shape
from hpc.plan import choose, format_plan, plan_job
from hpc.core.spec import spec_from_dict

from tests.conftest import REPO, hpcx
from tests.test_plan import NVSWITCH_8X80, ONE_24GB, site


def model(**fields):
    return spec_from_dict({"model": fields, "train": {"global_batch": 8}}).model


# --- the real count beside every preset name --------------------------------------------------

@pytest.mark.parametrize("size,count", [("tiny", "136K"), ("125m", "164M"), ("350m", "407M"), ("1.3b", "1.42B"),
                                        ("13b", "13.1B"), ("70b", "65.3B")])
def test_labels_carry_the_real_count(size, count):
    assert model_facts(model(size=size)).label == f"gpt {size} ({count} params)"


def test_presets_differ_from_their_names_and_the_docs_say_so():
    assert GPT_PRESETS["125m"].n_params == 163_812_864  # untied head + learned positions: +31%
    docs = (REPO / "docs" / "spec.md").read_text()
    assert "125m (164M)" in docs and "70b (65.3B)" in docs


def test_the_count_shows_in_the_plan_header_and_in_auto_errors():
    s = spec_from_dict({"model": {"size": "6.7b"}, "train": {"global_batch": 1},
                        "parallel": {"mixed_precision": "bf16"}})
    assert "gpt 6.7b (6.86B params) on test" in format_plan(plan_job(s, site(**ONE_24GB)))
    with pytest.raises(ConfigError, match=r"no strategy fits gpt 6\.7b \(6\.86B params\)"):
        choose(s, site(**ONE_24GB), 1)


def test_count_text():
    assert [count_text(n) for n in (999, 1000, 135_808, 163_812_864, 1_000_000_000, 65_268_105_216)] == \
        ["999", "1K", "136K", "164M", "1B", "65.3B"]


# --- the built-in GPT by architecture -------------------------------------------------------------

ARCHS = [
    (dict(size="125m", tie_embeddings=True), GPTShape(12, 768, 12, 2048, 50304, True)),
    (dict(size="tiny", dim=96, n_layers=3, n_heads=6), GPTShape(3, 96, 6, 64, 256)),
    (dict(size="350m", dim=1024, n_layers=12, n_heads=8, seq_len=512, vocab_size=32000, tie_embeddings=True),
     GPTShape(12, 1024, 8, 512, 32000, True)),
    (dict(size="small", n_layers=2), GPTShape(2, 384, 6, 256, 8192)),
]


@pytest.mark.parametrize("fields,shape", ARCHS, ids=[str(a[0]) for a in ARCHS])
def test_spec_gives_the_architecture(fields, shape):
    facts = model_facts(model(**fields))
    assert spec_shape(model(**fields)) == shape
    assert facts.n_params == shape.n_params and facts.unit_params == 12 * shape.d_model ** 2 + 4 * shape.d_model
    assert facts.root_params == facts.n_params - shape.n_layers * facts.unit_params


def test_tied_head_drops_one_vocabulary_matrix():
    untied, tied = (model_facts(model(size="1.3b", tie_embeddings=t)).n_params for t in (False, True))
    assert untied - tied == 50304 * 2048
    # the head's matmul still runs: FLOPs per token do not change
    assert model_facts(model(size="1.3b", tie_embeddings=True)).flops_per_token == \
        model_facts(model(size="1.3b")).flops_per_token


@pytest.mark.parametrize("fields,message", [
    (dict(size="125m", dim=1000), "`model.dim` = 1000 is not divisible by `model.n_heads` = 12"),
    (dict(size="tiny", n_heads=5), "`model.dim` = 64 is not divisible by `model.n_heads` = 5"),
    (dict(size="tiny", n_params=10), "`model.n_params` = 10 is for user models"),
    (dict(arch="a.b:c", seq_len=8, vocab_size=10, n_params=1000), "`model.n_layers` and `model.dim` are not"),
    (dict(arch="a.b:c", seq_len=8, vocab_size=10, n_params=1000, dim=8), "`model.n_layers` is not"),
    (dict(arch="a.b:c", seq_len=8, vocab_size=1000, n_params=1000, n_layers=2, dim=8),
     "is not more than the embedding and head alone"),
    (dict(arch="a.b:c", seq_len=8, vocab_size=1000, n_params=8000, n_layers=2, dim=8, tie_embeddings=True),
     "is not more than the embedding alone"),
])
def test_impossible_architectures_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model(**fields)


def test_bad_architecture_exits_2_in_one_line(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[model]\nsize = "125m"\ndim = 1000\n')
    out = hpcx("plan", str(job), "--site", "dgx-h100")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [
        f"error: {job}: `model.dim` = 1000 is not divisible by `model.n_heads` = 12 (head size 83.3333)"]


# --- user models -----------------------------------------------------------------------------------

def test_user_model_states_its_size():
    m = model(arch="pkg.mod:build", seq_len=4096, vocab_size=32000, n_params=6_738_415_616, n_layers=32, dim=4096)
    facts = model_facts(m)
    assert facts.label == "pkg.mod:build (6.74B params, stated)"
    root = 2 * 32000 * 4096  # embedding + untied head
    assert facts.root_params == root and facts.unit_params == -(-(6_738_415_616 - root) // 32)
    assert facts.flops_per_token == 6 * (6_738_415_616 - 32000 * 4096) + 12 * 32 * 4096 * 4096
    plan = plan_job(spec_from_dict({"model": {"arch": "pkg.mod:build", "seq_len": 4096, "vocab_size": 32000,
                                              "n_params": 6_738_415_616, "n_layers": 32, "dim": 4096},
                                    "train": {"global_batch": 8}, "parallel": {"mixed_precision": "bf16"}}),
                    site(**NVSWITCH_8X80))
    assert plan.choice is not None and plan.choice.dims.fsdp_enabled  # 108 GB of states: no replica fits
    assert any("parameter count stated in the spec" in n for n in plan.notes)


USER_MODULE = """
    from torch import nn

    class Net(nn.Module):
        def __init__(self, width, layers, vocab, tied):
            super().__init__()
            self.emb = nn.Embedding(vocab, width)
            self.stack = nn.ModuleList(nn.Sequential(nn.Linear(width, 3 * width), nn.Linear(3 * width, width))
                                       for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.out = nn.Linear(width, vocab, bias=False)
            if tied:
                self.out.weight = self.emb.weight

    def build(width=32, layers=3, vocab=50, tied=False):
        return Net(width, layers, vocab, tied)
"""


@pytest.mark.parametrize("tied", [False, True])
def test_count_params_builds_a_user_model_on_the_meta_device(tmp_path, tied):
    (tmp_path / "netmod.py").write_text(textwrap.dedent(USER_MODULE))
    job = tmp_path / "job.toml"
    job.write_text(textwrap.dedent(f"""
        [model]
        arch = "netmod:build"
        blocks = "stack"
        seq_len = 64
        vocab_size = 50
        kwargs = {{width = 32, layers = 3, vocab = 50, tied = {str(tied).lower()}}}
        [train]
        global_batch = 8
    """))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    block = (32 * 96 + 96) + (96 * 32 + 32)
    total = 50 * 32 + 3 * block + 2 * 32 + (0 if tied else 50 * 32)
    out = hpcx("plan", str(job), "--site", "dgx-h100", "--count-params", "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert f"counted on the meta device: {total} parameters in 3 blocks (largest {block})" in out.stderr
    doc = json.loads(out.stdout)
    assert doc["n_params"] == total and doc["model"].endswith("params, counted)")
    # without the flag the same spec plans as a model of unknown size
    plain = json.loads(hpcx("plan", str(job), "--site", "dgx-h100", "--json", env=env).stdout)
    assert plain["n_params"] is None


def test_count_params_on_a_broken_user_model_exits_2(tmp_path):
    (tmp_path / "broken.py").write_text("def build():\n    raise RuntimeError('needs a checkpoint file')\n")
    job = tmp_path / "job.toml"
    job.write_text('[model]\narch = "broken:build"\nseq_len = 8\nvocab_size = 10\n')
    env = {"PYTHONPATH": str(tmp_path)}
    out = hpcx("plan", str(job), "--site", "dgx-h100", "--count-params", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "could not build it on the meta device" in out.stderr and "needs a checkpoint file" in out.stderr


# --- the trainer builds what the spec describes ------------------------------------------------------

def test_trainer_builds_the_spec_architecture():
    from trainer.model import build_model

    for fields, shape in ARCHS:
        built = build_model(model(**fields), "meta")
        assert built.num_params() == shape.n_params, fields
        assert (built.head.weight is built.tok_emb.weight) == shape.tied
        assert len(built.blocks) == shape.n_layers and built.blocks[0].attn.n_heads == shape.n_heads


def test_tied_gpt_trains_through_the_shared_matrix():
    import torch
    from trainer.model import build_model

    torch.manual_seed(0)
    net = build_model(model(size="tiny", tie_embeddings=True), "cpu")
    tokens = torch.randint(0, 256, (2, 17))
    loss = torch.nn.functional.cross_entropy(net(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert net.tok_emb.weight.grad is not None and net.head.weight.grad is net.tok_emb.weight.grad


def test_dryrun_header_prints_the_parameter_count_once():
    """Issue 23: the header said "gpt 70b (65.3B params) (65.27B params)"."""
    from hpc.dryrun import model_text
    from hpc.core.models.gpt import gpt_facts, gpt_shape

    facts = gpt_facts("gpt 70b", gpt_shape("70b"))
    assert model_text(facts.label, facts.n_params) == "gpt 70b (65.3B params)"
    assert model_text("pkg.mod:build (parameters unknown)", 1_234_567) == "pkg.mod:build (1.23M params built)"
    assert model_text("pkg.mod:build (7.00B params, stated)", 6_738_415_616) == \
        "pkg.mod:build (7.00B params, stated); 6.74B params built"
