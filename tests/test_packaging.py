"""What a user's install has: bundled site profiles in a wheel, the site search path, and a clone
that needs nothing beside it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO, hpcx

BUNDLED = {"local", "sandbox", "sandbox-oci", "dgx-h100", "pcie-4gpu"}


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> Path:
    """A fresh venv with hpcx installed from a wheel (not editable); its dependencies are borrowed
    from the test venv through a .pth line, so nothing is downloaded."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"  # a copy: building in the checkout would leave build/ there, and reuse a stale one
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                               "__pycache__", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    wheel = next((root / "dist").glob("hpcx-*.whl"))
    install = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    site_packages = Path(subprocess.check_output([str(venv / "bin/python"), "-c",
                                                  "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                                 text=True).strip())
    (site_packages / "borrowed-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return venv


def test_wheel_lists_its_bundled_sites_from_the_root_directory(wheel_venv: Path, tmp_path: Path):
    out = subprocess.run([str(wheel_venv / "bin/hpcx"), "site", "list", "--json"], capture_output=True, text=True,
                         cwd="/", timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert BUNDLED <= set(rows)
    for name in BUNDLED:
        assert rows[name]["origin"] == "bundled" and rows[name]["error"] is None
        assert rows[name]["path"].startswith(str(wheel_venv)), rows[name]["path"]  # not this checkout's site/


def test_wheel_renders_a_job_against_a_bundled_site(wheel_venv: Path, tmp_path: Path):
    out = subprocess.run([str(wheel_venv / "bin/hpcx"), "render", str(REPO / "jobs/tiny-hsdp-2node.toml"),
                          "--site", "dgx-h100"], capture_output=True, text=True, cwd="/", timeout=60,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --gpus-per-node=2" in out.stdout and "#SBATCH --partition=gpu" in out.stdout  # dgx-h100's


def _profile(folder: Path, name: str, partition: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.toml").write_text(f'[scheduler]\nkind = "slurm"\npartition = "{partition}"\n')


def test_search_path_order_and_origin(tmp_path: Path):
    env_dir, home = tmp_path / "env", tmp_path / "home"
    _profile(env_dir, "mine", "from-env")
    _profile(home / ".config/hpcx/sites", "mine", "from-user")  # shadowed by $HPCX_SITE_PATH
    _profile(home / ".config/hpcx/sites", "sandbox", "user-sandbox")  # shadows the bundled one
    env = {"HPCX_SITE_PATH": f"{env_dir}:{tmp_path / 'missing'}", "HOME": str(home)}
    rows = {r["name"]: r for r in json.loads(hpcx("site", "list", "--json", env=env).stdout)}
    assert rows["mine"]["origin"] == "$HPCX_SITE_PATH" and rows["mine"]["path"] == str(env_dir / "mine.toml")
    assert rows["sandbox"]["origin"] == "user"
    assert rows["dgx-h100"]["origin"] == "bundled"
    shown = json.loads(hpcx("site", "show", "mine", "--json", env=env).stdout)
    assert shown["scheduler"]["partition"] == "from-env"
    text = hpcx("site", "list", env=env).stdout
    assert f"[user: {home / '.config/hpcx/sites/sandbox.toml'}]" in text


def test_unknown_site_names_the_search_path(tmp_path: Path):
    out = hpcx("site", "show", "nowhere", env={"HPCX_SITE_PATH": str(tmp_path), "HOME": str(tmp_path)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and str(tmp_path) in out.stderr and "bundled" not in out.stderr


def test_a_broken_profile_is_listed_and_its_runs_stay_visible(tmp_path: Path):
    sites, root = tmp_path / "sites", tmp_path / "runs"
    sites.mkdir()
    (sites / "broken.toml").write_text(f'[storage]\nrun_root = "{root}"\n[node]\ngpus = "eight"\n')
    run = root / "old-20260101-000000-abcdef"
    run.mkdir(parents=True)
    (run / "resolved.json").write_text(json.dumps({"version": 1, "launch": {}}))
    (run / "job.json").write_text(json.dumps({"job_id": "999999", "scheduler": "slurm"}))
    (run / "states.jsonl").write_text(json.dumps({"state": "COMPLETED"}) + "\n")
    env = {"HPCX_SITE_PATH": str(sites), "HOME": str(tmp_path)}
    listed = hpcx("site", "list", env=env)
    assert listed.returncode == 0 and "broken" in listed.stdout and "does not load" in listed.stdout
    status = hpcx("status", env=env)
    assert status.returncode == 0
    assert run.name in status.stdout
    assert "site profile" in status.stderr and "broken.toml" in status.stderr and str(root) in status.stderr


def test_repository_reads_nothing_beside_itself():
    """A user's clone has only the repository: nothing may read the workspace folder beside it."""
    out = subprocess.run(["git", "grep", "-nE", r"\.\./shared|parents\[2\] / .shared", "--", "hpc", "trainer", "tests",
                          "bench", "scripts", ".ci"], cwd=REPO, capture_output=True, text=True)
    assert out.stdout == "", out.stdout


def test_wheel_carries_every_package_of_the_checkout(wheel_venv: Path):
    """Packages are found (setup.py), not listed: a new subpackage ships without a line in pyproject.toml."""
    purelib = Path(subprocess.check_output([str(wheel_venv / "bin/python"), "-c",
                                            "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                           text=True).strip())
    found = {p.relative_to(REPO) for top in ("hpc", "trainer") for p in (REPO / top).rglob("__init__.py")}
    assert len(found) > 10 and {Path("hpc/__init__.py"), Path("trainer/models/__init__.py")} <= found
    assert [str(p) for p in sorted(found) if not (purelib / p).is_file()] == []
    shipped = sorted(p.name for p in (purelib / "hpc/_sites").glob("*.toml"))
    assert shipped == sorted(p.name for p in (REPO / "site").glob("*.toml")) and len(shipped) >= len(BUNDLED)


def module_level_imports(path: Path) -> set[str]:
    """Top-level package names imported at module level (not inside functions: those are lazy)."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_level_import_is_a_declared_dependency():
    """A clean `pip install .` can start the trainer and the CLI: what hpc/ and trainer/ import at module
    level is the standard library, hpcx itself, or in [project] dependencies (numpy was only in `test`)."""
    import importlib.metadata
    import re

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    declared = {re.split(r"[<>=!~;\[ ]", d, 1)[0].lower()
                for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    providers = importlib.metadata.packages_distributions()
    missing = {}
    for path in [*REPO.glob("hpc/**/*.py"), *REPO.glob("trainer/*.py")]:
        for name in module_level_imports(path) - set(sys.stdlib_module_names) - {"hpc", "trainer", "__future__"}:
            dists = {d.lower() for d in providers.get(name, [name])}
            if not dists & declared:
                missing.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not missing, f"imported at module level but not in [project] dependencies: {missing}"
    assert "numpy" in declared and "submitit" in declared


def test_bundled_gpu_sites_never_pin_one_interface_name():
    """NCCL_SOCKET_IFNAME=eth0 fails bootstrap on hosts whose Ethernet is ens*/enp*: bundled profiles
    exclude (^lo,docker) instead of naming an interface."""
    from hpc.core.site import load_site

    for name in BUNDLED:
        value = load_site(name).nccl.get("NCCL_SOCKET_IFNAME")
        assert value is None or value.startswith("^"), f"{name}: NCCL_SOCKET_IFNAME={value!r}"


def test_license_is_an_spdx_expression_setuptools_takes_without_a_warning(monkeypatch):
    """`license = "Apache-2.0"` (PEP 639; setuptools >= 77): the table form warns on every install
    that such builds stop working in 2027."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    from hpc.core.config import tomllib

    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert doc["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in doc["build-system"]["requires"]
    monkeypatch.chdir(REPO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), "pyproject.toml")
    assert [str(w.message) for w in caught] == []
    assert dist.metadata.license_expression == "Apache-2.0"


def test_a_wheel_install_knows_its_own_trainer_and_names_a_foreign_file(wheel_venv: Path, tmp_path: Path):
    """hpc.core.imports on a real wheel install: its RECORD lists every entry of `hpc/` and `trainer/`, so a
    file another distribution put into `trainer/` is named (issue 29)."""
    python = str(wheel_venv / "bin/python")
    probe = ["-c", "import hpc.core.imports as i; print(i.problem())"]
    out = subprocess.run([python, *probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.stdout.strip() == "None", out.stderr
    trainer = Path(subprocess.check_output([python, "-c", "import trainer; print(trainer.__file__)"], text=True,
                                           cwd=tmp_path).strip()).parent
    assert trainer.parent.name == "site-packages"
    foreign = trainer / "fit.py"
    foreign.write_text("")
    try:
        out = subprocess.run([python, *probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        foreign.unlink()
    assert str(foreign) in out.stdout and "hpcx did not install" in out.stdout, out.stdout + out.stderr


def test_the_checkout_tracks_no_link_out_of_itself_and_no_virtual_environment():
    """A clone is all a user has: a tracked symlink to a folder of this machine (a worktree's `.venv` once
    reached main that way, and `scripts/install` then found a dangling `.venv`) or a tracked environment
    breaks it. `.gitignore`'s `.venv` (no slash) also ignores a `.venv` that is a link."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-s"], capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    outside = [p for p in links if not (REPO / p).resolve().is_relative_to(REPO.resolve())]
    tracked = [line.split("\t", 1)[1] for line in listed.stdout.splitlines()]
    assert outside == [] and not [p for p in tracked if p.split("/")[0] in (".venv", "venv")], outside
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", ".venv"])
    assert ignored.returncode == 0  # a file or a link named .venv, not only a folder
