"""Each site profile's run root, for `hpcx status`, without loading every profile at every call.

Loading a profile means parsing its TOML and running every check of every scheduler kind (about 9 ms
for the four bundled ones, with the imports, and far more under load); the list needs two facts of each:
whether it loads (with its first problem when not: the warning) and its ``storage.run_root`` as written.
Those are kept in ``site-roots.json`` (``hpc.login.cache``). Each profile's entry is keyed by its
file's inode, size, mtime and ctime; not by the device number, which login nodes that mount one shared
filesystem number differently (and the home folder holding this cache is usually shared by them too).
The whole record is keyed by the Python version, hpcx's folder, and the inode, size, mtime and ctime of
every hpcx module that loading used. So an edited, replaced or touched profile, and an upgraded or
edited hpcx, are loaded again. The variables in a run root are the caller's environment: they are
expanded at every call, never cached.
"""

from __future__ import annotations

import os
import sys
import typing as tp
from pathlib import Path

from hpc.core.config import ConfigError
from hpc.core.sitepath import find_sites
from hpc.login import cache

CACHE = "site-roots.json"
MAX_PROFILES = 64  # profiles the record keeps (those of this call first: a site path per project)


def run_roots(warn: tp.Callable[[str], None]) -> list[Path]:
    """Every site profile's run root. A profile that does not load is named through ``warn`` and its
    ``storage.run_root`` is still searched when it can be read, so its runs never vanish silently."""
    record = cache.read(CACHE)
    known = record["profiles"] if _current(record) else {}
    seen: dict[str, dict[str, tp.Any]] = {}
    changed = not known
    roots: list[Path] = []
    for path, _ in find_sites().values():
        key = _file_key(path)
        facts = known.get(str(path))
        if key is None or not _facts_ok(facts) or facts["file"] != key:
            facts, changed = {**_load(path), "file": key}, True
        if key is not None:
            seen[str(path)] = facts
        roots += _roots(path, facts, warn)
    if changed:
        import hpc.core.site  # noqa: F401  # lazy: startup (the modules a load uses, named even if none loaded)

        others = {p: f for p, f in known.items() if p not in seen}
        kept = {**seen, **dict(list(others.items())[:max(0, MAX_PROFILES - len(seen))])}
        cache.write(CACHE, {"python": sys.version, "hpc": _package(), "code": _code(), "profiles": kept})
    return roots


def _load(path: Path) -> dict[str, tp.Any]:
    """What a full load says: {"loads", "run_root" (as written, or None), "error" (the first problem)}."""
    from hpc.core.site import load_site, written_run_root  # lazy: startup

    try:
        # by its path: a name found on the search path is loaded from there (``a.toml.toml`` is named
        # ``a.toml``, which load_site would read as a path relative to the working directory)
        return {"loads": True, "run_root": load_site(str(path)).storage.run_root, "error": None}
    except ConfigError as exc:
        return {"loads": False, "run_root": written_run_root(path), "error": exc.messages[0]}


def _roots(path: Path, facts: dict[str, tp.Any], warn: tp.Callable[[str], None]) -> list[Path]:
    """The profile's run root expanded in this environment, or a warning (and the root as written, when
    that one value expands)."""
    from hpc.core import runroot  # lazy: startup (hpcx status, whose fast path imports little)

    written, error = facts["run_root"], facts["error"]
    if facts["loads"]:
        try:
            return [runroot.expand_run_root(written, f"{path}: `storage.run_root` = {written!r}")]
        except ConfigError as exc:  # a variable unset here: the profile does not load for this caller
            error = exc.messages[0]
    try:
        root = runroot.expand_run_root(written, str(path)) if written is not None else None
    except ConfigError:
        root = None
    also = f"; still looking for its runs in {root}" if root else ""
    warn(f"warning: site profile {path} does not load ({error}){also}")
    return [root] if root else []


def _facts_ok(facts: tp.Any) -> tp.TypeGuard[dict[str, tp.Any]]:
    return (isinstance(facts, dict) and isinstance(facts.get("loads"), bool) and isinstance(facts.get("file"), list)
            and isinstance(facts.get("run_root"), (str, type(None)))
            and (facts["loads"] and isinstance(facts["run_root"], str) and facts.get("error") is None
                 or not facts["loads"] and isinstance(facts.get("error"), str)))


def _file_key(path: str | Path) -> list[int] | None:
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return [info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def _package() -> str:
    """The folder of the ``hpc`` package (this file's grandparent)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _code() -> dict[str, list[int] | None]:
    """The key of every hpcx module loaded now (those that loaded the profiles among them)."""
    files = {getattr(module, "__file__", None) for name, module in list(sys.modules.items())
             if name == "hpc" or name.startswith("hpc.")}
    return {f: _file_key(f) for f in sorted(f for f in files if isinstance(f, str))}


def _current(record: tp.Any) -> tp.TypeGuard[dict[str, tp.Any]]:
    """The record was written by this Python and this hpcx, none of whose modules changed since."""
    if not (isinstance(record, dict) and record.get("python") == sys.version and record.get("hpc") == _package()
            and isinstance(record.get("code"), dict) and record["code"] and isinstance(record.get("profiles"), dict)):
        return False
    return all(key is not None and _file_key(f) == key for f, key in record["code"].items())
