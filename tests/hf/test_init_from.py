"""``checkpoint.init_from``: a fine-tune starts from Hugging Face, DCP, safetensors or torch weights.

(b) an HF folder → init_from under fsdp and hsdp on 2 ranks → export after steps at lr = 0 gives back
the original tensors bit for bit (fp32 and bf16 files; tied stays tied); (c) the first logged loss
equals transformers' loss on the same samples; a requeued fine-tune resumes from its own newest step,
never from the pretrained weights again; every mismatch is found from headers at dryrun and submit,
one line each, all at once, exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.extras import extra

transformers = extra("transformers")

from hpc.ckpt.hf import export_hf  # noqa: E402

from tests.conftest import hpcx  # noqa: E402
from tests.hf.hf_helpers import LLAMA, fine_tune, hf_folder, hf_tensors, losses, run_ranks  # noqa: E402
from tests.trainer.trainer_testlib import REPO, make_run  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return hf_folder(tmp_path_factory.mktemp("hf") / "llama")


def exported(run, tmp_path, dtype="fp32"):
    tmp_path.mkdir(exist_ok=True)
    export_hf(run, tmp_path / f"out-{dtype}", dtype=dtype)
    return hf_tensors(tmp_path / f"out-{dtype}")


def assert_bitwise(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.parametrize("strategy,extra", [("fsdp", []), ("hsdp", ["parallel.shard_size=1"])])
def test_hf_folder_round_trips_bit_for_bit_on_two_ranks(source, tmp_path, strategy, extra):
    run = fine_tune(tmp_path, strategy, source, strategy, 2, extra)
    log = "".join(p.read_text() for p in (run / "logs").glob("*"))
    assert "init_from" in log and "(safetensors)" in log
    assert_bitwise(exported(run, tmp_path), hf_tensors(source))


def test_a_fine_tune_trains_shorter_samples_than_the_models_context(source, tmp_path):
    """``model.hf_config`` with ``model.seq_len`` below its max_position_embeddings (64): samples of 32
    tokens; the export records the model's context again and gives back the original tensors."""
    run = fine_tune(tmp_path, "short", source, "fsdp", 2, [f"model.hf_config={str(source)!r}", "model.seq_len=32"])
    doc = json.loads((run / "resolved.json").read_text())["spec"]["model"]
    assert (doc["seq_len"], doc["context_len"]) == (32, 64)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["tokens_per_s"] * first["step_time_s"] == pytest.approx(8 * 32)  # global_batch 8 × 32 tokens
    assert_bitwise(exported(run, tmp_path / "out"), hf_tensors(source))
    config = json.loads((tmp_path / "out" / "out-fp32" / "config.json").read_text())
    assert config["max_position_embeddings"] == 64


def test_uneven_shards_on_three_ranks_and_hsdp_on_four(source, tmp_path):
    """dims that do not divide by 3 (kv 32 rows, vocab 256): later ranks hold shorter shards; 2 × 2 HSDP
    with activation checkpointing (its wrapper renames the parameters)."""
    for name, strategy, ranks, overrides in (("three", "fsdp", 3, ["train.global_batch=6"]),
                                         ("four", "hsdp", 4, ["parallel.shard_size=2",
                                                              "parallel.activation_checkpointing=true"])):
        run = fine_tune(tmp_path, name, source, strategy, ranks, overrides)
        assert_bitwise(exported(run, tmp_path / name), hf_tensors(source))


def test_bf16_weights_become_fp32_masters_and_tied_stays_tied(tmp_path):
    src = hf_folder(tmp_path / "tied", dtype="bfloat16", tie_word_embeddings=True)
    run = fine_tune(tmp_path, "tied", src, "fsdp", 2, ["model.tie_embeddings=true"])
    original = hf_tensors(src)
    assert "lm_head.weight" not in original
    assert_bitwise(exported(run, tmp_path, "bf16"), original)
    fp32 = exported(run, tmp_path, "fp32")
    assert all(torch.equal(fp32[k], original[k].float()) for k in original)
    assert json.loads((tmp_path / "out-fp32" / "config.json").read_text())["tie_word_embeddings"] is True


def test_first_logged_loss_equals_transformers_loss_on_the_same_samples(source, tmp_path):
    run = fine_tune(tmp_path, "loss", source, "fsdp", 2, ["train.global_batch=4"])
    from trainer.data import SyntheticTokens
    from trainer.run import load_run

    spec = load_run(run).spec
    data = SyntheticTokens(256, 64, spec.train.seed)
    tokens = torch.stack([data[i] for i in range(4)])  # data.shuffle = false: the first global batch
    model = transformers.LlamaForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        want = model(input_ids=tokens, labels=tokens).loss.item()
    assert losses(run)[0] == pytest.approx(want, abs=1e-5)


def test_dcp_safetensors_and_torch_sources(source, tmp_path):
    first = fine_tune(tmp_path, "first", source, "fsdp", 2)
    step = sorted((first / "checkpoints").glob("step-*"))[-1]
    from_run = fine_tune(tmp_path, "from-run", first, "ddp", 2)  # DCP, resharded from fsdp to ddp
    assert_bitwise(exported(from_run, tmp_path / "a"), hf_tensors(source))
    flat = tmp_path / "one.safetensors"
    from safetensors.torch import save_file

    save_file(hf_tensors(source), flat)
    from_file = fine_tune(tmp_path, "from-file", flat, "none", 1)
    assert_bitwise(exported(from_file, tmp_path / "b"), hf_tensors(source))
    from hpc.ckpt.dcp import DcpReader

    reader = DcpReader(step)
    state = {k[len("model."):]: reader.read(k) for k in reader.entries if k.startswith("model.")}
    reader.close()
    torch.save(state, tmp_path / "plain.pt")
    from_torch = fine_tune(tmp_path, "from-torch", tmp_path / "plain.pt", "fsdp", 2)
    assert_bitwise(exported(from_torch, tmp_path / "c"), hf_tensors(source))


def test_a_requeued_fine_tune_resumes_from_its_own_step_not_the_pretrained_weights(tmp_path):
    src = hf_folder(tmp_path / "src")
    run = make_run(tmp_path, "ft", "fsdp", 2, [*LLAMA, f"checkpoint.init_from={str(src)!r}", "train.steps=2",
                                               "checkpoint.interval_steps=1", "train.log_every=1"])
    assert run_ranks(run, 2).returncode == 0
    shutil.rmtree(src)  # a second start that read init_from again would fail
    doc = json.loads((run / "resolved.json").read_text())
    doc["spec"]["train"]["steps"] = 4
    (run / "resolved.json").write_text(json.dumps(doc))
    out = run_ranks(run, 2)
    assert out.returncode == 0, out.stderr[-3000:]
    starts = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    assert [e.get("step") for e in starts if e.get("event") == "start"] == [0, 2]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


# --- refused from headers, one line each, all at once ---------------------------------------------------


def job(tmp_path, init_from, *extra):
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\narch = "llama"\nsize = "tiny"\n{chr(10).join(extra)}\n[train]\nglobal_batch = 8\n'
                    f'[parallel]\nstrategy = "fsdp"\n[checkpoint]\ninit_from = "{init_from}"\n')
    return str(path)


def refused(args):
    out = hpcx(*args, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    return [line.removeprefix("error: ") for line in out.stderr.strip().splitlines()]


def test_a_model_that_disagrees_is_refused_in_one_line_per_kind(tmp_path):
    """Another model is one problem: its config.json in one line (issue 47: a wrong base printed a line per
    tensor); the same weights without their config.json: one line for every tensor of another shape."""
    src = hf_folder(tmp_path / "wide", shard="10GB", num_key_value_heads=4)
    lines = refused(["dryrun", job(tmp_path, src), "--site", "local"])
    assert len(lines) == 1 and "config.json: describes another model: num_key_value_heads = 4 (the run's model " \
        "has 2)" in lines[0], lines
    lines = refused(["dryrun", job(tmp_path, src / "model.safetensors"), "--site", "local"])
    assert len(lines) == 1 and "4 tensors have other shapes: model.layers.0.self_attn.k_proj.weight is [64, 64], " \
        "the model's blocks.0.attn.wk.weight is [32, 64]" in lines[0] and "and 1 more" in lines[0], lines


def test_missing_unexpected_and_non_float_tensors(tmp_path):
    from safetensors.torch import save_file

    state = hf_tensors(hf_folder(tmp_path / "src"))
    del state["model.norm.weight"]
    state["model.layers.0.mlp.gate_proj.weight"] = state["model.layers.0.mlp.gate_proj.weight"].long()
    state["extra.weight"] = torch.zeros(3)
    save_file(state, tmp_path / "bad.safetensors")
    lines = refused(["dryrun", job(tmp_path, tmp_path / "bad.safetensors"), "--site", "local"])
    assert len(lines) == 3, lines
    assert "no tensor for 1 of the model's parameters: norm.weight [64]" in lines[0]
    assert "1 tensors are not floating point: model.layers.0.mlp.gate_proj.weight (int64)" in lines[1]
    assert "1 tensors match no parameter of the model: extra.weight" in lines[2]


@pytest.mark.parametrize("case", ["nothing-there", "truncated", "gpt-from-hf"])
def test_bad_sources_are_one_line(tmp_path, case):
    src = tmp_path / "nowhere"
    if case == "truncated":
        src = hf_folder(tmp_path / "src", shard="10GB")
        with open(src / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif case == "gpt-from-hf":
        src = hf_folder(tmp_path / "src")
    path = job(tmp_path, src)
    if case == "gpt-from-hf":
        (tmp_path / "job.toml").write_text((tmp_path / "job.toml").read_text().replace('"llama"', '"gpt"'))
    lines = refused(["dryrun", path, "--site", "local"])
    assert len(lines) == 1, lines
    words = {"nothing-there": "no such file or folder", "truncated": "model.safetensors",
             "gpt-from-hf": "hpcx reads those for arch = 'llama', arch = 'qwen2' or arch = 'mistral', not 'gpt'"}[case]
    assert words in lines[0]


def bin_folder(source: Path, dst: Path, files: int = 1) -> Path:
    """``source``'s weights as transformers wrote them before safetensors: ``pytorch_model.bin`` (a
    ``torch.save`` of the state_dict, Hugging Face's names) beside its config.json."""
    dst.mkdir()
    shutil.copyfile(source / "config.json", dst / "config.json")
    tensors = sorted(hf_tensors(source).items())
    for k in range(files):
        name = "pytorch_model.bin" if files == 1 else f"pytorch_model-{k + 1:05d}-of-{files:05d}.bin"
        torch.save(dict(tensors[k::files]), dst / name)
    return dst


def test_a_pytorch_model_bin_with_hugging_face_names_round_trips(source, tmp_path):
    weights = bin_folder(source, tmp_path / "bin") / "pytorch_model.bin"
    run = fine_tune(tmp_path, "from-bin", weights, "fsdp", 2)
    assert_bitwise(exported(run, tmp_path / "out"), hf_tensors(source))


@pytest.mark.parametrize("files,words", [(1, "its weights are one torch file: point init_from at the file, '{}'"),
                                         (2, "its weights are 2 torch files (pytorch_model-00001-of-00002.bin …)")])
def test_a_folder_of_bin_weights_says_what_to_point_at(source, tmp_path, files, words):
    folder = bin_folder(source, tmp_path / "bin", files)
    lines = refused(["dryrun", job(tmp_path, folder), "--site", "local"])
    assert len(lines) == 1 and words.format(folder / "pytorch_model.bin") in lines[0], lines


def test_submit_refuses_before_anything_is_submitted(tmp_path):
    root = tmp_path / "runs"
    lines = refused(["submit", job(tmp_path, tmp_path / "nowhere"), "--site", "local", "--set",
                     f"job.run_root={str(root)!r}"])
    assert len(lines) == 1 and "no such file or folder" in lines[0]
    assert not root.exists() or not any(root.iterdir())


def test_the_spec_records_the_path_absolute(tmp_path, monkeypatch):
    from hpc.core.spec import load_spec

    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.toml").write_text('[checkpoint]\ninit_from = "weights"\n')
    assert load_spec(tmp_path / "job.toml").checkpoint.init_from == str(tmp_path / "weights")
    assert REPO.exists()
