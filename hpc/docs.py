"""Reference docs for specs and site profiles, generated from the dataclasses.

    python -m hpc.docs spec > docs/spec.md
    python -m hpc.docs site > docs/site.md

A test checks the committed files are current.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing as tp

from hpc.core import site, spec, validate as v
from hpc.core.config import field_docs, number_text
from hpc.core.models import FAMILIES, HfReader, families

TITLES = {
    "spec": ("Job spec reference", "A job spec is one TOML file. Every section and key is optional; "
             "the defaults are shown. Unknown keys are errors."),
    "site": ("Site profile reference", "A site profile is found by name on the search path — "
             "`$HPCX_SITE_PATH` (folders separated by `:`), `~/.config/hpcx/sites`, `/etc/hpcx/sites`, then the "
             "profiles bundled with hpcx (the repository's `site/`); the first of a name wins, and "
             "`hpcx site list` shows where each came from — or given as a path to `--site`. "
             "Besides the sections below, a `[nccl]` table holds environment values exported in every "
             "task: names are shell variable names (`[A-Za-z_][A-Za-z0-9_]*`) starting with "
             + ", ".join(f"`{p}`" for p in v.NCCL_PREFIXES) + " (e.g. `NCCL_IB_HCA`, "
             "`PYTORCH_CUDA_ALLOC_CONF`, `GLOO_SOCKET_IFNAME`); names or values that look like credentials "
             "are refused, since they are written into every job script. A value already exported in the "
             "submitting shell wins over the profile's. On GPU sites set `GLOO_SOCKET_IFNAME` to the "
             "interface every node reaches (`ip -br addr`; names such as `eth0` or `ib0,ib1`, never NCCL's "
             "`^lo,docker` exclusions): the trainer's gloo side groups (the step-boundary vote, barriers, "
             "async saves) bind to it, are made right after the process group and fail within 30 s when "
             "they cannot connect. If your nodes name it differently, export `GLOO_SOCKET_IFNAME` before "
             "`hpcx submit` or set it in your own profile. `TORCH_NCCL_ASYNC_ERROR_HANDLING` is pinned to 3 "
             "by the trainer (the flight recorder dumps only then): another value, here or exported, is "
             "overridden with a warning in the rank's log."),
}

LIMITS = (f"Every file is a regular UTF-8 file (a byte-order mark is allowed) of at most "
          f"{v.CONFIG_MAX_BYTES // 2**20} MiB, with tables and arrays nested at most {v.MAX_DEPTH} deep. "
          "Strings are printable — no control, format or separator characters (tab, newline, escape, "
          f"backspace, DEL, C1 controls, U+2028/U+2029, bidi overrides …) — and at most {v.TEXT_MAX} "
          "bytes of UTF-8 (as Slurm counts: an emoji is 4) unless a key says otherwise. Numbers are finite (no `nan` or `inf`); integers are at "
          f"most {v.INT32_MAX} and floats at most {v.FLOAT_MAX:g} unless a key says otherwise.")


def section_markdown(name: str, cls: type) -> str:
    lines = [f"## `[{name}]`", "", *kind_note(cls), *family_note(cls), "| key | default | meaning |", "|---|---|---|"]
    limits = field_limits(cls)
    for key, doc, default in field_docs(cls):
        lines.append(f"| `{key}` | `{json.dumps(default)}` | {doc}{limits[key]} |")
    return "\n".join(lines) + "\n"


def kind_note(cls: type) -> list[str]:
    """For a section joined from scheduler kinds (``hpc.schedulers.section_class``): which kind declares which keys."""
    owned = getattr(cls, "KIND_FIELDS", {})
    if not owned:
        return []
    parts = [f"{', '.join(f'`{k}`' for k in keys)} belong to the `{kind}` kind (`hpc/schedulers/{kind}/section.py`)"
             for kind, keys in owned.items()]
    return ["; ".join(parts) + "; the other keys to every kind.", ""]


def family_note(cls: type) -> list[str]:
    """For the section joined from model families (``hpc.core.models.section_class``): each family's
    presets, its own keys, and the Hugging Face class whose configs it reads."""
    owned = getattr(cls, "FAMILY_FIELDS", {})
    if not owned:
        return []
    lines = []
    for fam in families():
        name, keys = fam.name, owned.get(fam.name, ())
        parts = [f"presets (`size`) {fam.preset_counts()}"] if fam.preset_counts() else []
        parts += [f"its keys {', '.join(f'`{k}`' for k in keys)}"] if keys else []
        parts += [f"reads `model.hf_config` of `{fam.hf_arch}`"] if isinstance(fam, HfReader) else []
        arch = f"`arch = \"{name}\"`" if name in FAMILIES else "`arch = \"package.module:function\"`"
        lines.append(f"- {arch}: {'; '.join(parts) or 'only the keys every family has'}.")
    return lines + ["", "A key only other families read is refused; the other keys belong to every family.", ""]


def field_limits(cls: type) -> dict[str, str]:
    """' Range: 1 – 35791393.' for bounded numbers, ' At most 128 characters.' for short strings."""
    hints = tp.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        meta, hint = f.metadata, hints[f.name]
        if hint in (int, float) and not meta.get("choices"):
            low = "" if meta.get("minimum") is None else number_text(meta["minimum"])
            high = meta.get("maximum")
            high = number_text(high if high is not None else (v.INT32_MAX if hint is int else v.FLOAT_MAX))
            out[f.name] = f" Range: {low or '…'} – {high}."
        elif meta.get("max_len") and meta["max_len"] != v.TEXT_MAX:
            out[f.name] = f" At most {meta['max_len']} bytes."
        else:
            out[f.name] = ""
    return out


def reference(kind: str) -> str:
    sections = (spec if kind == "spec" else site).SECTIONS
    title, intro = TITLES[kind]
    parts = [f"# {title}\n\n<!-- generated by `python -m hpc.docs {kind}`; do not edit -->\n\n{intro}\n\n{LIMITS}\n"]
    parts += [section_markdown(name, cls) for name, cls in sections.items()]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.stdout.write(reference(sys.argv[1] if len(sys.argv) > 1 else "spec"))
