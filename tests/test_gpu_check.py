"""``bench/gpu_check/run.py`` runs from a bare checkout, as on the lent GPU machine (torch, numpy; no hpcx
install, no submitit, no pytest), ends inside its budget and leaves nothing behind.

Why a fresh venv: ``python -I`` drops the working directory and ``PYTHONPATH`` but keeps the project venv's
site-packages, which hold the editable hpcx finder and submitit, so ``import hpc`` would still work; a venv
made with ``--system-site-packages`` sees the base interpreter's packages, not the project venv's (no
torch there, or another one). So the test makes an empty venv and links into it only the distributions
torch and numpy need (their ``requires`` closure, extras left out), nothing else.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import REPO

CHECK = REPO / "bench" / "gpu_check" / "run.py"
CUDA_ABSENT = "CUDA absent: torch.cuda.is_available() is False; running the CPU-possible parts only"
MACHINE = ("torch", "numpy")  # what the lent machine has besides the standard library (tensorboard is optional)


def closure(names: tuple[str, ...]) -> set[str]:
    """The distributions ``names`` need, transitively (extras left out)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for spec in metadata.distribution(name).requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def link_distribution(name: str, site: Path) -> None:
    """Symlink a distribution's top-level packages, modules and metadata into ``site`` (no .pth files)."""
    dist = metadata.distribution(name)
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in sorted(tops - {"__pycache__"}):
        source = Path(dist.locate_file(top))
        if top.endswith(".pth") or not source.exists() or (site / top).exists():
            continue
        (site / top).symlink_to(source)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A fresh venv holding torch and numpy (linked from this one) and nothing of hpcx."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    for name in closure(MACHINE):
        link_distribution(name, site)
    return venv / "bin" / "python"


def bare_env(tmp: Path) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", str(tmp)),
            "TMPDIR": str(tmp), "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_the_bare_venv_has_torch_and_nothing_of_the_project(bare_python, tmp_path):
    probe = ("import importlib.util as u, torch; "
             "print([m for m in ('hpc', 'trainer', 'submitit', 'pytest') if u.find_spec(m)], torch.__version__)")
    out = subprocess.run([str(bare_python), "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env=bare_env(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "[]"


def checkout_files() -> set[Path]:
    skip = {".git", ".venv", ".gpu_check_deps"}
    return {p for p in REPO.rglob("*") if not skip & set(p.relative_to(REPO).parts)}


def test_the_check_runs_from_a_bare_checkout_and_leaves_nothing(bare_python, tmp_path):
    scratch, cwd = tmp_path / "tmp", tmp_path / "cwd"
    scratch.mkdir()
    cwd.mkdir()
    before = checkout_files()
    # the two short CPU parts, a GPU part, and a budget they cannot outrun on a loaded machine (60 s for
    # all the parts left each one "stopped at the budget's end" at load 15)
    out = subprocess.run([str(bare_python), str(CHECK), "--budget-s", "400", "--only", "staging,strategies,offload"],
                         capture_output=True, text=True, cwd=cwd, env=bare_env(scratch), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == CUDA_ABSENT and sum("CUDA absent" in line for line in lines) == 1
    assert "FAILED" not in out.stdout and "MISSED" not in out.stdout, out.stdout
    rows = {line.split()[0] for line in lines[3:] if line.split() and line.split()[-1] == "ok" or " ok " in line}
    assert {"staging", "strategies"} <= rows, out.stdout  # both CPU parts ran
    assert "needs CUDA" in out.stdout and "unchecked" in out.stdout
    assert list(scratch.iterdir()) == [] and list(cwd.iterdir()) == []
    assert checkout_files() == before  # no bytecode, caches or run folders in the checkout


def load_check():
    """bench/gpu_check/run.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_run", CHECK)
    check = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = check  # its dataclasses look their module up
    spec.loader.exec_module(check)
    return check


def gone(pid: int, wait_s: float = 60) -> bool:
    """No such process, or only its zombie is left (killed, not yet reaped by init), within ``wait_s``
    (SIGKILL is delivered asynchronously)."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("max_s,status,says", [
    (3, "FAILED", "killed after 3 s (its deadline)"),  # past its own limit: a failure
    (100, "skipped", "stopped at the budget's end after 3 s (it may take 100 s)"),  # the whole budget ran out
])
def test_a_part_past_its_deadline_is_killed_with_everything_it_started(tmp_path, monkeypatch, max_s, status, says):
    check = load_check()
    marker = tmp_path / "grandchild.pid"
    # the grandchild leads a session of its own, as torchrun's workers do: a group kill would miss it
    sleeper = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
               f"time.sleep(120)'], start_new_session=True); open({str(marker)!r}, 'w').write(str(p.pid)); "
               "time.sleep(120)")
    monkeypatch.setattr(check, "part_command", lambda name, out, deadline: [sys.executable, "-c", sleeper])

    class Started(subprocess.Popen):
        """The part's 3 s count from when its grandchild exists (a slow start is waited for, not raced)."""

        def wait(self, timeout=None):
            while not marker.exists() and self.poll() is None:
                time.sleep(0.01)
            return super().wait(timeout)

    monkeypatch.setattr(check.subprocess, "Popen", Started)
    rows = check.run_part(check.Part("sleepy", False, 0, max_s), tmp_path, 3)
    assert rows == [check.row("sleepy", "part", says, status)]
    assert marker.exists() and gone(int(marker.read_text()))
    assert check._children == []


def test_the_child_paths_import_no_submitit():
    """What the check's children import (the trainer's in-job modules) works without submitit."""
    code = ("import sys; sys.modules['submitit'] = None; import trainer.__main__, trainer.train, trainer.loop, "
            "trainer.checkpoint, trainer.resilience, hpc.plan, hpc.plan.resolve, hpc.core.resolve; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "ok", out.stderr


GPU_SITE = {"scheduler": {"kind": "local", "gpu_directive": "none"},
            "node": {"gpus": 1, "gpu_model": "NVIDIA H200", "gpu_memory_gb": 150.0, "gpu_peak_tflops": 989.0,
                     "cpus": 16, "intra_link": "none"}, "network": {"fabric": "none"}}


def test_the_gpu_parts_run_folders_resolve_for_a_one_gpu_site(tmp_path, monkeypatch):
    """What a CPU can check of the CUDA-only parts before the first GPU run: their specs resolve for a
    one-GPU site as written, on NCCL, and the planner has a memory figure for the throughput run."""
    import json

    import torch

    from hpc.core.models import model_facts

    check = load_check()
    monkeypatch.setattr(check, "site_doc", lambda ctx: {**GPU_SITE, "storage": {"run_root": str(tmp_path)}})
    ctx = check.Ctx(tmp_path, torch.device("cpu"), float("inf"))
    throughput = check.make_run(ctx, "throughput", check.THROUGHPUT)
    from hpc.plan import plan_job

    _, spec, site = check.resolved(throughput)
    none = next(r.memory.total for r in plan_job(spec, site).rows if r.dims.strategy == "none")
    assert 1 < check.predicted_gb(throughput) < none  # FSDP's own row: no gradients at the loss backward
    on_gpu = check.Ctx(tmp_path, torch.device("cuda"), 0)  # resume_overrides only looks at the device type
    runs = [throughput, check.make_run(ctx, "resume", check.resume_overrides(on_gpu))]
    runs += [check.make_run(ctx, f"offload-{p}-{o}", check.offload_overrides(p, o)) for p in ("bf16", "fp16")
             for o in (False, True)]
    for run in runs:
        launch = json.loads((run / "resolved.json").read_text())["launch"]
        assert (launch["backend"], launch["strategy"], launch["world_size"]) == ("nccl", "fsdp", 1)
    assert [json.loads((r / "resolved.json").read_text())["launch"]["cpu_offload"] for r in runs[2:]] == \
        [False, True, False, True]
    _, resume_spec, _ = check.resolved(runs[1])
    assert model_facts(resume_spec.model).seq_len >= 1024 and resume_spec.train.deterministic  # bit for bit needs both on a GPU


NOT_WRITTEN = "site draft: not written (no throughput run measured an MFU): "


def test_the_cuda_absent_run_with_a_site_draft_says_so_and_writes_none(bare_python, tmp_path):
    scratch, cwd = tmp_path / "tmp", tmp_path / "cwd"
    scratch.mkdir()
    cwd.mkdir()
    before = checkout_files()
    out = subprocess.run([str(bare_python), str(CHECK), "--budget-s", "60", "--only", "staging",
                          "--site-draft", "site.toml"], capture_output=True, text=True, cwd=cwd,
                         env=bare_env(scratch), timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[0] == CUDA_ABSENT
    assert f"{NOT_WRITTEN}site.toml" in out.stdout.splitlines()
    assert list(scratch.iterdir()) == [] and list(cwd.iterdir()) == []
    assert checkout_files() == before


H200 = {"cuda": True, "torch": "2.x", "count": 1, "name": "NVIDIA H200", "memory_gb": 150.04, "peak_tflops": 989.0}


def test_the_parent_writes_the_site_draft_from_the_throughput_row(tmp_path):
    from hpc.core.site_draft import load_draft

    check = load_check()
    source = "bench/gpu_check on one NVIDIA H200, 2026-12-01: GPT 350m FSDP2 bf16+AC+compile, micro 8 x 2048"
    rows = [check.row("throughput", "MFU", "41.2%", "ok"),
            {**check.row("throughput", "MFU on the planner's basis", "41.2%", "ok"), "mfu": 0.41234,
             "mfu_source": source}]
    path = tmp_path / "h200.toml"
    line, failed = check.write_site_draft(path, rows, H200)
    drafted = load_draft(path)
    assert not failed and line == f"site draft: {path}: node.mfu = 0.412 ({source})"
    assert (drafted.node.mfu, drafted.node.mfu_source) == (0.412, source)
    assert (drafted.node.gpus, drafted.node.gpu_model, drafted.node.gpu_peak_tflops) == (1, "NVIDIA H200", 989.0)
    assert drafted.node.gpu_memory_gb == 150.0 and drafted.scheduler.kind == "local"
    text = path.read_text()
    line, failed = check.write_site_draft(path, rows, H200)  # never over a file
    assert failed and "exists" in line and path.read_text() == text
    assert check.main(["--site-draft", str(path)]) == 2  # refused before any part runs
    for rows_, info in ((rows[:1], H200), (rows, {"cuda": False})):
        assert check.write_site_draft(tmp_path / "none.toml", rows_, info) == (f"{NOT_WRITTEN}{tmp_path / 'none.toml'}",
                                                                                False)
    assert not (tmp_path / "none.toml").exists()


def test_the_planner_basis_mfu_in_a_draft_reproduces_the_measured_step(tmp_path, monkeypatch):
    """The throughput part's planner-basis row, written as a draft: the planner with that draft's node.mfu
    predicts the measured step for the throughput run (one GPU, no communication)."""
    import torch

    from hpc.core.models import model_facts
    from hpc.core.site_draft import load_draft
    from hpc.plan import compute_seconds, setup_of


    check = load_check()
    monkeypatch.setattr(check, "site_doc", lambda ctx: {**GPU_SITE, "storage": {"run_root": str(tmp_path)}})
    run = check.make_run(check.Ctx(tmp_path, torch.device("cpu"), float("inf")), "throughput", check.THROUGHPUT)
    measured = check.planner_row(run, 0.2)
    assert 0 < measured["mfu"] < 1 and measured["status"] == "ok"
    assert measured["mfu_source"].startswith("bench/gpu_check on one NVIDIA H200, ")
    assert measured["mfu_source"].endswith(": GPT 350m FSDP2 bf16+AC+compile, micro 8 x 2048, step 200.0 ms")
    check.write_site_draft(tmp_path / "draft.toml", [measured], H200)
    draft, spec = load_draft(tmp_path / "draft.toml"), check.resolved(run)[1]
    compute = compute_seconds(model_facts(spec.model), setup_of(spec, draft, 1), draft, draft.node.mfu)
    assert compute == pytest.approx(0.2, rel=3e-3)
