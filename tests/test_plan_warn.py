"""A strategy set in the spec that the plan knows runs out of memory (issue 34 item 6): `render`,
`submit` and `dryrun` warn with the figure, the same as the plan's row of that layout, and refuse
under --strict (exit 2); fitting layouts and `auto` are not warned about."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.core.site import load_site
from hpc.core.spec import spec_from_dict
from hpc.plan import launch_row
from hpc.plan.resolve import resolve
from hpc.plan.warn import memory_warning, need_figures
from tests.conftest import hpcx

CASES = [  # (name, spec doc, site, fits)
    ("13b ddp on one DGX node", {"model": {"size": "13b"}, "parallel": {"strategy": "ddp"}}, "dgx-h100", False),
    ("13b fsdp on one DGX node", {"model": {"size": "13b"}, "parallel": {"strategy": "fsdp"}}, "dgx-h100", True),
    ("405b fsdp on 128 DGX nodes", {"job": {"nodes": 128}, "model": {"arch": "llama", "size": "llama3.1-405b"},
                                    "train": {"global_batch": 1024}, "parallel": {"strategy": "fsdp",
                                                                                 "activation_checkpointing": True}},
     "dgx-h100", False),
    ("llama3-8b hsdp on 2 DGX nodes", {"job": {"nodes": 2}, "model": {"arch": "llama", "size": "llama3-8b"},
                                       "train": {"global_batch": 16}, "parallel": {"strategy": "hsdp",
                                                                                  "activation_checkpointing": True}},
     "dgx-h100", True),
    ("6.7b shard_grad_op on 4 PCIe GPUs", {"model": {"size": "6.7b"}, "train": {"global_batch": 4},
                                           "parallel": {"strategy": "fsdp", "sharding": "shard_grad_op"}},
     "pcie-4gpu", False),
    ("tiny ddp on local", {"model": {"size": "tiny"}, "parallel": {"strategy": "ddp"}}, "local", True),
]


def load(doc: dict, site_name: str):
    doc = {**doc, "train": {"global_batch": 8, **doc.get("train", {})}}
    spec, site = spec_from_dict(doc), load_site(site_name)
    return spec, site, resolve(spec, site)


@pytest.mark.parametrize("name,doc,site_name,fits", CASES, ids=[c[0] for c in CASES])
def test_the_warning_is_the_plans_row_of_that_layout(name, doc, site_name, fits):
    spec, site, launch = load(doc, site_name)
    row = launch_row(spec, site, launch)
    need, capacity, host, usable = need_figures(spec, site, launch)
    assert need == pytest.approx(row.need_gb) and capacity == row.capacity_gb
    assert host == pytest.approx(row.host_need_gb)
    line = memory_warning(spec, site, launch)
    assert (line is None) == fits == bool(row.fits), line
    if line:
        where = "GPU" if site.node.gpus else "rank"
        assert line.startswith(f"warning: {row.label} needs {need:.1f} GB per {where} of {capacity:.1f} GB")
        assert line.endswith("--strict refuses")


def test_offload_that_does_not_fit_the_host_is_warned_about():
    doc = {"job": {"nodes": 1}, "model": {"size": "70b"},
           "parallel": {"strategy": "fsdp", "cpu_offload": True, "activation_checkpointing": True}}
    spec = spec_from_dict({**doc, "train": {"global_batch": 8}})
    from hpc.core.site import parse_site

    site = parse_site({"scheduler": {"kind": "slurm", "gpu_directive": "gpus-per-node"},
                       "node": {"gpus": 8, "gpu_memory_gb": 80, "memory_gb": 256, "cpus": 64,
                                "intra_link": "nvswitch", "intra_bandwidth_gbs": 450},
                       "network": {"fabric": "infiniband", "bandwidth_gbs": 400}}, "small-host", "<test>")
    launch = resolve(spec, site)
    line = memory_warning(spec, site, launch)
    assert line is not None and "GB of host memory per node of 204.8 GB usable" in line
    assert "fsdp full_shard + offload needs" in line


def test_auto_is_never_warned_about():
    spec, site, launch = load({"model": {"size": "13b"}}, "dgx-h100")
    assert memory_warning(spec, site, launch) is None


def write(tmp_path: Path, text: str) -> Path:
    job = tmp_path / "job.toml"
    job.write_text(text)
    return job


DDP_13B = '[job]\nname = "g13"\n[model]\nsize = "13b"\n[train]\nglobal_batch = 8\n[parallel]\nstrategy = "ddp"\n'


def test_render_warns_on_stderr_and_refuses_under_strict(tmp_path):
    job = write(tmp_path, DDP_13B)
    done = hpcx("render", str(job), "--site", "dgx-h100")
    assert done.returncode == 0, done.stderr
    assert "warning: ddp needs 279.0 GB per GPU of 80.0 GB (the plan's estimate" in done.stderr
    assert "warning" not in done.stdout and "#SBATCH" in done.stdout  # the script stays clean
    strict = hpcx("render", str(job), "--site", "dgx-h100", "--strict")
    assert strict.returncode == 2 and strict.stdout == ""
    assert "ddp needs 279.0 GB per GPU of 80.0 GB" in strict.stderr and "--strict" in strict.stderr
    assert "Traceback" not in strict.stderr


def test_a_layout_that_fits_renders_without_a_warning_even_under_strict(tmp_path):
    job = write(tmp_path, DDP_13B.replace('"ddp"', '"fsdp"'))
    done = hpcx("render", str(job), "--site", "dgx-h100", "--strict")
    assert done.returncode == 0 and "warning:" not in done.stderr


@pytest.mark.parametrize("command", ["submit", "dryrun"])
def test_submit_and_dryrun_refuse_under_strict_before_anything_runs(tmp_path, command):
    job = write(tmp_path, DDP_13B.replace('name = "g13"', f'name = "g13"\nrun_root = "{tmp_path}/runs"'))
    done = hpcx(command, str(job), "--site", "dgx-h100", "--strict")
    assert done.returncode == 2, done.stderr
    assert "ddp needs 279.0 GB per GPU of 80.0 GB" in done.stderr and "refused under --strict" in done.stderr
    assert not (tmp_path / "runs").exists()
