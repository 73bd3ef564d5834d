"""The checkpoint formats, one ``Format`` row each: how one is recognized, its reader, its writer (a
``--to`` target), what opening it checks, and how ``checkpoint.init_from`` reads a rank's rows of it.
Torch-free (``hpcx ckpt convert --to`` takes its choices from here); readers are named
``module:attribute`` and writers import theirs when called.

Every place that used to branch on a format's name asks this table: ``convert`` (``detect``,
``open_checkpoint``, ``--to`` targets, ``--digest``, what ``inspect`` says it checked),
``init_source`` (a run folder, which names to try, reading headers), ``trainer.init_from`` (how a
rank reads) and ``hpc.dryrun`` (whether a rank's reads are known from headers). Adding a format is
a row here with its reader and writer modules.
"""

from __future__ import annotations

import importlib
import struct
import typing as tp
from dataclasses import dataclass
from pathlib import Path

from hpc.ckpt.files import INDEX_FILE, METADATA_FILE, file_kind, open_regular
from hpc.core.errors import CheckpointError

ZIP_MAGIC = b"PK\x03\x04"
LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\x0a"  # pickle protocol 2 + the 10-byte magic number of torch < 1.6 files

# How ``checkpoint.init_from`` reads a rank's rows of a format (``Format.init_reads``):
BYTE_RANGES = "byte ranges"  # headers say where each row-major tensor starts: a rank reads its rows' bytes
RECORDS = "records"  # through the reader (``read_rows``), a record's rows; whole where they are not contiguous
DCP_PLANNER = "dcp planner"  # torch's DCP load planner reads the stored chunks a rank's shard overlaps


def load(ref: str) -> tp.Any:
    """The attribute ``module:name`` names, imported now."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Format:
    """One checkpoint format."""

    name: str  # what ``inspect`` says, ``--to`` takes, ``InitSource.kind`` and readers' ``format`` hold
    folder: tp.Callable[[Path], bool] | None  # whether a folder holds one (None: never a folder)
    file: tp.Callable[[Path, bytes, int], bool] | None  # whether a file is one, from its first 9 bytes and size
    reader: str  # ``module:Class`` opening it, checked before anything is read
    write: tp.Callable[..., Path]  # ``write(reader, dst, keys, *, model_only, shard_bytes, digest, progress, scratch)``
    checked: str  # what opening it checks (``hpcx ckpt inspect``)
    refuse: tp.Callable[..., None] | None = None  # ``refuse(reader, dst, keys, shard_bytes)``: before writing
    digests: bool = False  # SHA-256 digests beside its files (``--digest``; checked by verify, inspect --deep)
    saves: bool = False  # what training saves: a run folder is read at its newest step; beside model.* it
    #                      holds the training state, under hpcx's own names (never Hugging Face's)
    init_reads: str = ""  # how ``checkpoint.init_from`` reads a rank's rows (``BYTE_RANGES`` …; "": it cannot)
    offsets: str = ""  # BYTE_RANGES: ``module:function`` (path -> {name: (dtype, shape, file, offset)}), headers only

    def open(self, path: str | Path) -> tp.Any:
        """The format's reader on ``path`` (``hpc.ckpt.entries.Reader``)."""
        return load(self.reader)(path)

    @property
    def planned_reads(self) -> bool:
        """Whether a rank's bytes are known from the headers alone (``trainer.init_from.read_plan``)."""
        return self.init_reads == BYTE_RANGES


def _dcp_folder(path: Path) -> bool:
    return (path / METADATA_FILE).exists() or any(path.glob("*.distcp"))


def _safetensors_folder(path: Path) -> bool:
    return (path / INDEX_FILE).exists() or any(path.glob("*.safetensors"))


def _torch_file(path: Path, head: bytes, size: int) -> bool:
    return head[:4] in (ZIP_MAGIC, LEGACY_TORCH_MAGIC)


def _safetensors_file(path: Path, head: bytes, size: int) -> bool:
    if path.suffix == ".safetensors":
        return True
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= size - 8 and head[8:9] in (b"{", b"[")


def _write_dcp(reader: tp.Any, dst: Path, keys: list[str], *, digest: bool, progress: tp.Any, scratch: tp.Any,
               **_: tp.Any) -> Path:
    from hpc.ckpt.dcp import write_dcp  # lazy: torch

    return write_dcp(reader, dst, keys, progress, scratch, digest=digest)


def _write_torch(reader: tp.Any, dst: Path, keys: list[str], *, model_only: bool, progress: tp.Any, scratch: tp.Any,
                 **_: tp.Any) -> Path:
    from hpc.ckpt.torchsave import write_torch  # lazy: torch

    return write_torch(reader, dst, keys, model_only=model_only, progress=progress, scratch=scratch)


def _write_safetensors(reader: tp.Any, dst: Path, keys: list[str], *, model_only: bool, shard_bytes: int,
                       progress: tp.Any, scratch: tp.Any, **_: tp.Any) -> Path:
    from hpc.ckpt.safetensors import write_safetensors  # lazy: torch

    return write_safetensors(reader, dst, keys, model_only=model_only, shard_bytes=shard_bytes, progress=progress,
                             scratch=scratch)


def _refuse_safetensors(reader: tp.Any, dst: Path, keys: list[str], shard_bytes: int) -> None:
    from hpc.ckpt.safetensors import check_safetensors_target  # lazy: torch

    check_safetensors_target(reader, dst, keys, shard_bytes)


# Detection asks in this order: a folder is DCP before safetensors, a file torch before safetensors.
FORMATS = (
    Format("dcp", _dcp_folder, None, "hpc.ckpt.dcp:DcpReader", _write_dcp,
           ".metadata (allow-list, entries, chunks tile every tensor and fit their items, storage records, "
           "file sizes and kinds) and every item's zip directory and pickle against its chunk; no tensor data",
           digests=True, saves=True, init_reads=DCP_PLANNER),
    Format("torch", None, _torch_file, "hpc.ckpt.torchsave:TorchReader", _write_torch,
           "zip directory (stored or deflated records), data.pkl (allow-list, a bounded tree) and every tensor "
           "record inside the file, no view larger than its storage; no tensor data",
           init_reads=RECORDS),
    Format("safetensors", _safetensors_folder, _safetensors_file, "hpc.ckpt.safetensors:SafetensorsReader",
           _write_safetensors,
           "header (types, offsets against dtype x shape, file size, no gap or overlap) and index; no tensor data",
           refuse=_refuse_safetensors, init_reads=BYTE_RANGES, offsets="hpc.ckpt.safetensors:tensor_offsets"),
)
BY_NAME = {f.name: f for f in FORMATS}
TARGETS = tuple(BY_NAME)  # what ``hpcx ckpt convert --to`` writes (with ``hf``, an export of a run)


def get(name: str) -> Format:
    """The format called ``name`` (one of ``TARGETS``)."""
    return BY_NAME[name]


def saved() -> Format:
    """The format training saves in (what a run or step folder holds)."""
    return next(f for f in FORMATS if f.saves)


def detect(path: str | Path) -> Format:
    """The format of what is at ``path``; CheckpointError when nothing fits."""
    path = Path(path)
    if path.is_dir():
        found = next((f for f in FORMATS if f.folder is not None and f.folder(path)), None)
        if found is None:
            raise CheckpointError([f"{path}: a folder with neither a DCP .metadata nor .safetensors files"])
        return found
    if file_kind(path) in ("missing", "a dangling symlink"):
        dangling = " (a dangling symlink)" if path.is_symlink() else ""
        raise CheckpointError([f"{path}: no such file or folder{dangling}"])
    try:
        with open_regular(path, "a checkpoint (a DCP folder, a torch.save file or a safetensors file)") as f:
            head, size = f.read(9), f.seek(0, 2)
    except OSError as exc:
        raise CheckpointError([f"{path}: cannot read ({exc.strerror})"]) from None
    if size == 0:
        raise CheckpointError([f"{path}: empty file (0 bytes); not a checkpoint"])
    found = next((f for f in FORMATS if f.file is not None and f.file(path, head, size)), None)
    if found is None:
        raise CheckpointError([f"{path}: not a checkpoint: neither a torch.save file (zip or legacy), a safetensors "
                               f"file (header length + JSON) nor a DCP folder (first bytes {head[:8]!r})"])
    return found
