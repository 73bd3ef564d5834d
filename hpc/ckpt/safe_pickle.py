"""Read DCP's ``.metadata`` pickle without ever running code from it.

``torch.distributed.checkpoint`` stores its index as a plain pickle, and its
own reader calls ``pickle.load`` on it: a planted file runs whatever its
``__reduce__`` names. ``load_dcp_metadata`` unpickles with an allow-list: the
DCP metadata dataclasses, ``torch.Size``, dtypes and layouts (by name), and
the path class DCP records as the checkpoint id. Any other global is refused
before it is looked up, so nothing outside the list is ever called.
"""

from __future__ import annotations

import enum
import io
import os
import pathlib
import pickle
import typing as tp
from pathlib import Path

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from hpc import compat
from hpc.ckpt.entries import short_repr
from hpc.ckpt.files import METADATA_FILE, file_kind, open_regular
from hpc.core.errors import CheckpointError

MAX_METADATA = 1 << 30  # a .metadata of a million tensors is ~200 MB; refuse reading more than this

_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta")

ALLOWED: dict[tuple[str, str], tp.Any] = {
    **{("torch.distributed.checkpoint.metadata", n): getattr(dcp_md, n) for n in _METADATA_CLASSES},
    compat.MEM_FORMAT_ENCODING: compat.mem_format_encoding(),
    compat.STORAGE_INFO: compat.storage_info_type(),
    ("torch", "Size"): torch.Size,
    compat.GET_LAYOUT: compat.get_layout(),  # maps a name to a layout
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,  # never instantiate a concrete foreign path
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


def _enum_member(cls: tp.Any, name: tp.Any) -> tp.Any:
    """``getattr(ENUM, NAME)``, as Python 3.11.0–3.11.4 (Debian bookworm's 3.11.2, so many images) pickle an
    enum member: only for an allow-listed enum class and one of its members' names."""
    allowed = [v for v in ALLOWED.values() if isinstance(v, type) and issubclass(v, enum.Enum)]
    if cls not in allowed or not isinstance(name, str) or name not in cls.__members__:
        raise RefusedGlobal(f"builtins.getattr({short_repr(cls)}, {short_repr(name)})")
    return cls.__members__[name]


class RefusedGlobal(pickle.UnpicklingError):
    """The pickle names a global outside the allow-list."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the allow-listed globals and torch dtypes."""

    def find_class(self, module: str, name: str) -> tp.Any:
        if (module, name) in ALLOWED:
            return ALLOWED[(module, name)]
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: tp.Any) -> tp.Any:
        raise RefusedGlobal(f"persistent id {short_repr(pid)}")


def loads_metadata(data: bytes, source: str = "<bytes>") -> dcp_md.Metadata:
    """Unpickle DCP metadata from ``data``; CheckpointError naming ``source`` on anything unexpected."""
    try:
        obj = MetadataUnpickler(io.BytesIO(data)).load()
    except RefusedGlobal as exc:
        raise CheckpointError([f"{source}: refused to unpickle `{exc}`; a DCP .metadata holds only "
                           "torch.distributed.checkpoint metadata classes"]) from None
    except Exception as exc:  # noqa: BLE001  (truncated or garbled: pickle raises many types)
        raise CheckpointError([f"{source}: not a readable DCP .metadata pickle ({type(exc).__name__}: {exc})"]) from None
    if not isinstance(obj, dcp_md.Metadata) or not isinstance(obj.state_dict_metadata, dict):
        raise CheckpointError([f"{source}: holds a {type(obj).__name__}, expected DCP Metadata"])
    if not isinstance(obj.storage_data, dict):
        raise CheckpointError([f"{source}: has no storage index (storage_data), expected one written by "
                           "FileSystemWriter"])
    return obj


def load_dcp_metadata(checkpoint_dir: str | Path) -> dcp_md.Metadata:
    """The safely unpickled ``.metadata`` of a DCP folder; CheckpointError if absent or not DCP metadata."""
    path = Path(checkpoint_dir) / METADATA_FILE
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointError([f"{checkpoint_dir}: no such checkpoint folder"])
    kind = file_kind(path)
    if kind == "missing":
        raise CheckpointError([f"{path}: missing; a DCP checkpoint is committed only by its .metadata "
                           "(the save did not finish)"])
    with open_regular(path, "DCP's .metadata pickle") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA:
            raise CheckpointError([f"{path}: {size} bytes, larger than the {MAX_METADATA} a DCP .metadata "
                                   "may be here"])
        data = f.readall()
    return loads_metadata(data, str(path))
