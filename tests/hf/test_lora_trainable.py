"""LoRA runs with ``lora.trainable`` out as PEFT folders and back (PEFT's ``modules_to_save``).

Classes of defect, each with cases of its own:

- ``--to peft`` of a run that trained parameters in full writes what ``PeftModel.from_pretrained``
  loads with missing or unexpected keys, with the base's values instead of the trained ones, or with
  logits other than hpcx's (the norms of every layer under fsdp on 2 ranks; the final norm and the
  untied head on 1);
- a ``lora.trainable`` that PEFT cannot save as it trained (part of a module: GPT-2's ``ln_f`` weight
  without its bias) is written anyway, or refused in more than one line, or leaves something at OUT;
- the exported folder as ``checkpoint.init_from`` does not continue the trained-in-full tensors, or a
  folder whose ``modules_to_save`` differ from the spec's ``lora.trainable`` is taken.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.extras import extra

transformers = extra("transformers")
peft = extra("peft")

from hpc.ckpt.dcp import DcpReader  # noqa: E402
from hpc.ckpt.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS  # noqa: E402
from hpc.ckpt.peft_export import export_peft  # noqa: E402

from tests.conftest import hpcx  # noqa: E402
from tests.hf.hf_helpers import LLAMA, hf_folder, hf_tensors, losses, run_ranks  # noqa: E402
from tests.hf.test_lora import LORA, hpcx_model, logits, lora_run, newest, peft_model  # noqa: E402
from tests.trainer.trainer_testlib import make_run  # noqa: E402

NORMS = "lora.trainable=['*norm*']"
LAYER_NORMS = [f"model.layers.{i}.{n}" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return hf_folder(tmp_path_factory.mktemp("lora-trainable") / "base")


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {"norms": lora_run(root, "norms", base, "fsdp", 2, [NORMS]),
            "head": lora_run(root, "head", base, "none", 1, ["lora.trainable=['norm.weight', 'head.weight']",
                                                             "train.steps=2"])}


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exported")
    out = {}
    for name, run in runs.items():
        out[name] = root / name
        export_peft(run, out[name])
    return out


def trained_model(run: Path, base: Path) -> torch.nn.Module:
    """hpcx's model of ``run`` (test_lora's ``hpcx_model``) with the parameters it trained in full from its newest step."""
    model = hpcx_model(run, base)
    reader = DcpReader(newest(run))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" not in name and f"model.{name}" in reader.entries:
                p.copy_(reader.read(f"model.{name}"))
    reader.close()
    return model


# ---------------------------------------------------------------- out


@pytest.mark.parametrize("name,modules", [
    ("norms", [*LAYER_NORMS, "model.norm"]),
    ("head", ["model.norm", "lm_head"]),
])
def test_the_peft_export_loads_the_trained_modules_with_hpcxs_logits(runs, exported, base, name, modules):
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    out = exported[name]
    assert json.loads((out / ADAPTER_CONFIG).read_text())["modules_to_save"] == modules
    model = peft_model(base, out)
    written, loaded = load_file(out / ADAPTER_WEIGHTS), get_peft_model_state_dict(model)
    assert set(written) == set(loaded)  # nothing missing, nothing unexpected
    assert all(torch.equal(written[k], loaded[k]) for k in written)
    assert {k for k in written if ".lora_" not in k} == {f"base_model.model.{m}.weight" for m in modules}
    theirs = hf_tensors(base)
    for m in modules:  # trained: not the base's values PEFT would otherwise copy
        assert not torch.equal(written[f"base_model.model.{m}.weight"], theirs[f"{m}.weight"]), m
    theirs_logits = logits(model)
    assert (logits(trained_model(runs[name], base)) - theirs_logits).abs().max().item() <= 1e-5
    assert (logits(hpcx_model(runs[name], base)) - theirs_logits).abs().max().item() > 1e-5  # the modules count


def test_part_of_a_module_is_refused_in_one_line(tmp_path):
    gpt = ["model.arch='gpt'", "model.size='tiny'", "train.steps=1", "train.global_batch=2", "lora.rank=2",
           "lora.trainable=['ln_f.weight']"]  # GPT-2's ln_f has a bias too, which did not train
    run = make_run(tmp_path, "gpt", "none", 1, gpt)
    done = run_ranks(run, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    out = hpcx("ckpt", "convert", str(run), str(tmp_path / "out"), "--to", "peft")
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "transformer.ln_f" in line]
    assert len(errors) == 1 and "`lora.trainable`" in errors[0] and str(run) in errors[0], out.stderr
    assert "bias" in errors[0] and "--merge-lora" in errors[0]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- in


def test_the_exported_folder_as_init_from_continues_the_trained_modules(runs, exported, base, tmp_path):
    run = lora_run(tmp_path, "again", exported["norms"], "none", 1, [NORMS, "train.lr=0.0", "train.steps=1"])
    a, b = DcpReader(newest(runs["norms"])), DcpReader(newest(run))
    before = {k: a.read(k) for k in a.entries if k.startswith("model.")}
    after = {k: b.read(k) for k in b.entries if k.startswith("model.")}
    meta = b.meta
    a.close()
    b.close()
    assert set(before) == set(after) and sum(".lora_" not in k for k in after) == 5  # 2 × 2 layer norms + the final
    assert all(torch.equal(before[k], after[k]) for k in before)  # lr = 0: the folder's tensors, norms included
    assert meta["base.source"] == str(base)
    # the base model's loss is the first run's first (B = 0, norms untrained): the continued run starts elsewhere
    assert losses(run)[0] != losses(runs["norms"])[0]


@pytest.mark.parametrize("folder,trainable,expected", [
    ("norms", "lora.trainable=['norm.weight']", "also has model.layers.0.input_layernorm"),
    ("norms", "lora.trainable=[]", "also has model.layers.0.input_layernorm"),
    ("head", NORMS, "lacks model.layers.0.input_layernorm"),
])
def test_a_folder_whose_modules_to_save_differ_is_refused_in_one_line(exported, folder, trainable, expected):
    from hpc.ckpt.init_source import init_from_problems
    from hpc.core.spec import load_spec
    from tests.trainer.trainer_testlib import TINY

    spec = load_spec(TINY, [*LLAMA, f"checkpoint.init_from={str(exported[folder])!r}", *LORA, trainable])
    problems = init_from_problems(spec)
    assert len(problems) == 1, problems
    assert "modules_to_save" in problems[0] and "`lora.trainable`" in problems[0] and expected in problems[0]


def test_a_plain_adapter_folder_continues_with_what_the_spec_trains_in_full_from_the_base(exported, base, tmp_path):
    """A folder without modules_to_save (a LoRA run without ``lora.trainable``, or PEFT's own): its adapters
    are read; the norms the spec now trains in full start from the base, as PeftModel has them."""
    from safetensors.torch import load_file, save_file

    from hpc.ckpt.init_source import init_from_problems
    from hpc.ckpt.peft import read_adapters
    from hpc.core.models import model_facts
    from hpc.core.spec import load_spec
    from tests.trainer.trainer_testlib import TINY

    plain = tmp_path / "plain"
    plain.mkdir()
    config = json.loads((exported["norms"] / ADAPTER_CONFIG).read_text())
    (plain / ADAPTER_CONFIG).write_text(json.dumps({**config, "modules_to_save": None}))
    tensors = load_file(exported["norms"] / ADAPTER_WEIGHTS)
    save_file({k: v for k, v in tensors.items() if ".lora_" in k}, plain / ADAPTER_WEIGHTS)
    spec = load_spec(TINY, [*LLAMA, f"checkpoint.init_from={str(plain)!r}", *LORA, NORMS])
    assert init_from_problems(spec) == []
    facts = model_facts(spec.model)
    read = read_adapters(plain, spec, facts.family, facts.shape)
    assert read and all(".lora_" in k for k in read)
    assert sum(".lora_" in k for k in tensors) == len(read)
    # the same folder with a norm tensor left in, undeclared: refused, one line naming it
    save_file({k: v for k, v in tensors.items() if ".lora_" in k or k.endswith("model.norm.weight")},
              plain / ADAPTER_WEIGHTS)
    with pytest.raises(Exception, match="match no adapter or modules_to_save parameter of the model: "
                                        "base_model.model.model.norm.weight"):
        read_adapters(plain, spec, facts.family, facts.shape)
