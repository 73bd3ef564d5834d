"""The Llama family: exact published parameter counts, the built model agreeing with its facts, the
activation bytes autograd really keeps, and the spec's checks (one line each)."""

from __future__ import annotations

import pytest

from hpc.core.config import ConfigError
from hpc.core.models.llama import LLAMA_PRESETS, LlamaShape, hf_names, llama_activations, swiglu_hidden
from hpc.core.models import model_facts
from hpc.core.spec import spec_from_dict

PUBLISHED = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
             "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3.1-405b": 405_853_388_800,
             "llama3.2-1b": 1_235_814_400}


def model(**fields):
    return spec_from_dict({"model": {"arch": "llama", **fields}, "train": {"global_batch": 8}}).model


@pytest.mark.parametrize("size,count", PUBLISHED.items())
def test_published_parameter_counts_are_exact(size, count):
    facts = model_facts(model(size=size))
    assert facts.n_params == count == LLAMA_PRESETS[size].n_params
    assert sum(_numel(s) for s in facts.param_shapes) == count
    assert facts.label.startswith(f"llama {size} (")


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def test_swiglu_width_follows_metas_rounding():
    assert [swiglu_hidden(4096, 256), swiglu_hidden(4096, 1024, 1.3), swiglu_hidden(16384, 4096, 1.2),
            swiglu_hidden(2048, 256, 1.5)] == [11008, 14336, 53248, 8192]


def test_spec_fields_replace_the_presets():
    s = model_facts(model(size="tiny", dim=96, n_heads=6, n_kv_heads=3, n_layers=3, ffn_dim=200,
                          rope_theta=1e6, tie_embeddings=True)).shape
    assert (s.d_model, s.n_heads, s.n_kv_heads, s.n_layers, s.ffn_dim, s.rope_theta, s.tied) == \
        (96, 6, 3, 3, 200, 1e6, True)
    assert model_facts(model(size="llama3.2-1b")).shape.tied  # the preset is tied


def test_flops_per_token_counts_the_head_and_attention():
    s = LLAMA_PRESETS["llama3-8b"]
    non_embedding = s.n_params - s.embedding_params
    assert s.flops_per_token() == 6.0 * non_embedding + 12.0 * s.n_layers * s.d_model * s.seq_len


@pytest.mark.parametrize("fields,message", [
    ({"size": "7b"}, r"`model.size` = '7b': expected one of tiny, small, llama2-7b"),
    ({"n_heads": 5, "n_kv_heads": 5}, r"`model.dim` = 64 is not divisible by `model.n_heads` = 5"),
    ({"n_kv_heads": 3}, r"`model.n_heads` = 4 is not divisible by `model.n_kv_heads` = 3"),
    ({"dropout": 0.1}, r"`model.dropout` = 0.1 is not used by arch = 'llama'"),
])
def test_bad_llama_specs_are_one_line_each(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        model(**fields)
    assert len(err.value.messages) == 1


def test_llama_fields_on_the_gpt_are_refused():
    with pytest.raises(ConfigError, match=r"`model.n_kv_heads` = 2 is for arch = 'llama', arch = 'qwen2' or arch = 'mistral', not 'gpt'"):
        spec_from_dict({"model": {"n_kv_heads": 2}})


def test_hf_names_cover_every_parameter_in_order():
    s = LLAMA_PRESETS["tiny"]
    names = hf_names(s)
    assert list(names)[:3] == ["tok_emb.weight", "blocks.0.attn_norm.weight", "blocks.0.attn.wq.weight"]
    assert names["blocks.1.mlp.w2.weight"] == ("model.layers.1.mlp.down_proj.weight", (s.d_model, s.ffn_dim))
    assert "head.weight" not in hf_names(LlamaShape(1, 8, 2, 1, 16, 8, 32, tied=True))


# --- torch: the built model and autograd ------------------------------------------------------

SHAPES = [(LlamaShape(3, 96, 4, 2, 160, 80, 300), 3), (LlamaShape(2, 128, 8, 8, 256, 64, 2000), 2),
          (LlamaShape(2, 64, 4, 1, 96, 48, 500, tied=True), 4)]
MODES = ["fp32", "autocast", "bf16-weights"]


def measured_held(shape, micro_batch, mode):
    """Bytes autograd saves in one forward (once per storage, parameters and buffers excluded) + the logits."""
    import torch
    from trainer.models.llama import Llama
    from trainer.objective import micro_loss

    torch.manual_seed(0)
    net = Llama(shape)
    if mode == "bf16-weights":
        net = net.to(torch.bfloat16)
    own = {t.untyped_storage().data_ptr() for t in [*net.parameters(), *net.buffers()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, shape.vocab_size, (micro_batch, shape.seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            logits = net(tokens[:, :-1])
        micro_loss(logits, tokens, None, 1.0)  # as trainer.loop does (the chunked cross-entropy)
    saved.pop(logits.untyped_storage().data_ptr(), None)  # the loss saves the logits themselves: counted below
    return sum(saved.values()) + logits.numel() * logits.element_size()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,micro_batch", SHAPES, ids=str)
def test_held_activations_match_autograd(shape, micro_batch, mode):
    mixed = "none" if mode == "fp32" else "bf16"
    predicted = llama_activations(shape, micro_batch, False, mixed, autocast=mode != "bf16-weights").held
    if mode == "autocast":  # the bf16 weight copies autocast caches (the planner's buffers)
        predicted += shape.matmul_params * 2
    assert measured_held(shape, micro_batch, mode) == pytest.approx(predicted, rel=0.001)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_built_model_matches_its_facts(size):
    from trainer.model import build_model

    spec = model(size=size)
    net = build_model(spec, "meta")
    facts = model_facts(spec)
    assert [tuple(p.shape) for p in net.parameters()] == list(facts.param_shapes)
    assert [n for n, _ in net.named_parameters()] == list(hf_names(facts.shape))
    assert max(sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules()) == \
        facts.largest_module_params


# --- planner, dryrun, render --------------------------------------------------------------------

L70 = ["model.arch='llama'", "model.size='llama3-70b'", "job.nodes=16", "job.tasks_per_node=8",
       "train.global_batch=128"]


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_dryrun_of_llama3_70b_on_128_ranks_agrees_with_the_plan(strategy):
    from hpc.cli import load_job
    from hpc.dryrun import dryrun

    from tests.conftest import REPO

    spec, site, launch = load_job(str(REPO / "jobs" / "gpt-13b-auto.toml"), "dgx-h100",
                                  [*L70, f"parallel.strategy={strategy!r}"])
    result = dryrun(spec, site, launch, rank=127)
    assert result.n_params == 70_553_706_496 and result.problems == [], result.problems
    for what in ("params", "grads", "optimizer"):
        assert result.measured[what] == pytest.approx(result.planned[what], rel=0.01), what


def test_the_tiny_llama_job_plans_on_the_local_site():
    from tests.conftest import REPO, hpcx

    out = hpcx("plan", str(REPO / "jobs" / "tiny-llama.toml"), "--site", "local")
    assert out.returncode == 0, out.stderr
    assert "llama tiny (131K params)" in out.stdout


def test_meta_build_materializes_with_the_weight_init_scheme():
    import torch
    from trainer.models.llama import rope_frequencies
    from trainer.model import WeightInit, build_model

    spec = model(size="tiny", rope_factor=8.0, rope_original_seq_len=16)
    shape = model_facts(spec).shape
    states = []
    for _ in range(2):
        net = build_model(spec, "meta")
        WeightInit.of(net, seed=7).materialize(net, torch.device("cpu"))
        states.append({k: v.clone() for k, v in net.state_dict().items()})
        assert torch.equal(net.rope.inv_freq, rope_frequencies(shape))
        assert torch.equal(net.norm.weight, torch.ones(shape.d_model))
        assert net.blocks[0].attn.wo.weight.std().item() < net.blocks[0].attn.wq.weight.std().item()
    assert "rope.inv_freq" not in states[0]  # not in checkpoints: computed from the shape
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_llama3_scaling_divides_only_the_long_wavelengths():
    import torch
    from trainer.models.llama import rope_frequencies

    plain = rope_frequencies(LlamaShape(1, 128, 1, 1, 8, 8, 8, rope_theta=500000.0))
    scaled = rope_frequencies(LlamaShape(1, 128, 1, 1, 8, 8, 8, rope_theta=500000.0, rope_factor=8.0))
    wavelen = 2 * torch.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    assert torch.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)


def test_scale_predict_counts_the_llama():
    from tests.conftest import REPO, hpcx

    out = hpcx("scale", "predict", str(REPO / "jobs" / "llama3-8b-finetune.toml"), "--site", "dgx-h100",
               "--nodes", "2,4")
    assert out.returncode == 0 and "llama3-8b-ft" in out.stdout, out.stderr
