"""``hpcx dryrun``: the trainer's real construction at full world size on torch's fake process group.

Classes of defect, each with cases of its own:

- dryrun and plan disagree on params/grads/optimizer per rank (table-driven: every strategy on the
  tiny, small and 13b presets at 2, 8, 32 and 128 ranks, 70b at 128, first and last ranks; uneven
  shards of the tiny model at 128 ranks);
- the report is wrong about the layout (mesh coordinates and node spread, FSDP units and their
  resharding, the checkpoint plan) or fails on a shipped example;
- bad input (a rank outside the job, a job that does not resolve, a user model that cannot be
  imported) is not one line with exit 2; a real disagreement is not exit 1;
- a user model the job could not start (its function raises, no ModuleList at ``model.blocks``, modules
  without ``reset_parameters()``, a forward the loss cannot use: ``tests/trainer/dryrun_models.py``)
  passes dryrun, or is not one line naming the file with exit 2;
- dryrun imports a GPU library, or a second world in the same process sees the first one's mesh.

Each case builds one fake world in this process and tears it down (``hpc.dryrun.fake_pg``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hpc.cli import load_job
from hpc.dryrun import DryRun, add_plan, dryrun

from tests.conftest import REPO, hpcx

JOBS = REPO / "jobs"
BIG = str(JOBS / "gpt-13b-auto.toml")

# name: overrides of gpt-13b-auto.toml (bf16, activation checkpointing, async saves)
STRATEGIES = {
    "ddp": ["parallel.strategy='ddp'"],
    "fsdp": ["parallel.strategy='fsdp'", "parallel.sharding='full_shard'"],
    "fsdp-grad-op": ["parallel.strategy='fsdp'", "parallel.sharding='shard_grad_op'"],
    "fsdp-no-shard": ["parallel.strategy='fsdp'", "parallel.sharding='no_shard'"],
    "fsdp-offload": ["parallel.strategy='fsdp'", "parallel.cpu_offload=true"],
    "hsdp": ["parallel.strategy='hsdp'", "parallel.sharding='full_shard'"],
    "hsdp-grad-op": ["parallel.strategy='hsdp'", "parallel.sharding='shard_grad_op'"],
}
WORLDS = {2: (1, 2), 8: (1, 8), 32: (4, 8), 128: (16, 8)}  # ranks: (nodes, tasks per node) on dgx-h100


def _sets(size: str, world: int, strategy: str) -> list[str]:
    nodes, tpn = WORLDS[world]
    sets = [f"model.size={size!r}", f"job.nodes={nodes}", f"job.tasks_per_node={tpn}", "train.global_batch=256",
            *STRATEGIES[strategy]]
    if strategy.startswith("hsdp") and nodes == 1:
        sets.append(f"parallel.shard_size={world // 2}")  # two replicas inside one node
    return sets


def _run(path: str, sets: list[str], site: str = "dgx-h100", rank: int = 0) -> DryRun:
    spec, site_profile, launch = load_job(path, site, sets)
    return dryrun(spec, site_profile, launch, rank)


CASES = [(size, world, strategy) for size in ("tiny", "small", "13b") for world in WORLDS for strategy in STRATEGIES]
CASES += [("70b", 128, strategy) for strategy in ("fsdp", "hsdp", "hsdp-grad-op")]


@pytest.mark.parametrize("size,world,strategy", CASES, ids=[f"{s}-{w}-{t}" for s, w, t in CASES])
def test_dryrun_agrees_with_the_plan(size, world, strategy):
    result = _run(BIG, _sets(size, world, strategy))
    assert result.world_size == world and result.planned is not None
    assert result.problems == [], "\n".join(result.problems)
    for what in ("params", "grads", "optimizer"):
        assert result.measured[what] == pytest.approx(result.planned[what], rel=0.01), what


@pytest.mark.parametrize("size", ["tiny", "small", "13b"])
@pytest.mark.parametrize("strategy", ["none", "dp"])
def test_one_process_strategies_agree_with_the_plan(size, strategy):
    result = _run(BIG, [f"model.size={size!r}", "job.nodes=1", "job.tasks_per_node=1", "train.global_batch=8",
                        "train.micro_batch=8", f"parallel.strategy={strategy!r}"])  # dp splits it over 8 GPUs
    assert result.world_size == 1 and result.problems == []
    assert result.measured["params"] == 4 * result.n_params


def test_uneven_shards_on_the_last_ranks_are_below_the_plan_and_not_a_problem():
    """The tiny GPT's d_model = 64 rows over 128 ranks: ranks 64.. hold empty shards of LayerNorms,
    yet FSDP2 pads every rank's storage to the first chunk, so only the optimizer state is smaller."""
    first = _run(BIG, _sets("tiny", 128, "fsdp"), rank=0)
    last = _run(BIG, _sets("tiny", 128, "fsdp"), rank=127)
    assert not first.short_shards and last.short_shards and last.problems == []
    assert last.measured["params"] == first.measured["params"] == first.planned["params"]
    assert last.measured["optimizer"] < first.measured["optimizer"]
    assert first.planned["params"] > 4 * first.n_params / 128  # padding counted by the planner


def test_a_real_difference_is_a_problem():
    spec, site, launch = load_job(BIG, "dgx-h100", _sets("small", 8, "fsdp"))
    result = dryrun(spec, site, launch)
    result.problems, result.measured["grads"] = [], int(result.planned["grads"] * 1.02)
    add_plan(result, spec, launch)
    assert len(result.problems) == 1
    assert result.problems[0].startswith("grads: dryrun") and "+2.0%" in result.problems[0]


# ---------------------------------------------------------------- the layout it reports


def test_hsdp_mesh_coordinates_and_nodes():
    result = _run(BIG, ["parallel.strategy='hsdp'"], rank=13)  # 4 nodes × 8
    mesh = result.mesh
    assert mesh["names"] == ["dp_replicate", "dp_shard"] and mesh["shape"] == [4, 8]
    assert mesh["coordinate"] == [1, 5] and mesh["node"] == 1 and mesh["local_rank"] == 5
    shard, replicate = mesh["dims"]["dp_shard"], mesh["dims"]["dp_replicate"]
    assert shard["mine"] == list(range(8, 16)) and shard["nodes_of_mine"] == [1] and shard["max_nodes_per_group"] == 1
    assert replicate["mine"] == [5, 13, 21, 29] and replicate["nodes_of_mine"] == [0, 1, 2, 3]


def test_hsdp_shard_group_over_two_nodes():
    result = _run(BIG, ["model.size='70b'", "job.nodes=16", "train.global_batch=1024", "parallel.strategy='hsdp'",
                        "parallel.shard_size=16"], rank=127)
    shard = result.mesh["dims"]["dp_shard"]
    assert result.mesh["shape"] == [8, 16] and shard["nodes_of_mine"] == [14, 15] and shard["max_nodes_per_group"] == 2


@pytest.mark.parametrize("sharding,flags", [("full_shard", (True, True, False)),
                                            ("shard_grad_op", (False, False, False))])
def test_fsdp_units_embeddings_and_head_are_units_of_their_own(sharding, flags):
    result = _run(BIG, ["parallel.strategy='fsdp'", f"parallel.sharding={sharding!r}"])
    units = {tuple(u.modules): u for u in result.units}
    assert len(units) == 40 + 3
    block, emb, head, root = units[("blocks.0",)], units[("tok_emb", "pos_emb")], units[("ln_f", "head")], \
        units[("(root)",)]
    assert (block.reshard_after_forward, emb.reshard_after_forward, head.reshard_after_forward) == flags
    assert root.params == 0 and root.reshard_after_forward is None
    assert emb.params == (50304 + 2048) * 5120 and head.params == 50304 * 5120 + 2 * 5120
    assert sum(u.params for u in result.units) == result.n_params
    assert sum(u.shard_bytes for u in result.units) == result.measured["params"]


def test_user_model_units_are_its_blocks_and_the_root(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests" / "trainer"))  # init_models.py
    job = _user_job(tmp_path)
    result = _run(str(job), ["parallel.strategy='fsdp'"], site="local", rank=1)
    assert [u.modules for u in result.units] == [["trunk.layers.0"], ["trunk.layers.1"], ["trunk.layers.2"], ["(root)"]]
    assert result.planned is None and result.problems == [] and result.measured["params"] > 0


def test_ddp_has_no_units_and_whole_replicas():
    result = _run(BIG, _sets("small", 8, "ddp"))
    assert result.units == [] and result.mesh["shape"] is None
    assert result.measured["params"] == 4 * result.n_params


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp", "ddp"])
def test_checkpoint_plan_holds_this_ranks_params_and_optimizer_state(strategy):
    result = _run(BIG, _sets("small", 32, strategy), rank=9)
    c = result.checkpoint
    expected = result.measured["params"] + result.measured["optimizer"]
    assert 0 <= c["bytes"] - expected < 64 * 1024  # plus this rank's RNG states (torch, numpy)
    assert c["other_items"] > 0 and (c["shards"] > 0) == (strategy != "ddp")


def test_two_worlds_in_one_process_do_not_share_meshes():
    a = _run(BIG, _sets("tiny", 8, "fsdp"), rank=0)
    b = _run(BIG, _sets("tiny", 8, "fsdp"), rank=7)
    assert a.mesh["coordinate"] == [0] and b.mesh["coordinate"] == [7]
    assert b.measured == a.measured  # 64-row tensors split evenly over 8


# ---------------------------------------------------------------- every shipped example, and the CLI


EXAMPLES = [("tiny-ddp.toml", "local"), ("tiny-hsdp-2node.toml", "sandbox"), ("gpt-1.3b-fsdp.toml", "dgx-h100"),
            ("gpt-13b-auto.toml", "dgx-h100"), ("gpt-13b-auto.toml", "pcie-4gpu"), ("tiny-ddp.toml", "dgx-h100"),
            ("gpt-1.3b-fsdp.toml", "pcie-4gpu"), ("tiny-hsdp-2node.toml", "dgx-h100")]


@pytest.mark.parametrize("job,site", EXAMPLES, ids=[f"{j}@{s}" for j, s in EXAMPLES])
def test_every_shipped_example_builds(job, site):
    result = _run(str(JOBS / job), [], site=site, rank=0)
    assert result.problems == [] and result.n_params > 0


def test_cli_text_for_the_13b_job():
    out = hpcx("dryrun", BIG, "--site", "dgx-h100", "--rank", "13", timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "as rank 13 of 32 (node 1, local rank 5)" in text
    assert "gpt 13b (13.1B params) on dgx-h100" in text and text.count("params)") == 1  # issue 23: once
    assert "dp_shard: 4 groups of 8 ranks, each inside one node" in text
    assert "blocks.0 … blocks.39 (40 units, each)" in text and "tok_emb, pos_emb" in text
    assert "checkpoint (DCP local plan of this rank)" in text and "+0.00%" in text


def test_cli_json_for_70b_on_128_ranks():
    out = hpcx("dryrun", BIG, "--site", "dgx-h100", "--set", "model.size='70b'", "--set", "job.nodes=16",
               "--set", "train.global_batch=1024", "--set", "parallel.strategy='hsdp'", "--rank", "127", "--json",
               timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["world_size"] == 128 and doc["rank"] == 127 and doc["problems"] == []
    assert doc["mesh"]["coordinate"] == [15, 7] and doc["dims"]["dp_shard"] == 8
    assert doc["measured"]["params"] == doc["planned"]["params"]


@pytest.mark.parametrize("args,words", [
    (["--rank", "32"], "--rank 32: "),
    (["--set", "job.nodes=3"], "`train.global_batch` = 512 is not divisible"),
    (["--site", "local"], "runs on this machine only"),
    (["--set", "model.arch='no_such_pkg_hpcx.m:make'", "--set", "model.seq_len=8", "--set", "model.vocab_size=8",
      "--set", "parallel.strategy='fsdp'"], "cannot import 'no_such_pkg_hpcx.m' here"),
])
def test_bad_input_is_one_line_and_exit_2(args, words):
    out = hpcx("dryrun", BIG, *(["--site", "dgx-h100"] if "--site" not in args else []), *args, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_a_disagreement_exits_1(monkeypatch):
    from click.testing import CliRunner

    import hpc.dryrun
    from hpc.cli import cli

    real = hpc.dryrun.model_states
    monkeypatch.setattr(hpc.dryrun, "model_states", lambda *a: tuple(x * 0.9 for x in real(*a)))
    out = CliRunner().invoke(cli, ["dryrun", str(JOBS / "tiny-ddp.toml")])
    assert out.exit_code == 1, out.output
    assert "dryrun and plan differ by more than 1%" in out.output and "params: dryrun" in out.output


PROBE = """
import sys
from hpc.cli import cli
try:
    cli.main(args=sys.argv[1:], prog_name="hpcx")
except SystemExit as exc:
    code = exc.code
gpu = sorted(m for m in sys.modules if m.split(".")[0] in ("triton", "pynvml", "cupy", "apex", "transformer_engine",
                                                             "flash_attn", "nvidia", "pycuda", "numba"))
import torch
print("GPU=" + ",".join(gpu) + " cuda_initialized=" + str(torch.cuda.is_initialized()), file=sys.stderr)
"""


def test_dryrun_imports_no_gpu_library_beyond_torch():
    out = subprocess.run([sys.executable, "-c", PROBE, "dryrun", str(JOBS / "tiny-hsdp-2node.toml"), "--site",
                          "dgx-h100", "--set", "parallel.compile=true",
                          "--set", "parallel.activation_checkpointing=true"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "GPU= cuda_initialized=False" in out.stderr, out.stderr[-3000:]
    assert "layout: hsdp" in out.stdout


def _user_job(tmp_path):
    job = tmp_path / "user.toml"
    job.write_text((JOBS / "tiny-ddp.toml").read_text().replace(
        'arch = "gpt"\nsize = "tiny"',
        'arch = "init_models:make"\nblocks = "trunk.layers"\nseq_len = 16\nvocab_size = 250'))
    return job


def test_a_fused_adamw_gets_its_state_on_meta():
    """Fused AdamW has no meta kernel: the dry step runs it unfused (same state) and restores the flag."""
    from hpc.core.dims import parallel_dims
    from hpc.dryrun import rank_bytes, step_on_meta
    from hpc.dryrun.fake_pg import fake_process_group
    from hpc.core.resolve import decide_parallel
    from hpc.core.spec import Model, Parallel
    from trainer.model import build_model, model_blocks
    from trainer.parallelize import build_mesh, parallelize

    dims = parallel_dims("fsdp", "full_shard", 8)
    with fake_process_group(8, 3):
        model = build_model(Model(size="tiny"), "meta")
        model = parallelize(model, model_blocks(model), decide_parallel(Parallel(strategy="fsdp"), False), dims, build_mesh(dims, "cpu"),
                            torch.device("meta"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        step_on_meta(model, optimizer)
        measured, _ = rank_bytes(model, optimizer)
    assert optimizer.param_groups[0]["fused"] is True and len(optimizer.state) == len(list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert 2 * measured["params"] <= measured["optimizer"] <= 2 * measured["params"] + 4 * len(optimizer.state)


# ---------------------------------------------------------------- what the job would hit before step 1 (issue 20)


def _startup(tmp_path, monkeypatch, name, *sets):
    """``hpcx dryrun`` (in process) of the tiny job with ``model.arch = "dryrun_models:NAME"``."""
    from click.testing import CliRunner

    from hpc.cli import cli

    monkeypatch.syspath_prepend(str(REPO / "tests" / "trainer"))  # dryrun_models.py
    job = tmp_path / "startup.toml"
    job.write_text((JOBS / "tiny-ddp.toml").read_text().replace(
        'arch = "gpt"\nsize = "tiny"', f'arch = "dryrun_models:{name}"\nseq_len = 16\nvocab_size = 64'))
    out = CliRunner().invoke(cli, ["dryrun", str(job), "--set", "parallel.strategy='fsdp'", *sets])
    return job, out


def _one_error(job, out) -> str:
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {job}: "), out.stderr
    assert "Traceback" not in out.stderr
    return lines[0]


def test_a_good_user_model_passes_with_its_forward_checked(tmp_path, monkeypatch):
    _, out = _startup(tmp_path, monkeypatch, "good")
    assert out.exit_code == 0, out.output
    assert "forward (user model, on the meta device): a [2, 8] meta batch gives logits [2, 8, 64]" in out.stdout


@pytest.mark.parametrize("name,words", [
    ("absent", "module 'dryrun_models' has no function 'absent'"),
    ("NOT_A_FUNCTION", "module 'dryrun_models' has no function 'NOT_A_FUNCTION'"),
    ("needs_width", "needs_width() (with `model.kwargs`) raised TypeError: needs_width() missing 1 required "
                    "positional argument: 'width'"),
    ("sequential_blocks", "`model.blocks` = 'blocks' is a Sequential, expected nn.ModuleList"),
    ("hf_output", "its forward on a [2, 8] batch of token ids returned Output (not a tensor), expected a tensor "
                  "of logits [batch, seq, vocab] = [2, 8, 64]: return its .logits"),
    ("last_only", "returned a tensor of shape [2, 64], expected a tensor of logits [batch, seq, vocab]"),
])
def test_a_user_model_the_job_cannot_start_is_one_line_and_exit_2(tmp_path, monkeypatch, name, words):
    job, out = _startup(tmp_path, monkeypatch, name)
    assert words in _one_error(job, out)


@pytest.mark.parametrize("sets", [(), ("--set", "parallel.strategy='none'"), ("--set", "parallel.strategy='ddp'")])
def test_a_user_model_without_blocks_runs_where_no_feature_needs_them(tmp_path, monkeypatch, sets):
    """ddp (and none) wrap the whole model: no `blocks` attribute is asked for (the default `fsdp` of
    ``_startup`` is replaced by the last --set)."""
    _, out = _startup(tmp_path, monkeypatch, "no_blocks", *(sets or ("--set", "parallel.strategy='ddp'")))
    assert out.exit_code == 0, out.output
    assert "forward (user model, on the meta device)" in out.stdout


@pytest.mark.parametrize("sets,feature", [
    ((), "needed by strategy 'fsdp' (an FSDP unit per block)"),
    (("--set", "parallel.strategy='ddp'", "--set", "parallel.activation_checkpointing=true"),
     "needed by parallel.activation_checkpointing"),
    (("--set", "parallel.strategy='ddp'", "--set", "parallel.compile=true"), "needed by parallel.compile"),
    (("--set", "parallel.activation_checkpointing=true"),
     "needed by parallel.activation_checkpointing, strategy 'fsdp' (an FSDP unit per block)"),
])
def test_a_user_model_without_blocks_is_refused_naming_the_feature_that_needs_them(tmp_path, monkeypatch, sets,
                                                                                feature):
    job, out = _startup(tmp_path, monkeypatch, "no_blocks", *sets)
    line = _one_error(job, out)
    assert "`model.blocks` = 'blocks': Trunk has no attribute 'blocks' (children: trunk)" in line and feature in line


def test_a_module_import_error_is_one_line_and_exit_2(tmp_path, monkeypatch):
    job, out = _startup(tmp_path, monkeypatch, "good", "--set", "model.arch='dryrun_models_absent_hpcx:make'")
    assert "cannot import 'dryrun_models_absent_hpcx' here" in _one_error(job, out)


def test_modules_without_reset_parameters_are_named_with_their_classes(tmp_path, monkeypatch):
    """The job's WeightInit would refuse them after 20 s on the nodes; dryrun names them all at once."""
    job, out = _startup(tmp_path, monkeypatch, "no_reset")
    line = _one_error(job, out)
    assert "blocks.{0..2}.norm (RMSNorm), rotary (Rotary) own parameters or buffers but define no " \
           "reset_parameters()" in line
    assert "Linear" not in line and "embed" not in line


def test_collapsed_paths():
    from hpc.dryrun.startup import collapsed

    assert collapsed([("model.layers.0.input_layernorm", "LlamaRMSNorm")]) == \
        ["model.layers.0.input_layernorm (LlamaRMSNorm)"]
    items = [(f"model.layers.{i}.{n}", "LlamaRMSNorm") for i in range(32) for n in ("a", "b")]
    assert collapsed(items + [("model.norm", "LlamaRMSNorm"), ("(root)", "M")]) == [
        "model.layers.{0..31}.a (LlamaRMSNorm)", "model.layers.{0..31}.b (LlamaRMSNorm)", "model.norm (LlamaRMSNorm)",
        "(root) (M)"]
    assert collapsed([("h.1.n", "N"), ("h.3.n", "N")]) == ["h.{1,3}.n (N)"]
