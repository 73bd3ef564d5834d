"""Strict loading of TOML into dataclass sections.

Every spec and site section is a plain ``@dataclass`` whose fields carry a
``doc`` in their metadata. ``load_sections`` walks a parsed TOML document and
collects *every* problem it finds (unknown key with a "did you mean", wrong
type, value out of range) instead of stopping at the first one, so a user
fixes a file in one pass. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import stat
import sys
import types
import typing as tp
import unicodedata
from pathlib import Path

from hpc.core import validate as v
from hpc.core.errors import ConfigError, UserError


def _tomllib() -> tp.Any:
    """tomllib (tomli before 3.11), imported when a TOML file is first read: `hpcx status` reads none."""
    if sys.version_info >= (3, 11):
        import tomllib  # lazy: startup
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib  # lazy: startup
    return tomllib


def __getattr__(name: str) -> tp.Any:  # `from hpc.core.config import tomllib` still works
    if name == "tomllib":
        return _tomllib()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def field(default: tp.Any = dataclasses.MISSING, *, doc: str, choices: tp.Sequence = (),
          minimum: float | None = None, maximum: float | None = None, max_len: int | None = None,
          factory: tp.Callable | None = None) -> tp.Any:
    """A dataclass field with its documentation and simple value constraints.

    Numbers are finite and at most ``maximum`` (default: 2**31 - 1 for integers, 1e9 for floats);
    strings are printable and at most ``max_len`` characters (default 1024), also inside arrays/tables.
    """
    meta = {"doc": doc, "choices": tuple(choices), "minimum": minimum, "maximum": maximum, "max_len": max_len}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def suggest(key: str, valid: tp.Iterable[str], prefix: str = "") -> str:
    """'did you mean `train.micro_batch`?' for the closest valid key, else the list of valid keys. A key
    that differs by look-alike characters (Cyrillic `е` in `steps`) gets the code points named."""
    valid = sorted(valid)
    close = nearest(key, valid)
    if close:
        return f"did you mean `{prefix}{close}`?{lookalike_note(key, close)}"
    return "valid keys: " + ", ".join(valid)


# Letters of other scripts that look like Latin ones (Unicode's confusables, the common part); NFKC
# already folds fullwidth and compatibility forms (ｓｔｅｐｓ, ℓ).
_CONFUSABLE = str.maketrans("аеорсухіјѕԁһӏԛԝгɡАВЕКМНОРСТХІЈЅαοινκρτυΑΒΕΗΙΚΜΝΟΡΤΧΥΖıʟ",
                            "aeopcyxijsdhlqwrgABEKMHOPCTXIJSaoivkptuABEHIKMNOPTXYZiL")


def skeleton(text: str) -> str:
    """``text`` with look-alike letters and compatibility forms folded to ASCII where one looks the same."""
    return unicodedata.normalize("NFKC", text).translate(_CONFUSABLE)


def nearest(key: str, valid: tp.Sequence[str]) -> str | None:
    """The valid name closest to ``key``: the same after folding look-alikes, else difflib's nearest."""
    same = [x for x in valid if skeleton(x) == skeleton(key)]
    if same:
        return same[0]
    import difflib  # lazy: startup (only when a key is wrong)

    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return close[0] if close else None


def lookalike_note(key: str, close: str) -> str:
    """`` (`е` is U+0435 CYRILLIC SMALL LETTER IE, not `e`)`` for each non-ASCII character of ``key``."""
    import difflib  # lazy: startup

    pairs = {}
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, key, close, autojunk=False).get_opcodes():
        for n, ch in enumerate(key[i1:i2]):
            if not ch.isascii() and ch not in pairs:
                pairs[ch] = close[j1 + n] if op == "replace" and i2 - i1 == j2 - j1 else None
    notes = [f"{_char_note(ch)}" + (f", not `{other}`" if other else "") for ch, other in pairs.items()]
    return f" ({'; '.join(notes)})" if notes else ""


def _char_note(ch: str) -> str:
    if not ch.isprintable():
        return f"the key holds {v.char_label(ch)}"
    name = unicodedata.name(ch, "")
    return f"`{ch}` is U+{ord(ch):04X}" + (f" {name}" if name else "")


def describe(value: tp.Any, path: str = "") -> str:
    """``'ten' (str)`` for a message; the value is withheld when ``path`` looks like a secret's."""
    return f"{value_text(value, path)} ({type(value).__name__})"


def value_text(value: tp.Any, path: str = "") -> str:
    """``show(value)``, or ``<hidden>`` under a key that looks like a credential's."""
    return "<hidden>" if path and v.hides_value(path) else show(value)


def show(value: tp.Any) -> str:
    """repr of a value for a one-line message: printable, and cut when long."""
    if isinstance(value, int) and abs(value) >= 10**60:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "…"


def shown_key(key: str) -> str:
    """A user's key as it may appear inside a message."""
    return v.shown(key, 60)


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


def check_number(path: str, value: float, meta: tp.Mapping[str, tp.Any] = {}, floating: bool = False) -> list[str]:
    """Finite and within the field's bounds (NaN compares false with everything, so it is named).
    Without a ``maximum``, integer fields stop at 2**31 - 1 and float fields (``floating``) at 1e9."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"`{path}` = {value_text(value, path)}: expected a finite number"]
    minimum, maximum = meta.get("minimum"), meta.get("maximum")
    if maximum is None:
        maximum = v.FLOAT_MAX if floating or isinstance(value, float) else v.INT32_MAX
    if minimum is not None and value < minimum:
        return [f"`{path}` = {value_text(value, path)}: expected a value >= {number_text(minimum)}"]
    if value > maximum:
        return [f"`{path}` = {value_text(value, path)}: expected a value <= {number_text(maximum)}"]
    return []


def number_text(x: float) -> str:
    """``35791393`` for integers, ``1e+09`` for floats: a bound as a reader writes it."""
    return str(x) if isinstance(x, int) else f"{x:g}"


def check_scalar(path: str, value: tp.Any, meta: tp.Mapping[str, tp.Any] = {}, hint: tp.Any = None) -> list[str]:
    """Bounds of a number, printability and length of a string; nothing for other values."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_number(path, value, meta, floating=hint is float)
    if isinstance(value, str):
        return v.check_text(path, value, meta.get("max_len") or v.TEXT_MAX)
    return []


def _check_items(path: str, value: tp.Any, hint: tp.Any, meta: tp.Mapping[str, tp.Any]) -> list[str]:
    """Element-wise checks for arrays and tables, naming the element's own key path."""
    origin = tp.get_origin(hint)
    if origin is list:
        item = tp.get_args(hint)[0]
        pairs = [(f"{path}[{i}]", x) for i, x in enumerate(value)]
    elif origin is dict:
        item = tp.get_args(hint)[1]
        pairs = [(f"{path}.{shown_key(k)}", x) for k, x in value.items()]
    else:
        return []
    errors = []
    if origin is dict:
        errors += [m for k in value for m in v.check_text(f"{path} key {show(k)}", k, v.TEXT_MAX)]
    for sub_path, x in pairs:
        if not _scalar_ok(x, item):
            errors.append(f"`{sub_path}` = {describe(x, sub_path)}: expected {_type_name(item)}")
        else:
            errors += check_scalar(sub_path, x, meta, item)
    return errors


def check_free(path: str, value: tp.Any) -> list[str]:
    """A free-form value (``model.kwargs``), walked without recursion: printable keys and strings,
    finite numbers, integers within int64, names that do not look like credentials."""
    errors, stack = [], [(path, value)]
    while stack:
        where, x = stack.pop()
        if isinstance(x, dict):
            for k, item in reversed(list(x.items())):
                sub = f"{where}.{shown_key(k)}"
                errors += v.check_text(f"{where} key {show(k)}", k, v.TEXT_MAX)
                if v.looks_secret(k):
                    errors.append(f"`{sub}` looks like a secret: kwargs are written to resolved.json; put the "
                                  "variable's name in `env.passthrough` and read it with os.environ in your model")
                    continue
                stack.append((sub, item))
        elif isinstance(x, list):
            stack += reversed([(f"{where}[{i}]", item) for i, item in enumerate(x)])
        elif isinstance(x, int) and not isinstance(x, bool):
            errors += check_number(where, x, {"minimum": -v.INT64_MAX - 1, "maximum": v.INT64_MAX})
        elif isinstance(x, str) and (kind := v.secret_value_kind(x)):
            errors.append(f"`{where}` holds what looks like {kind}: kwargs are written to resolved.json")
        elif isinstance(x, (str, float, bool)):
            errors += check_scalar(where, x, _FREE_LIMITS)
        else:  # TOML dates and times: no JSON form in resolved.json
            errors.append(f"`{where}` = {describe(x, where)}: expected a string, number, boolean, array or table")
    return errors


_FREE_LIMITS = {"minimum": -sys.float_info.max, "maximum": sys.float_info.max, "max_len": v.PATH_MAX}


def check_value(path: str, value: tp.Any, f: dataclasses.Field, hint: tp.Any) -> list[str]:
    """Every problem with one field's value (empty when it is acceptable)."""
    if not _scalar_ok(value, hint):
        return [f"`{path}` = {describe(value, path)}: expected {_type_name(hint)}"]
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        shown_choices = ", ".join(repr(c) for c in meta["choices"])
        return [f"`{path}` = {value_text(value, path)}: expected one of {shown_choices}"]
    if hint is tp.Any or tp.get_origin(hint) is dict and tp.get_args(hint)[1] is tp.Any:
        return check_free(path, value)
    return check_scalar(path, value, meta, hint) or _check_items(path, value, hint, meta)


def check_table(path: str, value: tp.Any, hint: tp.Any) -> list[str]:
    """Type and content checks for a free-form table such as a site's [nccl]."""
    if not isinstance(value, dict):
        return [f"`{path}` = {describe(value, path)}: expected a table [{path}]"]
    return _check_items(path, value, hint, {})


def untouched(errors: tp.Sequence[str], paths: tp.Iterable[str]) -> bool:
    """No message in ``errors`` names one of the dotted ``paths`` (``train.betas``: also its items and
    keys) or the section a path is in as a whole: a cross-check of those fields sees the values given,
    not defaults left where a value failed its type check."""
    paths = list(paths)
    tables = {p.split(".")[0] for p in paths}
    named = re.compile("`(?:" + "|".join(re.escape(t) for t in tables) + ")`|`(?:"
                       + "|".join(re.escape(p) for p in paths) + r")[`\s.\[]")
    return not any(named.search(e) for e in errors)


@functools.cache
def type_hints(cls: type) -> dict[str, tp.Any]:
    """``typing.get_type_hints`` of a section class, evaluated once per process (several profiles share
    the classes; `hpcx status` loads every site profile)."""
    return tp.get_type_hints(cls)


def build_section(cls: type, table: tp.Any, prefix: str, errors: list[str]) -> tp.Any:
    """Instantiate one dataclass section from a TOML table, appending problems to ``errors``."""
    if not isinstance(table, dict):
        errors.append(f"`{prefix}` = {describe(table, prefix)}: expected a table [{prefix}]")
        return cls()
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        path = f"{prefix}.{key}"
        if key not in fields:
            errors.append(f"unknown key `{prefix}.{shown_key(key)}`: {suggest(key, fields, prefix + '.')}")
            continue
        problems = check_value(path, value, fields[key], hints[key])
        if problems:
            errors += problems
            continue
        kwargs[key] = float(value) if hints[key] is float else value
    return cls(**kwargs)


def build_document(sections: dict[str, type], doc: dict, errors: list[str]) -> dict[str, tp.Any]:
    """Instantiate every section class from a parsed document; unknown sections are errors."""
    too_deep = deepest_path(doc)
    if too_deep:  # e.g. from --set a.b.c…; nothing below may recurse into it
        errors.append(f"`{too_deep}…` nests deeper than {v.MAX_DEPTH} levels: expected a flatter document")
        return {name: cls() for name, cls in sections.items()}
    for key in doc:
        if key not in sections:
            close = nearest(key, list(sections))
            hint = (f"did you mean `[{close}]`?{lookalike_note(key, close)}" if close
                    else "valid sections: " + ", ".join(sections))
            errors.append(f"unknown section `[{shown_key(key)}]`: {hint}")
    return {name: build_section(cls, doc.get(name, {}), name, errors) for name, cls in sections.items()}


def read_toml(path: Path) -> dict:
    """Parse a spec or site file: a regular file of at most 1 MiB, UTF-8 with or without a BOM.

    Syntax errors become ``file:line:column: message``; nesting deeper than 32 tables or arrays is
    refused before the parser recurses into it.
    """
    return parse_toml(read_config_text(path), str(path))


def read_config_text(path: Path, limit: int = v.CONFIG_MAX_BYTES) -> str:
    """The text of a small regular file; devices, FIFOs, folders and big files are refused at once."""
    try:
        mode = os.stat(path).st_mode  # before open: opening a socket fails, a FIFO blocks
        if not stat.S_ISREG(mode):
            raise ConfigError([f"{path}: {v.file_kind(mode)}: expected a regular TOML file"])
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such file"]) from None
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    mode = os.fstat(fd).st_mode  # the file may have been replaced since the stat
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError([f"{path}: {v.file_kind(mode)}: expected a regular TOML file"])
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from None
    if len(data) > limit:
        raise ConfigError([f"{path}: larger than {limit / 2**20:g} MiB: expected a TOML file of a few KB"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: cannot read: not UTF-8 text (byte {exc.start})"]) from None


def parse_toml(text: str, source: str) -> dict:
    """``tomllib.loads`` with a BOM accepted, nesting bounded and every error a ConfigError."""
    text = text.removeprefix("\ufeff")
    deep = nesting_error(text, TOML_SYNTAX)
    if deep:
        raise ConfigError([f"{source}:{deep[0]}:{deep[1]}: tables or arrays nested deeper than "
                           f"{v.MAX_DEPTH} levels: expected a flatter file"])
    tomllib = _tomllib()
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None)
        col = getattr(exc, "colno", None)
        msg = getattr(exc, "msg", str(exc))
        if line is None or col is None:  # Python < 3.14 only puts the position in the text
            line, col, msg = _position_from_message(str(exc))
        raise TomlSyntaxError([f"{source}:{line}:{col}: TOML syntax error: {msg}{_char_at(text, line, col)}"]) from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise ConfigError([f"{source}: TOML value error: {str(exc).split(';')[0]}"]) from None
    too_deep = deepest_path(doc)
    if too_deep:
        raise ConfigError([f"{source}: `{too_deep}…` nests deeper than {v.MAX_DEPTH} levels: expected a flatter file"])
    return doc


# What opens and closes a nesting level, and what the scanner must skip: comments and strings.
TOML_SYNTAX = (re.compile(r"[\n#\"'\[\]{}]"), "#")
JSON_SYNTAX = (re.compile(r"[\n\"\[\]{}]"), None)


def _char_at(text: str, line: int, col: int) -> str:
    """A note on a non-ASCII character where the parser stopped (a look-alike letter in a bare key)."""
    lines = text.split("\n")
    row = lines[line - 1] if 0 < line <= len(lines) else ""
    ch = row[col - 1] if 0 < col <= len(row) else ""
    if not ch or ch.isascii() or not ch.isprintable():  # unprintable ones: said elsewhere (a BOM inside)
        return ""
    return f" ({_char_note(ch)}; a bare key is ASCII letters, digits, `-` and `_`: quote it, or type the ASCII letter)"


class TomlSyntaxError(ConfigError):
    """The text is not TOML (as opposed to TOML that is too deep or too big)."""


def nesting_error(text: str, syntax: tuple[re.Pattern, str | None], limit: int = v.MAX_DEPTH) -> tuple[int, int] | None:
    """(line, column) where brackets nest deeper than ``limit``, else None. A linear scan that skips
    strings and comments, so a parser that recurses per level never sees such input."""
    special, comment = syntax
    depth, line, line_start, i = 0, 1, 0, 0
    while (m := special.search(text, i)) is not None:
        i, c = m.start(), m.group()
        if c == "\n":
            line, line_start = line + 1, i + 1
        elif c == comment:
            newline = text.find("\n", i)
            i = (newline if newline >= 0 else len(text)) - 1
        elif c in "\"'":
            end = _string_end(text, i)
            line += text.count("\n", i, end)
            line_start = max(line_start, text.rfind("\n", i, end) + 1)
            i = end - 1
        elif c in "[{":
            depth += 1
            if depth > limit:
                return line, i - line_start + 1
        else:
            depth = max(0, depth - 1)
        i += 1
    return None


def _string_end(text: str, i: int) -> int:
    """Index just past the string that starts at ``i`` (TOML/JSON basic and literal strings,
    single- or multi-line); an unclosed string ends at the end of its line, the parser says why."""
    quote = text[i]
    delim = quote * 3 if text.startswith(quote * 3, i) else quote
    j = i + len(delim)
    while j < len(text):
        if quote == '"' and text[j] == "\\":
            j += 2
            continue
        if text.startswith(delim, j):
            return j + len(delim)
        if text[j] == "\n" and len(delim) == 1:
            return j
        j += 1
    return len(text)


def deepest_path(doc: tp.Any, limit: int = v.MAX_DEPTH) -> str | None:
    """The key path (cut) of a value nested deeper than ``limit`` tables/arrays, found without
    recursion (dotted keys such as ``a.b.c…`` nest without brackets)."""
    stack = [(doc, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > limit:
            return path[:80]
        if isinstance(value, dict):
            keys = [shown_key(str(k)) for k in value]
            stack += [(x, depth + 1, f"{path}.{k}" if path else k) for k, x in zip(keys, value.values())]
        elif isinstance(value, list):
            stack += [(x, depth + 1, f"{path}[{n}]") for n, x in enumerate(value)]
    return None


def load_json_bounded(data: str | bytes, what: str, error: type[UserError] = ConfigError,
                      max_depth: int = v.MAX_DEPTH) -> tp.Any:
    """``json.loads`` for headers and files hpcx did not write (a safetensors header, a run folder
    from elsewhere): nesting deeper than ``max_depth`` and malformed JSON raise ``error`` with one
    line naming ``what``, never a RecursionError."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise error([f"{what}: not UTF-8 JSON (byte {exc.start})"]) from None
    deep = nesting_error(text, JSON_SYNTAX, max_depth)
    if deep:
        raise error([f"{what}: JSON nested deeper than {max_depth} levels (line {deep[0]}, column {deep[1]})"])
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise error([f"{what}: not valid JSON: {str(exc).splitlines()[0][:200]}"]) from None


def _position_from_message(text: str) -> tuple[int, int, str]:
    # tomllib: "Expected '=' after a key in a key/value pair (at line 3, column 5)"
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
        raise ConfigError([f"--set {_shown_item(item)}: expected KEY=VALUE, e.g. --set train.steps=100"])
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError([f"--set {_shown_item(item)}: expected a dotted key such as train.steps"])
    try:
        doc = parse_toml(f"v = {raw}", "--set")
    except TomlSyntaxError as exc:
        if raw.lstrip()[:1] in ("\"", "'", "[", "{"):  # meant as TOML: `"a" "b"`, `[1, 2`, `{a = 1`
            why = exc.messages[0].split("TOML syntax error: ", 1)[-1]
            raise ConfigError([f"--set {_shown_item(item)}: expected one TOML value after `=`: {why}"]) from None
        return parts, raw  # not TOML: the text itself (job.name=hello world)
    except ConfigError as exc:  # valid TOML, but too deep or too long a number
        raise ConfigError([f"--set {_shown_item(item)}: {exc.messages[0].split(': ', 1)[1]}"]) from None
    if list(doc) != ["v"]:  # `5\n[env.set]\nX=1`: a document, of which one key would be kept
        raise ConfigError([f"--set {_shown_item(item)}: expected one TOML value after `=` (a number, a quoted "
                           "string, an array or an inline table), not more lines of TOML"])
    return parts, doc["v"]


def _shown_item(item: str) -> str:
    """A --set argument for a message: its value withheld when the key looks like a secret's."""
    key, eq, _ = item.partition("=")
    if eq and v.hides_value(key):
        return repr(v.shown(key) + "=<hidden>")
    if not eq and v.hides_value(re.sub(r"[^\w.]", ".", item)):  # no `=`: the value may be in there
        return "<argument withheld: it names a secret>"
    return repr(v.shown(item))


def apply_overrides(doc: dict, overrides: tp.Sequence[str]) -> dict:
    """Return a copy of ``doc`` with ``--set`` overrides applied (validated later with the rest)."""
    out = {k: dict(x) if isinstance(x, dict) else x for k, x in doc.items()}
    for item in overrides:
        parts, value = parse_override(item)
        table = out
        for part in parts[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError([f"--set {_shown_item(item)}: `{shown_key(part)}` is not a table"])
        table[parts[-1]] = value
    return out


def field_docs(cls: type) -> list[tuple[str, str, tp.Any]]:
    """(name, doc, default) for each field of a section: the source of the reference docs."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        out.append((f.name, f.metadata.get("doc", ""), default))
    return out
