"""``model.hf_config = "PATH"``: the family and every shape from a Hugging Face ``config.json``, on the
login node without torch; a contradicting spec value or an architecture hpcx lacks is one line naming
both, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.core.config import ConfigError
from hpc.core.hf import hf_config
from hpc.core.models.llama import LLAMA_PRESETS, LlamaShape
from hpc.core.models import model_facts
from hpc.core.spec import spec_from_dict

from tests.conftest import REPO, hpcx
from tests.extras import extra

SHAPE = LlamaShape(2, 64, 4, 2, 192, 64, 256, rope_theta=500000.0, rope_factor=8.0, rope_original_seq_len=16,
                   norm_eps=1e-6)


def folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    return tmp_path / "m"


def spec(path: Path, **model):
    return spec_from_dict({"model": {"hf_config": str(path), **model}, "train": {"global_batch": 8}})


@pytest.mark.parametrize("shape", [SHAPE, LLAMA_PRESETS["llama3.2-1b"], LLAMA_PRESETS["llama2-70b"]], ids=str)
def test_every_shape_comes_from_the_config(tmp_path, shape):
    s = spec(folder(tmp_path, hf_config("llama", shape)))
    facts = model_facts(s.model)
    assert s.model.arch == "llama" and facts.shape == shape and facts.n_params == shape.n_params
    assert s.model.hf_config == str(tmp_path / "m")


def test_a_config_saved_by_transformers_5_gives_the_same_shape_and_count(tmp_path):
    transformers = extra("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                                   rms_norm_eps=1e-6, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    cfg.save_pretrained(tmp_path / "m")
    facts = model_facts(spec(tmp_path / "m").model)
    assert facts.shape == SHAPE
    import torch
    with torch.device("meta"):
        assert transformers.LlamaForCausalLM(cfg).num_parameters() == facts.n_params


def test_agreeing_spec_values_are_fine_and_a_contradiction_names_both(tmp_path):
    path = folder(tmp_path, hf_config("llama", SHAPE))
    assert spec(path, dim=64, arch="llama").model.dim == 64
    with pytest.raises(ConfigError) as err:
        spec(path, dim=96, n_kv_heads=4)
    assert err.value.messages == [
        f"<spec>: `model.dim` = 96 contradicts {path}/config.json: hidden_size = 64",
        f"<spec>: `model.n_kv_heads` = 4 contradicts {path}/config.json: num_key_value_heads = 2"]


@pytest.mark.parametrize("change,words", [
    ({"architectures": ["GemmaForCausalLM"]}, "architectures = ['GemmaForCausalLM']; hpcx implements "
                                              "['LlamaForCausalLM', 'Qwen2ForCausalLM', 'MistralForCausalLM'] only"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'; hpcx's Llama has 'silu'"),
    ({"attention_bias": True}, "attention_bias = True; hpcx's Llama has False"),
    ({"head_dim": 32}, "head_dim = 32; hpcx's Llama has hidden_size / num_attention_heads = 16"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "hpcx implements rope_type 'default' and 'llama3'"),
])
def test_what_hpcx_lacks_is_one_line_exit_2(tmp_path, change, words):
    path = folder(tmp_path, {**hf_config("llama", SHAPE), **change})
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\nhf_config = "{path}"\n[train]\nglobal_batch = 8\n')
    out = hpcx("plan", str(job), "--site", "local")
    assert out.returncode == 2 and words in out.stderr and str(path) in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_a_missing_or_broken_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        spec(tmp_path / "nowhere")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        spec(tmp_path / "bad")


def test_the_login_node_reads_it_without_torch(tmp_path):
    path = folder(tmp_path, hf_config("llama", LLAMA_PRESETS["llama3-8b"]))
    code = ("import sys; from hpc.core.spec import spec_from_dict; from hpc.core.models import model_facts; "
            f"s = spec_from_dict({{'model': {{'hf_config': {str(path)!r}}}}}); "
            "print(model_facts(s.model).n_params, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["8030261248", "False"]


def llama31_folder(tmp_path: Path) -> Path:
    """A Llama 3.1 8B config.json as Meta publishes it: a context of 131,072 tokens."""
    from dataclasses import replace

    return folder(tmp_path, hf_config("llama", replace(LLAMA_PRESETS["llama3.1-8b"], context_len=131072)))


def test_the_training_length_is_a_choice_up_to_the_models_context(tmp_path):
    path = llama31_folder(tmp_path)
    whole = model_facts(spec(path).model)
    assert whole.seq_len == 131072 and whole.shape.context == 131072  # unset: the model's context
    facts = model_facts(spec(path, seq_len=8192).model)
    assert facts.seq_len == 8192 and facts.shape.context == 131072
    assert facts.shape == replace_context(LLAMA_PRESETS["llama3.1-8b"], 131072)
    assert hf_config("llama", facts.shape)["max_position_embeddings"] == 131072  # the export records the model's
    with pytest.raises(ConfigError) as err:
        spec(path, seq_len=131073)
    assert err.value.messages == ["<spec>: `model.seq_len` = 131073 is longer than the model's context "
                                  "`model.context_len` = 131072: train at most 131072 tokens a sample"]


def replace_context(shape: LlamaShape, context: int) -> LlamaShape:
    from dataclasses import replace

    return replace(shape, context_len=context)


def test_the_plan_of_a_llama_31_config_at_seq_len_8192_is_the_8192_plan(tmp_path):
    path = llama31_folder(tmp_path)
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\nhf_config = "{path}"\n[train]\nglobal_batch = 8\n')
    preset = tmp_path / "preset.toml"  # the same model, its preset's seq_len 8192
    preset.write_text('[model]\narch = "llama"\nsize = "llama3.1-8b"\n[train]\nglobal_batch = 8\n')

    def activations(*args: str) -> list[float]:
        out = hpcx("plan", *args, "--site", "local", "--json")
        assert out.returncode == 0, out.stderr
        return [row["memory_gb"]["activations"] for row in json.loads(out.stdout)["rows"]]

    at_8192 = activations(str(job), "--set", "model.seq_len=8192")
    assert at_8192 == activations(str(preset))
    assert activations(str(job))[0] > 15 * at_8192[0]  # the whole context: 16× the tokens
