"""The workload (``hpc.core.workload``): one typed value per spec (LM / task / script), resolved once by
``workload_of``, and no other code of hpc/ or trainer/ that reads the kind fields to learn the kind."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from hpc.core.config import ConfigError
from hpc.core.models import DEFAULT_ARCH, TASK
from hpc.core.spec import load_spec, spec_from_dict
from hpc.core.workload import LMWorkload, ScriptWorkload, TaskWorkload, workload_of

ROOT = Path(__file__).resolve().parent.parent
RESNET = {"target": "examples.resnet:ImageTask", "kwargs": {"width": 8, "train_samples": 64}}


@pytest.mark.parametrize("doc, arch", [
    ({}, DEFAULT_ARCH),
    ({"model": {"arch": "llama", "size": "tiny"}}, "llama"),
    ({"model": {"arch": "gpt", "size": "tiny"}, "train": {"steps": 3}}, "gpt"),
    ({"job": {"name": "x"}, "task": {}}, DEFAULT_ARCH),  # an empty [task] names no task
])
def test_a_spec_without_command_or_task_is_the_language_model_of_its_family(doc, arch):
    w = spec_from_dict(doc).workload
    assert w == LMWorkload(arch) and w.kind == "lm" and w.uses_trainer and w.code_modules == ()


def test_a_user_model_is_a_language_model_whose_module_is_the_jobs_code():
    w = spec_from_dict({"model": {"arch": "mypkg.sub.mod:build", "seq_len": 16, "vocab_size": 64}}).workload
    assert isinstance(w, LMWorkload) and w.arch == "mypkg.sub.mod:build" and w.code_modules == ("mypkg.sub.mod",)


@pytest.mark.parametrize("task, expected", [
    (RESNET, TaskWorkload("examples.resnet:ImageTask", {"width": 8, "train_samples": 64})),
    ({**RESNET, "tokens_per_sample": 3, "flops_per_sample": 8.2e9},
     TaskWorkload("examples.resnet:ImageTask", {"width": 8, "train_samples": 64}, 3, 8.2e9)),
    ({"target": "pkg.tasks:Bert", "sync_batchnorm": True}, TaskWorkload("pkg.tasks:Bert", {}, 1, 0.0, True)),
])
def test_a_spec_with_a_task_target_is_that_task_with_its_own_fields(task, expected):
    spec = spec_from_dict({"task": task})
    w = spec.workload
    assert w == expected and w.kind == "task" and w.uses_trainer
    assert (w.module, w.cls, w.code_modules) == (expected.target.split(":")[0], expected.target.split(":")[1],
                                                 (expected.target.split(":")[0],))
    assert spec.model.arch == TASK and spec.model.seq_len == expected.tokens_per_sample  # apply_task read it


@pytest.mark.parametrize("command", [["python", "train.py"], ["torchrun", "--nproc_per_node", "2", "t.py"],
                                     ["/opt/my tools/run"]])
def test_a_spec_with_a_command_is_that_script(command):
    w = spec_from_dict({"job": {"command": command}}).workload
    assert w == ScriptWorkload(tuple(command)) and w.kind == "script" and not w.uses_trainer
    assert w.code_modules == ()


@pytest.mark.parametrize("body, expected", [
    ("", LMWorkload(DEFAULT_ARCH)),
    ('[model]\narch = "llama"\nsize = "tiny"\n', LMWorkload("llama")),
    ('[task]\ntarget = "examples.resnet:ImageTask"\nkwargs = {width = 8}\n',
     TaskWorkload("examples.resnet:ImageTask", {"width": 8})),
    ('[job]\ncommand = ["python", "t.py", "--lr", "3e-4"]\n', ScriptWorkload(("python", "t.py", "--lr", "3e-4"))),
])
def test_load_spec_resolves_the_workload_and_resolved_json_reads_back_the_same(tmp_path, body, expected):
    path = tmp_path / "job.toml"
    path.write_text(body)
    spec = load_spec(path)
    assert spec.workload == expected
    again = spec_from_dict(spec.to_dict(), "resolved.json", read_hf_config=False)
    assert again.workload == expected and ("task" in spec.to_dict()) == isinstance(expected, TaskWorkload)


@pytest.mark.parametrize("body, words", [
    ('[job]\ncommand = ["python", "t.py"]\n[task]\ntarget = "examples.resnet:ImageTask"\n',
     "`[task]` configures hpcx's trainer, but `job.command` runs your own script"),
    ('[job]\ncommand = ["python", "t.py"]\n[model]\narch = "llama"\n', "`[model]` configures hpcx's trainer"),
    ('[job]\ncommand = []\n', "`job.command` = []: an empty command runs nothing"),
    ('[task]\nkwargs = {width = 8}\n', "`task.kwargs` is set but `task.target` is not"),
    ('[model]\narch = "task-model"\n', "`model.arch` = 'task-model' is set by `[task]`"),
    ('[task]\ntarget = "examples.resnet:ImageTask"\n[model]\narch = "llama"\n', "`[model]` is the task's"),
])
def test_specs_that_mix_or_half_give_the_kinds_are_still_refused_in_one_line(tmp_path, body, words):
    path = tmp_path / "job.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert any(words in m and str(path) in m for m in err.value.messages), err.value.messages


def test_the_workload_is_resolved_once_frozen_and_a_changed_copy_resolves_its_own():
    spec = spec_from_dict({"job": {"command": ["python", "t.py"]}})
    w = spec.workload
    assert spec.workload is w  # kept, not recomputed
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.command = ("other",)  # type: ignore[misc]
    lm = dataclasses.replace(spec, job=dataclasses.replace(spec.job, command=[]))
    assert lm.workload == LMWorkload(spec.model.arch) and spec.workload is w


def test_workload_of_reads_a_command_before_a_task():
    """A resolved.json a hand could write with both (the loader refuses it) reads as what its ranks ran."""
    spec = spec_from_dict({"task": RESNET})
    both = dataclasses.replace(spec, job=dataclasses.replace(spec.job, command=["python", "t.py"]))
    assert workload_of(both) == ScriptWorkload(("python", "t.py")) and workload_of(spec) == spec.workload


def test_the_trainer_takes_the_jobs_own_code_from_the_workload():
    from trainer.resilience import code_modules

    assert code_modules(spec_from_dict({"task": RESNET})) == ("examples.resnet",)
    assert code_modules(spec_from_dict({"model": {"arch": "m.x:b", "seq_len": 8, "vocab_size": 8}})) == ("m.x",)
    assert code_modules(spec_from_dict({})) == code_modules(spec_from_dict({"job": {"command": ["x"]}})) == ()


def test_a_script_task_refuses_a_run_of_hpcxs_trainer():
    from trainer.script import script_command

    assert script_command(spec_from_dict({"job": {"command": ["python", "t.py"]}})) == ("python", "t.py")
    with pytest.raises(ValueError, match="hpcx's trainer \\(task\\)"):
        script_command(spec_from_dict({"task": RESNET}))


# ------------------------------------------------------------------ no other code learns the kind from fields

KIND_FIELDS = {"command": "job", "target": "task"}  # job.command, task.target
ALLOWED = {  # (file, function): the resolver, and the loader's checks of the fields as written
    ("hpc/core/workload.py", "workload_of"),
    ("hpc/core/spec.py", "spec_from_dict"),  # check_command(spec.job.command): the field's own check
    ("hpc/core/tasks.py", "task_problems"),  # [task] as written: a target's form, the sections it owns
}


def kind_field_reads(source: str, filename: str = "<src>") -> list[tuple[int, str, str]]:
    """(line, enclosing function, ``job.command``/``task.target``) for each read of a kind field: an
    attribute ``command`` of something named ``job`` (``spec.job``, ``job``), ``target`` of ``task``."""
    found: list[tuple[int, str, str]] = []

    def named(node: ast.AST) -> str | None:
        return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None

    def walk(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Attribute) and child.attr in KIND_FIELDS and KIND_FIELDS[child.attr] == named(child.value):
                found.append((child.lineno, function, f"{KIND_FIELDS[child.attr]}.{child.attr}"))
            if isinstance(child, ast.Call) and named(child.func) == "script_mode":
                found.append((child.lineno, function, "script_mode()"))
            walk(child, inner)

    walk(ast.parse(source, filename), "<module>")
    return found


@pytest.mark.parametrize("source, expected", [
    ("def f(spec):\n    if spec.job.command:\n        return 1\n", [(2, "f", "job.command")]),
    ("def g(spec):\n    return 1 if not spec.task.target else 2\n", [(2, "g", "task.target")]),
    ("def h(spec):\n    task = spec.task\n    return bool(task.target)\n", [(3, "h", "task.target")]),
    ("def k(run):\n    return list(run.spec.job.command)\n", [(2, "k", "job.command")]),
    ("x = script_mode(spec)\n", [(1, "<module>", "script_mode()")]),
    ("def ok(spec, step):\n    return step.command, spec.workload.command, self.target\n", []),
])
def test_the_walker_finds_a_kind_field_read_however_it_is_spelled(source, expected):
    assert kind_field_reads(source) == expected


def test_no_code_of_hpc_or_trainer_reads_the_kind_fields_but_the_resolver_and_the_loader():
    offending, allowed_seen = [], set()
    for path in sorted([*ROOT.joinpath("hpc").rglob("*.py"), *ROOT.joinpath("trainer").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for line, function, what in kind_field_reads(path.read_text(), rel):
            if (rel, function) in ALLOWED:
                allowed_seen.add((rel, function))
            else:
                offending.append(f"{rel}:{line} ({function}) reads {what}: match on spec.workload instead")
    assert not offending, "\n".join(offending)
    assert allowed_seen == ALLOWED  # each exception is still needed (else drop it)


def test_the_workload_module_is_a_leaf_of_the_standard_library():
    tree = ast.parse((ROOT / "hpc/core/workload.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "typing", "dataclasses"}, imported
