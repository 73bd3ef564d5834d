"""Shared pieces of the checkpoint tests: a small GPT, strategies, one deterministic training step,
and a launcher for real gloo processes on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hpc.core.models.gpt import GPTShape
from trainer.models.gpt import GPT

HERE = Path(__file__).resolve().parent
SHAPE = GPTShape(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=64)


def build(strategy: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """Model (same init everywhere), strategy applied, AdamW and a warm-up schedule."""
    torch.manual_seed(seed)
    model: nn.Module = GPT(SHAPE)
    if strategy in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        mesh = (init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)) if strategy == "fsdp" else
                init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard")))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif strategy == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return model, optimizer, scheduler


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (so every strategy computes the same gradient)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, SHAPE.vocab_size, (4, SHAPE.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, step: int) -> float:
    """One optimizer step on ``batch(step)``; the loss before the update."""
    x, y = batch(step)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, SHAPE.vocab_size), y.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss.item()


def init_from_env() -> None:
    """gloo over a FileStore named by HPCX_TEST_STORE (no ports to collide)."""
    world = int(os.environ["WORLD_SIZE"])
    if world > 1 or os.environ.get("HPCX_TEST_FORCE_PG"):
        store = dist.FileStore(os.environ["HPCX_TEST_STORE"], world)
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=world)


def launch(world: int, args: list[str], tmp: Path, timeout: float = 120) -> None:
    """Run ``dist_worker.py ARGS`` on ``world`` ranks; raise with every rank's output if one fails."""
    store = tmp / f"store-{os.getpid()}-{len(list(tmp.glob('store-*')))}"
    env = {**os.environ, "WORLD_SIZE": str(world), "HPCX_TEST_STORE": str(store), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "dist_worker.py"), *args], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        raise AssertionError("\n".join(f"--- rank {r} (exit {p.returncode})\n{out[-3000:]}"
                                       for r, (p, out) in enumerate(zip(procs, outputs))))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def cli(*args: object) -> tuple[int, str]:
    """``hpcx ckpt ARGS`` in-process: (exit code, stdout + stderr); a traceback fails the test."""
    from click.testing import CliRunner

    from hpc.cli.ckpt import ckpt_group

    result = CliRunner().invoke(ckpt_group, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result.exit_code, result.output


def assert_refused(args: tuple, *expect: str) -> str:
    """``hpcx ckpt ARGS`` exits 2 with only ``error:`` lines, each mentioning... and all of ``expect``."""
    code, out = cli(*args)
    lines = out.strip().splitlines()
    assert code == 2, (args, code, out)
    assert lines and all(line.startswith("error: ") for line in lines), out
    assert "Traceback" not in out
    for text in expect:
        assert text in out, (text, out)
    return out


def refused_everywhere(tmp_path: Path, src: Path, *expect: str) -> None:
    """inspect (plain and --deep), convert (every target) and verify all refuse ``src`` with
    ``error:`` lines mentioning ``expect``, and leave nothing new in ``tmp_path``."""
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_refused(("inspect", src), str(src.name), *expect)
    assert_refused(("inspect", src, "--deep"), *expect)
    for to, dst in (("dcp", "out.dcp"), ("torch", "out.pt"), ("safetensors", "out.st")):
        assert_refused(("convert", src, tmp_path / dst, "--to", to), *expect)
    assert_refused(("verify", src, src), *expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
