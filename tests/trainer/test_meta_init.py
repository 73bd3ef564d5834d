"""Meta-device build and sharded initialisation (trainer.model.WeightInit).

Three classes of defect, each with its own cases:

- initial weights that depend on the layout: the full state gathered right after init must be
  bit-identical under none, ddp 2, fsdp 2 and 4 (each sharding), hsdp 2×2 and fsdp + CPU offload
  (real gloo processes), for the built-in GPT with dimensions that do not divide by 4 and for a
  user model; and, in one process with a fake process group, every rank's shard at 8, 32 and 128
  ranks must be the slice of the single-process state;
- tensors left as ``to_empty`` garbage: every parameter and buffer is set (NaN-filled first);
- a model that cannot be initialised this way: a one-line error naming the module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpc.core.dims import parallel_dims
from hpc.core.spec import Model
from trainer.model import WeightInit, build_model, model_blocks, module_seed
from trainer.models.gpt import GPT
from trainer_testlib import make_run, torchrun

GPT_UNEVEN = ["model.seq_len=30", "model.vocab_size=250"]  # pos_emb and head rows split 8/8/8/6 over 4
USER = ["model.arch='init_models:make'", "model.blocks='trunk.layers'", "model.seq_len=16", "model.vocab_size=250"]

TWO = {"ddp2": ("ddp", []), "fsdp2": ("fsdp", []), "fsdp2_grad_op": ("fsdp", ["parallel.sharding='shard_grad_op'"]),
       "fsdp2_offload_ac": ("fsdp", ["parallel.cpu_offload=true", "parallel.activation_checkpointing=true"])}
FOUR = {"fsdp4": ("fsdp", []), "fsdp4_no_shard": ("fsdp", ["parallel.sharding='no_shard'"]),
        "hsdp2x2": ("hsdp", ["parallel.shard_size=2"]), "ddp4": ("ddp", [])}


def _none_state(run_dir: Path) -> dict[str, torch.Tensor]:
    from trainer.run import load_run
    from trainer.train import build_parallel_model

    run = load_run(run_dir)
    model, _ = build_parallel_model(run.spec, run.launch, torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _launch(tmp: Path, ranks: int, configs: dict, model: list[str], tag: str) -> dict[str, dict]:
    dirs = {name: make_run(tmp, f"{tag}-{name}", strategy, ranks, model + sets)
            for name, (strategy, sets) in configs.items()}
    out = tmp / f"out-{tag}-{ranks}"
    out.mkdir()
    proc = torchrun(ranks, ["tests/trainer/init_worker.py", str(out), *map(str, dirs.values())], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: torch.load(out / f"{d.name}.pt", weights_only=True) for name, d in dirs.items()}


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> dict[str, dict[str, dict]]:
    tmp = tmp_path_factory.mktemp("meta-init")
    found = {}
    for tag, model in (("gpt", GPT_UNEVEN), ("user", USER)):
        found[tag] = {"none": _none_state(make_run(tmp, f"{tag}-none", "none", 1, model))}
        found[tag].update(_launch(tmp, 2, TWO, model, tag))
        found[tag].update(_launch(tmp, 4, FOUR, model, tag))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["gpt", "user"])
@pytest.mark.parametrize("name", list(TWO) + list(FOUR))
def test_full_state_after_init_is_bit_identical_to_one_process(states, tag, name):
    reference, got = states[tag]["none"], states[tag][name]
    assert sorted(got) == sorted(reference)
    different = [k for k in reference if not torch.equal(got[k], reference[k])]
    assert different == [], f"{tag} {name}: {different}"


@pytest.mark.slow
def test_the_reference_state_is_a_real_init(states):
    """Not all zeros or all equal: LayerNorms ones/zeros, GPT-2 std on matrices, torch's init on user layers."""
    gpt, user = states["gpt"]["none"], states["user"]["none"]
    assert torch.equal(gpt["blocks.0.ln1.weight"], torch.ones(64)) and torch.equal(gpt["ln_f.bias"], torch.zeros(64))
    assert 0.018 < gpt["tok_emb.weight"].std().item() < 0.022
    assert gpt["blocks.1.attn.proj.weight"].std().item() < 0.6 * gpt["blocks.1.attn.qkv.weight"].std().item()
    assert not torch.equal(gpt["blocks.0.attn.qkv.weight"], gpt["blocks.1.attn.qkv.weight"])  # one seed per module
    bound = 1 / 24 ** 0.5  # nn.Linear's kaiming-uniform bound for fan_in 24
    assert user["trunk.layers.0.lin.weight"].abs().max().item() <= bound
    assert user["trunk.layers.0.lin.bias"].abs().max().item() > 0


# ---------------------------------------------------------------- shards at full world size (fake process group)


@pytest.fixture(scope="module")
def reference_gpt() -> dict[str, torch.Tensor]:
    model = build_model(Model(size="tiny", seq_len=30, vocab_size=250), "meta")
    WeightInit.of(model, 7).materialize(model, torch.device("cpu"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("strategy,sharding,world,rank", [
    ("fsdp", "full_shard", 8, 0), ("fsdp", "full_shard", 8, 7), ("fsdp", "shard_grad_op", 32, 29),
    ("hsdp", "full_shard", 32, 13), ("fsdp", "full_shard", 128, 100), ("hsdp", "shard_grad_op", 128, 127),
    ("fsdp", "no_shard", 8, 5)])
def test_each_rank_holds_the_slice_of_the_single_process_state(reference_gpt, strategy, sharding, world, rank):
    from hpc.dryrun.fake_pg import fake_process_group
    from trainer.parallelize import build_mesh, parallelize
    from hpc.core.resolve import decide_parallel
    from hpc.core.spec import Parallel

    dims = parallel_dims(strategy, sharding, world, 8)
    with fake_process_group(world, rank):
        model = build_model(Model(size="tiny", seq_len=30, vocab_size=250), "meta")
        init = WeightInit.of(model, 7)
        parallel = decide_parallel(Parallel(strategy=strategy, sharding=sharding), False)
        model = parallelize(model, model_blocks(model), parallel, dims, build_mesh(dims, "cpu"), torch.device("cpu"), init)
        for name, p in model.named_parameters():
            full = reference_gpt[name]
            coordinate = p.device_mesh.get_coordinate()[-1]
            chunks = torch.chunk(full, p.device_mesh.shape[-1], dim=0)
            want = chunks[coordinate] if coordinate < len(chunks) else full[:0]
            assert torch.equal(p.to_local(), want), f"{name} on rank {rank}/{world}"


# ---------------------------------------------------------------- nothing left unset


def _nan_filled(model: nn.Module) -> nn.Module:
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(float("nan"))
    return model


@pytest.mark.parametrize("spec", [Model(size="tiny"), Model(size="small"),
                                  Model(arch="init_models:make", seq_len=16, vocab_size=250, blocks="trunk.layers"),
                                  Model(arch="init_models:make", seq_len=16, vocab_size=7, kwargs={"width": 5})],
                         ids=["tiny", "small", "user", "user-odd"])
def test_every_parameter_and_buffer_is_set(spec):
    model = _nan_filled(build_model(spec, "meta"))
    WeightInit.of(model, 0).initialise(model, torch.device("cpu"))
    unset = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if torch.isnan(t).any()]
    assert unset == []


def test_buffers_are_recomputed_not_kept_from_to_empty():
    model = _nan_filled(build_model(Model(arch="init_models:make", seq_len=16, vocab_size=250), "meta"))
    WeightInit.of(model, 0).initialise(model, torch.device("cpu"))
    assert torch.equal(model.trunk.layers[2].scale.table, torch.arange(24, dtype=torch.float32) / 7)


def test_same_seed_same_weights_other_seed_other_weights():
    def init(seed: int) -> GPT:
        model = build_model(Model(size="tiny"), "meta")
        WeightInit.of(model, seed).materialize(model, torch.device("cpu"))
        return model

    a, b, c = init(3), init(3), init(4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.head.weight, c.head.weight)


def test_module_seed_is_a_stable_hash_of_seed_and_name():
    """Not Python's salted hash(): every process (and every run) derives the same seed."""
    assert module_seed(0, "blocks.0.attn.qkv") == module_seed(0, "blocks.0.attn.qkv")
    assert module_seed(0, "blocks.0.attn.qkv") == 2279953589064509504
    assert len({module_seed(s, n) for s in (0, 1) for n in ("a", "b", "blocks.0.ln1")}) == 6


def test_names_are_taken_before_wrappers_rename_modules():
    """checkpoint_wrapper inserts ``_checkpoint_wrapped_module``: the seeds still follow the bare names."""
    from hpc.core.resolve import decide_parallel
    from hpc.core.spec import Parallel
    from trainer.parallelize import parallelize

    def init(ac: bool) -> dict[str, torch.Tensor]:
        model = build_model(Model(size="tiny"), "meta")
        init = WeightInit.of(model, 1)
        parallel = decide_parallel(Parallel(strategy="none", activation_checkpointing=ac), False)
        model = parallelize(model, model_blocks(model), parallel,
                            parallel_dims("none", "full_shard", 1), None, torch.device("cpu"), init)
        return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in model.state_dict().items()}

    plain, wrapped = init(False), init(True)
    assert all(torch.equal(plain[k], wrapped[k]) for k in plain)


# ---------------------------------------------------------------- models that cannot be initialised


def test_a_module_without_reset_parameters_is_named():
    from hpc.core.errors import UserError

    model = _nan_filled(build_model(Model(arch="init_models:make_without_reset", seq_len=16, vocab_size=250), "meta"))
    with pytest.raises(UserError, match=r"module 'trunk.layers.1.extra' \(NoReset\) owns w but has no "
                                        r"reset_parameters\(\)"):
        WeightInit.of(model, 0).initialise(model, torch.device("cpu"))


def test_a_parameter_at_the_root_needs_the_root_to_reset_it():
    from hpc.core.errors import UserError

    model = nn.Module()
    with torch.device("meta"):
        model.scale = nn.Parameter(torch.empty(3))
    model.to_empty(device="cpu")
    with pytest.raises(UserError, match=r"module '\(root\)' \(Module\) owns scale"):
        WeightInit.of(model, 0).initialise(model, torch.device("cpu"))


@pytest.mark.parametrize("strategy,world", [("none", 1), ("ddp", 2), ("fsdp", 2), ("fsdp", 4)])
def test_a_tied_head_stays_tied_after_materialization(strategy, world):
    """``to_empty`` gives each module its own tensor; the head tied to the token embedding must share
    it again, or the model silently trains an untied head and counts its parameters twice."""
    from hpc.dryrun.fake_pg import fake_process_group
    from hpc.core.models.gpt import gpt_shape
    from hpc.plan.resolve import resolve
    from hpc.core.site import load_site
    from hpc.core.spec import spec_from_dict
    from trainer.train import build_parallel_model

    spec = spec_from_dict({"model": {"size": "tiny", "tie_embeddings": True},
                           "job": {"nodes": 1, "tasks_per_node": world},
                           "parallel": {"strategy": strategy}, "train": {"global_batch": 4 * world}})
    launch = resolve(spec, load_site("local"))  # a CPU site that runs 4 tasks on a node (the sandbox's have 2 CPUs)
    with fake_process_group(world, world - 1):
        model, _ = build_parallel_model(spec, launch, torch.device("cpu"))
        inner = getattr(model, "module", model)
        assert inner.head.weight is inner.tok_emb.weight
        if strategy in ("none", "ddp"):
            assert sum(p.numel() for p in model.parameters()) == gpt_shape("tiny", tied=True).n_params
        assert torch.isfinite(inner.tok_emb.weight.full_tensor() if hasattr(inner.tok_emb.weight, "full_tensor")
                              else inner.tok_emb.weight).all()
