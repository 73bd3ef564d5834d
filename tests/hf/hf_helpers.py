"""Tiny Hugging Face folders and hpcx runs for the init_from and export tests (nothing downloaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.trainer.trainer_testlib import REPO, child_env, make_run, torchrun

# the tiny Llama preset: 2 layers, dim 64, 4 heads / 2 kv, SwiGLU 192, vocab 256, context 64
TINY = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
LLAMA = ["model.arch='llama'", "model.size='tiny'"]


def hf_folder(path: Path, dtype: str = "float32", shard: str = "100KB", seed: int = 0, **config) -> Path:
    """A random ``LlamaForCausalLM`` saved by transformers (sharded with an index when over ``shard``)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**TINY, **config})
    model = transformers.LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size=shard)
    return path


def hf_tensors(path: Path) -> dict:
    """Every tensor of a safetensors folder, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run_ranks(run: Path, ranks: int) -> subprocess.CompletedProcess:
    """Train ``run`` with ``ranks`` local processes (torchrun; one process without it)."""
    if ranks == 1:
        return subprocess.run([sys.executable, "-m", "trainer", str(run)], env=child_env(2), capture_output=True,
                              text=True, timeout=300, cwd=REPO)
    return torchrun(ranks, ["-m", "trainer", str(run)])


def fine_tune(root: Path, name: str, source: Path | str, strategy: str, ranks: int, extra: list[str] = ()) -> Path:
    """A run of the tiny Llama from ``source`` at lr = 0 (the weights do not move), trained to its end."""
    sets = [*LLAMA, f"checkpoint.init_from={str(source)!r}", "train.lr=0.0", "train.steps=2", "train.log_every=1",
            "data.shuffle=false", *extra]
    run = make_run(root, name, strategy, ranks, sets)
    out = run_ranks(run, ranks)
    assert out.returncode == 0, out.stderr[-4000:]
    return run


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
