"""Chat templates: the tokenizer's own Jinja template, rendered as transformers' ``apply_chat_template``
renders it, and the characters of the assistant's turns, which are what the loss counts.

Where the template comes from is transformers' order: ``chat_template.jinja`` (and
``additional_chat_templates/NAME.jinja``) beside the tokenizer, else ``chat_template`` in
``tokenizer_config.json`` (a string, or a list of ``{"name", "template"}``); of several, ``default``
(``tool_use`` for a row that carries ``tools``). The template sees ``messages``, ``tools``,
``documents``, ``add_generation_prompt`` and the named special tokens of ``tokenizer_config.json``
(``bos_token``, ``eos_token``, …) as transformers passes them, in the same sandboxed environment
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``, its ``tojson``, the
``{% generation %}`` tag).

The assistant's characters: where the template marks them with ``{% generation %}``, those blocks (one
rendering, as ``return_assistant_tokens_mask`` finds them); otherwise, for each assistant message, the
characters between the conversation before it rendered with ``add_generation_prompt`` and the
conversation up to it, each of which must be a prefix of the whole rendering (a template that renders
earlier turns differently once later ones follow is refused for that row: hpcx cannot tell the
assistant's characters then). jinja2 is imported only here, when a template is used.
"""

from __future__ import annotations

import hashlib
import json
import re
import typing as tp
from datetime import datetime
from pathlib import Path

from hpc.core.config import load_json_bounded
from hpc.core.errors import UserError
from hpc.core.validate import open_regular
from hpc.data.inputs import BadInput, Limits, Segments
from hpc.data.tokenizer import MAX_FILE_BYTES

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
CONFIG_FILE = "tokenizer_config.json"
LEGACY_SPECIAL_FILE = "special_tokens_map.json"
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_TEMPLATE_BYTES = 4 << 20  # a chat template is a few KB; the largest published ones ~30 KB
RENDER_BUDGET = 8  # characters rendered for one row's prefixes, at most this many times --max-document-bytes
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases, first is the standard


def read_json_file(path: Path) -> tp.Any:
    """A bounded JSON file of the tokenizer's folder (a regular file, as many bytes as a tokenizer.json
    may have); None when it does not exist."""
    if not path.exists():
        return None
    return load_json_bounded(read_text(path, MAX_FILE_BYTES), str(path), UserError)


def read_text(path: Path, limit: int = MAX_TEMPLATE_BYTES) -> str:
    """A bounded UTF-8 text file (a FIFO or a device is refused before it is opened)."""
    with open_regular(path, str(path), "a regular file", UserError) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError([f"{path}: over {limit:,} bytes: expected a file of a few KB"])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError([f"{path}: byte {exc.start} is not UTF-8: expected UTF-8 text"]) from None


def find_template(folder: Path, tok: tp.Any) -> dict[str, tp.Any] | None:
    """The plan's record of the tokenizer's chat template (``source``, ``sha256``, ``templates`` by
    name, ``variables`` for the template, ``generation``), or None where the folder has none. A
    template that does not compile, or special tokens the tokenizer lacks, are a UserError."""
    config = read_json_file(folder / CONFIG_FILE)
    config = config if isinstance(config, dict) else {}
    source, templates = _template_files(folder)
    if not templates:
        source, templates = _config_templates(folder / CONFIG_FILE, config.get("chat_template"))
    if not templates:
        return None
    if "default" not in templates:
        raise UserError([f"{source}: chat templates {sorted(templates)} and none named 'default': expected a "
                         "default template"])
    templates = {k: v for k, v in templates.items() if k in ("default", "tool_use")}
    for name, text in templates.items():
        _compile_or_refuse(text, f"{source}" + (f" ({name})" if name != "default" else ""))
    variables = special_tokens(folder, config, tok)
    digest = template_digest(templates)
    entry = {"source": source, "sha256": digest, "templates": templates, "variables": variables,
             "generation": bool(GENERATION_TAG.search(templates["default"]))}
    if any("strftime_now" in text for text in templates.values()):
        entry["now"] = datetime.now().isoformat(timespec="seconds")  # one date for every group (same_plan)
    return entry


def same_plan(old: dict, new: dict) -> bool:
    """Plans equal but for the time their template's ``strftime_now`` renders (the first one's is kept)."""
    def undated(plan: dict) -> dict:
        entry = plan.get("chat_template")
        return dict(plan, chat_template={k: v for k, v in entry.items() if k != "now"}) if entry else plan

    return isinstance(old, dict) and undated(old) == undated(new)


def _template_files(folder: Path) -> tuple[str, dict[str, str]]:
    """Templates of ``chat_template.jinja`` (as ``default``) and ``additional_chat_templates/*.jinja``:
    transformers reads these before the config's entry."""
    templates: dict[str, str] = {}
    if (folder / TEMPLATE_FILE).exists():
        templates["default"] = read_text(folder / TEMPLATE_FILE)
    extra = folder / TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = read_text(path)
    source = folder / TEMPLATE_FILE if (folder / TEMPLATE_FILE).exists() else extra
    return str(source), templates


def _config_templates(path: Path, value: tp.Any) -> tuple[str, dict[str, str]]:
    """``chat_template`` of ``tokenizer_config.json``: a string, a list of ``{"name", "template"}``, or
    a table of names."""
    where = f"{path}: chat_template"
    if value is None:
        return where, {}
    if isinstance(value, str):
        return where, {"default": value}
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                   for t in value):
            raise UserError([f"{where}: a list whose entries are not {{\"name\", \"template\"}} strings: expected "
                             "a template string or such a list"])
        return where, {t["name"]: t["template"] for t in value}
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return where, dict(value)
    raise UserError([f"{where} is a {type(value).__name__}: expected a template string or a list of named templates"])


def special_tokens(folder: Path, config: dict, tok: tp.Any) -> dict[str, str]:
    """The variables transformers gives a template besides the messages: the named special tokens of
    ``tokenizer_config.json`` (and of a legacy ``special_tokens_map.json`` where the config lists no
    ``added_tokens_decoder``), each a token of the tokenizer."""
    found = _named_tokens(config)
    if "added_tokens_decoder" not in config:
        legacy = read_json_file(folder / LEGACY_SPECIAL_FILE)
        found.update(_named_tokens(legacy if isinstance(legacy, dict) else {}))
    for name, text in found.items():
        if tok.token_to_id(text) is None:
            raise UserError([f"{folder / CONFIG_FILE}: {name} {text!r} is not a token of the tokenizer: expected "
                             "the special tokens the chat template writes to be in tokenizer.json"])
    return found


def _named_tokens(config: dict) -> dict[str, str]:
    """The standard special tokens, every other ``*_token`` string, and a table ``extra_special_tokens``."""
    extra = config.get("extra_special_tokens")
    items = list(config.items()) + (list(extra.items()) if isinstance(extra, dict) else [])
    out = {}
    for key, value in items:
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(key, str) and key.endswith("_token") and isinstance(text, str):
            out[key] = text
    return dict(sorted(out.items(), key=lambda kv: (kv[0] not in NAMED_TOKENS, kv[0])))


def _compile_or_refuse(text: str, source: str) -> tp.Any:
    import jinja2  # lazy: jinja2

    try:
        return environment().from_string(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError([f"{source}: line {exc.lineno}: {exc.message}: expected a Jinja chat template"]) from None


# ---------------------------------------------------------------- the environment (transformers' own)


def environment(now: str | None = None, chars: int = 1 << 24) -> tp.Any:
    """The sandboxed Jinja environment of ``transformers.utils.chat_template_utils``: the same options,
    filters, globals and ``{% generation %}`` tag, so a template renders the same characters
    (``strftime_now`` renders ``now``, an ISO time, where given: the plan's, not each group's own); bounded
    by ``hpc.data.template_bounds`` to values of ``chars`` characters and a million steps a rendering."""
    import jinja2.ext  # lazy: jinja2

    from hpc.data.template_bounds import BoundedEnvironment, Budget  # lazy: jinja2

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, budget=Budget(chars),
                             extensions=[_tracker_class(), jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now if now is None else _strftime_at(now)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace_class()
    return env


def _raise_exception(message: str) -> tp.NoReturn:
    import jinja2  # lazy: jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: tp.Any, ensure_ascii: bool = False, indent: int | None = None, separators: tp.Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _strftime_at(now: str) -> tp.Callable[[str], str]:
    when = datetime.fromisoformat(now)
    return lambda format: when.strftime(format)


class _TemplateDict:
    """``dict`` for templates without attribute access to the type (as transformers limits it)."""

    def __call__(self, *args: tp.Any, **kwargs: tp.Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: tp.Any, **kwargs: tp.Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


_CLASSES: dict[str, type] = {}


def _namespace_class() -> type:
    """jinja2's ``namespace`` refusing underscore names (transformers' ``TemplateNamespace``)."""
    if "namespace" not in _CLASSES:
        import jinja2.utils  # lazy: jinja2

        def check(name: tp.Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")

        class TemplateNamespace(jinja2.utils.Namespace):
            def __init__(*args: tp.Any, **kwargs: tp.Any):  # jinja's signature trick: namespace(self=…) works
                self, rest = args[0], args[1:]
                attrs = dict(*rest, **kwargs)
                for name in attrs:
                    check(name)
                jinja2.utils.Namespace.__init__(self, attrs)

            def __setitem__(self, name: str, value: tp.Any) -> None:
                check(name)
                jinja2.utils.Namespace.__setitem__(self, name, value)

        _CLASSES["namespace"] = TemplateNamespace
    return _CLASSES["namespace"]


def _tracker_class() -> type:
    """The ``{% generation %}`` tag: renders its body, and while a rendering tracks, records the body's
    (start, end) characters, the start being what the rendering has yielded so far (transformers'
    ``AssistantTracker``)."""
    if "tracker" not in _CLASSES:
        import jinja2  # lazy: jinja2
        import jinja2.ext  # lazy: jinja2
        import jinja2.nodes  # lazy: jinja2

        class GenerationTracker(jinja2.ext.Extension):
            tags = {"generation"}

            def __init__(self, env: tp.Any):
                super().__init__(env)
                self.tracking: tuple[tp.Callable[[], int], list] | None = None
                env.extend(generation_tracker=self)

            def parse(self, parser: tp.Any) -> tp.Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

            @jinja2.pass_eval_context
            def _generation(self, context: tp.Any, caller: tp.Any) -> str:
                rv = caller()
                if self.tracking is not None:
                    start = self.tracking[0]()
                    self.tracking[1].append((start, start + len(rv)))
                return rv

        _CLASSES["tracker"] = GenerationTracker
    return _CLASSES["tracker"]


# ---------------------------------------------------------------- rendering rows


class TooLong(Exception):
    """A rendering past its bound (``budget``: a row's renderings together)."""

    def __init__(self, budget: bool = False):
        super().__init__()
        self.budget = budget


class ChatRenderer:
    """Renders the chat rows of one preparation with the plan's template into segments: the rendered
    text cut into the assistant's characters (counted) and the rest."""

    def __init__(self, entry: dict[str, tp.Any], limits: Limits = Limits()):
        self.max_chars = limits.document_bytes + (1 << 20)
        self.entry, self.env = entry, environment(entry.get("now"), self.max_chars)
        self.compiled = {name: self.env.from_string(text) for name, text in entry["templates"].items()}
        self.tracker = self.env.generation_tracker
        self.budget = RENDER_BUDGET * max(limits.document_bytes, 1 << 20)
        self.spent = 0

    def segments(self, messages: tp.Any, tools: tp.Any, where: str, key: str = "messages") -> Segments | BadInput:
        """The segments of one conversation, or the BadInput saying why it cannot be rendered."""
        chat = normalize_messages(messages, where, key)
        if isinstance(chat, BadInput):
            return chat
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            return BadInput(where, f"'tools' is a {type(tools).__name__}: expected a list of JSON schemas")
        from hpc.data.template_bounds import TemplateBomb  # lazy: jinja2

        template = self.compiled.get("tool_use" if tools is not None else "default", self.compiled["default"])
        self.spent = 0
        try:
            text, spans = self._spans(template, chat, tools, where)
        except TooLong as exc:
            if exc.budget:
                return BadInput(where, f"{len(chat)} messages whose conversations up to each assistant turn render "
                                f"past {self.budget:,} characters together: expected fewer turns per row, or a "
                                "template that marks the assistant's turns with {% generation %} (rendered once)")
            return BadInput(where, f"the chat renders past {self.max_chars:,} characters: expected at most that "
                            "(raise --max-document-bytes)")
        except _Refused as exc:
            return exc.bad
        except TemplateBomb as exc:
            return BadInput(where, f"{exc} ({self.entry['source']}): expected a template that renders a "
                            "conversation in bounded time and size")
        except Exception as exc:  # noqa: BLE001  (a template may raise anything: raise_exception, TypeError, …)
            first = (str(exc).splitlines() or [""])[0][:200]
            return BadInput(where, f"the chat template ({self.entry['source']}) raised {type(exc).__name__}: "
                            f"{first}: expected a conversation this template renders")
        if not any(e > s for s, e in spans):
            return BadInput(where, "the chat template marks no assistant characters: expected an assistant "
                            "message (only the assistant's tokens count in the loss)")
        return cut(text, spans)

    def _spans(self, template: tp.Any, chat: list[dict], tools: tp.Any, where: str) -> tuple[str, list]:
        if self.entry["generation"]:
            return self.render(template, chat, tools, False, track=True)
        whole = self.render(template, chat, tools, False)[0]
        spans = []
        for i, message in enumerate(chat):
            if message["role"] != "assistant":
                continue
            before = self.render(template, chat[:i], tools, True)[0]
            through = self.render(template, chat[:i + 1], tools, False)[0]
            if not (through.startswith(before) and whole.startswith(through)):
                raise _Refused(BadInput(where, f"message {i} (assistant): the chat template renders the "
                                        "conversation up to it differently from the start of the whole one, so its "
                                        "tokens cannot be told apart: expected a template whose earlier turns render "
                                        "the same, or one that marks the assistant's turns with "
                                        "{% generation %}…{% endgeneration %}"))
            spans.append((len(before), len(through)))
        return whole, spans

    def render(self, template: tp.Any, chat: list[dict], tools: tp.Any, prompt: bool,
               track: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """(text, generation spans) of one rendering, streamed and bounded in characters (one rendering,
        and all of a row's together)."""
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        total = 0
        self.env.budget.reset()
        self.tracker.tracking = (lambda: total, spans) if track else None
        try:
            for block in template.generate(messages=chat, tools=tools, documents=None, add_generation_prompt=prompt,
                                           **self.entry["variables"]):
                blocks.append(block)
                total += len(block)
                self.spent += len(block)
                if total > self.max_chars or self.spent > self.budget:
                    raise TooLong(budget=total <= self.max_chars)
        finally:
            self.tracker.tracking = None
        return "".join(blocks), spans


class _Refused(Exception):
    def __init__(self, bad: BadInput):
        self.bad = bad


def normalize_messages(messages: tp.Any, where: str, key: str = "messages") -> list[dict] | BadInput:
    """The messages as transformers hands them to a template (keys whose value is null dropped, the
    reasoning fields aliased), each checked: a string ``role`` and a ``content`` (absent only beside
    ``tool_calls``)."""
    expected = f"expected {key!r} to be a list of {{\"role\": …, \"content\": …}}"
    if not isinstance(messages, list) or not messages:
        return BadInput(where, f"{key!r} is not a non-empty list: {expected}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return BadInput(where, f"message {i} is a {type(message).__name__}: {expected}")
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str):
            return BadInput(where, f"message {i} has no string 'role': {expected}")
        if "content" not in message and "tool_calls" not in message:
            return BadInput(where, f"message {i} ({message['role']}) has no 'content': {expected} (a string, parts "
                            "or a table, for the template to render; absent only beside 'tool_calls')")
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    if not any(m["role"] == "assistant" for m in out):
        return BadInput(where, f"no assistant message: {expected}, one with role 'assistant'")
    return out


def cut(text: str, spans: list[tuple[int, int]]) -> Segments:
    """``text`` as segments: the characters of ``spans`` counted, the rest not (empty pieces left out)."""
    out: Segments = []
    pos = 0
    for start, end in sorted(spans):
        start = max(start, pos)
        if start > pos:
            out.append((text[pos:start], False))
        if end > start:
            out.append((text[start:end], True))
        pos = max(pos, end)
    if pos < len(text):
        out.append((text[pos:], False))
    return out


# ---------------------------------------------------------------- the plan's choice

MODES = ("auto", "tokenizer", "none")  # --chat-template


def plan_template(folder: Path, tok: tp.Any, kind: str, mode: str) -> dict[str, tp.Any] | None:
    """The template a preparation renders with (``find_template``), or None: ``auto`` takes the
    tokenizer's where it has one, ``tokenizer`` requires it, ``none`` never renders one. Plain text
    (``--format text``) is never rendered."""
    if mode not in MODES:
        raise UserError([f"--chat-template {mode}: expected one of {', '.join(MODES)}"])
    if kind == "text" or mode == "none":
        if mode == "tokenizer":
            raise UserError(["--chat-template tokenizer with --format text: expected --format prompt-response "
                             "(plain text is tokenized as it is)"])
        return None
    found = find_template(folder, tok)
    if found is None and mode == "tokenizer":
        raise UserError([f"--chat-template tokenizer: {folder} has no chat template: expected {TEMPLATE_FILE} or a "
                         f"chat_template in {CONFIG_FILE} (or --chat-template auto)"])
    return found


def template_record(entry: dict[str, tp.Any] | None) -> dict[str, tp.Any] | None:
    """What the manifest says of the template: where it came from, its SHA-256, whether it marks the
    assistant's turns, and the templates themselves by name (``default``, ``tool_use``): what a model
    export writes as its ``chat_template.jinja``, whatever the tokenizer's folder holds by then."""
    return None if entry is None else {k: entry[k] for k in ("source", "sha256", "generation", "templates")}


def template_digest(templates: dict[str, str]) -> str:
    """The SHA-256 ``find_template`` records for a set of named templates."""
    return hashlib.sha256(json.dumps(templates, sort_keys=True).encode()).hexdigest()


def folder_templates(folder: Path) -> dict[str, str]:
    """The templates transformers would load from a tokenizer folder (``default``, ``tool_use``), as
    ``find_template`` reads them; {} where it has none."""
    config = read_json_file(folder / CONFIG_FILE)
    _, templates = _template_files(folder)
    if not templates:
        _, templates = _config_templates(folder / CONFIG_FILE, config.get("chat_template") if isinstance(config, dict)
                                         else None)
    return {k: v for k, v in templates.items() if k in ("default", "tool_use")}


# ---------------------------------------------------------------- the tokenizer as transformers loads it


def add_config_tokens(tok: tp.Any, folder: Path) -> list[str]:
    """The named special tokens of ``tokenizer_config.json`` that ``tokenizer.json`` holds in its
    vocabulary but not among its added tokens, added as special tokens, as transformers adds them when
    it loads the folder (then text spelling one is that token, never its pieces). Returns them."""
    config = read_json_file(folder / CONFIG_FILE)
    if not isinstance(config, dict):
        return []
    from tokenizers import AddedToken  # lazy: tokenizers

    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    raw = _raw_named_tokens(config)
    new = [name for name, text in _named_tokens(config).items()
           if text not in added and tok.token_to_id(text) is not None]
    tokens = [AddedToken(_named_tokens(config)[n], special=True, **_token_options(raw.get(n))) for n in new]
    if tokens:
        tok.add_special_tokens(tokens)
    return [t.content for t in tokens]


def _raw_named_tokens(config: dict) -> dict[str, tp.Any]:
    extra = config.get("extra_special_tokens")
    return {**config, **(extra if isinstance(extra, dict) else {})}


def _token_options(value: tp.Any) -> dict[str, bool]:
    """An AddedToken table's flags (``lstrip``, ``rstrip``, ``single_word``, ``normalized``)."""
    if not isinstance(value, dict):
        return {}
    return {k: value[k] for k in ("lstrip", "rstrip", "single_word", "normalized") if isinstance(value.get(k), bool)}
