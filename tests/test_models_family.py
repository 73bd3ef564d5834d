"""The model-family registry (``hpc.core.models``) as a new family meets it: every family implements the
``Family`` protocol (and its torch half ``trainer.models.Builder``), the spec's ``[model]`` section is the
fields every family has then each family's own, loaded strictly, and another family's fields are refused.

A made-up family ``ssm`` (a module written into tmp_path) stands in for the next one: its module and one
line in ``FAMILIES`` are all it takes."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc.core import models, spec as spec_mod
from hpc.core.errors import ConfigError

SSM_FAMILY = '''
from dataclasses import dataclass

from hpc.core.config import field
from hpc.core.models import ModelFacts


@dataclass
class Fields:
    state_dim: int = field(16, doc="SSM: state size per channel.", minimum=1)


def facts(model, counted=None):
    n = model.n_layers * model.dim * model.state_dim
    return ModelFacts(label=f"ssm ({n} params)", n_params=n, unit_params=model.dim * model.state_dim,
                      root_params=0, n_units=model.n_layers, flops_per_token=6.0 * n, seq_len=model.seq_len,
                      vocab_size=model.vocab_size, family="ssm")


class Ssm:
    name = "ssm"
    phrase = "arch = 'ssm'"
    fields = Fields
    builder = "ssm_builder"
    counted_by_building = False
    facts = staticmethod(facts)

    def problems(self, model):
        return [] if model.n_layers and model.dim else ["`model.n_layers` and `model.dim` must be set for arch = 'ssm'"]

    def activation_bytes(self, facts, micro_batch, checkpointing, mixed_precision, dropout=0.0, autocast=False):
        return None

    def code_notice(self, model):
        return None

    def preset_counts(self):
        return ""


FAMILY = Ssm()
'''


@pytest.fixture
def ssm(tmp_path: Path, monkeypatch):
    """The ``ssm`` family registered beside the built-in ones, and the spec's sections joined with it."""
    (tmp_path / "ssm_family.py").write_text(textwrap.dedent(SSM_FAMILY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(models.FAMILIES, "ssm", "ssm_family")
    joined = {**spec_mod.sections(), "model": models.section_class(spec_mod.CommonModel)}
    monkeypatch.setattr(spec_mod, "sections", lambda: joined)
    yield importlib.import_module("ssm_family").FAMILY
    sys.modules.pop("ssm_family", None)


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("fam", models.families(), ids=lambda f: f.name)
def test_every_registered_family_implements_the_protocol(fam):
    assert isinstance(fam, models.Family)
    assert dataclasses.is_dataclass(fam.fields) and isinstance(fam.counted_by_building, bool)
    assert models.family(fam.name if fam.name in models.FAMILIES else "pkg.mod:fn") is fam
    assert fam.builder.startswith("trainer.models.")


def test_a_member_missing_is_not_a_family():
    class NoFields:
        name, phrase, builder, counted_by_building = "x", "arch = 'x'", "trainer.models.x", False
        facts = problems = activation_bytes = code_notice = preset_counts = staticmethod(lambda *a: None)

    assert not isinstance(NoFields(), models.Family)
    NoFields.fields = type("Fields", (), {})
    assert isinstance(NoFields(), models.Family)


def test_the_hugging_face_sides_are_protocols_too():
    gpt, llama, qwen2, mistral, user = models.families()
    assert isinstance(gpt, models.HfMapped) and not isinstance(gpt, models.HfReader)
    assert isinstance(llama, models.HfReader) and llama.hf_arch == "LlamaForCausalLM"
    assert all(isinstance(f, models.HfReader) for f in (qwen2, mistral))
    assert not isinstance(user, models.HfMapped)
    from hpc.core.hf import architectures

    assert architectures() == {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                               "MistralForCausalLM": "mistral"}


@pytest.mark.parametrize("fam", models.families(), ids=lambda f: f.name)
def test_every_familys_torch_half_implements_the_builder(fam):
    from trainer import models as trainer_models

    builder = importlib.import_module(fam.builder)
    assert isinstance(builder, trainer_models.Builder)
    assert trainer_models.family(fam.name if fam.name in models.FAMILIES else "pkg.mod:fn") is builder


def test_the_section_is_the_common_fields_then_each_familys_own():
    names, common = _names(spec_mod.Model), _names(spec_mod.CommonModel)
    assert names[:len(common)] == common and common[0] == "arch"
    owned = spec_mod.Model.FAMILY_FIELDS
    assert names[len(common):] == list(dict.fromkeys(n for fam in models.families() for n in owned[fam.name]))
    assert owned["gpt"] == () and "n_kv_heads" in owned["llama"] and "kwargs" in owned["user"]
    assert names.count("arch") == 1  # one declaration (a second one used to win silently)
    # the Llama-block families share their block's fields (one declaration, decoder.BlockFields)
    shared = ("n_kv_heads", "ffn_dim", "rope_theta", "norm_eps", "context_len")
    assert all(set(shared) <= set(owned[f]) for f in ("llama", "qwen2", "mistral")) and names.count("ffn_dim") == 1
    assert "head_dim" in owned["qwen2"] and "head_dim" not in owned["llama"] and "sliding_window" in owned["mistral"]


def test_unknown_model_keys_name_the_valid_ones():
    with pytest.raises(ConfigError, match=r"`model.n_kv_head`.*did you mean `model.n_kv_heads`"):
        spec_mod.spec_from_dict({"model": {"arch": "llama", "n_kv_head": 2}})


@pytest.mark.parametrize("fields,message", [
    ({"arch": "llama", "kwargs": {"a": 1}}, r"`model.kwargs` = \{'a': 1\} is for user models, not 'llama'"),
    ({"arch": "pkg.mod:fn", "seq_len": 8, "vocab_size": 8, "norm_eps": 1e-6},
     r"`model.norm_eps` = 1e-06 is for arch = 'llama', arch = 'qwen2' or arch = 'mistral', not 'pkg.mod:fn'"),
    ({"arch": "llama", "head_dim": 32}, r"`model.head_dim` = 32 is for arch = 'qwen2' or arch = 'mistral', not 'llama'"),
    ({"arch": "qwen2", "sliding_window": 8}, r"`model.sliding_window` = 8 is for arch = 'mistral', not 'qwen2'"),
    ({"arch": "mistral", "rope_factor": 8.0}, r"`model.rope_factor` = 8.0 is for arch = 'llama', not 'mistral'"),
])
def test_another_familys_fields_are_refused(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        spec_mod.spec_from_dict({"model": fields})
    assert len(err.value.messages) == 1


def test_a_new_family_is_its_module_and_one_registry_line(ssm):
    assert isinstance(ssm, models.Family) and ssm in models.families()
    joined = models.section_class(spec_mod.CommonModel)
    assert joined.FAMILY_FIELDS["ssm"] == ("state_dim",) and list(joined.FAMILY_FIELDS)[-1] == "user"
    spec = spec_mod.spec_from_dict({"model": {"arch": "ssm", "n_layers": 2, "dim": 8, "state_dim": 4,
                                              "seq_len": 16, "vocab_size": 32}})
    facts = models.model_facts(spec.model)
    assert (facts.family, facts.n_params) == ("ssm", 64) and models.family_of(facts) is ssm
    with pytest.raises(ConfigError, match=r"`model.n_layers` and `model.dim` must be set for arch = 'ssm'"):
        spec_mod.spec_from_dict({"model": {"arch": "ssm"}})
    with pytest.raises(ConfigError, match=r"`model.state_dim` = 4 is for arch = 'ssm', not 'gpt'"):
        spec_mod.spec_from_dict({"model": {"state_dim": 4}})
    with pytest.raises(ConfigError, match=r"`model.state_dim` = 0: expected a value >= 1"):
        spec_mod.spec_from_dict({"model": {"arch": "ssm", "n_layers": 2, "dim": 8, "state_dim": 0}})


def test_two_families_declaring_one_field_is_refused(ssm, monkeypatch):
    clash = dataclasses.make_dataclass("Fields", [("n_kv_heads", int, dataclasses.field(default=0))])
    monkeypatch.setattr(type(ssm), "fields", clash)
    with pytest.raises(TypeError, match=r"ssm family.*n_kv_heads.*llama"):
        models.section_class(spec_mod.CommonModel)
    common = dataclasses.make_dataclass("Fields", [("arch", str, dataclasses.field(default=""))])
    monkeypatch.setattr(type(ssm), "fields", common)
    with pytest.raises(TypeError, match=r"arch.*CommonModel"):
        models.section_class(spec_mod.CommonModel)


def test_importing_the_spec_loads_no_family():
    """The ``[model]`` section is joined when first asked for (``hpcx`` commands that read no spec skip it)."""
    code = ("import sys, hpc.core.spec as s; "
            "before = sorted(m for m in sys.modules if m.startswith('hpc.core.models.')); "
            "s.Model; print(before, 'hpc.core.models.llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] True"
