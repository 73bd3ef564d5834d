"""The direction of imports drawn in docs/design.md: checked on the source, every import statement
(module level and inside functions), so a new dependency that breaks the layering fails here.

The rules: ``hpc.core`` imports no torch, no login tool and no scheduler implementation (only the
registry ``hpc.schedulers`` and its interface ``hpc.schedulers.base``); the trainer imports from hpc
only the core, ``hpc.ckpt``, ``hpc.compat`` and the registry; nothing outside ``hpc/schedulers/<kind>/``
names Slurm (its variables, ``#SBATCH``, its commands, its package); no ``arch == "gpt"`` (or any family's
name) outside that family's modules, no family module importing another's, no family named by the core spec."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# importer module -> trainer modules it may import (hpc/ never imports the trainer otherwise)
TRAINER_ALLOWED = {"hpc.login.submit": {"trainer.task", "trainer.script"},  # both torch-free: what submitit pickles
                   # `hpcx dryrun` runs the trainer's own construction (it imports torch, unlike render/plan)
                   "hpc.dryrun": {"trainer.model", "trainer.optim", "trainer.train", "trainer.parallelize",
                                  "trainer.checkpoint", "trainer.init_from", "trainer.tasks",
                                  "trainer.models.decoder"},  # the document mask, built as the models build it
                   # its start-up checks build the bare user model on meta, resolve the blocks where a feature
                   # needs them (trainer.parallelize.blocks_for) and run the loop's loss on its output
                   "hpc.dryrun.startup": {"trainer.model", "trainer.objective", "trainer.tasks", "trainer.parallelize"},
                   # `hpcx plan --count-params` builds a user model on the meta device to count it
                   "hpc.cli.plan": {"trainer.count"}}
# modules that import nothing else from hpc (the bottom of the graph)
LEAVES = ("hpc.core.errors", "hpc.core.dims", "hpc.core.boot", "hpc.login.evals")
# what the core may import from hpc: itself, and the scheduler registry with its interface
CORE_MAY_IMPORT = ("hpc.core", "hpc.schedulers", "hpc.schedulers.base")
# what the trainer may import from hpc
# (hpc.job: the script mode's helper, a torch-free leaf the script mode's task sets the variables of)
TRAINER_MAY_IMPORT = ("hpc.core", "hpc.ckpt", "hpc.compat", "hpc.schedulers", "hpc.schedulers.base", "hpc.job")
# the one module outside hpc/schedulers/<kind>/ that names a kind's package: `python -m hpc.requeue`, the
# entry point the rendered sbatch script (and its goldens) runs, calls Slurm's check after srun
NAMES_SLURM_FOR_ITS_SCRIPT = ("hpc/requeue/__main__.py",)
KIND_PACKAGES = ("slurm", "local")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """Every module named by an import statement in ``path`` (absolute imports only)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


HPC_MODULES = sorted((module_name(p), p) for p in (REPO / "hpc").rglob("*.py"))


@pytest.mark.parametrize("name,path", HPC_MODULES, ids=[m for m, _ in HPC_MODULES])
def test_hpc_does_not_import_the_trainer(name, path):
    used = {m for m in imports(path) if m == "trainer" or m.startswith("trainer.")}
    allowed = TRAINER_ALLOWED.get(name, set())
    used = {m for m in used if not any(m.startswith(a + ".") for a in allowed)}  # names imported from them
    assert used <= allowed, \
        f"{name} imports {sorted(used - allowed)}: hpc/ must not depend on the trainer (see docs/design.md)"


@pytest.mark.parametrize("name", LEAVES)
def test_the_bottom_of_the_graph_imports_nothing_from_hpc(name):
    path = REPO / Path(*name.split(".")).with_suffix(".py")
    assert not {m for m in imports(path) if m.startswith("hpc")}


def _names_from_hpc(path: Path) -> set[str]:
    """The hpc modules (and names in them) that ``path`` imports, ``from hpc import x`` read as ``hpc.x``."""
    return {m for m in imports(path) if m.startswith("hpc.")}


def _allowed(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


CORE_MODULES = [(m, p) for m, p in HPC_MODULES if m.startswith("hpc.core")]
TRAINER_MODULES = sorted((module_name(p), p) for p in (REPO / "trainer").rglob("*.py"))


@pytest.mark.parametrize("name,path", CORE_MODULES, ids=[m for m, _ in CORE_MODULES])
def test_the_core_imports_no_torch_no_login_tool_and_no_scheduler_implementation(name, path):
    used = imports(path)
    assert not {m for m in used if m == "torch" or m.startswith("torch.")}, f"{name} imports torch"
    # `from hpc.schedulers import X` names X of the registry; a kind's package is not allowed
    wrong = {m for m in _names_from_hpc(path) if not _allowed(m, CORE_MAY_IMPORT)
             or any(_allowed(m, (f"hpc.schedulers.{k}",)) for k in KIND_PACKAGES)}
    wrong -= {"hpc.schedulers"}
    assert not wrong, f"{name} imports {sorted(wrong)}: the core imports only itself and hpc.schedulers (see docs/design.md)"


@pytest.mark.parametrize("name,path", TRAINER_MODULES, ids=[m for m, _ in TRAINER_MODULES])
def test_the_trainer_imports_from_hpc_only_the_core_ckpt_compat_and_the_scheduler_registry(name, path):
    wrong = {m for m in _names_from_hpc(path) if not _allowed(m, TRAINER_MAY_IMPORT)
             or any(_allowed(m, (f"hpc.schedulers.{k}",)) for k in KIND_PACKAGES)}
    if "hpc" in imports(path):  # `from hpc import schedulers` and the like
        wrong |= {m for m in imports(path) if m.startswith("hpc.") and m.count(".") == 1
                  and not _allowed(m, TRAINER_MAY_IMPORT)}
    assert not wrong, f"{name} imports {sorted(wrong)}: the trainer imports only {', '.join(TRAINER_MAY_IMPORT)}"


def _outside_the_kinds() -> list[Path]:
    """hpc/ and trainer/ sources outside hpc/schedulers/<kind>/."""
    kinds = [REPO / "hpc" / "schedulers" / k for k in KIND_PACKAGES]
    return [p for p in list((REPO / "hpc").rglob("*.py")) + list((REPO / "trainer").rglob("*.py"))
            if not any(k in p.parents for k in kinds)]


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string literal that is not prose: docstrings and config field docs (``doc=``) may mention Slurm."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    prose = {id(node.body[0].value) for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
             and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    prose |= {id(part) for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg == "doc"
              for part in ast.walk(node.value)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose]


def test_only_the_slurm_package_names_slurm():
    """Slurm's variables (``SLURM_*``), ``#SBATCH`` lines and its package stay in hpc/schedulers/slurm/;
    everything else asks the registry by kind (the registry names each kind's module once, in KINDS)."""
    offenders = []
    for path in _outside_the_kinds():
        rel = str(path.relative_to(REPO))
        for line, text in _string_constants(path):
            if "SLURM_" in text or "#SBATCH" in text:
                offenders.append(f"{rel}:{line} {text[:40]!r}")
        if rel in NAMES_SLURM_FOR_ITS_SCRIPT:
            continue
        kinds = {m for m in imports(path) if any(_allowed(m, (f"hpc.schedulers.{k}",)) for k in KIND_PACKAGES)}
        offenders += [f"{rel} imports {m}" for m in sorted(kinds)]
    assert offenders == []


def _family_modules() -> dict[str, set[Path]]:
    """Each model family's own files: its torch-free module (``hpc.core.models.FAMILIES``) and its torch half
    (``Family.builder``)."""
    from hpc.core.models import families

    def path(module: str) -> Path:
        return REPO / (module.replace(".", "/") + ".py")

    return {fam.name: {path(type(fam).__module__), path(fam.builder)} for fam in families()}


def test_no_module_outside_a_family_branches_on_its_name():
    """A model family is one module each side (hpc/core/models/<family>.py, trainer/models/<family>.py): no
    other module compares with ``"gpt"`` or ``"llama"``."""
    offenders = []
    own = _family_modules()
    assert {"gpt", "llama"} <= set(own) and REPO / "trainer/models/llama.py" in own["llama"]
    for path in list((REPO / "hpc").rglob("*.py")) + list((REPO / "trainer").rglob("*.py")):
        names = {name for name, paths in own.items() if path not in paths}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in names
                                                     for c in [node.left, *node.comparators]):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_no_family_imports_another_familys_modules():
    """What the GPT and the Llama share is hpc.core.models.decoder and trainer.models.decoder: the Llama
    imports nothing of the GPT's, nor any family another's."""
    own = _family_modules()
    modules = {name: {module_name(p) for p in paths} for name, paths in own.items()}
    offenders = []
    for name, paths in own.items():
        foreign = set().union(*(m for other, m in modules.items() if other != name))
        for path in paths:
            offenders += [f"{path.relative_to(REPO)} imports {m}" for m in sorted(imports(path) & foreign)]
    assert "trainer.models.gpt" in modules["gpt"] and offenders == []


def test_the_core_spec_names_no_family():
    """``hpc/core/spec.py`` holds the fields every family has: no family's name as a constant (the default
    arch comes from the registry), no field a family declares (``Family.fields``)."""
    import dataclasses

    from hpc.core.models import families

    tree = ast.parse((REPO / "hpc" / "core" / "spec.py").read_text(encoding="utf-8"))
    names = {fam.name for fam in families()}
    constants = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    family_fields = {f.name for fam in families() for f in dataclasses.fields(fam.fields)}
    declared = {item.target.id for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    assert {"n_kv_heads", "kwargs"} <= family_fields and "arch" in declared
    assert not constants & names and not declared & family_fields, (constants & names, declared & family_fields)


def test_schedulers_are_the_only_modules_that_run_slurm_commands():
    """Slurm knowledge lives in hpc/schedulers/slurm/; nothing else calls its commands."""
    commands = ("sbatch", "scancel", "scontrol", "sacct", "squeue", "srun")
    offenders = []
    for path in _outside_the_kinds():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # a command line is an argument list whose first item names the command
            if isinstance(node, (ast.List, ast.Tuple)) and node.elts and isinstance(node.elts[0], ast.Constant) \
                    and node.elts[0].value in commands:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.elts[0].value!r}")
    assert offenders == []


def _identifiers(path: Path) -> list[tuple[int, str]]:
    """Every name the code of ``path`` defines or uses (functions, classes, arguments, variables, attributes)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
    return found


def test_no_code_outside_the_slurm_package_is_named_after_slurm():
    """A function such as ``slurm_path_problem`` in the core is Slurm knowledge in the wrong place: it
    moves to hpc/schedulers/slurm/ and the rest asks the registry (``hpc.schedulers.path_problem``)."""
    offenders = [f"{p.relative_to(REPO)}:{line} {name}" for p in _outside_the_kinds()
                 for line, name in _identifiers(p) if "slurm" in name.lower()]
    assert offenders == []


def _section_fields(module: str) -> set[str]:
    import importlib

    return {f.name for f in __import__("dataclasses").fields(importlib.import_module(module).Section)}


def test_the_core_declares_no_field_of_a_kinds_scheduler_section():
    """The fields only one kind uses (Slurm's partition, account, qos, gpu_directive, sbatch) are declared
    in that kind's package; the core's site profile declares what every kind has. (A spec's
    ``job.partition``/``account``/``qos`` are what a job asks of any batch scheduler, and stay.)"""
    from hpc import schedulers

    kind_fields = set().union(*(_section_fields(f"hpc.schedulers.{k}.section") for k in schedulers.SECTIONED))
    assert {"partition", "gpu_directive", "sbatch"} <= kind_fields
    declared = set()
    for path in [REPO / "hpc" / "core" / "site.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                declared |= {item.target.id for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    assert "kind" in declared and not declared & kind_fields, f"hpc/core/site.py declares {sorted(declared & kind_fields)}"


def _scheduler_reads(path: Path) -> list[tuple[int, str]]:
    """(line, field) of every ``….scheduler.FIELD`` and ``getattr(….scheduler, "FIELD")`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "scheduler":
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "scheduler"
              and isinstance(node.args[1], ast.Constant)):
            found.append((node.lineno, node.args[1].value))
    return found


def test_nothing_outside_a_kind_reads_a_field_of_its_scheduler_section():
    """Slurm's partition, account, qos, gpu_directive and sbatch are read by Slurm's package only: the core
    asks the kind (``Scheduler.placement`` for the launch's partition/account/qos, ``site_problems``,
    ``cpus_allocated``), so a kind without them needs no branch anywhere else."""
    from hpc import schedulers

    kind_fields = set().union(*(_section_fields(f"hpc.schedulers.{k}.section") for k in schedulers.SECTIONED))
    offenders = [f"{p.relative_to(REPO)}:{line} scheduler.{name}" for p in _outside_the_kinds()
                 for line, name in _scheduler_reads(p) if name in kind_fields]
    assert offenders == []


def test_the_scheduler_field_check_sees_a_read(tmp_path):
    """The check above finds both spellings (it would pass on any tree if it found neither)."""
    source = tmp_path / "m.py"
    source.write_text("a = site.scheduler.partition\nb = getattr(site.scheduler, 'qos')\nc = site.scheduler.kind\n")
    assert _scheduler_reads(source) == [(1, "partition"), (2, "qos"), (3, "kind")]


# the one module that may reach into another package's private names: torch's and submitit's (tests/test_compat.py
# checks each by name)
COMPAT = "hpc/compat.py"


def private_imports(path: Path) -> list[str]:
    """Each ``from M import _name`` / ``import M._name`` in ``path`` where M is another module (a name of
    the module's own package's ``__init__`` counts as another module's too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [f"{path.relative_to(REPO)}:{node.lineno} from {'.' * node.level}{node.module or ''} import "
                      f"{a.name}" for a in node.names if a.name.startswith("_") and not a.name.endswith("__")]
        elif isinstance(node, ast.Import):
            found += [f"{path.relative_to(REPO)}:{node.lineno} import {a.name}" for a in node.names
                      if any(part.startswith("_") and not part.startswith("__") for part in a.name.split("."))]
    return found


def _submitit_private_names() -> set[str]:
    """The private attributes of submitit's executors (what an override would have to name)."""
    import submitit

    classes = (submitit.SlurmExecutor, submitit.LocalExecutor, submitit.helpers.DelayedSubmission)
    return {name for cls in classes for name in dir(cls) if name.startswith("_") and not name.startswith("__")}


def test_no_module_imports_another_modules_private_name():
    """A helper two modules share is public where it lives (the PEFT writer calls the HF writer's
    ``write_shard``, not ``_write_shard``); only hpc/compat.py reaches into torch's and submitit's."""
    offenders = [hit for path in sorted((REPO / "hpc").rglob("*.py")) + sorted((REPO / "trainer").rglob("*.py"))
                 if str(path.relative_to(REPO)) != COMPAT for hit in private_imports(path)]
    assert offenders == []


def test_only_the_compat_module_names_submitits_private_hooks():
    """``_submitit_command_str`` and ``_submit_command`` are overridden in ``hpc.compat.ExecutorHooks`` only;
    the executors override its public ``task_command_text`` and ``submitting``."""
    private = _submitit_private_names()
    assert {"_submitit_command_str", "_submit_command"} <= private
    offenders = [f"{p.relative_to(REPO)}:{line} {name}" for p in _outside_compat() for line, name in _identifiers(p)
                 if name in private]
    assert offenders == []
    compat_names = {name for _, name in _identifiers(REPO / COMPAT)}
    assert {"_submitit_command_str", "_submit_command"} <= compat_names


def _outside_compat() -> list[Path]:
    return [p for p in sorted((REPO / "hpc").rglob("*.py")) + sorted((REPO / "trainer").rglob("*.py"))
            if str(p.relative_to(REPO)) != COMPAT]


def test_the_private_import_check_sees_each_spelling(tmp_path):
    """The check above finds a private name imported absolutely, relatively and as a module (it would pass
    on any tree if it found none)."""
    source = tmp_path / "m.py"
    source.write_text("from a.b import _x, y\nfrom . import _z\nimport a._c\nimport a.__d\nfrom __future__ import "
                      "annotations\n")
    source = source.rename(REPO / "tests" / f"_probe_{os.getpid()}.py")
    try:
        found = [hit.split(" ", 1)[1] for hit in private_imports(source)]
    finally:
        source.unlink()
    assert found == ["from a.b import _x", "from . import _z", "import a._c"]


# ------------------------------------------------------------------------------------------- import cycles


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: at module level and inside functions, not under
    ``if TYPE_CHECKING:`` (its ``else`` runs, and counts)."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack += child.orelse
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            else:
                stack.append(child)
    return found


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing ``name`` loads (``hpc.core.spec.JobSpec``: ``hpc.core.spec``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ``modules`` it imports (``from a import b`` is ``a.b`` where that is a module)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif node.module and node.level == 0:
                wanted = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            graph[name] |= {t for t in (_target(w, modules) for w in wanted) if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, without recursion), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, todo = work[-1]
            child = next((c for c in todo if c not in index or c in stack), None)
            if child is not None and child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(graph[child]))))
                continue
            if child is not None:  # on the stack: a way back
                low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = stack[stack.index(node):]
                del stack[stack.index(node):]
                if len(part) > 1:
                    found.append(sorted(part))
    return sorted(found)


def _ours() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((REPO / "hpc").rglob("*.py")) + sorted((REPO / "trainer").rglob("*.py"))}


def test_no_import_cycles_among_hpc_and_trainer_modules():
    """No module imports, at module level or inside a function, one that imports it back (directly or through
    others): a shared piece lives in a module below both (issue 41). ``if TYPE_CHECKING:`` imports never run."""
    graph = import_graph(_ours())
    assert sum(map(len, graph.values())) > 500 and "hpc.core.spec" in graph["hpc.core.resolve"]
    found = cycles(graph)
    assert found == [], "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_sees_a_cycle_through_a_function_local_import(tmp_path):
    """A loop closed by an import inside a function is found, one only under TYPE_CHECKING is not, and a
    module importing a name of another (``from p.b import x``) depends on that module."""
    files = {"p.a": "from p.b import x\n",
             "p.b": "import typing as tp\nif tp.TYPE_CHECKING:\n    import p.c\ndef f():\n    import p.a\nx = 1\n",
             "p.c": "from p import b\n", "p": ""}
    modules = {}
    for name, text in files.items():
        modules[name] = tmp_path / f"{name}.py"
        modules[name].write_text(text)
    graph = import_graph(modules)
    assert graph["p.c"] == {"p.b"} and graph["p.b"] == {"p.a"}
    assert cycles(graph) == [["p.a", "p.b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": set()}) == [
        ["a", "b", "c"], ["d", "e"]]


# ------------------------------------------------------------------------------- imports inside functions

# libraries an import inside a function may keep off a path that does not need them (`# lazy: torch`), and
# the start-ups that import as little as they can (`# lazy: startup`: `hpcx status`'s fast path, a spec's load;
# `# lazy: boot`: what ``hpc.core.imports.BOOT`` runs before a task holds its signals)
HEAVY = ("torch", "torchao", "submitit", "matplotlib", "numpy", "tokenizers", "transformers", "peft", "safetensors",
         "jinja2", "click", "pyarrow", "zstandard")
START_UPS = ("startup", "boot")
# imports inside functions in hpc/ and trainer/ with no `# lazy:` reason (issue 41: this number only goes down;
# each one left is hoisted to the module's top, or says which library or start-up it keeps light)
UNREASONED_AT_MOST = 7


def _split_imports(tree: ast.AST) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(module-level imports, imports inside functions) that can run (not under ``if TYPE_CHECKING:``)."""
    top: list[ast.stmt] = []
    inner: list[ast.stmt] = []
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, local = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                stack += [(c, local) for c in child.orelse]
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if local else top).append(child)
            else:
                stack.append((child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))))
    return top, inner


def _wanted(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    assert isinstance(node, ast.ImportFrom)
    return [f"{node.module}.{a.name}" for a in node.names] + [node.module] if node.module and node.level == 0 else []


def _reached(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> what importing it loads (its module-level imports, theirs, and its packages'): the modules of
    ours, and the top-level names of the libraries."""
    direct: dict[str, set[str]] = {}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        top, _ = _split_imports(ast.parse(path.read_text(encoding="utf-8")))
        wanted = [w for node in top for w in _wanted(node)]
        direct[name] = {w.split(".")[0] for w in wanted}  # the libraries (HEAVY among them)
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        edges[name] = ({t for t in (_target(w, modules) for w in wanted) if t} | (parents & set(modules))) - {name}
    reached = {}
    for name in modules:
        seen, todo = set(), [name]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += edges[m]
        reached[name] = seen | set().union(*(direct[m] for m in seen))
    return reached


def _local_imports() -> list[tuple[str, int, str, set[str], set[str]]]:
    """(file, line, its `# lazy:` reason or "", what it loads, what its module loads already: ``_reached``) of
    each import inside a function in hpc/ and trainer/."""
    modules = _ours()
    reached = _reached(modules)
    found = []
    for name, path in modules.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        _, inner = _split_imports(ast.parse("\n".join(lines)))
        for node in inner:
            text = lines[node.lineno - 1]
            reason = text.split("# lazy:", 1)[1].split()[0] if "# lazy:" in text else ""
            loads = {w.split(".")[0] for w in _wanted(node)}
            loads |= set().union(*(reached[t] for t in (_target(w, modules) for w in _wanted(node)) if t))
            loads |= {t for t in (_target(w, modules) for w in _wanted(node)) if t}
            found.append((str(path.relative_to(REPO)), node.lineno, reason, loads, reached[name]))
    return found


def test_each_lazy_import_keeps_off_what_its_reason_names():
    """``# lazy: torch`` on an import inside a function is true: the import loads torch and the module's own
    imports do not already (else it belongs at the top); ``# lazy: startup`` (or ``boot``) loads some module
    its module's own imports do not."""
    wrong = [f"{f}:{line} lazy: {reason}" for f, line, reason, loads, own in _local_imports() if reason and not (
        (reason in START_UPS and loads - own) or (reason in HEAVY and reason in loads - own))]
    assert wrong == []


def test_imports_inside_functions_without_a_reason_do_not_grow():
    """Issue 41: an import inside a function is there to keep a heavy library (or a start-up) light, and says
    so. The ones from before that rule are counted; a new one without a reason fails here."""
    found = _local_imports()
    reasons = {reason for _, _, reason, _, _ in found}
    assert {"torch", "startup", "boot"} <= reasons
    unreasoned = [f"{f}:{line}" for f, line, reason, _, _ in found if not reason]
    assert len(unreasoned) <= UNREASONED_AT_MOST, \
        f"{len(unreasoned)} imports inside functions without a `# lazy:` reason (at most {UNREASONED_AT_MOST})"
