"""The Qwen2 and Mistral families pass the Llama family's tests: logits equal transformers' from a tiny
config saved with ``save_pretrained`` (Qwen2's q/k/v biases, Mistral's sliding window, a head width of
its own), exact parameter counts for the published configs (counted by transformers on the meta device
here), ``model.hf_config`` reads every honoured key and refuses the rest one line each, and a fine-tune
from the folder (``checkpoint.init_from``) exports (``--to hf``) back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.extras import extra

transformers = extra("transformers")

from hpc.ckpt.hf import export_hf, hf_tensors as mapped_tensors  # noqa: E402
from hpc.core.config import ConfigError  # noqa: E402
from hpc.core.hf import hf_config  # noqa: E402
from hpc.core.models import model_facts  # noqa: E402
from hpc.core.models.decoder import LlamaShape, hf_names  # noqa: E402
from hpc.core.models.mistral import MISTRAL_PRESETS  # noqa: E402
from hpc.core.models.qwen2 import QWEN2_PRESETS  # noqa: E402
from hpc.core.spec import spec_from_dict  # noqa: E402
from trainer.model import build_model  # noqa: E402

from tests.hf.hf_helpers import hf_tensors, run_ranks  # noqa: E402
from tests.hf.test_hf_export import hpcx_model, loaded, logits_diff  # noqa: E402
from tests.trainer.trainer_testlib import make_run  # noqa: E402

CLASSES = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6)
# the published configs (config.json of Qwen/Qwen2.5-7B and mistralai/Mistral-7B-v0.3)
PUBLISHED = {
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1e6,
                                 rms_norm_eps=1e-6, max_position_embeddings=131072)),
    "mistral-7b-v0.3": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                                        tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-5,
                                        max_position_embeddings=32768, sliding_window=None)),
}
KNOWN = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "qwen2.5-72b": 72_706_203_648,
         "mistral-7b-v0.1": 7_241_732_096, "mistral-7b-v0.3": 7_248_023_552, "mistral-nemo-12b": 12_247_782_400}


def meta_count(arch: str, config: dict) -> int:
    """Parameters of the transformers model of ``config``, built on the meta device (a tied matrix once)."""
    cls = CLASSES[arch][0]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cls(**config))
    return sum(p.numel() for p in model.parameters())


def tiny_folder(path: Path, arch: str, seed: int = 0, **config) -> Path:
    """A random tiny model of ``arch`` saved by transformers; every bias and norm away from its init (zeros,
    ones), so a dropped or swapped one would show."""
    cfg_cls, model_cls = CLASSES[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**TINY, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.1)
    model.save_pretrained(path)
    return path


def spec_of(folder: Path, **model):
    return spec_from_dict({"model": {"hf_config": str(folder), **model}, "train": {"global_batch": 8}})


def hpcx_from(folder: Path, **model) -> tuple[torch.nn.Module, LlamaShape]:
    """hpcx's model of the folder's config.json, holding its tensors (through the export's name mapping)."""
    spec = spec_of(folder, **model)
    shape = model_facts(spec.model).shape
    net = build_model(spec.model, "cpu").eval()
    theirs = hf_tensors(folder)
    names = hf_names(shape)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(theirs[names[name][0]])
    return net, shape


# ---------------------------------------------------------------- counts and the built model


@pytest.mark.parametrize("size", PUBLISHED)
def test_published_parameter_counts_equal_transformers_on_the_meta_device(size):
    arch, config = PUBLISHED[size]
    facts = model_facts(spec_from_dict({"model": {"arch": arch, "size": size}}).model)
    assert facts.n_params == meta_count(arch, config) == KNOWN[size]
    assert sum(torch.Size(s).numel() for s in facts.param_shapes) == facts.n_params


@pytest.mark.parametrize("arch,size", [(a, s) for a, p in (("qwen2", QWEN2_PRESETS), ("mistral", MISTRAL_PRESETS))
                                       for s in p])
def test_every_presets_config_json_counts_the_same_in_transformers(arch, size):
    facts = model_facts(spec_from_dict({"model": {"arch": arch, "size": size}}).model)
    config = {k: v for k, v in hf_config(arch, facts.shape).items() if k not in ("architectures", "model_type")}
    assert meta_count(arch, config) == facts.n_params == KNOWN.get(size, facts.n_params)
    assert facts.label.startswith(f"{arch} {size} (")


@pytest.mark.parametrize("arch,size", [("qwen2", "tiny"), ("qwen2", "qwen2.5-0.5b"), ("mistral", "tiny"),
                                       ("mistral", "mistral-nemo-12b")])
def test_built_model_matches_its_facts(arch, size):
    spec = spec_from_dict({"model": {"arch": arch, "size": size}}).model
    net, facts = build_model(spec, "meta"), model_facts(spec)
    assert [tuple(p.shape) for p in net.parameters()] == list(facts.param_shapes)
    assert [n for n, _ in net.named_parameters()] == list(hf_names(facts.shape))
    assert max(sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules()) == \
        facts.largest_module_params
    # the Llama's module names: the parallel plans and LoRA targets apply unchanged
    assert {"wq", "wk", "wv", "wo"} <= dict(net.blocks[0].attn.named_children()).keys()
    assert {"w1", "w2", "w3"} <= dict(net.blocks[0].mlp.named_children()).keys()


# ---------------------------------------------------------------- logits equal transformers'


CASES = [("qwen2", {}), ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
         ("qwen2", {"head_dim": 32}),
         ("mistral", {"sliding_window": None}), ("mistral", {}),  # MistralConfig's 4096: longer than the samples
         ("mistral", {"sliding_window": 7}), ("mistral", {"sliding_window": 16, "head_dim": 8})]


@pytest.mark.parametrize("arch,config", CASES, ids=str)
def test_logits_equal_transformers_from_a_saved_config(tmp_path, arch, config):
    folder = tiny_folder(tmp_path / arch, arch, **config)
    ours, shape = hpcx_from(folder)
    if config.get("sliding_window"):
        assert shape.window == config["sliding_window"]
    assert shape.qkv_bias == (arch == "qwen2") and shape.tied == config.get("tie_word_embeddings", False)
    theirs = loaded(folder)
    assert logits_diff(ours, theirs, 256) <= 1e-5  # 24 tokens: past a window of 7 or 16
    # and the export's mapping of our state dict is the folder's tensors
    exported = dict(mapped_tensors(ours.state_dict(), arch, shape))
    source = hf_tensors(folder)
    assert sorted(exported) == sorted(source) and all(torch.equal(exported[k], source[k]) for k in source)


def test_a_window_shorter_than_the_samples_changes_the_logits(tmp_path):
    """The window is honoured, not ignored: 7 tokens back differs from every token back past the 7th."""
    full, _ = hpcx_from(tiny_folder(tmp_path / "full", "mistral", sliding_window=None))
    windowed, shape = hpcx_from(tiny_folder(tmp_path / "seven", "mistral", sliding_window=7))  # the same weights
    assert shape.window == 7 and all(torch.equal(a, b) for a, b in zip(full.parameters(), windowed.parameters()))
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = full(tokens), windowed(tokens)
    assert torch.equal(a[:, :7], b[:, :7]) and (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


# ---------------------------------------------------------------- config.json: honoured and refused


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_the_spec_takes_every_shape_from_the_config(tmp_path, arch):
    folder = tiny_folder(tmp_path / arch, arch, num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=5e5,
                         tie_word_embeddings=True, max_position_embeddings=128)
    spec = spec_of(folder, seq_len=32)
    s = model_facts(spec.model).shape
    assert spec.model.arch == arch
    assert (s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.ffn_dim, s.vocab_size, s.seq_len, s.context) == \
        (2, 64, 4, 1, 192, 256, 32, 128)
    assert (s.norm_eps, s.rope_theta, s.tied, s.qkv_bias) == (1e-5, 5e5, True, arch == "qwen2")
    assert s.window == (4096 if arch == "mistral" else 0)  # MistralConfig's default, as transformers reads it


@pytest.mark.parametrize("arch,change,words", [
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window = True; hpcx's Qwen2 attends to every earlier token"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types = ['full_attention', "
                                                                        "'sliding_attention']"),
    ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'default' only"),
    ("mistral", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "hpcx's Mistral implements rope_type 'default' only"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act = 'gelu'; hpcx's Mistral has 'silu'"),
    ("mistral", {"sliding_window": 0}, "sliding_window = 0: expected null or a whole number"),
    ("mistral", {"head_dim": 7}, "head_dim = 7: expected an even whole number"),
    ("qwen2", {"num_key_value_heads": 3}, "num_key_value_heads = 3: expected a divisor of num_attention_heads = 4"),
])
def test_what_hpcx_lacks_is_one_line_naming_the_key(tmp_path, arch, change, words):
    config = {"architectures": [CLASSES[arch][1].__name__], "model_type": arch, **TINY, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        spec_of(tmp_path)
    assert len(err.value.messages) == 1 and words in err.value.messages[0], err.value.messages


@pytest.mark.parametrize("arch,fields,message", [
    ("qwen2", {"size": "qwen3"}, r"`model.size` = 'qwen3': expected one of tiny, qwen2.5-0.5b"),
    ("mistral", {"n_kv_heads": 3}, r"`model.n_heads` = 4 is not divisible by `model.n_kv_heads` = 3"),
    ("mistral", {"head_dim": 7}, r"head size 7 is odd"),
    ("qwen2", {"dropout": 0.1}, r"`model.dropout` = 0.1 is not used by arch = 'qwen2'"),
])
def test_bad_specs_are_one_line_each(arch, fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        spec_from_dict({"model": {"arch": arch, **fields}})
    assert len(err.value.messages) == 1


def test_sliding_window_minus_one_turns_a_presets_window_off():
    def window(**f):
        return model_facts(spec_from_dict({"model": {"arch": "mistral", "size": "mistral-7b-v0.1", **f}}).model).shape.window

    assert (window(), window(sliding_window=-1), window(sliding_window=1024)) == (4096, 0, 1024)


# ---------------------------------------------------------------- init_from, then --to hf, bit for bit


@pytest.mark.parametrize("arch,config,strategy,ranks", [("qwen2", {}, "fsdp", 2),
                                                     ("mistral", {"sliding_window": 16}, "none", 1)])
def test_a_fine_tune_from_the_folder_exports_back_bit_for_bit(tmp_path, arch, config, strategy, ranks):
    folder = tiny_folder(tmp_path / "src", arch, **config)
    sets = [f"model.arch={arch!r}", f"model.hf_config={str(folder)!r}", f"checkpoint.init_from={str(folder)!r}",
            "train.lr=0.0", "train.steps=2", "data.shuffle=false", "model.seq_len=32"]
    run = make_run(tmp_path, "run", strategy, ranks, sets)
    out = run_ranks(run, ranks)
    assert out.returncode == 0, out.stderr[-4000:]
    summary = export_hf(run, tmp_path / "out")
    assert summary["arch"] == CLASSES[arch][1].__name__
    exported, source = hf_tensors(tmp_path / "out"), hf_tensors(folder)
    assert sorted(exported) == sorted(source)
    for name in source:
        assert torch.equal(exported[name].view(torch.uint8), source[name].view(torch.uint8)), name
    assert logits_diff(hpcx_model(run), loaded(tmp_path / "out"), 256) <= 1e-5
    config_out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_out["max_position_embeddings"] == 64 and config_out.get("sliding_window") == config.get("sliding_window")


@pytest.mark.parametrize("arch,config", [("qwen2", {}), ("mistral", {"sliding_window": 16})])
def test_a_lora_fine_tune_of_the_family_exports_what_peft_loads_with_hpcxs_logits(tmp_path, arch, config):
    """LoRA through the family seam: Qwen2's targeted q/k/v carry biases, Mistral's attention a window; the
    first loss is the base model's, ``--to peft`` loads in PeftModel with no missing or unexpected keys
    and hpcx's logits, ``--merge-lora`` is that model."""
    peft = extra("peft")
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from hpc.ckpt.dcp import DcpReader
    from hpc.ckpt.peft import ADAPTER_WEIGHTS
    from hpc.ckpt.peft_export import export_peft
    from tests.hf.hf_helpers import losses
    from trainer.lora import apply_lora
    from trainer.run import load_run

    folder = tiny_folder(tmp_path / "src", arch, **config)
    common = [f"model.arch={arch!r}", f"model.hf_config={str(folder)!r}", f"checkpoint.init_from={str(folder)!r}",
              "train.steps=3", "train.global_batch=4", "train.log_every=1", "data.shuffle=false", "model.seq_len=32"]
    lora = ["lora.rank=4", "lora.alpha=8.0", "lora.targets=['q_proj', 'k_proj', 'v_proj', 'o_proj', 'w2']"]
    base_run = make_run(tmp_path, "base", "none", 1, [*common, "train.steps=1"])
    run = make_run(tmp_path, "lora", "none", 1, [*common, *lora])
    for r in (base_run, run):
        out = run_ranks(r, 1)
        assert out.returncode == 0, out.stderr[-4000:]
    first, *rest = losses(run)
    assert first == losses(base_run)[0] and rest != [first] * len(rest)

    spec = load_run(run).spec
    ours = apply_lora(build_model(spec.model, "cpu"), spec).eval()
    theirs, names = hf_tensors(folder), hf_names(model_facts(spec.model).shape)
    reader = DcpReader(sorted((run / "checkpoints").glob("step-*"))[-1])
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(reader.read(f"model.{name}") if "lora_" in name else theirs[names[name][0]])
    reader.close()

    export_peft(run, tmp_path / "adapter")
    base = CLASSES[arch][1].from_pretrained(folder, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    written = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert set(written) == set(get_peft_model_state_dict(model))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (ours(tokens) - model(tokens).logits).abs().max().item() <= 1e-5
