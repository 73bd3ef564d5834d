"""MFU as a site field: the planner uses `node.mfu` and says where the figure came from; a scale study
writes the MFU it measured into a site draft, and planning with that draft reproduces the measurement."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from hpc import scale
from hpc.core.config import ConfigError
from hpc.plan import MFU_DEFAULT, compute_seconds, format_plan, plan_job, setup_of
from hpc.core.models import model_facts
from hpc.scale.mfu import study_mfu
from hpc.scale.report import Study, study_site
from hpc.scale.study import read_study
from hpc.cli.scale import scale_group
from hpc.core.site import parse_site
from hpc.core.site_draft import load_draft, measured_mfu, write_draft

from tests.test_plan import spec
from tests.test_scale import WARM, make_study, states


def h100(mfu: float = 0.0, source: str = ""):
    node = {"gpus": 8, "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory_gb": 80, "gpu_peak_tflops": 989,
            "memory_gb": 2048, "cpus": 112, "intra_link": "nvswitch", "intra_bandwidth_gbs": 450, "mfu": mfu,
            "mfu_source": source}
    doc = {"scheduler": {"kind": "slurm"}, "node": node, "network": {"fabric": "infiniband", "bandwidth_gbs": 400}}
    return parse_site(doc, "h100", "<test>")


def test_node_mfu_sets_the_compute_time_and_its_source_is_printed():
    s = spec("1.3b", global_batch=64)
    assumed, measured = plan_job(s, h100()), plan_job(s, h100(0.55, "scale study x at 1 node"))
    assert assumed.mfu == MFU_DEFAULT and measured.mfu == 0.55
    assert measured.compute_s == pytest.approx(assumed.compute_s * MFU_DEFAULT / 0.55)
    assert "at MFU 0.40, assumed: site 'h100' sets no node.mfu" in format_plan(assumed)
    assert "at MFU 0.55, scale study x at 1 node" in format_plan(measured)
    unnamed = plan_job(s, h100(0.5))
    assert "MFU 0.50, node.mfu of site 'h100'" in format_plan(unnamed)
    assert plan_job(s, h100(0.55)).to_dict()["mfu_source"] == "node.mfu of site 'h100'"


def test_node_mfu_out_of_range_is_a_user_error():
    with pytest.raises(ConfigError) as err:
        h100(1.5)
    assert "node.mfu" in "\n".join(err.value.messages)


def test_measured_mfu_arithmetic():
    assert measured_mfu(989e12 * 0.5, 1.0, 989) == pytest.approx(0.5)
    assert measured_mfu(1e12, 0.0, 989) is None and measured_mfu(1e12, 1.0, 0) is None


def test_scale_study_writes_its_mfu_into_a_site_draft_that_reproduces_the_step(tmp_path):
    study = make_study(tmp_path, "pcie-4gpu", 4, {1: {"steps": WARM + [0.005] * 4}, 2: {"steps": WARM + [0.0056] * 4}})
    report = scale.build_report(study, states({1: "COMPLETED", 2: "COMPLETED"}))
    mfu, source = study_mfu(study, report)
    assert source.startswith("scale study tiny-ddp (scale-tiny-ddp-20250101-000000-abcdef") and "1 node(s)" in source
    base = report["points"][0]
    doc = read_study(study)
    drafted = write_draft(tmp_path / "pcie-measured.toml", study_site(doc), mfu, source)
    assert drafted.node.mfu == float(f"{mfu:.3g}") and drafted.node.mfu_source == source
    again = load_draft(tmp_path / "pcie-measured.toml")
    assert again.node == drafted.node and again.network == drafted.network
    # the planner with the measured MFU predicts the measured compute: step − predicted communication
    point = Study(study, doc, study_site(doc)).spec(1)
    compute = compute_seconds(model_facts(point.model), setup_of(point, again, 1), again, again.node.mfu)
    assert compute == pytest.approx(base["step_time_s"] - base["predicted_comm_s"], rel=2e-3)
    with pytest.raises(ConfigError):  # never written over a file
        write_draft(tmp_path / "pcie-measured.toml", again, 0.5, "x")


def test_scale_report_site_draft_cli(tmp_path, monkeypatch):
    study = make_study(tmp_path, "pcie-4gpu", 4, {1: {"steps": WARM + [0.005] * 4}, 2: {"steps": WARM + [0.0056] * 4}})
    monkeypatch.setattr(scale.study, "point_state", lambda p: "COMPLETED")
    out = tmp_path / "draft.toml"
    result = CliRunner().invoke(scale_group, ["report", str(study), "--site-draft", str(out)])
    assert result.exit_code == 0, result.output
    assert f"site draft {out}: node.mfu = " in result.output
    assert load_draft(out).node.mfu > 0
    again = CliRunner().invoke(scale_group, ["report", str(study), "--site-draft", str(out)])
    assert again.exit_code == 2 and "exists" in again.output
