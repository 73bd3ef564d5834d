"""The hostile-input corpus of the surfaces added last (issue 47): chat templates, PEFT adapter folders,
tasks, script mode, ``[lora]`` and ``parallel.tp``; registered into ``tests.tokens.hostile.CASES`` (one
class per defect) and run by ``tests/tokens/test_hostile.py`` as every other case: the real CLI in a
fresh process, exit 2 with one ``error:`` line naming the file and the key or field, no traceback,
nothing left behind (a refused ``submit`` makes no run folder: each spec's run root is inside its
case folder), peak RSS under 600 MB.

The files are built here without torch: a Hugging Face base folder is ``config.json`` and a
safetensors file of zeros written by hand from hpcx's tensor plan of the tiny Llama, and an adapter
folder is PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's names. A new
surface gets the same treatment by adding rows to the tables below.
"""

from __future__ import annotations

import json
import struct
import typing as tp
from pathlib import Path

from tests.tokens.hostile import JSONL, Expect, case, prepare

NEW_CLASSES = ("chat-bombs", "adapters", "tasks", "given-for-nothing", "one-line")

# ---------------------------------------------------------------------------------- building blocks


def safetensors(path: Path, tensors: dict[str, tuple[int, ...]], dtype: str = "F32",
                header: dict | None = None) -> Path:
    """A safetensors file of zeros: ``tensors`` name → shape (``header`` replaces the header as written)."""
    size = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}[dtype]
    doc: dict[str, tp.Any] = {}
    offset = 0
    for name, shape in tensors.items():
        n = size
        for s in shape:
            n *= s
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header if header is not None else doc).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def llama_shape(**changes: int) -> tp.Any:
    from hpc.core.models import model_facts
    from hpc.core.spec import sections

    model = sections()["model"](arch="llama", size="tiny", **changes)
    return model_facts(model).shape


def hf_base(d: Path, **changes: int) -> Path:
    """A Hugging Face folder of hpcx's tiny Llama (``changes``: other shape fields)."""
    from hpc.core.hf import hf_config, tensor_plan

    shape = llama_shape(**changes)
    (d / "base").mkdir()
    (d / "base" / "config.json").write_text(json.dumps(hf_config("llama", shape)))
    safetensors(d / "base" / "model.safetensors", {t.name: t.shape for t in tensor_plan("llama", shape)})
    return d / "base"


PEFT_PREFIX = "base_model.model."


def adapter_tensors(targets: tp.Sequence[str] = ("q_proj", "v_proj"), r: int = 4, **changes: int) -> dict:
    """PEFT's names and shapes of the adapters of ``targets`` on the tiny Llama."""
    from hpc.core.hf import tensor_plan

    out = {}
    for t in tensor_plan("llama", llama_shape(**changes)):
        stem = t.name.removesuffix(".weight")
        if stem.rsplit(".", 1)[-1] in targets and len(t.shape) == 2:
            out[f"{PEFT_PREFIX}{stem}.lora_A.weight"] = (r, t.shape[1])
            out[f"{PEFT_PREFIX}{stem}.lora_B.weight"] = (t.shape[0], r)
    return out


def adapter_config(base: Path | str, **changes: tp.Any) -> dict[str, tp.Any]:
    doc = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": 4,
           "lora_alpha": 8.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
           "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not DROP}


DROP = object()  # a value that removes its key from adapter_config.json


def adapter(d: Path, base: Path, config: dict | bytes | None = None, tensors: dict | None = None) -> Path:
    """A PEFT adapter folder ``d/adapter`` over ``base``."""
    folder = d / "adapter"
    folder.mkdir()
    raw = config if isinstance(config, bytes) else json.dumps(config or adapter_config(base)).encode()
    (folder / "adapter_config.json").write_bytes(raw)
    safetensors(folder / "adapter_model.safetensors", adapter_tensors() if tensors is None else tensors)
    return folder


LORA = '[lora]\nrank = 4\nalpha = 8.0\ntargets = ["q_proj", "v_proj"]\n'


def job(d: Path, body: str, name: str = "job.toml") -> Path:
    """A spec whose run root is inside the case folder (a run folder left behind shows in its snapshot)."""
    (d / name).write_text(f'[job]\nrun_root = "{d / "runs"}"\n{body}')
    return d / name


def llama_job(d: Path, init_from: Path | str, lora: str = LORA, extra: str = "") -> Path:
    return job(d, f'[model]\narch = "llama"\nsize = "tiny"\n[checkpoint]\ninit_from = "{init_from}"\n{lora}{extra}')


def submit(spec: Path) -> list[str]:
    return ["submit", str(spec), "--site", "local"]
