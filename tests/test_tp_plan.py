"""The tensor-parallel plan is data each built-in family declares (``hpc.core.models.tp_plan``, issue 41): it
names only modules its built model has (meta device), the planner's split (``ModelFacts.tp_split``) follows from
it and equals the split table it replaced, and ``trainer.tp.apply_tp`` places every parameter as the plan's
role says (one process on torch's fake process group, a tp group of 2)."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
from torch import nn

from hpc.core import models
from hpc.core.models import families, family, model_facts
from hpc.core.models.decoder import BLOCK_TP_PLAN, hf_names
from hpc.core.models.gpt import TP_PLAN as GPT_TP_PLAN
from hpc.core.models.llama import LLAMA_PRESETS
from hpc.core.models.tp_plan import IN_DIM, OUT_DIM, REPLICATED, BlockTp, TpPlan, tp_plan_of
from hpc.core.spec import Model
from trainer.model import build_model

BUILT_IN = list(models.FAMILIES)
VARIANTS = [(arch, tied) for arch in BUILT_IN for tied in (False, True)]


def built(arch: str, tied: bool = False) -> tuple[nn.Module, Model]:
    spec = Model(arch=arch, size="tiny", tie_embeddings=tied)
    return build_model(spec, "meta"), spec


def plan(arch: str) -> TpPlan:
    found = tp_plan_of(family(arch))
    assert found is not None
    return found


def test_every_built_in_family_declares_a_plan_and_no_other_does():
    assert {fam.name for fam in families() if tp_plan_of(fam) is not None} == set(BUILT_IN)
    assert tp_plan_of(family("pkg.mod:make")) is None and tp_plan_of(family(models.TASK)) is None
    assert plan("llama") is plan("qwen2") is plan("mistral") is BLOCK_TP_PLAN  # one block, one plan
    assert plan("gpt").block.whole == ("attn",) and not plan("gpt").planned  # the fused qkv: computed whole


@pytest.mark.parametrize("arch,tied", VARIANTS)
def test_the_plan_names_modules_the_built_model_has(arch, tied):
    model, _ = built(arch, tied)
    p = plan(arch)
    assert isinstance(model.get_submodule(p.embedding), nn.Embedding)
    assert model.get_submodule(p.head).weight.dim() == 2 and model.get_submodule(p.final_norm).weight.dim() == 1
    if p.positions:
        assert isinstance(model.get_submodule(p.positions), nn.Embedding)
    blocks = model.get_submodule(p.blocks)
    assert isinstance(blocks, nn.ModuleList) and len(blocks) == 2
    inputs = dict(p.block.gathered)
    for block in blocks:
        for name, role in p.block.roles().items():
            module = block.get_submodule(name)  # raises where the plan names a module the block lacks
            if role in ("column", "row"):
                assert module.weight.dim() == 2, name
            elif role == "norms":
                assert module.weight.dim() == 1, name
            elif role == "gathered":  # the inputs the plan prepares: the forward's required ones
                required = [q for q in inspect.signature(module.forward).parameters.values()
                            if q.default is inspect.Parameter.empty]
                assert len(required) == inputs[name], name


@pytest.mark.parametrize("arch,tied", VARIANTS)
def test_the_facts_name_every_parameter_of_the_built_model(arch, tied):
    model, spec = built(arch, tied)
    shape = model_facts(spec).shape
    names = shape.param_names() if arch == "gpt" else list(hf_names(shape))
    assert names == [n for n, _ in model.named_parameters()]
    assert list(shape.param_shapes()) == [tuple(q.shape) for q in model.parameters()]


def old_split_table(s) -> tuple[int, ...]:
    """The Llama block's split table that the declared plan replaced (``LlamaShape.tp_split`` until issue 41)."""
    bias = (0,) if s.qkv_bias else ()
    block = (-1, 0, *bias, 0, *bias, 0, *bias, 1, -1, 0, 1, 0)
    return (0,) + block * s.n_layers + (-1,) + (() if s.tied else (0,))


@pytest.mark.parametrize("arch", [a for a in BUILT_IN if a != "gpt"])
@pytest.mark.parametrize("size", ["tiny", "big"])
def test_the_planners_split_follows_from_the_plan_as_the_table_did(arch, size):
    fam = family(arch)
    presets = LLAMA_PRESETS if arch == "llama" else fam.presets  # type: ignore[attr-defined]
    name = size if size == "tiny" else list(presets)[-1]
    for tied in (False, True):
        f = model_facts(Model(arch=arch, size=name, tie_embeddings=tied))
        assert f.tp_split == old_split_table(f.shape) == BLOCK_TP_PLAN.split(hf_names(f.shape))
        assert f.tp_divides == (f.shape.n_heads, f.shape.n_kv_heads)
    biased = replace(LLAMA_PRESETS["tiny"], qkv_bias=True)
    assert BLOCK_TP_PLAN.split(hf_names(biased)) == old_split_table(biased)


def test_the_gpt_plan_is_applied_but_not_counted_by_the_planner():
    f = model_facts(Model(arch="gpt", size="tiny"))
    assert f.tp_split == () and f.tp_divides == ()  # the planner: an even split, unsplit activations (bounds)
    assert GPT_TP_PLAN.split(f.shape.param_names())[:3] == (OUT_DIM, REPLICATED, REPLICATED)  # tok, pos, ln1


def test_split_dims_by_role_and_parameter():
    p = TpPlan(BlockTp(column=("a.c",), row=("a.r",), norms=("n",), whole=("w",)), positions="pos")
    got = {name: p.split_dim(name) for name in ("tok_emb.weight", "head.weight", "norm.weight", "pos.weight",
                                                "blocks.0.a.c.weight", "blocks.0.a.c.bias", "blocks.11.a.r.weight",
                                                "blocks.1.a.r.bias", "blocks.0.n.weight", "blocks.0.w.q.weight",
                                                "blocks.x.a.c.weight", "a.c.weight")}
    assert got == {"tok_emb.weight": OUT_DIM, "head.weight": OUT_DIM, "norm.weight": REPLICATED,
                   "pos.weight": REPLICATED, "blocks.0.a.c.weight": OUT_DIM, "blocks.0.a.c.bias": OUT_DIM,
                   "blocks.11.a.r.weight": IN_DIM, "blocks.1.a.r.bias": REPLICATED, "blocks.0.n.weight": REPLICATED,
                   "blocks.0.w.q.weight": REPLICATED, "blocks.x.a.c.weight": REPLICATED, "a.c.weight": REPLICATED}


# ---------------------------------------------------------------- the trainer: placements from the roles


def placements(arch: str, tied: bool) -> tuple[nn.Module, dict[str, str]]:
    """The tiny model of ``arch`` after ``apply_tp`` on rank 0 of a fake tp group of 2: each parameter's
    placement (``"plain"``: not a DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hpc.dryrun.fake_pg import fake_process_group
    from trainer.tp import apply_tp

    model, _ = built(arch, tied)
    with fake_process_group(2, 0):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        assert apply_tp(model, model.get_submodule(plan(arch).blocks), mesh["tp"], plan(arch)) is plan(arch)
        got = {name: str(q.placements[0]) if isinstance(q, DTensor) else "plain" for name, q in
               model.named_parameters(remove_duplicate=False)}
    return model, got


@pytest.mark.parametrize("arch,tied", VARIANTS)
def test_apply_tp_places_every_parameter_as_its_role_says(arch, tied):
    model, got = placements(arch, tied)
    p = plan(arch)
    whole = tuple(f".{m}." for m in p.block.whole)
    by_dim = {OUT_DIM: "S(0)", IN_DIM: "S(1)", REPLICATED: "R"}
    expected = {name: "plain" if any(w in name for w in whole) else by_dim[p.split_dim(name)] for name in got}
    assert got == expected
    if tied:  # one parameter again, split over the vocabulary
        assert model.get_submodule(p.head).weight is model.get_submodule(p.embedding).weight


def test_apply_tp_gives_the_gpt_the_placements_it_had():
    """Pinned by hand (the name-sniffing plan's): the fused attention plain, positions and norms replicated."""
    _, got = placements("gpt", False)
    block = {"ln1.weight": "R", "ln1.bias": "R", "attn.qkv.weight": "plain", "attn.proj.weight": "plain",
             "ln2.weight": "R", "ln2.bias": "R", "mlp.fc.weight": "S(0)", "mlp.proj.weight": "S(1)"}
    assert got == {"tok_emb.weight": "S(0)", "pos_emb.weight": "R",
                   **{f"blocks.{i}.{k}": v for i in range(2) for k, v in block.items()},
                   "ln_f.weight": "R", "ln_f.bias": "R", "head.weight": "S(0)"}


def test_the_trainer_maps_each_role_to_its_style():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel)

    from trainer.tp import block_plan, outer_plan

    block = block_plan(BLOCK_TP_PLAN)
    assert [type(block[m]) for m in ("attn_norm", "attn", "attn.wq", "attn.wo", "mlp", "mlp.w2")] == [
        SequenceParallel, PrepareModuleInput, ColwiseParallel, RowwiseParallel, PrepareModuleInput, RowwiseParallel]
    assert block["attn"].input_layouts == (Shard(1), None, None) and block["mlp"].input_layouts == (Shard(1),)
    assert block["attn.wo"].output_layouts == (Shard(1),)
    assert isinstance(block_plan(GPT_TP_PLAN)["attn"], PrepareModuleInputOutput)
    outer = outer_plan(GPT_TP_PLAN)
    assert set(outer) == {"tok_emb", "head", "ln_f"} and isinstance(outer["ln_f"], SequenceParallel)
    assert outer["tok_emb"].input_layouts == (Replicate(),) and outer["tok_emb"].output_layouts == (Shard(1),)
    assert outer["head"].output_layouts == (Shard(-1),) and outer["head"].use_local_output is False
