"""``hpcx ckpt convert RUN OUT --to peft``: a LoRA run's adapters as a PEFT folder (``adapter_config.json``
and ``adapter_model.safetensors`` with PEFT's names; see ``hpc.ckpt.peft``), written by the Hugging Face
export's shard writer (``hpc.ckpt.hf``)."""

from __future__ import annotations

import json
import math
import typing as tp
from pathlib import Path

import torch

from hpc.ckpt.dcp import DcpReader
from hpc.ckpt.entries import Scratch
from hpc.ckpt.hf import run_model, run_of, write_shard, write_text
from hpc.ckpt.outputs import check_destination, parents_made, staged
from hpc.ckpt.peft import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, module_plan, module_problems, peft_names,
                           run_lora)
from hpc.core.errors import CheckpointError, ConfigError
from hpc.core.hf import HfTensor
from hpc.core.lora import adapter_shapes


def _adapter_plan(reader: tp.Any, spec: tp.Any, arch: str, shape: tp.Any) -> list[HfTensor]:
    shapes = adapter_shapes(spec.model, spec.lora)
    names = peft_names(arch, shape, shapes)
    saved = module_plan(spec.lora, arch, shape)
    missing = [f"{reader.path}: no tensor model.{n}" for n in [*shapes, *(t.source for t in saved)]
               if f"model.{n}" not in reader.entries]
    if missing:
        raise CheckpointError(missing)
    return [HfTensor(names[n], n, "copy", s) for n, s in shapes.items()] + saved


def export_peft(src: str | Path, dst: str | Path) -> dict[str, tp.Any]:
    """``hpcx ckpt convert SRC DST --to peft``: the run's adapters as a PEFT folder at ``dst`` (fp32)."""
    src, dst = Path(src), Path(dst)
    check_destination(dst, make_parents=True)
    run, step = run_of(src)
    arch, shape, resolved = run_model(run)
    spec = run_lora(resolved, run)
    problems = module_problems(spec.lora, arch, shape)
    if problems:
        raise ConfigError([f"{run}: {p}; export the merged model with --to hf --merge-lora" for p in problems])
    reader = DcpReader(step)
    try:
        plan = _adapter_plan(reader, spec, arch, shape)
        with parents_made(dst), staged(dst, folder=True) as tmp:
            write_text(tmp / ADAPTER_CONFIG, json.dumps(adapter_config(spec, arch, shape), indent=2) + "\n")
            write_shard(tmp / ADAPTER_WEIGHTS, reader, plan, torch.float32, lambda n: None, (Scratch(), Scratch()))
    finally:
        reader.close()
    nbytes = sum(math.prod(t.shape) for t in plan) * 4
    return {"src": str(step), "dst": str(dst), "arch": "peft LoRA", "tensors": len(plan), "files": 1,
            "bytes": nbytes, "dtype": "fp32"}
