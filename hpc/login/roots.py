"""The index of run roots: every folder a run was ever submitted into, so `status`, `logs`, `cancel`
and `drill` find runs made under a spec's ``job.run_root`` (or a site given as a path) by name or
job id, not only those under the run roots of the profiles on the search path.

One absolute path per line in ``$XDG_STATE_HOME/hpcx/run-roots`` (default
``~/.local/state/hpcx/run-roots``), appended by `submit` when the root is new. Roots that no longer
exist are skipped when read and dropped when the file is next rewritten. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_LINES = 1000  # rewrite (dropping vanished roots) once the file grows past this


def index_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "hpcx" / "run-roots"


def _read(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.startswith("/")]


def remembered() -> list[Path]:
    """The recorded run roots that still exist, oldest first, each once."""
    return [Path(p) for p in dict.fromkeys(_read(index_path())) if os.path.isdir(p)]


def remember_or_warn(root: Path) -> str | None:
    """``remember(root)``; a warning line instead of an exception when the index cannot be written
    (the run itself is fine, only finding it by name needs its path then)."""
    try:
        remember(root)
    except OSError as exc:
        return (f"warning: could not record {root} in {index_path()} ({exc.strerror}): "
                "give `hpcx status` the run folder's path")
    return None


def remember(root: Path) -> None:
    """Record ``root`` (absolute) unless it is there already; raises OSError when the index cannot be
    written."""
    path = index_path()
    lines = _read(path)
    if str(root) in lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    if len(lines) >= MAX_LINES:
        keep = [str(p) for p in remembered()] + [str(root)]
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            tmp.write_text("".join(f"{p}\n" for p in keep), encoding="utf-8")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return
    with open(path, "a", encoding="utf-8") as f:  # one short append: concurrent submits interleave whole lines
        f.write(f"{root}\n")
