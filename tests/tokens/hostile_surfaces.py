"""The hostile-input corpus of the surfaces added last (issue 47): chat templates, PEFT adapter folders,
tasks, script mode, ``[lora]`` and ``parallel.tp``; registered into ``tests.tokens.hostile.CASES`` (one
class per defect) and run by ``tests/tokens/test_hostile.py`` as every other case: the real CLI in a
fresh process, exit 2 with one ``error:`` line naming the file and the key or field, no traceback,
nothing left behind (a refused ``submit`` makes no run folder: each spec's run root is inside its
case folder), peak RSS under 600 MB.

The files are built here without torch: a Hugging Face base folder is ``config.json`` and a
safetensors file of zeros written by hand from hpcx's tensor plan of the tiny Llama, and an adapter
folder is PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` with PEFT's names. A new
surface gets the same treatment by adding rows to the tables below.
"""

from __future__ import annotations

import json
import struct
import typing as tp
from pathlib import Path

from tests.tokens.hostile import CASES, Expect, case, prepare

NEW_CLASSES = ("chat-bombs", "adapters", "tasks", "wrong-types", "given-for-nothing", "one-line", "run-json")
for _cls in NEW_CLASSES:
    CASES.setdefault(_cls, {})

# ---------------------------------------------------------------------------------- building blocks


def safetensors(path: Path, tensors: dict[str, tuple[int, ...]], dtype: str = "F32",
                header: dict | None = None) -> Path:
    """A safetensors file of zeros: ``tensors`` name → shape (``header`` replaces the header as written)."""
    size = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}[dtype]
    doc: dict[str, tp.Any] = {}
    offset = 0
    for name, shape in tensors.items():
        n = size
        for s in shape:
            n *= s
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header if header is not None else doc).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def llama_shape(**changes: int) -> tp.Any:
    from hpc.core.models import model_facts
    from hpc.core.spec import sections

    model = sections()["model"](arch="llama", size="tiny", **changes)
    return model_facts(model).shape


def hf_base(d: Path, **changes: int) -> Path:
    """A Hugging Face folder of hpcx's tiny Llama (``changes``: other shape fields)."""
    from hpc.core.hf import hf_config, tensor_plan

    shape = llama_shape(**changes)
    (d / "base").mkdir()
    (d / "base" / "config.json").write_text(json.dumps(hf_config("llama", shape)))
    safetensors(d / "base" / "model.safetensors", {t.name: t.shape for t in tensor_plan("llama", shape)})
    return d / "base"


PEFT_PREFIX = "base_model.model."


def adapter_tensors(targets: tp.Sequence[str] = ("q_proj", "v_proj"), r: int = 4, **changes: int) -> dict:
    """PEFT's names and shapes of the adapters of ``targets`` on the tiny Llama."""
    from hpc.core.hf import tensor_plan

    out = {}
    for t in tensor_plan("llama", llama_shape(**changes)):
        stem = t.name.removesuffix(".weight")
        if stem.rsplit(".", 1)[-1] in targets and len(t.shape) == 2:
            out[f"{PEFT_PREFIX}{stem}.lora_A.weight"] = (r, t.shape[1])
            out[f"{PEFT_PREFIX}{stem}.lora_B.weight"] = (t.shape[0], r)
    return out


def adapter_config(base: Path | str, **changes: tp.Any) -> dict[str, tp.Any]:
    doc = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": 4,
           "lora_alpha": 8.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
           "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not DROP}


DROP = object()  # a value that removes its key from adapter_config.json


def adapter(d: Path, base: Path, config: dict | bytes | None = None, tensors: dict | None = None) -> Path:
    """A PEFT adapter folder ``d/adapter`` over ``base``."""
    folder = d / "adapter"
    folder.mkdir()
    raw = config if isinstance(config, bytes) else json.dumps(config or adapter_config(base)).encode()
    (folder / "adapter_config.json").write_bytes(raw)
    safetensors(folder / "adapter_model.safetensors", adapter_tensors() if tensors is None else tensors)
    return folder


LORA = '[lora]\nrank = 4\nalpha = 8.0\ntargets = ["q_proj", "v_proj"]\n'


def job(d: Path, body: str, name: str = "job.toml") -> Path:
    """A spec whose run root is inside the case folder (a run folder left behind shows in its snapshot)."""
    (d / name).write_text(f'[job]\nrun_root = "{d / "runs"}"\n{body}')
    return d / name


def llama_job(d: Path, init_from: Path | str, lora: str = LORA, extra: str = "") -> Path:
    return job(d, f'[model]\narch = "llama"\nsize = "tiny"\n[checkpoint]\ninit_from = "{init_from}"\n{lora}{extra}')


def submit(spec: Path) -> list[str]:
    return ["submit", str(spec), "--site", "local"]


def render(spec: Path) -> list[str]:
    return ["render", str(spec), "--site", "local"]


# ------------------------------------------------------------------------------------- chat bombs
# Each template renders a two-turn chat; a bomb is the row's one-line refusal (file:line), in bounded
# time and memory, before anything is written.

CHAT_ROW = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
CHAT_BOMBS: dict[str, tuple[str, str]] = {
    "concat-doubling": ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
                        "{% endfor %}{{ ns.x }}", "builds a string"),
    "plus-doubling": ("{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}"
                      "{% endfor %}{{ ns.x }}", "builds a joined value"),
    "macro-doubling": ("{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}"
                       "{{ d('ab', 60) }}", "builds a string"),
    "string-times-a-billion": ("{{ 'ab' * 1000000000 }}", "builds a repeated value"),
    "list-times-a-billion": ("{{ (messages * 1000000000)|length }}", "builds a repeated value"),
    "nested-ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                      "loop iterations and calls"),
    "nested-message-loops": ("{% for i in range(99999) %}{% for m in messages %}{% for k in messages %}{% endfor %}"
                             "{% endfor %}{% endfor %}", "loop iterations and calls"),
    "recursive-loop-branching": ("{% for m in messages recursive %}{% if loop.depth < 40 %}{{ loop(messages) }}"
                                 "{% endif %}{% endfor %}", "loop iterations and calls"),
    "recursive-loop-endless": ("{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "RecursionError"),
    "macro-recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    "replace-growing": ("{% set ns = namespace(x='a' * 1000) %}{% for i in range(10) %}"
                        "{% set ns.x = ns.x|replace('a', ns.x) %}{% endfor %}", "builds a replaced string"),
    "center-a-billion": ("{{ 'a'|center(1000000000) }}", "center width"),
    "method-ljust": ("{{ 'a'.ljust(1000000000) }}", "ljust width"),
    "format-width": ("{{ '%1000000000s'|format('a') }}", "a width of 1000000000"),
    "str-format-width": ("{{ '{:>1000000000}'.format('a') }}", "a width of 1000000000"),
    "join-growing": ("{% set ns = namespace(x='a' * 100000) %}{{ ([ns.x] * 1000)|join(ns.x) }}", "builds a joined"),
    "power-tower": ("{{ 10 ** 100000000 }}", "bits"),
    "indent-wide": ("{{ ('\\n' * 1000000)|indent(1000) }}", "builds an indented string"),
}


def _chat_bomb(template: str, words: str) -> tp.Callable[[Path, Path], Expect]:
    def make(d: Path, tok: Path) -> Expect:
        (d / "tok").mkdir()
        (d / "tok" / "tokenizer.json").write_bytes(tok.read_bytes())
        (d / "tok" / "chat_template.jinja").write_text(template)
        (d / "chat.jsonl").write_text(CHAT_ROW + "\n")
        return Expect(prepare(d / "tok", d / "chat.jsonl", out=d / "out", extra=["--format", "prompt-response"]), 2,
                      [f"{d / 'chat.jsonl'}:1", words])
    return make


for _name, (_template, _words) in CHAT_BOMBS.items():
    CASES["chat-bombs"][_name] = _chat_bomb(_template, _words)


@case("chat-bombs")
def a_real_template_still_renders(d: Path, tok: Path) -> Expect:
    """The bounds leave an ordinary template alone (a loop, concatenation, filters, a macro)."""
    template = ("{% macro turn(m) %}{{ m['role'] | upper ~ ': ' ~ m['content'] | trim }}{% endmacro %}"
                "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ turn(m) }}"
                "{% endgeneration %}{% else %}{{ turn(m) }}{% endif %}{{ '\n' }}{% endfor %}")
    expect = _chat_bomb(template, "")(d, tok)
    return Expect(expect.argv, 0, ["1 documents"], ("out",))


# ------------------------------------------------------------------------- PEFT adapter folders
# checkpoint.init_from of an adapter folder, refused by `submit` from headers before anything is queued.

def _adapter_case(build: tp.Callable[[Path, Path], Path], words: tuple[str, ...], lora: str = LORA) -> tp.Callable:
    def make(d: Path, tok: Path) -> Expect:
        folder = build(d, hf_base(d))
        return Expect(submit(llama_job(d, folder, lora)), 2, ["`checkpoint.init_from`", *words])
    return make


def _config(**changes: tp.Any) -> tp.Callable[[Path, Path], Path]:
    return lambda d, base: adapter(d, base, adapter_config(base, **changes))


def _raw(data: bytes) -> tp.Callable[[Path, Path], Path]:
    return lambda d, base: adapter(d, base, data)


def _swapped(name: str, kind: str) -> tp.Callable[[Path, Path], Path]:
    """The folder with ``name`` replaced by /dev/zero, a FIFO or a folder, or removed."""
    import os

    def build(d: Path, base: Path) -> Path:
        folder = adapter(d, base)
        (folder / name).unlink()
        if kind == "dev-zero":
            (folder / name).symlink_to("/dev/zero")
        elif kind == "fifo":
            os.mkfifo(folder / name)
        elif kind == "folder":
            (folder / name).mkdir()
        return folder
    return build


def _other_base(d: Path) -> Path:
    (d / "other").mkdir()
    return hf_base(d / "other", dim=32)


ADAPTERS: dict[str, tuple[tp.Callable[[Path, Path], Path], tuple[str, ...]]] = {
    # the kind and size of adapter_config.json
    "config-100-mb": (_raw(b'{"a": "' + b"x" * (100 << 20) + b'"}'), ("adapter_config.json", "over 1 MiB")),
    "config-nested-100000": (_raw(b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}"), ("adapter_config.json", "nested")),
    "config-dev-zero": (_swapped("adapter_config.json", "dev-zero"), ("adapter_config.json", "character device")),
    "config-fifo": (_swapped("adapter_config.json", "fifo"), ("adapter_config.json", "FIFO")),
    "config-a-folder": (_swapped("adapter_config.json", "folder"), ("adapter_config.json", "directory")),
    "config-not-json": (_raw(b"{'r': 4}"), ("adapter_config.json", "JSON")),
    "config-not-utf8": (_raw(b'{"r": "\xff"}'), ("adapter_config.json", "UTF-8")),
    "config-a-list": (_raw(b"[1, 2]"), ("adapter_config.json", "peft_type")),
    "peft-type-prefix": (_config(peft_type="PREFIX_TUNING"), ("peft_type 'PREFIX_TUNING'",)),
    # PEFT's field types
    "r-true": (_config(r=True), ("r = true", "integer rank")),
    "r-string": (_config(r="4"), ('r = "4"',)),
    "r-float": (_config(r=4.0), ("r = 4.0",)),
    "r-zero": (_config(r=0), ("r = 0",)),
    "r-missing": (_config(r=DROP), ("r is missing",)),
    "alpha-string": (_config(lora_alpha="8.0"), ('lora_alpha = "8.0"', "a number")),
    "alpha-bool": (_config(lora_alpha=True), ("lora_alpha = true",)),
    "dropout-one": (_config(lora_dropout=1.0), ("lora_dropout = 1.0",)),
    "targets-number": (_config(target_modules=3), ("target_modules = 3",)),
    "targets-empty": (_config(target_modules=[]), ("target_modules = []",)),
    "modules-to-save-string": (_config(modules_to_save="lm_head"), ('modules_to_save = "lm_head"', "a list")),
    "modules-to-save-number": (_config(modules_to_save=[1]), ("modules_to_save = [1]",)),
    "fan-in-fan-out-string": (_config(fan_in_fan_out="false"), ('fan_in_fan_out = "false"',)),
    "bias-all": (_config(bias="all"), ('bias = "all"', "no biases")),
    "dora": (_config(use_dora=True), ("use_dora = true", "DoRA")),
    "rslora": (_config(use_rslora=True), ("use_rslora = true",)),
    "layers-to-transform": (_config(layers_to_transform=[0]), ("layers_to_transform = [0]",)),
    "rank-pattern": (_config(rank_pattern={"q_proj": 8}), ("rank_pattern",)),
    "base-path-number": (_config(base_model_name_or_path=7), ("base_model_name_or_path = 7",)),
    # against the spec and the model
    "rank-differs": (_config(r=8), ("r = 8, the spec's `lora.rank` = 4",)),
    "alpha-differs": (_config(lora_alpha=32), ("lora_alpha = 32",)),
    "target-not-in-model": (_config(target_modules=["q_proj", "c_attn"]), ("'c_attn' is no module of 'llama'",)),
    "targets-differ": (_config(target_modules=["q_proj", "k_proj"]), ("the spec's `lora.targets`",)),
    "fan-in-fan-out-wrong": (_config(fan_in_fan_out=True), ("fan_in_fan_out = True",)),
    "base-elsewhere": (_config(base_model_name_or_path="meta-llama/Llama-2-7b"), ("downloads nothing",)),
    "base-of-another-size": (lambda d, base: adapter(d, _other_base(d)), ("describes another model",
                                                                           "hidden_size = 32")),
    # the weights, from the safetensors header
    "weights-missing": (_swapped("adapter_model.safetensors", "gone"), ("adapter_model.safetensors", "no such file")),
    "weights-dev-zero": (_swapped("adapter_model.safetensors", "dev-zero"), ("character device",)),
    "weights-fifo": (_swapped("adapter_model.safetensors", "fifo"), ("FIFO",)),
    "weights-of-rank-8": (lambda d, base: adapter(d, base, tensors=adapter_tensors(r=8)), ("shapes differ",
                                                                                         "is [8, 64]")),
    "weights-of-another-width": (lambda d, base: adapter(d, base, tensors=adapter_tensors(dim=32)), ("shapes differ",)),
    "weights-lack-v-proj": (lambda d, base: adapter(d, base, tensors=adapter_tensors(("q_proj",))),
                            ("no tensor", "v_proj.lora_A")),
    "weights-extra-k-proj": (lambda d, base: adapter(d, base, tensors=adapter_tensors(("q_proj", "v_proj", "k_proj"))),
                             ("match no adapter", "k_proj")),
    "weights-integers": (lambda d, base: (lambda f: (safetensors(f / "adapter_model.safetensors", adapter_tensors(),
                                                                 "I64"), f)[1])(adapter(d, base)),
                         ("not floating point", "(I64)")),
    "weights-header-nested": (lambda d, base: (lambda f: (safetensors(f / "adapter_model.safetensors", {}, header={
        "a": json.loads("[" * 60 + "]" * 60)}), f)[1])(adapter(d, base)), ("adapter_model.safetensors",)),
}
for _name, (_build, _words) in ADAPTERS.items():
    CASES["adapters"][_name] = _adapter_case(_build, _words)


@case("adapters")
def adapter_folder_that_fits(d: Path, tok: Path) -> Expect:
    return Expect(render(llama_job(d, adapter(d, hf_base(d)))), 0, ["timeout_min"])


@case("adapters")
def adapter_with_lora_off(d: Path, tok: Path) -> Expect:
    return Expect(submit(llama_job(d, adapter(d, hf_base(d)), lora="")), 2, ["`lora.rank` = 0"])


# ------------------------------------------------------------------------------------------ tasks

TASK_MODULE = '''
class Good:
    def __init__(self, width: int = 4, *, depth: int = 2):
        self.width = width

    def build_model(self): ...
    def units(self, model): ...
    def train_dataset(self): ...
    def loss(self, model, batch): ...


class NoInit:
    def build_model(self): ...
    def units(self, model): ...
    def train_dataset(self): ...
    def loss(self, model, batch): ...


class Lacks:
    def build_model(self): ...


class Needs:
    def __init__(self, path, /, *, steps):
        pass

    def build_model(self): ...
    def units(self, model): ...
    def train_dataset(self): ...
    def loss(self, model, batch): ...


def factory():
    return Good()
'''

TASKS: dict[str, tuple[str, tuple[str, ...]]] = {
    "class-missing": ('target = "usertask:Nope"', ("usertask.py defines no 'Nope'", "Good")),
    "class-case": ('target = "usertask:good"', ("defines no 'good'",)),
    "kwargs-unknown": ('target = "usertask:Good"\nkwargs = {height = 3}', ("class Good", "no keyword argument 'height'")),
    "kwargs-without-init": ('target = "usertask:NoInit"\nkwargs = {a = 1}', ("class NoInit", "no __init__")),
    "kwargs-missing-required": ('target = "usertask:Needs"\nkwargs = {steps = 1}', ("class Needs", "requires path")),
    "kwonly-missing": ('target = "usertask:Needs"\nkwargs = {path = "x"}', ("no keyword argument 'path'",)),
    "methods-missing": ('target = "usertask:Lacks"', ("class Lacks", "has no units(), train_dataset(), loss()")),
    "module-syntax-error": ('target = "brokentask:Task"', ("brokentask.py:1", "invalid syntax")),
    "target-dot-dot": ('target = "usertask..x:Good"', ("`task.target` = 'usertask..x:Good'",)),
    "target-trailing-dot": ('target = "usertask.:Good"', ("expected 'package.module:Class'",)),
    "target-no-class": ('target = "usertask"', ("expected 'package.module:Class'",)),
    "target-stdlib": ('target = "os.path:join"', ("Python's own",)),
    "with-lora": ('target = "usertask:Good"\n[lora]\nrank = 4', ("`lora.rank` = 4 with the task",)),
    "with-init-from": ('target = "usertask:Good"\n[checkpoint]\ninit_from = "/x"', ("`checkpoint.init_from`",)),
}


def _task_case(body: str, words: tuple[str, ...]) -> tp.Callable[[Path, Path], Expect]:
    def make(d: Path, tok: Path) -> Expect:
        from tests.conftest import REPO

        (d / "usertask.py").write_text(TASK_MODULE)
        (d / "brokentask.py").write_text("def broken(:\n    pass\n")
        spec = job(d, f"[task]\n{body}\n")
        return Expect(submit(spec), 2, [str(spec), *words], env={"PYTHONPATH": f"{REPO}:{d}"})
    return make


for _name, (_body, _words) in TASKS.items():
    CASES["tasks"][_name] = _task_case(_body, _words)


@case("tasks")
def task_class_that_fits(d: Path, tok: Path) -> Expect:
    expect = _task_case('target = "usertask:Good"\nkwargs = {width = 8, depth = 1}', ())(d, tok)
    return Expect(render(Path(expect.argv[1])), 0, ["timeout_min"], env=expect.env)


@case("tasks")
def task_made_by_a_function(d: Path, tok: Path) -> Expect:
    """What a function returns is known only when it runs: not refused here (the rank checks it)."""
    expect = _task_case('target = "usertask:factory"', ())(d, tok)
    return Expect(render(Path(expect.argv[1])), 0, ["timeout_min"], env=expect.env)


# ------------------------------------------------------------------------------------ wrong types

TYPES: dict[str, tuple[str, str]] = {
    "lora-rank-true": ('[model]\narch = "llama"\n[lora]\nrank = true', "`lora.rank` = True (bool)"),
    "lora-rank-string": ('[model]\narch = "llama"\n[lora]\nrank = "4"', "`lora.rank` = '4' (str)"),
    "lora-alpha-string": ('[model]\narch = "llama"\n[lora]\nrank = 4\nalpha = "16"', "`lora.alpha` = '16' (str)"),
    "lora-targets-string": ('[model]\narch = "llama"\n[lora]\nrank = 4\ntargets = "q_proj"', "`lora.targets`"),
    "lora-trainable-string": ('[model]\narch = "llama"\n[lora]\nrank = 4\ntrainable = "*norm*"', "`lora.trainable`"),
    "tp-true": ('[parallel]\ntp = true', "`parallel.tp` = True (bool)"),
    "tp-string": ('[parallel]\ntp = "2"', "`parallel.tp` = '2' (str)"),
    "tp-float": ('[parallel]\ntp = 2.0', "`parallel.tp` = 2.0 (float)"),
    "command-string": ('command = "python train.py"', "`job.command`"),
    "command-numbers": ('command = ["python", 3]', "`job.command[1]` = 3 (int)"),
    "task-kwargs-string": ('[task]\ntarget = "usertask:Good"\nkwargs = "width=3"', "`task.kwargs`"),
    "task-tokens-string": ('[task]\ntarget = "usertask:Good"\ntokens_per_sample = "4"', "`task.tokens_per_sample`"),
}


def _spec_case(body: str, words: str, command: str = "submit") -> tp.Callable[[Path, Path], Expect]:
    def make(d: Path, tok: Path) -> Expect:
        from tests.conftest import REPO

        (d / "usertask.py").write_text(TASK_MODULE)
        spec = job(d, body + "\n")
        argv = submit(spec) if command == "submit" else [command, str(spec), "--site", "local"]
        return Expect(argv, 2, [str(spec), words], env={"PYTHONPATH": f"{REPO}:{d}"})
    return make


for _name, (_body, _words) in TYPES.items():
    CASES["wrong-types"][_name] = _spec_case(_body, _words)


# ------------------------------------------------------------------------- given for nothing

NOTHING: dict[str, tuple[str, str]] = {
    "command-empty": ("command = []", "`job.command` = []: an empty command runs nothing"),
    "lora-trainable-without-rank": ('[lora]\ntrainable = ["*norm*"]', "`lora.trainable` is set but `lora.rank` = 0"),
    "lora-targets-without-rank": ('[lora]\ntargets = ["qkv"]', "`lora.targets` is set but `lora.rank` = 0"),
    "lora-alpha-rank-zero": ("[lora]\nrank = 0\nalpha = 32.0\ndropout = 0.1", "`lora.alpha`, `lora.dropout`"),
    "task-kwargs-without-target": ("[task]\nkwargs = {width = 3}", "`task.kwargs` is set but `task.target` is not"),
    "task-tokens-without-target": ("[task]\ntokens_per_sample = 4", "`task.tokens_per_sample` is set but"),
    "task-empty-target-with-kwargs": ('[task]\ntarget = ""\nkwargs = {a = 1}', "`task.kwargs` is set but"),
    "lora-with-task": ('[task]\ntarget = "usertask:Good"\n[lora]\nrank = 2', "hpcx adds LoRA adapters to the "
                                                                            "projections of its built-in families"),
    "lora-with-a-user-model": ('[model]\narch = "usertask:factory"\nseq_len = 8\nvocab_size = 16\n[lora]\nrank = 2',
                               "declares no projections for LoRA"),
    "lora-in-script-mode": ('command = ["python", "x.py"]\n[lora]\nrank = 2', "`[lora]` configures hpcx's trainer"),
    "lora-target-twice-by-two-names": ('[model]\narch = "llama"\n[lora]\nrank = 2\ntargets = ["wq", "q_proj"]',
                                       "name the same module more than once"),
    "lora-target-twice": ('[model]\narch = "llama"\n[lora]\nrank = 2\ntargets = ["v_proj", "v_proj"]',
                          "v_proj name the same module"),
    "tp-in-script-mode": ('command = ["python", "x.py"]\n[parallel]\ntp = 2', "`[parallel]` configures hpcx's trainer"),
    # tensor parallelism on a site without GPUs (the cases render on `local`), unless asked to rehearse it
    "tp-on-a-site-without-gpus": ('[model]\narch = "llama"\n[parallel]\nstrategy = "fsdp"\ntp = 2',
                                  "which has no GPUs (`node.gpus` = 0)"),
    "tp-under-hsdp-without-gpus": ('[model]\narch = "llama"\n[parallel]\nstrategy = "hsdp"\ntp = 2',
                                   "`parallel.tp_on_cpu` = true to rehearse"),
    "tp-on-cpu-said-false": ('[model]\narch = "gpt"\n[parallel]\nstrategy = "fsdp"\ntp = 2\ntp_on_cpu = false',
                             "`parallel.tp` = 2 on site 'local', which has no GPUs"),
    "tp-on-cpu-without-tp": ('[parallel]\ntp_on_cpu = true', "`parallel.tp_on_cpu` = true but `parallel.tp` = 1"),
    "tp-on-cpu-at-tp-one": ('[parallel]\ntp = 1\ntp_on_cpu = true', "no tensor-parallel layout to rehearse"),
}
for _name, (_body, _words) in NOTHING.items():
    CASES["given-for-nothing"][_name] = _spec_case(_body, _words)


# ------------------------------------------------------------------------------- one line each

ONE_LINE: dict[str, tuple[str, str]] = {
    "tp-three-reasons": ('[model]\narch = "llama"\n[parallel]\nstrategy = "fsdp"\ntp = 3\ntp_on_cpu = true',
                         "does not divide the 2 ranks of one NVLink domain"),
    "tp-strategy-and-domain": ('tasks_per_node = 1\n[model]\narch = "llama"\n[parallel]\nstrategy = "none"\n'
                               "tp = 2\ntp_on_cpu = true", "needs strategy fsdp or hsdp"),
    "tp-lora-and-dropout": ('[model]\narch = "gpt"\ndropout = 0.1\n[parallel]\nstrategy = "fsdp"\ntp = 2\ntp_on_cpu = true\n[lora]\n'
                            "rank = 2", "with `[lora]`"),
    "tp-user-model": ('[model]\narch = "usertask:factory"\nseq_len = 8\nvocab_size = 16\n[parallel]\n'
                      'strategy = "fsdp"\ntp = 2\ntp_on_cpu = true', "is a user model"),
}
for _name, (_body, _words) in ONE_LINE.items():
    CASES["one-line"][_name] = _spec_case(_body, _words)


@case("one-line")
def tp_on_the_gpt_renders(d: Path, tok: Path) -> Expect:
    """It printed a TypeError traceback (the GPT's activations took no tp)."""
    return Expect(render(job(d, '[model]\narch = "gpt"\n[parallel]\nstrategy = "fsdp"\ntp = 2\ntp_on_cpu = true\n')), 0, ["timeout_min"])


@case("one-line")
def base_of_another_model(d: Path, tok: Path) -> Expect:
    """A wrong base printed a line per tensor (22–29); its config.json is one line."""
    other = d / "o"
    other.mkdir()
    return Expect(submit(llama_job(d, hf_base(other, dim=32, n_layers=3), lora="")), 2,
                  ["config.json: describes another model", "hidden_size = 32", "num_hidden_layers = 3"])


@case("one-line")
def weights_of_another_model(d: Path, tok: Path) -> Expect:
    """The same, from a safetensors file without a config.json: one line for every tensor of another shape."""
    base = hf_base(d, dim=32)
    return Expect(submit(llama_job(d, base / "model.safetensors", lora="")), 2,
                  ["tensors have other shapes", "and "])


# ------------------------------------------------------------------- a run folder's own JSON files
# `hpcx ckpt convert RUN`: the run folder is a command-line argument, and its resolved.json is read
# bounded in size and depth like any file hpcx did not write here.

def _run_json(write: tp.Callable[[Path], tp.Any], words: tuple[str, ...]) -> tp.Callable[[Path, Path], Expect]:
    def make(d: Path, tok: Path) -> Expect:
        step = d / "run" / "checkpoints" / "step-00000002"
        step.mkdir(parents=True)
        (step / ".metadata").write_bytes(b"")
        write(d / "run" / "resolved.json")
        return Expect(["ckpt", "convert", str(d / "run"), str(d / "out"), "--to", "hf"], 2,
                      [str(d / "run" / "resolved.json"), *words])
    return make


RUN_JSON: dict[str, tuple[tp.Callable[[Path], tp.Any], tuple[str, ...]]] = {
    "resolved-dev-zero": (lambda p: p.symlink_to("/dev/zero"), ("character device",)),
    "resolved-fifo": (lambda p: __import__("os").mkfifo(p), ("FIFO",)),
    "resolved-nested": (lambda p: p.write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}"), ("nested",)),
    "resolved-100-mb": (lambda p: p.write_bytes(b'{"a": "' + b"x" * (100 << 20) + b'"}'), ("over 64 MiB",)),
}
for _name, (_write, _words) in RUN_JSON.items():
    CASES["run-json"][_name] = _run_json(_write, _words)
