"""Issue 29: hpcx's own `hpc` and `trainer`, whatever the submit folder holds (`hpc.core.imports`), and a
foreign `trainer` or `hpc` (another distribution's, a folder on PYTHONPATH) refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.core import failures, imports
from tests.conftest import REPO

HPCX = Path(sys.executable).parent / "hpcx"  # the console script a user runs (not `python -m hpc.cli`)
JOB = str(REPO / "jobs/tiny-ddp.toml")
USER_MODEL = '''
import os
from pathlib import Path


def build(**_):
    from hpc.core.models.gpt import gpt_shape
    from trainer.models.gpt import GPT

    with open(Path(__file__).resolve().parents[1] / "built.txt", "a") as f:
        f.write(f"{os.getpid()}\\n")
    return GPT(gpt_shape("tiny"))
'''


def shadowing_folder(folder: Path) -> Path:
    """A submit folder with `trainer.py`, `trainer/`, `hpc/` that raise on import, a user model package
    `mypkg` (it writes built.txt when built) and its job spec; returns the spec."""
    for name in ("trainer.py", "trainer/__init__.py", "hpc/__init__.py"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"raise RuntimeError('the submit folder\\'s {name} was imported')\n")
    (folder / "mypkg").mkdir()
    (folder / "mypkg/__init__.py").write_text("")
    (folder / "mypkg/mod.py").write_text(USER_MODEL)
    spec = folder / "job.toml"
    spec.write_text((REPO / "jobs/tiny-ddp.toml").read_text().replace('arch = "gpt"\nsize = "tiny"',
                                                                        'arch = "mypkg.mod:build"\nseq_len = 64\n'
                                                                        'vocab_size = 256'))
    assert "mypkg.mod:build" in spec.read_text()
    return spec


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def test_this_checkout_is_its_own():
    assert imports.problem() is None


def test_a_job_from_a_folder_that_shadows_hpcx_trains_and_imports_its_user_model(tmp_path: Path):
    spec = shadowing_folder(tmp_path / "here")
    out = subprocess.run([str(HPCX), "submit", str(spec.name), "--set", f"job.run_root={json.dumps(str(tmp_path))}",
                          "--set", "train.steps=3", "--wait"], capture_output=True, text=True, timeout=600,
                         cwd=spec.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert any(line.startswith("result: 3 steps") for line in out.stdout.splitlines()), out.stdout
    assert len((spec.parent / "built.txt").read_text().split()) == 2  # both ranks built the user's model


def test_the_task_command_ignores_the_current_folder(tmp_path: Path):
    """Each process hpcx starts is `python -c BOOT MODULE`: the check after srun's usage line, from a folder
    whose `hpc` raises."""
    shadowing_folder(tmp_path)
    out = subprocess.run(imports.python_command(sys.executable, "hpc.requeue"), capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and one_line(out.stderr).startswith("usage: python -m hpc.requeue"), out.stderr


def test_a_user_model_comes_after_hpcx_on_the_path(tmp_path: Path):
    shadowing_folder(tmp_path / "here")
    (tmp_path / "bin").mkdir()  # a script's own folder is sys.path[0], as for the hpcx console script
    (tmp_path / "bin/probe.py").write_text(
        "import os, sys\nfrom trainer.models.user import _user_function\nf = _user_function('mypkg.mod:build')\n"
        "print(f.__module__, sys.path.index(os.getcwd()) == len(sys.path) - 1)\n")
    out = subprocess.run([sys.executable, str(tmp_path / "bin/probe.py")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path / "here")
    assert out.returncode == 0 and out.stdout.split() == ["mypkg.mod", "True"], out.stderr


def foreign_trainer(folder: Path) -> Path:
    (folder / "trainer").mkdir(parents=True)
    (folder / "trainer/__init__.py").write_text("raise RuntimeError('imported the foreign trainer')\n")
    return folder / "trainer"


def test_submit_refuses_a_trainer_on_pythonpath_in_one_line(tmp_path: Path):
    foreign = foreign_trainer(tmp_path / "elsewhere")
    (tmp_path / "cwd").mkdir()
    env = {**os.environ, "PYTHONPATH": str(foreign.parent)}
    out = subprocess.run([str(HPCX), "submit", JOB, "--set", f"job.run_root={json.dumps(str(tmp_path))}"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path / "cwd")
    line = one_line(out.stderr)
    assert out.returncode == 2 and str(foreign) in line and str(REPO / "trainer") in line, out.stderr
    assert "PYTHONPATH" in line and "imported the foreign trainer" not in line
    assert not list(tmp_path.glob("tiny-ddp*")), "nothing was submitted"


def test_the_first_task_refuses_a_trainer_on_pythonpath_in_one_line(tmp_path: Path):
    foreign = foreign_trainer(tmp_path / "elsewhere")
    env = {**os.environ, "PYTHONPATH": str(foreign.parent)}
    out = subprocess.run(imports.python_command(sys.executable, "trainer.entry", str(tmp_path / "submitit")),
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    line = one_line(out.stderr)
    assert out.returncode == 2 and str(foreign) in line and str(REPO / "trainer") in line, out.stderr
    found = failures.loading_failure(out.stderr)  # a restart would repeat it: told as a loading failure
    assert found is not None and found["module"] == "trainer" and str(foreign) in found["error"]


def fake_wheel(site: Path, files: dict[str, str]) -> Path:
    """A site-packages folder holding hpcx as a wheel installs it: its packages and RECORD."""
    record = []
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)
        record.append(f"{path},sha256=x,{len(text.encode())}")
    info = site / "hpcx-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hpcx\nVersion: 0.1.0\n")
    (info / "RECORD").write_text("\n".join(record + ["hpcx-0.1.0.dist-info/RECORD,,"]) + "\n")
    return site


HPCX_FILES = {"hpc/__init__.py": "'''hpcx'''\n", "hpc/core/__init__.py": "", "trainer/__init__.py": "'''trainer'''\n",
              "trainer/entry.py": "", "trainer/models/__init__.py": ""}


def test_a_wheel_install_of_its_own_passes(tmp_path: Path):
    site = fake_wheel(tmp_path, HPCX_FILES)
    assert imports.problem([str(site)], str(site / "hpc")) is None


def test_a_second_distribution_with_files_in_trainer_is_named(tmp_path: Path):
    """Another distribution installed its `trainer` into the same site-packages (ours won the __init__)."""
    site = fake_wheel(tmp_path, HPCX_FILES)
    (site / "trainer/fit.py").write_text("")
    other = site / "trainer-1.2.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: trainer\nVersion: 1.2\n")
    (other / "RECORD").write_text("trainer/__init__.py,sha256=y,3\ntrainer/fit.py,sha256=z,0\n")
    line = imports.problem([str(site)], str(site / "hpc"))
    assert line is not None and "\n" not in line
    assert str(site / "trainer/fit.py") in line and "distribution trainer 1.2" in line


def test_an_overwritten_init_is_named(tmp_path: Path):
    site = fake_wheel(tmp_path, HPCX_FILES)
    (site / "trainer/__init__.py").write_text("from .fit import Trainer  # another package's\n")
    line = imports.problem([str(site)], str(site / "hpc"))
    assert line is not None and str(site / "trainer/__init__.py") in line and "overwritten" in line


def test_a_foreign_trainer_before_the_wheel_on_the_path_is_named(tmp_path: Path):
    site = fake_wheel(tmp_path / "site", HPCX_FILES)
    foreign = foreign_trainer(tmp_path / "first")
    line = imports.problem([str(foreign.parent), str(site)], str(site / "hpc"))
    assert line is not None and str(foreign) in line and str(site / "trainer") in line


def test_an_hpc_of_another_checkout_is_named(tmp_path: Path):
    site = fake_wheel(tmp_path, HPCX_FILES)
    (tmp_path / "other/hpc").mkdir(parents=True)
    line = imports.problem([str(site)], str(tmp_path / "other/hpc"))
    assert line is not None and line.startswith("`hpc` resolves to") and str(site / "hpc") in line


@pytest.mark.parametrize("editable,expected", [(True, "/src/my proj"), (False, None)])
def test_an_editable_install_is_its_project_folder(tmp_path: Path, editable: bool, expected: str | None):
    (tmp_path / "direct_url.json").write_text(json.dumps({"url": "file:///src/my%20proj",
                                                          "dir_info": {"editable": editable}}))
    assert imports._editable_root(str(tmp_path)) == expected


def test_an_editable_install_is_where_its_finder_maps_it(tmp_path: Path, monkeypatch):
    """setuptools' editable finder (imported at start-up) says where `hpc` and `trainer` are; a `trainer`
    found on the path before it is named."""
    import types

    info = tmp_path / "site/hpcx-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "RECORD").write_text("__editable__.hpcx-0.1.0.pth,sha256=x,79\n")
    project = tmp_path / "project"
    monkeypatch.setitem(sys.modules, "__editable___hpcx_0_1_0_finder", types.SimpleNamespace(
        MAPPING={"hpc": str(project / "hpc"), "trainer": str(project / "trainer")}))
    (project / "trainer").mkdir(parents=True)
    (project / "trainer/__init__.py").write_text("")
    assert imports.problem([str(tmp_path / "site"), str(project)], str(project / "hpc")) is None
    foreign = foreign_trainer(tmp_path / "first")
    line = imports.problem([str(foreign.parent), str(tmp_path / "site"), str(project)], str(project / "hpc"))
    assert line is not None and str(foreign) in line and str(project / "trainer") in line


@pytest.mark.slow
def test_torchrun_of_hpcx_rank_from_a_folder_that_shadows_hpcx(tmp_path: Path):
    """`torchrun --no-python hpcx-rank RUN` (README's launch) with the user's model from the current folder."""
    from tests.trainer.trainer_testlib import child_env, make_run

    here = tmp_path / "here"
    shadowing_folder(here)
    run_dir = make_run(tmp_path, "run", "ddp", 2, ["train.steps=2", "model.arch='mypkg.mod:build'",
                                                   "model.seq_len=64", "model.vocab_size=256"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "--no-python",
           str(HPCX.parent / "hpcx-rank"), str(run_dir)]
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300, cwd=here)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == 2
    assert len((here / "built.txt").read_text().split()) == 2
