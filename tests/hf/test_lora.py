"""LoRA fine-tunes from a Hugging Face folder, and what comes out of them (issue 33, items 1, 3, 4).

Classes of defect, each with cases of its own:

- the adapters change step 0 (the first loss of a LoRA run differs from the base model's) or train
  the base (a base weight gets a gradient, optimizer state, or is written again by a save), under
  fsdp and hsdp on 2 ranks;
- ``--to peft`` writes what ``PeftModel.from_pretrained`` loads with missing or unexpected keys, or
  with logits other than hpcx's; ``--to hf --merge-lora`` differs from the PEFT model; a LoRA run
  exported without ``--merge-lora`` is not refused in one line;
- a resume after a drill is not bit-identical, fails at another world size, or goes on with a base
  that changed since the adapters were trained;
- a PEFT folder as ``checkpoint.init_from`` does not continue its adapters.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.extras import extra

transformers = extra("transformers")
peft = extra("peft")

from hpc.ckpt.dcp import DcpReader  # noqa: E402
from hpc.ckpt.hf import export_hf  # noqa: E402
from hpc.ckpt.peft import ADAPTER_WEIGHTS  # noqa: E402
from hpc.ckpt.peft_export import export_peft  # noqa: E402
from hpc.core.models import model_facts  # noqa: E402
from hpc.core.models.llama import hf_names  # noqa: E402
from trainer.lora import apply_lora  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.run import load_run  # noqa: E402

from tests.conftest import hpcx  # noqa: E402
from tests.hf.hf_helpers import LLAMA, fine_tune, hf_folder, hf_tensors, losses, run_ranks  # noqa: E402
from tests.trainer.trainer_testlib import make_run  # noqa: E402

LORA = ["lora.rank=4", "lora.alpha=8.0", "lora.targets=['wq', 'v_proj', 'o_proj', 'w1', 'down_proj']"]
STEPS = ["train.steps=4", "checkpoint.interval_steps=2", "checkpoint.keep=3", "train.global_batch=4",
         "train.log_every=1", "data.shuffle=false"]
STRATEGIES = {"fsdp": [], "hsdp": ["parallel.shard_size=1"]}


def lora_run(root: Path, name: str, base: Path, strategy: str, ranks: int, extra: list[str] = ()) -> Path:
    sets = [*LLAMA, f"checkpoint.init_from={str(base)!r}", *STEPS, *LORA, *STRATEGIES.get(strategy, []), *extra]
    run = make_run(root, name, strategy, ranks, sets)
    out = run_ranks(run, ranks)
    assert out.returncode == 0, out.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return hf_folder(tmp_path_factory.mktemp("lora") / "base")


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    out = {s: lora_run(root, s, base, s, 2) for s in STRATEGIES}
    out["base"] = fine_tune(root, "base", base, "fsdp", 2, ["train.global_batch=4", "train.steps=1"])
    return out


def newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step-*"))[-1]


def hpcx_model(run: Path, base: Path) -> torch.nn.Module:
    """hpcx's LoRA model of ``run``: the base from its Hugging Face folder, the adapters from the newest step."""
    spec = load_run(run).spec
    model = apply_lora(build_model(spec.model, "cpu"), spec).eval()
    theirs = hf_tensors(base)
    reader = DcpReader(newest(run))
    names = {ours: hf for ours, (hf, _) in hf_names(model_facts(spec.model).shape).items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.read(f"model.{name}") if "lora_" in name else theirs[names[name]])
    reader.close()
    return model


def logits(model: torch.nn.Module) -> torch.Tensor:
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(tokens)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def peft_model(base: Path, adapters: Path) -> torch.nn.Module:
    hf = transformers.LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, adapters).eval()


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_first_loss_is_the_base_models_and_the_adapters_train(runs, strategy):
    first, *rest = losses(runs[strategy])
    assert first == losses(runs["base"])[0]  # B = 0: step 0 computes the base model exactly
    assert len(rest) == 3 and rest != [first] * 3  # the adapters moved the loss


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_checkpoints_hold_the_adapters_and_name_the_base(runs, base, strategy):
    reader = DcpReader(newest(runs[strategy]))
    model = [k for k in reader.entries if k.startswith("model.")]
    optim = [k for k in reader.entries if k.startswith("optim.state.")]
    meta = reader.meta
    reader.close()
    assert model and all(".lora_A." in k or ".lora_B." in k for k in model)
    assert len(model) == 2 * 2 * 5  # 2 layers × 5 targets × (A, B)
    assert optim and all(".lora_" in k for k in optim)  # Adam state of the adapters only
    assert meta["base.source"] == str(base) and len(meta["base.sha256"]) == 64


# ---------------------------------------------------------------- exports


def test_the_peft_export_loads_with_no_missing_keys_and_hpcxs_logits(runs, base, tmp_path):
    out = tmp_path / "adapter"
    summary = export_peft(runs["fsdp"], out)
    assert summary["tensors"] == 20 and (out / "adapter_config.json").is_file()
    model = peft_model(base, out)
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    written, loaded = load_file(out / ADAPTER_WEIGHTS), get_peft_model_state_dict(model)
    assert set(written) == set(loaded)  # nothing missing, nothing unexpected
    assert all(torch.equal(written[k], loaded[k]) for k in written)
    assert any(written[k].abs().max() > 0 for k in written if "lora_B" in k)  # trained, not the zeros it began as
    assert (logits(hpcx_model(runs["fsdp"], base)) - logits(model)).abs().max().item() <= 1e-5


def test_the_merged_export_is_the_peft_model(runs, base, tmp_path):
    export_peft(runs["hsdp"], tmp_path / "adapter")
    summary = export_hf(runs["hsdp"], tmp_path / "merged", merge_lora=True)
    assert summary["arch"] == "LlamaForCausalLM"
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ours = logits(merged.eval())
    assert (ours - logits(peft_model(base, tmp_path / "adapter"))).abs().max().item() <= 1e-5
    assert (ours - logits(transformers.LlamaForCausalLM.from_pretrained(base).eval())).abs().max().item() > 1e-5


@pytest.mark.parametrize("args,expected", [
    (["--to", "hf"], "a LoRA run (`lora.rank` = 4)"),
    (["--to", "peft", "--merge-lora"], "--merge-lora writes --to hf"),
])
def test_exports_that_cannot_be_are_one_line(runs, tmp_path, args, expected):
    out = hpcx("ckpt", "convert", str(runs["fsdp"]), str(tmp_path / "out"), *args)
    assert out.returncode == 2 and expected in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


def test_a_full_run_is_not_a_peft_export(runs, tmp_path):
    out = hpcx("ckpt", "convert", str(runs["base"]), str(tmp_path / "out"), "--to", "peft")
    assert out.returncode == 2 and "not a LoRA run" in out.stderr, out.stderr


# ---------------------------------------------------------------- resume


def drilled(run: Path, root: Path, name: str) -> Path:
    """A copy of ``run`` whose last checkpoint and metrics after it are gone: the next start resumes at step 2."""
    copy = root / name
    shutil.copytree(run, copy)
    shutil.rmtree(newest(copy))
    lines = (copy / "metrics.jsonl").read_text().splitlines()[:2]
    (copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    import json

    resolved = json.loads((copy / "resolved.json").read_text())
    resolved["run_dir"] = str(copy)
    (copy / "resolved.json").write_text(json.dumps(resolved))
    return copy


def test_a_resume_after_a_drill_is_bit_identical(runs, tmp_path):
    copy = drilled(runs["hsdp"], tmp_path, "again")
    out = run_ranks(copy, 2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr
    assert losses(copy) == losses(runs["hsdp"])
    a, b = DcpReader(newest(runs["hsdp"])), DcpReader(newest(copy))
    tensors = [k for k, e in a.entries.items() if e.is_tensor]
    assert set(tensors) == {k for k, e in b.entries.items() if e.is_tensor} and any(k.startswith("optim.") for k in tensors)
    assert all(torch.equal(a.read(k), b.read(k)) for k in tensors)  # adapters, Adam state, RNG: bit for bit
    a.close()
    b.close()


def test_a_resume_at_another_world_size_goes_on(runs, tmp_path):
    copy = drilled(runs["fsdp"], tmp_path, "one-rank")
    out = run_ranks(copy, 1)
    assert out.returncode == 0, out.stderr[-3000:]
    assert losses(copy)[2:] == pytest.approx(losses(runs["fsdp"])[2:], rel=1e-4)


def test_a_base_that_changed_is_refused_at_resume(tmp_path):
    base = hf_folder(tmp_path / "base")
    run = lora_run(tmp_path, "r", base, "none", 1, ["train.steps=2", "checkpoint.interval_steps=1"])
    shutil.rmtree(newest(run))
    shutil.rmtree(base)
    hf_folder(base, seed=1)  # the same shapes, other weights
    out = run_ranks(run, 1)
    assert out.returncode != 0
    assert "the base changed" in out.stderr, out.stderr[-3000:]


# ---------------------------------------------------------------- a PEFT folder in


def test_a_peft_folder_as_init_from_continues_its_adapters(runs, base, tmp_path):
    adapter = tmp_path / "adapter"
    export_peft(runs["fsdp"], adapter)
    run = lora_run(tmp_path, "continued", adapter, "none", 1, ["train.lr=0.0", "train.steps=1"])
    reader = DcpReader(newest(run))
    from safetensors.torch import load_file

    written = load_file(adapter / ADAPTER_WEIGHTS)
    ours = {k.removeprefix("model."): reader.read(k) for k in reader.entries if k.startswith("model.")}
    meta = reader.meta
    reader.close()
    assert len(ours) == len(written) == 20
    spec = load_run(run).spec
    from hpc.ckpt.peft import peft_names

    names = peft_names("llama", model_facts(spec.model).shape, ours)
    assert all(torch.equal(ours[k], written[names[k]]) for k in ours)  # lr = 0: the adapters as the folder had them
    assert meta["base.source"] == str(base)


def test_a_peft_folder_with_another_rank_is_refused(runs, tmp_path):
    from hpc.core.spec import load_spec
    from hpc.ckpt.init_source import init_from_problems
    from tests.trainer.trainer_testlib import TINY

    adapter = tmp_path / "adapter"
    export_peft(runs["fsdp"], adapter)
    spec = load_spec(TINY, [*LLAMA, f"checkpoint.init_from={str(adapter)!r}", *LORA, "lora.rank=8"])
    problems = init_from_problems(spec)
    assert any("r = 4, the spec's `lora.rank` = 8" in p for p in problems), problems


# ---------------------------------------------------------------- the GPT family


def test_a_gpt_lora_run_starts_at_the_base_loss_and_trains_only_adapters(tmp_path):
    gpt = ["model.arch='gpt'", "model.size='tiny'", "train.steps=2", "train.global_batch=4", "train.log_every=1"]
    full = make_run(tmp_path, "full", "ddp", 2, [*gpt, "train.lr=0.0"])
    lora = make_run(tmp_path, "lora", "ddp", 2, [*gpt, "lora.rank=2", "lora.targets=['c_attn', 'proj']"])
    for run in (full, lora):
        out = run_ranks(run, 2)
        assert out.returncode == 0, out.stderr[-3000:]
    assert losses(lora)[0] == losses(full)[0]
    reader = DcpReader(newest(lora))
    model = [k for k in reader.entries if k.startswith("model.")]
    reader.close()
    # 2 layers × (qkv, attn.proj, mlp.proj) × (A, B): `proj` names both projections, as PEFT's c_proj does
    assert len(model) == 12 and all(".lora_" in k for k in model)
