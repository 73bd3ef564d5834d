"""``hpcx ckpt convert RUN|STEP OUT --to hf``: what ``from_pretrained`` loads, with no missing or
unexpected keys and the same logits as hpcx's model; sharded with an index, bf16, the GPT as GPT-2;
every refusal one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hpc.ckpt.dcp import DcpReader  # noqa: E402
from hpc.ckpt.hf import export_hf  # noqa: E402
from hpc.core.models import model_facts  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.run import load_run  # noqa: E402

from tests.conftest import hpcx  # noqa: E402
from tests.trainer.trainer_testlib import REPO, child_env, make_run  # noqa: E402

LLAMA = ["model.arch='llama'", "model.size='tiny'", "train.steps=3", "train.log_every=1"]
GPT = ["model.arch='gpt'", "model.size='tiny'", "model.tie_embeddings=true", "train.steps=3"]


def trained(root: Path, name: str, overrides: list[str]) -> Path:
    """A run folder trained for a few steps in one process (its final step saved)."""
    run = make_run(root, name, "none", 1, overrides)
    out = subprocess.run([sys.executable, "-m", "trainer", str(run)], env=child_env(2), capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> Path:
    return trained(tmp_path_factory.mktemp("hf"), "llama", LLAMA)


def hpcx_model(run: Path) -> torch.nn.Module:
    """hpcx's model of ``run`` holding its newest checkpoint's weights."""
    spec = load_run(run).spec
    model = build_model(spec.model, "cpu").eval()
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    reader = DcpReader(step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(reader.read(f"model.{name}"))
    reader.close()
    return model


def loaded(folder: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    return model.eval()


def logits_diff(ours: torch.nn.Module, theirs: torch.nn.Module, vocab: int) -> float:
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits.float()).abs().max().item()


def test_llama_export_loads_with_the_same_logits(llama_run, tmp_path):
    summary = export_hf(llama_run, tmp_path / "hf")
    assert summary["arch"] == "LlamaForCausalLM" and summary["files"] == 1
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["intermediate_size"] == 192
    assert logits_diff(hpcx_model(llama_run), loaded(tmp_path / "hf"), 256) <= 1e-5


def test_sharded_export_has_an_index_and_loads(llama_run, tmp_path):
    step = sorted((llama_run / "checkpoints").glob("step-*"))[-1]
    summary = export_hf(step, tmp_path / "hf", shard_bytes=100_000)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert summary["files"] == len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert logits_diff(hpcx_model(llama_run), loaded(tmp_path / "hf"), 256) <= 1e-5


def test_bf16_export_holds_bf16_weights(llama_run, tmp_path):
    export_hf(llama_run, tmp_path / "hf", dtype="bf16")
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ours = hpcx_model(llama_run)
    theirs = loaded(tmp_path / "hf")
    assert theirs.model.embed_tokens.weight.float().equal(ours.tok_emb.weight.to(torch.bfloat16).float())


def test_tied_gpt_exports_to_gpt2(tmp_path):
    run = trained(tmp_path, "gpt", GPT)
    export_hf(run, tmp_path / "hf")
    theirs = loaded(tmp_path / "hf")
    assert type(theirs).__name__ == "GPT2LMHeadModel"
    assert logits_diff(hpcx_model(run), theirs, 256) <= 1e-5


def test_tokenizer_files_are_copied_when_the_data_names_one(llama_run, tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    (tok / "tokenizer_config.json").write_text("{}")
    run = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(llama_run), str(run)], check=True)
    (run / "data.json").write_text(json.dumps({"tokenizer": {"path": str(tok / "tokenizer.json"), "sha256": "x"}}))
    export_hf(run, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors",
                                                                    "tokenizer.json", "tokenizer_config.json"]
    from hpc.ckpt.hf import tokenizer_files

    doc = json.loads((run / "resolved.json").read_text())
    assert tokenizer_files(doc) == []  # synthetic data: no tokenizer
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "manifest.json").write_text(json.dumps({"tokenizer": {"path": str(tok)}}))
    doc["spec"]["data"]["source"] = str(prepared)
    assert [p.name for p in tokenizer_files(doc)] == ["tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("case", ["exists", "not-a-run", "user-model", "inside-the-checkpoint"])
def test_refusals_are_one_line_exit_2(llama_run, tmp_path, case):
    dst, src = tmp_path / "out", str(llama_run)
    if case == "inside-the-checkpoint":
        dst = sorted((llama_run / "checkpoints").glob("step-*"))[-1] / "hf"
    if case == "exists":
        dst.mkdir()
    elif case == "not-a-run":
        src = str(tmp_path)
    elif case == "user-model":
        src = str(make_run(tmp_path, "user", "none", 1, ["model.arch='tests.trainer.init_models:plain'",
                                                          "model.seq_len=64", "model.vocab_size=256"]))
        (Path(src) / "checkpoints" / "step-0000001").mkdir(parents=True)
        (Path(src) / "checkpoints" / "step-0000001" / ".metadata").write_bytes(b"")
    out = hpcx("ckpt", "convert", src, str(dst), "--to", "hf", timeout=120)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert not dst.exists() or case == "exists"
    assert case != "inside-the-checkpoint" or "inside the checkpoint" in out.stderr, out.stderr


MEMORY_CHILD = r"""
import json, sys
import torch
from hpc.ckpt.hf import export_hf
import hpc.ckpt.dcp, hpc.core.spec, hpc.core.runs, hpc.core.models
def hwm():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
before = hwm()
export_hf(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
print(json.dumps({"growth": hwm() - before}))
"""


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_memory_stays_at_about_the_largest_tensor(tmp_path, dtype):
    import torch.distributed.checkpoint as dcp

    from trainer.models.llama import Llama

    sets = ["model.arch='llama'", "model.size='small'", "model.dim=512", "model.n_layers=12", "model.vocab_size=16384"]
    run = make_run(tmp_path, "big", "none", 1, sets)
    spec = load_run(run).spec
    shape = model_facts(spec.model).shape
    dcp.save({"model": Llama(shape).state_dict()}, checkpoint_id=str(run / "checkpoints" / "step-0000001"),
             no_dist=True)
    total, largest = shape.n_params * 4, shape.largest_module_params * 4  # 207 MB, the embedding's 32 MB
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(run), str(tmp_path / "hf"), dtype],
                         capture_output=True, text=True, cwd=REPO, env=child_env(1), timeout=300, check=True)
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    assert growth <= 2 * largest + 32 * 2**20 < total / 2, (growth, largest, total)
