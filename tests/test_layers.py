"""The direction of imports drawn in docs/design.md: checked on the source, every import statement
(module level and inside functions), so a new dependency that breaks the layering fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# importer module -> trainer modules it may import (hpc/ never imports the trainer otherwise)
TRAINER_ALLOWED = {"hpc.submit": {"trainer.task"},
                   # `hpcx dryrun` runs the trainer's own construction (it imports torch, unlike render/plan)
                   "hpc.dryrun": {"trainer.model", "trainer.optim", "trainer.train", "trainer.parallelize",
                                  "trainer.checkpoint", "trainer.init_from"},
                   # `hpcx plan --count-params` builds a user model on the meta device to count it
                   "hpc.plan_cli": {"trainer.count"}}
# modules that import nothing else from hpc (the bottom of the graph)
LEAVES = ("hpc.errors", "hpc.dims")
# `hpcx site detect` reads `scontrol show node` of the node it runs on to draft a profile
DRAFTING_A_SITE = ("detect.py", "plan_cli.py")


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


def test_schedulers_are_the_only_modules_that_run_slurm_commands():
    """Slurm knowledge lives in hpc/schedulers/slurm.py; nothing else calls its commands."""
    commands = ("sbatch", "scancel", "scontrol", "sacct", "squeue", "srun")
    offenders = []
    for path in list((REPO / "hpc").rglob("*.py")) + list((REPO / "trainer").rglob("*.py")):
        if path.parent.name == "schedulers" or path.name in DRAFTING_A_SITE:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # a command line is an argument list whose first item names the command
            if isinstance(node, (ast.List, ast.Tuple)) and node.elts and isinstance(node.elts[0], ast.Constant) \
                    and node.elts[0].value in commands:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.elts[0].value!r}")
    assert offenders == []
