"""A site profile draft carrying a measured MFU: what a scale study or the GPU check writes back.

The planner's compute time is FLOPs / (``node.gpu_peak_tflops`` × ``node.mfu``); a measurement of
compute alone (a step's time less its communication) gives ``node.mfu`` for that site. The draft
is the whole profile, every section as loaded, with ``node.mfu`` and ``node.mfu_source`` set and
a comment saying where the figure came from; it is written beside, never over, the profile.
"""

from __future__ import annotations

import typing as tp
from dataclasses import asdict, replace
from pathlib import Path

from hpc.core.config import ConfigError, read_toml
from hpc.core.runs import write_atomic
from hpc.core.site import SECTIONS, SiteProfile, parse_site


def measured_mfu(flops: float, compute_s: float, peak_tflops: float) -> float | None:
    """FLOPs done in ``compute_s`` seconds over the GPU's peak; None when a figure is missing."""
    if not flops or compute_s <= 0 or not peak_tflops:
        return None
    return flops / (compute_s * peak_tflops * 1e12)


def with_mfu(site: SiteProfile, mfu: float, source: str) -> SiteProfile:
    """The profile with ``node.mfu`` (three significant digits, at most 1) and its source."""
    return replace(site, node=replace(site.node, mfu=min(1.0, float(f"{mfu:.3g}")), mfu_source=source))


def _value(v: tp.Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):  # e.g. [container] runtimes, mounts, env
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(site: SiteProfile, note: str) -> str:
    """The profile as TOML, every section as loaded, with ``note`` as the first comment."""
    doc = asdict(site)
    out = [f"# Site profile draft from {site.name!r} ({site.source or 'built in'}). {note}"]
    for section in (*SECTIONS, "nccl"):
        table = {k: v for k, v in doc[section].items() if v is not None}
        if table:
            out += ["", f"[{section}]"] + [f"{k} = {_value(v)}" for k, v in table.items()]
    return "\n".join(out) + "\n"


def write_draft(path: Path, site: SiteProfile, mfu: float, source: str) -> SiteProfile:
    """Write the draft to ``path`` (a new file: an existing one is refused) and return it as loaded back."""
    if path.exists():
        raise ConfigError([f"{path}: exists; a site draft is never written over a file (choose a new name)"])
    drafted = with_mfu(site, mfu, source)
    text = render(drafted, f"node.mfu = {drafted.node.mfu} was measured: {source}. Check every value.")
    write_atomic(path, text)
    return load_draft(path)


def load_draft(path: Path) -> SiteProfile:
    """A written draft, loaded as any profile is (so a draft that would not load is never left unnoticed)."""
    return parse_site(read_toml(path), path.stem, str(path))
