"""SHA-256 digests of checkpoint shard files, written when the shards are written. Torch-free.

``torch.save`` records a CRC32 per zip record, but hpcx writes shards without it (it was a
large part of a save's time) and ``torch.load`` never checks it anyway, so by itself nothing
notices a flipped byte in a shard. hpcx therefore writes, for every shard file ``F`` of a DCP
folder it writes, ``F.sha256`` beside it in ``sha256sum`` format (``<hex>  F``; ``sha256sum -c
F.sha256`` checks it too). The trainer's writing rank does it after its shards are fsync'ed,
off the training loop's critical path (see trainer/checkpoint.py); ``hpcx ckpt convert --to dcp
--digest`` does it for its shard (not by default: there it is on the critical path, and the
conversion can be checked against its source with ``verify``). ``hpcx ckpt verify`` and ``hpcx ckpt inspect --deep`` check every digest
present; checkpoints without digests (older hpcx, other writers) are read as before and
reported as such.
"""

from __future__ import annotations

import hashlib
import os
import re
import typing as tp
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpc.core.errors import CheckpointError

SUFFIX = ".sha256"
CHUNK = 8 << 20
LINE = re.compile(r"^(?P<hex>[0-9a-f]{64}) [ *](?P<name>.+)\n?$")


def file_digest(path: Path) -> str:
    """The hex SHA-256 of a file, read in chunks into one buffer."""
    h, buf = hashlib.sha256(), bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def digest_path(path: Path) -> Path:
    """Where ``path``'s digest is recorded: ``path.sha256``."""
    return path.with_name(path.name + SUFFIX)


class HashingWriter:
    """A binary file that hashes what is written to it, the hash of each large write running in a
    second thread beside the write itself (both release the GIL), so a digest costs about
    max(hash, write) instead of their sum. ``write`` returns only when both are done: the caller
    may reuse its buffer."""

    LARGE = 1 << 20

    def __init__(self, f: tp.BinaryIO):
        self.f, self.hash = f, hashlib.sha256()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hpcx-sha256")

    def write(self, data: tp.Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) < self.LARGE:
            self.hash.update(view)
            return self.f.write(view)
        hashed = self.pool.submit(self.hash.update, view)
        try:
            return self.f.write(view)
        finally:
            hashed.result()

    def tell(self) -> int:
        return self.f.tell()

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()

    def hexdigest(self) -> str:
        return self.hash.hexdigest()

    def close(self) -> None:
        self.pool.shutdown()


def write_digest(path: Path, hexdigest: str | None = None) -> Path:
    """Write ``path.sha256`` (through a temporary name, fsync'ed), hashing ``path`` unless its
    ``hexdigest`` is given; the sidecar's path."""
    line = f"{hexdigest or file_digest(path)}  {path.name}\n"
    out, tmp = digest_path(path), path.with_name(f".{path.name}{SUFFIX}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def recorded_digest(path: Path) -> str | None:
    """The digest recorded for ``path`` (None when there is no ``.sha256`` beside it)."""
    side = digest_path(path)
    if not side.is_file():
        return None
    try:
        m = LINE.match(side.read_text(encoding="ascii"))
    except (OSError, UnicodeDecodeError):
        m = None
    if not m or m.group("name") != path.name:
        raise CheckpointError([f"{side}: not a sha256sum line for {path.name}"])
    return m.group("hex")


def check_digests(folder: Path, names: tp.Iterable[str]) -> dict[str, tp.Any]:
    """Check the recorded digest of every file in ``names``: {"checked": [...], "missing": [...]};
    CheckpointError listing every file whose bytes changed since its digest was written."""
    checked, missing, problems = [], [], []
    for name in sorted(names):
        path = folder / name
        want = recorded_digest(path)
        if want is None:
            missing.append(name)
            continue
        got = file_digest(path)
        if got != want:
            problems.append(f"{path}: SHA-256 {got[:16]}... differs from the {want[:16]}... recorded when it "
                            "was written (the file changed or is corrupt)")
        checked.append(name)
    if problems:
        raise CheckpointError(problems)
    return {"checked": checked, "missing": missing}
