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
import torch

from tests.extras import extra

transformers = extra("transformers")

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


def test_the_export_makes_the_folders_above_it(llama_run, tmp_path):
    out = hpcx("ckpt", "convert", str(llama_run), str(tmp_path / "exports" / "v1" / "hf"), "--to", "hf")
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "exports" / "v1").iterdir()) == ["hf"]
    assert (tmp_path / "exports" / "v1" / "hf" / "config.json").is_file()


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


BOS, EOS, PAD = 200, 201, 202  # none of LlamaConfig's defaults (1, 2, none)


def special_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer of the tiny Llama's 256 ids whose BOS, EOS and PAD are Llama 3's names."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder.mkdir()
    names = {BOS: "<|begin_of_text|>", EOS: "<|end_of_text|>", PAD: "<|pad|>"}
    vocab = {names.get(i, f"w{i}"): i for i in range(256)}
    Tokenizer(WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": names[BOS], "eos_token": {"content": names[EOS]}, "pad_token": names[PAD]}))
    return folder / "tokenizer.json"


def always_eos(folder: Path) -> None:
    """Weights that make the exported model say EOS after any token: the blocks add nothing to the
    residual (o_proj, down_proj zero), every embedding is ones, and only the head's EOS row is not zero."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    tensors["model.embed_tokens.weight"].fill_(1.0)
    tensors["lm_head.weight"].zero_()
    tensors["lm_head.weight"][EOS] = 1.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_the_export_generates_with_transformers_and_stops_at_the_eos_the_data_recorded(llama_run, tmp_path):
    tok = special_tokenizer(tmp_path / "tok")
    run = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(llama_run), str(run)], check=True)
    (run / "data.json").write_text(json.dumps({"tokenizer": {"path": str(tok), "eos_id": EOS}}))
    export_hf(run, tmp_path / "hf")
    ids = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
    for name in ("config.json", "generation_config.json"):
        doc = json.loads((tmp_path / "hf" / name).read_text())
        assert {k: doc.get(k) for k in ids} == ids, name
    always_eos(tmp_path / "hf")
    model = loaded(tmp_path / "hf")
    assert model.generation_config.eos_token_id == EOS
    out = model.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                         max_new_tokens=20, do_sample=False)
    assert out[0].tolist() == [5, 6, 7, EOS]  # stopped at EOS, not 20 tokens later
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "hf" / "tokenizer.json"))
    assert fast.convert_ids_to_tokens([EOS]) == ["<|end_of_text|>"]


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
