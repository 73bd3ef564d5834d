"""Strict loading of TOML into dataclass sections.

Every spec and site section is a plain ``@dataclass`` whose fields carry a
``doc`` in their metadata. ``load_sections`` walks a parsed TOML document and
collects *every* problem it finds (unknown key with a "did you mean", wrong
type, value out of range) instead of stopping at the first one, so a user
fixes a file in one pass. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing as tp
from pathlib import Path

from hpc.errors import ConfigError  # noqa: F401  (re-exported: the loader's error type)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# Characters that would break or smuggle commands into the sbatch script.
_CONTROL = {"\n": "newline", "\r": "carriage return", "\x00": "NUL", "\x1b": "escape"}


def field(default: tp.Any = dataclasses.MISSING, *, doc: str, choices: tp.Sequence = (),
          minimum: float | None = None, factory: tp.Callable | None = None) -> tp.Any:
    """A dataclass field with its documentation and simple value constraints."""
    meta = {"doc": doc, "choices": tuple(choices), "minimum": minimum}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def suggest(key: str, valid: tp.Iterable[str], prefix: str = "") -> str:
    """'did you mean `train.micro_batch`?' for the closest valid key, else the list of valid keys."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"did you mean `{prefix}{close[0]}`?"
    return "valid keys: " + ", ".join(valid)


def describe(value: tp.Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _type_name(tp_: tp.Any) -> str:
    origin = tp.get_origin(tp_)
    if origin in (tp.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in tp.get_args(tp_))
    if origin is tp.Literal:
        return "one of " + ", ".join(repr(a) for a in tp.get_args(tp_))
    if origin is list:
        return "an array of " + _plural(tp.get_args(tp_)[0])
    if origin is dict:
        return "a table of " + _plural(tp.get_args(tp_)[1])
    return {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
            type(None): "unset"}.get(tp_, getattr(tp_, "__name__", str(tp_)))


def _plural(tp_: tp.Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp_, "values")


def _scalar_ok(value: tp.Any, tp_: tp.Any) -> bool:
    origin = tp.get_origin(tp_)
    if origin in (tp.Union, types.UnionType):
        return any(_scalar_ok(value, a) for a in tp.get_args(tp_))
    if tp_ is tp.Any:
        return True
    if tp_ is type(None):
        return value is None
    if tp_ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp_ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, dict):
        return isinstance(value, origin)
    return isinstance(value, tp_)


def _control_char(text: str) -> str | None:
    for ch, name in _CONTROL.items():
        if ch in text:
            return name
    return None


def _check_string(path: str, value: tp.Any) -> str | None:
    bad = _control_char(value) if isinstance(value, str) else None
    if bad:
        article = "an" if bad[0] in "aeiou" else "a"
        return f"`{path}` contains {article} {bad} character, which is not allowed in values that reach the job script"
    return None


def _check_items(path: str, value: tp.Any, hint: tp.Any) -> list[str]:
    """Element-wise checks for arrays and tables, naming the element's own key path."""
    origin = tp.get_origin(hint)
    if origin is list:
        item = tp.get_args(hint)[0]
        pairs = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    elif origin is dict:
        item = tp.get_args(hint)[1]
        pairs = [(f"{path}.{k}", v) for k, v in value.items()]
    else:
        return []
    errors = []
    for sub_path, v in pairs:
        if not _scalar_ok(v, item):
            errors.append(f"`{sub_path}` = {describe(v)}: expected {_type_name(item)}")
        elif message := _check_string(sub_path, v):
            errors.append(message)
    if origin is dict:
        errors += [m for k in value if (m := _check_string(f"{path} key {k!r}", k))]
    return errors


def check_value(path: str, value: tp.Any, f: dataclasses.Field, hint: tp.Any) -> list[str]:
    """Every problem with one field's value (empty when it is acceptable)."""
    if not _scalar_ok(value, hint):
        return [f"`{path}` = {describe(value)}: expected {_type_name(hint)}"]
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        shown = ", ".join(repr(c) for c in meta["choices"])
        return [f"`{path}` = {value!r}: expected one of {shown}"]
    minimum = meta.get("minimum")
    if minimum is not None and isinstance(value, (int, float)) and value < minimum:
        return [f"`{path}` = {value!r}: expected a value >= {minimum:g}"]
    message = _check_string(path, value)
    return [message] if message else _check_items(path, value, hint)


def check_table(path: str, value: tp.Any, hint: tp.Any) -> list[str]:
    """Type and content checks for a free-form table such as a site's [nccl]."""
    if not isinstance(value, dict):
        return [f"`{path}` = {describe(value)}: expected a table [{path}]"]
    return _check_items(path, value, hint)


def build_section(cls: type, table: tp.Any, prefix: str, errors: list[str]) -> tp.Any:
    """Instantiate one dataclass section from a TOML table, appending problems to ``errors``."""
    if not isinstance(table, dict):
        errors.append(f"`{prefix}` = {describe(table)}: expected a table [{prefix}]")
        return cls()
    hints = tp.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        path = f"{prefix}.{key}"
        if key not in fields:
            errors.append(f"unknown key `{path}`: {suggest(key, fields, prefix + '.')}")
            continue
        problems = check_value(path, value, fields[key], hints[key])
        if problems:
            errors += problems
            continue
        kwargs[key] = float(value) if hints[key] is float else value
    return cls(**kwargs)


def build_document(sections: dict[str, type], doc: dict, errors: list[str]) -> dict[str, tp.Any]:
    """Instantiate every section class from a parsed document; unknown sections are errors."""
    for key in doc:
        if key not in sections:
            close = difflib.get_close_matches(key, list(sections), n=1, cutoff=0.6)
            hint = f"did you mean `[{close[0]}]`?" if close else "valid sections: " + ", ".join(sections)
            errors.append(f"unknown section `[{key}]`: {hint}")
    return {name: build_section(cls, doc.get(name, {}), name, errors) for name, cls in sections.items()}


def read_toml(path: Path) -> dict:
    """Parse a TOML file; syntax errors become ``file:line:column: message``."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{path}: cannot read: {exc}"]) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None)
        col = getattr(exc, "colno", None)
        msg = getattr(exc, "msg", str(exc))
        if line is None:  # Python < 3.14 only puts the position in the text
            line, col, msg = _position_from_message(str(exc))
        raise ConfigError([f"{path}:{line}:{col}: TOML syntax error: {msg}"]) from None


def _position_from_message(text: str) -> tuple[int, int, str]:
    # tomllib: "Expected '=' after a key in a key/value pair (at line 3, column 5)"
    import re

    m = re.search(r"^(.*) \(at line (\d+), column (\d+)\)$", text)
    if m:
        return int(m.group(2)), int(m.group(3)), m.group(1)
    m = re.search(r"^(.*) \(at end of document\)$", text)
    if m:
        return 0, 0, m.group(1) + " at end of document"
    return 0, 0, text


def parse_override(item: str) -> tuple[list[str], tp.Any]:
    """``train.steps=100`` -> (["train", "steps"], 100); the value is read as TOML, else as a string."""
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=100"])
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError([f"--set {item!r}: expected a dotted key such as train.steps"])
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts, value


def apply_overrides(doc: dict, overrides: tp.Sequence[str]) -> dict:
    """Return a copy of ``doc`` with ``--set`` overrides applied (validated later with the rest)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    for item in overrides:
        parts, value = parse_override(item)
        table = out
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError([f"--set {item!r}: `{part}` is not a table"])
        table[parts[-1]] = value
    return out


def field_docs(cls: type) -> list[tuple[str, str, tp.Any]]:
    """(name, doc, default) for each field of a section: the source of the reference docs."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, f.metadata.get("doc", ""), default))
    return out
