"""``hpcx ckpt convert RUN OUT --to hf --merge-lora``: a LoRA run's checkpoint seen as a full model's, each
target weight ``W + (alpha / r) · B A`` read from the base (``checkpoint.init_from``, opened by
``hpc.ckpt.init_source``) and the adapters, one tensor at a time; ``hpc.ckpt.hf.export_hf`` writes it as
any run."""

from __future__ import annotations

import typing as tp
from pathlib import Path

import torch

from hpc.ckpt import formats
from hpc.compat import to_nf4
from hpc.ckpt.dcp import DcpReader
from hpc.ckpt.entries import tensor_entry
from hpc.ckpt.init_source import open_source
from hpc.ckpt.peft import run_lora
from hpc.ckpt.torch_zip import read_exact
from hpc.core.errors import ConfigError
from hpc.core.lora import is_nf4, rest_dtype
from hpc.core.spec import compute_precision


class MergedReader:
    """A LoRA run's step folder read as the full model's (``hpc.ckpt.entries.Reader``): ``model.<name>``
    of every base parameter, from the checkpoint where it trained (``lora.trainable``), else from the
    base, with ``scaling · B A`` added to each target weight."""

    format = "dcp"

    def __init__(self, step: Path, spec: tp.Any, arch: str, shape: tp.Any, mixed_precision: str = "none"):
        if not spec.checkpoint.init_from:
            raise ConfigError([f"{step}: a LoRA run without `checkpoint.init_from`: its base is its own "
                               "initialisation, which --merge-lora cannot read back"])
        self.path, self.scaling, self.lora, self.arch = step, spec.lora.scaling, spec.lora, arch
        self.mixed_precision = mixed_precision
        self.ckpt = DcpReader(step)
        self.base = open_source(spec.checkpoint.init_from, arch, shape)
        self.meta, self.paths = self.ckpt.meta, self.ckpt.paths
        self.entries = dict(self.ckpt.entries)
        for name, t in self.base.tensors.items():
            self.entries.setdefault(f"model.{name}", tensor_entry(f"model.{name}", t.dtype, t.shape))
        self._base_reader: tp.Any = None

    def read(self, key: str) -> tp.Any:
        return self.ckpt.read(key)

    def read_into(self, key: str, out: torch.Tensor) -> None:
        name = key.removeprefix("model.")
        if key in self.ckpt.entries:
            self.ckpt.read_into(key, out)
        else:
            out.copy_(self._as_trained(name, self._base_tensor(name)))
        stem = name.removesuffix(".weight")
        if f"model.{stem}.lora_A.weight" in self.ckpt.entries:
            a, b = (self.ckpt.read(f"model.{stem}.lora_{x}.weight").float() for x in "AB")
            out.add_((b @ a * self.scaling).to(out.dtype))

    def _as_trained(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A base tensor as the run computed with it (``lora.base_dtype``): rounded to bf16, or quantized
        to NF4 and dequantized (torchao, as ``trainer.lora`` stored it), so the merged model is the one
        the adapters were trained on."""
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[rest_dtype(self.lora, self.mixed_precision)]
        if is_nf4(name, self.lora, self.arch):
            return to_nf4(value.to(dtype)).get_original_weight()
        return value.to(dtype)

    def _base_tensor(self, name: str) -> torch.Tensor:
        t = self.base.tensors[name]
        buf = torch.empty(t.shape, dtype=t.dtype)
        if t.file is not None:
            with open(t.file, "rb", buffering=0) as f:
                read_exact(f, t.offset, buf, str(t.file))
            return buf
        if self._base_reader is None:
            self._base_reader = formats.get(self.base.kind).open(self.base.step or self.base.path)
        self._base_reader.read_into(t.key, buf)
        return buf

    def close(self) -> None:
        self.ckpt.close()
        if self._base_reader is not None:
            self._base_reader.close()


def merged_reader(run: Path, step: Path, resolved: dict[str, tp.Any], arch: str, shape: tp.Any) -> MergedReader:
    """The reader ``export_hf`` takes for ``--merge-lora``: the base as the run held it (its decided
    ``mixed_precision``, recorded in ``launch.parallel``, decides ``lora.base_dtype = "auto"``)."""
    return MergedReader(step, run_lora(resolved, run), arch, shape, run_precision(resolved))


def run_precision(resolved: dict[str, tp.Any]) -> str:
    """The compute dtype a run trained in: its launch's decided one, else the spec's (`auto`: the site's
    backend decides it, as ``hpc.core.resolve.decide_parallel`` does)."""
    launch = resolved.get("launch")
    launch = launch if isinstance(launch, dict) else {}
    parallel = launch.get("parallel")
    decided = parallel.get("mixed_precision") if isinstance(parallel, dict) else None
    if isinstance(decided, str) and decided != "auto":
        return decided
    spec = resolved.get("spec", {}).get("parallel", {})
    return compute_precision(spec.get("mixed_precision", "auto"), launch.get("backend") == "nccl")
