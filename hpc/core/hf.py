"""Hugging Face's side of a model, without torch: ``config.json`` both ways, and the tensor mapping.

Each built-in family that maps onto a ``transformers`` class implements ``hpc.core.models.HfMapped``:
``hf_config(shape)`` (its ``config.json``), ``hf_tensor_plan(shape)`` (for every Hugging Face
tensor, the hpcx parameter it comes from and how: copied, transposed or zeros) and, when hpcx reads
that class's configs, ``HfReader``: ``hf_spec_fields(path, doc)`` with ``hf_keys`` (config key →
``[model]`` field), ``hf_arch`` and ``hf_model_type``. This module asks them:

- ``hf_config(family, shape)`` / ``tensor_plan(family, shape)``: for the export (``hpc.ckpt.hf``)
  and ``checkpoint.init_from`` (``hpc.ckpt.init_source``), so the two agree;
- ``apply_hf_config(model_doc)``: ``model.hf_config = "PATH"`` fills the spec's ``[model]`` from a
  ``config.json`` (``architectures()`` says which family reads which class), one line per
  contradiction, naming both.
"""

from __future__ import annotations

import os
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc.core.config import load_json_bounded
from hpc.core.errors import ConfigError
from hpc.core.models import FAMILIES, HfMapped, HfReader, families, family as family_of_arch
from hpc.core.validate import open_regular

CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class HfTensor:
    """One tensor of the Hugging Face checkpoint and where it comes from in hpcx's model."""

    name: str  # Hugging Face's name
    source: str  # hpcx's parameter name ("" for zeros)
    op: str  # "copy", "transpose" (2-D) or "zeros"
    shape: tuple[int, ...]  # Hugging Face's shape


def architectures() -> dict[str, str]:
    """The ``transformers`` classes whose configs hpcx reads (``HfReader.hf_arch``) → their family."""
    return {f.hf_arch: f.name for f in families() if isinstance(f, HfReader)}


def _mapping(family: str) -> tp.Any:
    """The family, when it maps onto a transformers class (``HfMapped``); ConfigError otherwise."""
    found = family_of_arch(family) if family in FAMILIES else None
    if not isinstance(found, HfMapped):
        mapped = ", ".join(repr(f.name) for f in families() if isinstance(f, HfMapped))
        raise ConfigError([f"model.arch = {family!r}: only the built-in {mapped} map onto Hugging Face models "
                           "(a user model has no known transformers class)"])
    return found


def hf_config(family: str, shape: tp.Any) -> dict[str, tp.Any]:
    """``config.json`` of an hpcx model of ``family`` (fp32 weights)."""
    return _mapping(family).hf_config(shape)


def tensor_plan(family: str, shape: tp.Any) -> list[HfTensor]:
    """Every Hugging Face tensor of the model, in hpcx's parameter order."""
    return _mapping(family).hf_tensor_plan(shape)


def spec_fields(path: Path, doc: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """The ``[model]`` fields a ``config.json`` sets (``arch`` included); ConfigError for a class hpcx
    does not implement (``architectures``, or ``model_type`` where a bare config names none)."""
    known = architectures()
    archs = doc.get("architectures") or [a for a, f in known.items()
                                         if _mapping(f).hf_model_type == doc.get("model_type")]
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str) or archs[0] not in known:
        found = (f"architectures = {doc['architectures']!r}" if doc.get("architectures")
                 else f"model_type = {doc.get('model_type')!r} and no architectures")
        raise ConfigError([f"`model.hf_config`: {path}: {found[:200]}; hpcx implements {list(known)!r} only"])
    return {"arch": known[archs[0]], **_mapping(known[archs[0]]).hf_spec_fields(path, doc)}


# ---------------------------------------------------------------- config.json → spec fields

def config_path(path: str) -> Path:
    """The ``config.json`` that ``model.hf_config`` names (a folder holding one, or the file), absolute."""
    p = Path(os.path.expandvars(os.path.expanduser(path))).absolute()
    return p / CONFIG_FILE if p.is_dir() else p


def read_config(path: Path) -> dict[str, tp.Any]:
    """A ``config.json``, bounded; ConfigError naming the file when it is not a JSON object."""
    where = f"`model.hf_config`: {path}"
    with open_regular(path, where, "a regular config.json file") as f:  # a FIFO or /dev/zero: refused unopened
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError([f"{where}: over {MAX_CONFIG_BYTES} bytes: expected a config.json under 1 MiB"])
    doc = load_json_bounded(data, where)
    if not isinstance(doc, dict):
        raise ConfigError([f"`model.hf_config`: {path}: expected a JSON object"])
    return doc


def apply_hf_config(model_doc: dict[str, tp.Any]) -> list[str]:
    """Fill a spec's ``[model]`` table from its ``hf_config`` in place (the path made absolute); one
    line per value of the spec that contradicts the file. Nothing to do without ``hf_config``."""
    raw = model_doc.get("hf_config")
    if not isinstance(raw, str) or not raw:
        return []
    path = config_path(raw)
    fields = spec_fields(path, read_config(path))
    keys = {"arch": "architectures", **{ours: theirs for theirs, ours in _mapping(fields["arch"]).hf_keys}}
    errors = [f"`model.{key}` = {model_doc[key]!r} contradicts {path}: {keys.get(key, key)} = {value!r}"
              for key, value in fields.items() if key in model_doc and not _same(model_doc[key], value)]
    model_doc.update(fields)
    model_doc["hf_config"] = str(path.parent if path.name == CONFIG_FILE else path)
    return errors


def _same(a: tp.Any, b: tp.Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b
