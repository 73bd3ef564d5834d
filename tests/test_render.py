"""Golden files for `hpcx render`: every example job × every shipped site.

Refresh after an intended change with:

    HPCX_UPDATE_GOLDENS=1 python -m pytest tests/test_render.py

then read the diff (`git diff tests/goldens`) before committing it.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from hpc.config import ConfigError
from hpc.render import render, render_summary
from hpc.schedulers.slurm import slurm_parameters
from hpc.resolve import resolve
from hpc.site import list_sites, load_site
from hpc.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
GOLDENS = Path(__file__).parent / "goldens"
JOBS = sorted((REPO / "jobs").glob("*.toml"))
RUN_DIR = "/hpcx-runs/RUN"
PYTHON = "/venv/bin/python"


def rendered(job: Path, site_name: str) -> str:
    spec = load_spec(job)
    site = load_site(site_name)
    try:
        launch = resolve(spec, site)
    except ConfigError as exc:
        return "".join(f"error: {m.replace(str(job), 'jobs/' + job.name)}\n" for m in exc.messages)
    return render_summary(spec, site, launch) + "\n" + render(spec, site, launch, RUN_DIR, PYTHON)


@pytest.mark.parametrize("site_name", list_sites())
@pytest.mark.parametrize("job", JOBS, ids=lambda p: p.stem)
def test_golden(job: Path, site_name: str):
    golden = GOLDENS / f"{job.stem}__{site_name}.txt"
    text = rendered(job, site_name)
    if os.environ.get("HPCX_UPDATE_GOLDENS"):
        golden.write_text(text)
    assert golden.exists(), f"missing golden {golden}: run HPCX_UPDATE_GOLDENS=1 pytest {__file__}"
    assert text == golden.read_text(), f"render changed; if intended: HPCX_UPDATE_GOLDENS=1 pytest {__file__}"


def test_no_stale_goldens():
    expected = {f"{j.stem}__{s}.txt" for j in JOBS for s in list_sites()}
    assert {p.name for p in GOLDENS.glob("*.txt")} == expected


def test_render_is_pure():
    job = REPO / "jobs/tiny-hsdp-2node.toml"
    assert rendered(job, "sandbox") == rendered(job, "sandbox")


def test_hostile_values_are_quoted(tmp_path: Path):
    nasty = "a b'$(touch /tmp/pwned)`id`\"; rm -rf ~"
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml", [f"job.name={nasty}", f"env.set.MY_VAR={nasty}"])
    assert spec.job.name == nasty and spec.env.set["MY_VAR"] == nasty
    site = load_site("sandbox")
    script = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    assert f"#SBATCH --job-name={shlex.quote(nasty)}" in script
    assert f"export MY_VAR={shlex.quote(nasty)}" in script
    # every line bash executes parses back to the same words: nothing runs
    for line in script.splitlines():
        if line.startswith("export MY_VAR="):
            assert shlex.split(line) == ["export", f"MY_VAR={nasty}"]


def test_secrets_never_rendered(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret")
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml", ['env.passthrough=["HF_TOKEN"]'])
    site = load_site("sandbox")
    script = render(spec, site, resolve(spec, site), RUN_DIR, PYTHON)
    assert "HF_TOKEN" in script and "hf_supersecret" not in script


def test_gpu_directives():
    spec = load_spec(REPO / "jobs/gpt-1.3b-fsdp.toml")
    for site_name, key, value in (("dgx-h100", "gpus_per_node", 8), ("pcie-4gpu", "gres", "gpu:4")):
        site = load_site(site_name)
        params = slurm_parameters(spec, site, resolve(spec, site))
        assert params[key] == value
