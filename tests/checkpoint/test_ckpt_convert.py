"""`hpcx ckpt inspect | convert | verify`: round trips, loadability, resume, and refusals."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ckpt_helpers import SHAPE, build, train_step  # noqa: E402

from hpc.cli.ckpt import ckpt_group  # noqa: E402
from hpc.core.errors import CheckpointError  # noqa: E402
from trainer.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint  # noqa: E402
from trainer.models.gpt import GPT  # noqa: E402


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(ckpt_group, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, float]:
    """A checkpoint after 2 steps, and the loss of the step after it."""
    run = tmp_path_factory.mktemp("run")
    model, optimizer, scheduler = build("none")
    for s in range(2):
        train_step(model, optimizer, scheduler, s)
    path = Checkpointer(run).save(2, model, optimizer, scheduler, {"step": 2, "tokens_seen": 128})
    return path, train_step(model, optimizer, scheduler, 2)


def resumed_loss(path: Path) -> float:
    model, optimizer, scheduler = build("none", seed=9)
    load_checkpoint(path, model, optimizer, scheduler)
    return train_step(model, optimizer, scheduler, 2)


@pytest.mark.parametrize("middle", ["torch", "safetensors"])
def test_round_trip_is_bit_exact_and_resumes(saved, tmp_path: Path, middle: str) -> None:
    ckpt, next_loss = saved
    mid, back = tmp_path / f"mid.{'pt' if middle == 'torch' else 'st'}", tmp_path / "back"
    extra = ["--shard-size", "40KB"] if middle == "safetensors" else []
    assert cli("convert", ckpt, mid, "--to", middle, *extra)[0] == 0
    assert cli("convert", mid, back, "--to", "dcp")[0] == 0
    code, out = cli("verify", ckpt, back)
    assert code == 0 and "bit-exact" in out, out
    assert cli("verify", ckpt, mid)[0] == 0
    assert resumed_loss(back) == next_loss
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []


def test_model_only_outputs_load_strictly_into_the_plain_model(saved, tmp_path: Path) -> None:
    import safetensors.torch

    ckpt, _ = saved
    assert cli("convert", ckpt, tmp_path / "m.pt", "--to", "torch", "--model-only")[0] == 0
    assert cli("convert", ckpt, tmp_path / "m.safetensors", "--to", "safetensors", "--model-only")[0] == 0
    for state in (torch.load(tmp_path / "m.pt", weights_only=True),
                  safetensors.torch.load_file(tmp_path / "m.safetensors")):
        GPT(SHAPE).load_state_dict(state, strict=True)
    assert cli("verify", ckpt, tmp_path / "m.safetensors", "--model-only")[0] == 0


def test_large_safetensors_output_is_sharded_with_an_index(saved, tmp_path: Path) -> None:
    import safetensors.torch

    ckpt, _ = saved
    out = tmp_path / "st"
    assert cli("convert", ckpt, out, "--to", "safetensors", "--model-only", "--shard-size", "30KB")[0] == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    state = {}
    for name in shards:
        state.update(safetensors.torch.load_file(out / name))
    assert set(state) == set(index["weight_map"])
    GPT(SHAPE).load_state_dict(state, strict=True)


def test_inspect_shows_what_was_saved(saved) -> None:
    ckpt, _ = saved
    code, out = cli("inspect", ckpt, "--json")
    info = json.loads(out)
    assert code == 0 and info["complete"] and info["format"] == "dcp"
    assert (info["step"], info["tokens_seen"], info["world_size"], info["strategy"]) == (2, 128, 1, "none")
    qkv = next(t for t in info["tensors"] if t["key"] == "model.blocks.0.attn.qkv.weight")
    assert (qkv["shape"], qkv["dtype"], qkv["bytes"]) == ([96, 32], "float32", 96 * 32 * 4)
    code, text = cli("inspect", ckpt)
    assert code == 0 and "world size:" in text and "model.head.weight" in text


def test_verify_reports_the_first_difference(saved, tmp_path: Path) -> None:
    ckpt, _ = saved
    assert cli("convert", ckpt, tmp_path / "a.pt", "--to", "torch")[0] == 0
    state = torch.load(tmp_path / "a.pt", weights_only=True)
    state["model"]["head.weight"][0, 0] += 1e-3
    torch.save(state, tmp_path / "b.pt")
    code, out = cli("verify", ckpt, tmp_path / "b.pt")
    assert code == 1 and "model.head.weight" in out
    assert cli("verify", ckpt, tmp_path / "b.pt", "--atol", "1e-2")[0] == 0


class Planted:
    """Unpickling this would create a file: the test checks that it never happens."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (open, (str(self.target), "w"))


def test_planted_metadata_pickle_is_refused_and_never_runs(saved, tmp_path: Path) -> None:
    import shutil

    ckpt, _ = saved
    bad = tmp_path / "run" / "checkpoints" / "step-0000009"
    shutil.copytree(ckpt, bad)
    marker = tmp_path / "pwned"
    (bad / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    code, out = cli("inspect", bad)
    assert code == 2 and ".metadata" in out and "refused" in out and "Traceback" not in out
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(bad, *build("none"))
    assert latest_checkpoint(tmp_path / "run") is None
    assert not marker.exists()


def test_planted_torch_file_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"model": {"w": torch.zeros(1)}, "x": Planted(marker)}, tmp_path / "bad.pt")
    code, out = cli("convert", tmp_path / "bad.pt", tmp_path / "out", "--to", "dcp")
    assert code == 2 and "bad.pt" in out and not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["no-metadata", "missing-shard", "truncated", "wrong-path"])
def test_torn_input_is_refused_with_one_line_and_nothing_written(saved, tmp_path: Path, damage: str) -> None:
    import shutil

    ckpt, _ = saved
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    shard = next(src.glob("*.distcp"))
    expect = {"no-metadata": ".metadata", "missing-shard": shard.name, "truncated": "truncated",
              "wrong-path": "no such"}[damage]
    if damage == "no-metadata":
        (src / ".metadata").unlink()
    elif damage == "missing-shard":
        shard.unlink()
    elif damage == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        src = tmp_path / "nowhere"
    for args in (("inspect", src), ("convert", src, tmp_path / "out.st", "--to", "safetensors"),
                 ("verify", src, ckpt)):
        code, out = cli(*args)
        assert code == 2 and expect in out and "Traceback" not in out, (args, out)
        assert all(line.startswith("error: ") for line in out.strip().splitlines()), out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no output, no partial


def test_existing_destination_is_refused(saved, tmp_path: Path) -> None:
    ckpt, _ = saved
    (tmp_path / "x.pt").write_bytes(b"keep me")
    code, out = cli("convert", ckpt, tmp_path / "x.pt", "--to", "torch")
    assert code == 2 and "already exists" in out and (tmp_path / "x.pt").read_bytes() == b"keep me"


def test_cli_module_does_not_import_torch() -> None:
    code = "import sys, hpc.ckpt, hpc.cli.ckpt; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_format_package_never_imports_the_trainer() -> None:
    code = ("import sys, pkgutil, importlib, hpc.ckpt\n"
            "for m in pkgutil.iter_modules(hpc.ckpt.__path__): importlib.import_module('hpc.ckpt.' + m.name)\n"
            "bad = [m for m in sys.modules if m == 'trainer' or m.startswith('trainer.')]\n"
            "assert not bad, f'hpc.ckpt imported {bad}'")
    subprocess.run([sys.executable, "-c", code], check=True)
