"""The built-in GPT has exactly the planner's parameter count; user models name their blocks."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from hpc.core.errors import ConfigError
from hpc.core.models.gpt import GPT_PRESETS, gpt_shape
from hpc.core.spec import Model
from trainer.model import build_model, model_blocks
from trainer.models.gpt import GPT


@pytest.mark.parametrize("size", list(GPT_PRESETS))
def test_parameter_count_matches_planner(size):
    shape = GPT_PRESETS[size]
    with torch.device("meta"):  # counts without allocating 70B parameters
        model = GPT(shape)
    assert model.num_params() == shape.n_params


@pytest.mark.parametrize("size", list(GPT_PRESETS))
def test_parameter_shapes_and_largest_module_match_the_planner(size):
    """The planner pads each tensor's shard (param_shapes) and sizes init by the largest module."""
    shape = GPT_PRESETS[size]
    with torch.device("meta"):
        model = GPT(shape)
    assert tuple(tuple(p.shape) for p in model.parameters()) == shape.param_shapes()
    own = [sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()]
    assert max(own) == shape.largest_module_params


def test_gpt_units_outside_the_blocks_cover_every_other_parameter():
    model = build_model(Model(size="tiny"), "meta")
    outer = {id(p) for group in model.fsdp_units() for m in group for p in m.parameters()}
    inner = {id(p) for p in model.blocks.parameters()}
    assert outer.isdisjoint(inner) and outer | inner == {id(p) for p in model.parameters()}


def test_overrides_of_seq_len_and_vocab_are_built():
    model = build_model(Model(size="tiny", seq_len=32, vocab_size=100), "cpu")
    assert model.pos_emb.num_embeddings == 32 and model.head.out_features == 100
    assert model.num_params() == gpt_shape("tiny", 32, 100).n_params


def test_forward_is_causal():
    torch.manual_seed(0)
    model = build_model(Model(size="tiny"), "cpu").eval()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.equal(a[0, :10], b[0, :10]) and not torch.equal(a[0, 10:], b[0, 10:])


def _user_model(width: int = 8) -> nn.Module:
    model = nn.Module()
    model.transformer = nn.Module()
    model.transformer.h = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
    return model


def test_user_model_and_blocks_path(monkeypatch):
    module = types.ModuleType("user_models_for_test")
    module.make = _user_model
    monkeypatch.setitem(sys.modules, "user_models_for_test", module)
    model = build_model(Model(arch="user_models_for_test:make", kwargs={"width": 4}), "cpu")
    blocks = model_blocks(model, "transformer.h")
    assert len(blocks) == 3 and blocks[0].in_features == 4


def test_wrong_blocks_path_names_the_children():
    with pytest.raises(ConfigError, match="has no attribute 'layers'.*children: transformer"):
        model_blocks(_user_model(), "layers")
    with pytest.raises(ConfigError, match="expected nn.ModuleList"):
        model_blocks(_user_model(), "transformer")


@pytest.mark.parametrize("arch,words", [
    ("no_such_package_hpcx.mod:make", "cannot import 'no_such_package_hpcx.mod' here"),
    ("user_models_for_test:missing", "has no function 'missing'"),
    ("user_models_for_test:not_a_module", "returned int, expected an nn.Module")])
def test_a_user_model_that_cannot_be_built_is_a_config_error(monkeypatch, arch, words):
    module = types.ModuleType("user_models_for_test")
    module.not_a_module = lambda: 3
    monkeypatch.setitem(sys.modules, "user_models_for_test", module)
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        build_model(Model(arch=arch), "meta")
