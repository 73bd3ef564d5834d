"""Scaling studies: submission plan, report arithmetic, verdicts, output files, and the α-β prediction.

Study folders here are built by the tests: their metrics.jsonl lines are synthetic measurements
(made-up step times), written the way the trainer writes them.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc.core import runs
from hpc import scale
from hpc.core.config import ConfigError
from hpc.cli.scale import scale_group
from hpc.core.site import load_site
from hpc.core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "data" / "tiny-scale.toml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir: Path, step_times: list[float], tokens_per_step: int, **split: list[float]) -> None:
    """Synthetic rank-0 metrics: one line per step, with optional compute_s/comm_wait_s/data_s."""
    for i, t in enumerate(step_times):
        record = {"step": i + 1, "loss": 5.0, "tokens_per_s": tokens_per_step / t, "step_time_s": t}
        record.update({k: v[i] for k, v in split.items()})
        runs.append_jsonl(run_dir / "metrics.jsonl", record)


def make_study(root: Path, site: str, tpn: int, points: dict[int, dict], mode: str = "weak") -> Path:
    """A study folder like ``start_study`` leaves it; ``points[n]`` = {"steps": [...], "split": {...}} or
    {"run": False} (never submitted) or {"steps": []} (submitted, nothing logged)."""
    study_dir = root / "scale-tiny-ddp-20250101-000000-abcdef"
    study_dir.mkdir(parents=True)
    shutil.copyfile(TINY, study_dir / "spec.toml")
    base = [f"job.tasks_per_node={tpn}"]
    spec = load_spec(TINY, base)
    site_profile = load_site(site)
    entries = []
    for n, what in sorted(points.items()):
        batch, _ = scale.point_batch(spec, site_profile, n, mode)
        entry = {"nodes": n, "ranks": n * tpn, "global_batch": batch, "strategy": "ddp", "job_id": None,
                 "overrides": [f"job.nodes={n}", f"train.global_batch={batch}"], "run_dir": None, "error": None}
        if what.get("run", True):
            run = study_dir / f"tiny-ddp-n{n}"
            run.mkdir()
            entry["run_dir"], entry["job_id"] = str(run), str(100 + n)
            write_metrics(run, what.get("steps", []), batch * spec.model.seq_len if spec.model.seq_len else batch * 64,
                          **what.get("split", {}))
        else:
            entry["error"] = "submission failed: sbatch: error: invalid partition"
        entries.append(entry)
    study = {"version": 1, "name": "tiny-ddp", "mode": mode, "site": site, "site_source": str(REPO / "site" / f"{site}.toml"),
             "overrides": base, "steps": 6, "warmup_metrics_steps": 2, "tasks_per_node": tpn, "points": entries}
    runs.write_json(study_dir / "study.json", study)
    return study_dir


def states(mapping: dict[int, str]):
    return lambda point: mapping[point["nodes"]] if point.get("run_dir") else "SUBMIT FAILED"


# warm-up steps 1-2 are slow on purpose: they must not count
WARM = [9.0, 7.0]


def test_efficiency_from_metrics_excludes_warmup(tmp_path):
    study = make_study(tmp_path, "sandbox", 2, {1: {"steps": WARM + [0.10, 0.10, 0.11, 0.10]},
                                                 2: {"steps": WARM + [0.125, 0.125, 0.125, 0.125]}})
    report = scale.build_report(study, states({1: "COMPLETED", 2: "COMPLETED"}))
    one, two = report["points"]
    assert one["tokens_per_s"] == pytest.approx(8 * 64 / 0.10) and one["steps_measured"] == 4
    assert two["tokens_per_s"] == pytest.approx(16 * 64 / 0.125)
    assert one["efficiency"] == 1.0
    assert two["efficiency"] == pytest.approx((16 * 64 / 0.125 / 4) / (8 * 64 / 0.10 / 2))  # 0.8
    assert report["baseline_nodes"] == 1
    assert one["compute_s"] is None and "not measured" in scale.table_lines(report)[1]


def test_partial_study_reports_failed_queued_and_unsubmitted_points(tmp_path):
    study = make_study(tmp_path, "sandbox", 2, {1: {"steps": []}, 2: {"steps": WARM + [0.2, 0.2, 0.2]},
                                                 4: {"steps": []}, 8: {"run": False}})
    report = scale.build_report(study, states({1: "FAILED", 2: "COMPLETED", 4: "PENDING"}))
    rows = {r["nodes"]: r for r in report["points"]}
    assert [rows[n]["state"] for n in (1, 2, 4, 8)] == ["FAILED", "COMPLETED", "PENDING", "SUBMIT FAILED"]
    assert report["baseline_nodes"] == 2 and rows[2]["efficiency"] == 1.0  # smallest *measured* point
    assert rows[1]["efficiency"] is None and rows[4]["tokens_per_s"] is None
    text = "\n".join(scale.table_lines(report) + scale.notes(report))
    assert "1 nodes: FAILED, nothing measured after warm-up" in text
    assert "8 nodes: submission failed: sbatch: error: invalid partition" in text
    files, warnings = scale.write_report(report, study)
    assert warnings == []
    assert Path(files["png"]).read_bytes().startswith(PNG_SIGNATURE)
    with open(files["csv"]) as f:
        table = list(csv.DictReader(f))
    assert [r["state"] for r in table] == ["FAILED", "COMPLETED", "PENDING", "SUBMIT FAILED"]
    assert table[0]["efficiency"] == "" and float(table[1]["efficiency"]) == 1.0
    assert "| 8 | 16 | SUBMIT FAILED |" in Path(files["md"]).read_text()


def test_plot_draws_measured_and_predicted_series(tmp_path):
    study = make_study(tmp_path, "pcie-4gpu", 4, {1: {"steps": WARM + [0.005] * 4}, 2: {"steps": WARM + [0.0058] * 4}})
    report = scale.build_report(study, states({1: "COMPLETED", 2: "COMPLETED"}))
    fig = scale.plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_SIGNATURE
    throughput, efficiency = fig.axes
    for ax in (throughput, efficiency):
        lines = {line.get_label(): line for line in ax.get_lines()}
        assert {"measured", "predicted", "linear"} <= set(lines)
        assert list(lines["measured"].get_xdata()) == [1, 2] and list(lines["predicted"].get_xdata()) == [1, 2]
    assert list(throughput.get_lines()[0].get_ydata()) == [r["tokens_per_s"] for r in report["points"]]
    assert list(efficiency.get_lines()[1].get_ydata()) == [r["predicted_efficiency"] for r in report["points"]]


def test_communication_bound_verdict_names_link_and_advice(tmp_path):
    # pcie-4gpu: 4 ranks on PCIe at 1 node, the 3 GB/s Ethernet between nodes at 2; the model (NCCL's
    # tuning, issue 23) adds 0.35 ms of communication at 2 nodes, so 0.6 ms lost is communication-bound
    study = make_study(tmp_path, "pcie-4gpu", 4, {1: {"steps": WARM + [0.005] * 4}, 2: {"steps": WARM + [0.0056] * 4}})
    report = scale.build_report(study, states({1: "COMPLETED", 2: "COMPLETED"}))
    two = report["points"][1]
    assert report["prediction_basis"] == "anchored"
    assert two["efficiency"] == pytest.approx(0.005 / 0.0056)
    assert two["verdict"].startswith("communication-bound on inter-node (ethernet, 3 GB/s per node)")
    assert "NCCL cost model" in two["verdict"]
    assert any("`parallel.strategy` = 'hsdp' with `parallel.shard_size` = 4" in a for a in two["advice"])
    assert any(a.startswith("`train.micro_batch` 2 → 4") for a in two["advice"])
    assert any("DDP bucket size" in a for a in two["advice"])
    # anchored prediction: the smallest point's measured step minus its predicted communication is compute
    assert report["points"][0]["predicted_tokens_per_s"] == pytest.approx(report["points"][0]["tokens_per_s"])


def test_unexplained_verdict(tmp_path):
    study = make_study(tmp_path, "pcie-4gpu", 4, {1: {"steps": WARM + [0.005] * 4}, 2: {"steps": WARM + [0.010] * 4}})
    two = scale.build_report(study, states({1: "COMPLETED", 2: "COMPLETED"}))["points"][1]
    assert two["verdict"].startswith("unexplained (efficiency 50%: 5.0 ms per step lost; the model accounts for 0.3 ms)")


def test_measured_split_gives_data_bound_and_comm_bound(tmp_path):
    base = {"steps": WARM + [0.1] * 4, "split": {"compute_s": [0.08] * 6, "comm_wait_s": [0.01] * 6, "data_s": [0.01] * 6}}
    data = {"steps": WARM + [0.2] * 4, "split": {"compute_s": [0.08] * 6, "comm_wait_s": [0.01] * 6, "data_s": [0.11] * 6}}
    study = make_study(tmp_path / "a", "sandbox", 2, {1: base, 2: data})
    two = scale.build_report(study, states({1: "COMPLETED", 2: "COMPLETED"}))["points"][1]
    assert two["data_s"] == pytest.approx(0.11)
    assert two["verdict"].startswith("data-bound (efficiency 50%")
    assert two["advice"][0].startswith("raise `data.num_workers` from 0 to 2")
    comm = {"steps": WARM + [0.2] * 4, "split": {"compute_s": [0.08] * 6, "comm_wait_s": [0.11] * 6, "data_s": [0.01] * 6}}
    study = make_study(tmp_path / "b", "sandbox", 2, {1: base, 2: comm})
    report = scale.build_report(study, states({1: "COMPLETED", 2: "COMPLETED"}))
    assert report["points"][1]["verdict"].startswith("communication-bound on inter-node (ethernet")
    assert "measured communication wait: +100.0 ms" in report["points"][1]["verdict"]
    assert "80.0/110.0/10.0" in scale.table_lines(report)[2]


# ---------------------------------------------------------------- starting a study

def test_weak_and_strong_points(tmp_path):
    site = load_site("sandbox")
    weak = scale.prepare_points(TINY, site, ["job.tasks_per_node=2"], [1, 2], "weak", 6, tmp_path)
    assert [(p["nodes"], p["ranks"], p["global_batch"]) for p in weak] == [(1, 2, 8), (2, 4, 16)]
    assert f'job.run_root={json.dumps(str(tmp_path))}' in weak[0]["overrides"]
    spec = load_spec(TINY, ["job.tasks_per_node=2", *weak[1]["overrides"]])
    assert (spec.job.nodes, spec.train.global_batch, spec.train.steps, spec.job.name) == (2, 16, 6, "tiny-ddp-n2")
    strong = scale.prepare_points(TINY, site, ["job.tasks_per_node=2"], [1, 2], "strong", None, tmp_path)
    assert [p["global_batch"] for p in strong] == [8, 8]


def test_every_bad_point_is_reported_at_once(tmp_path):
    site = load_site("sandbox")
    with pytest.raises(ConfigError) as err:
        scale.prepare_points(TINY, site, ["job.tasks_per_node=2", "train.global_batch=4"], [1, 2, 4], "strong", 2, tmp_path)
    messages = err.value.messages
    assert messages[0].startswith("train.steps = 2 leaves nothing to measure after `train.warmup_metrics_steps` = 2")
    assert ("strong scaling keeps `train.global_batch` = 4, but at 2 nodes it must divide by ranks × micro_batch "
            "= 2 × 2 × 2 = 8") in messages
    assert "strong scaling keeps `train.global_batch` = 4, but at 4 nodes it must divide by ranks × micro_batch " \
           "= 4 × 2 × 2 = 16" in messages and len(messages) == 3
    with pytest.raises(ConfigError) as err:
        scale.prepare_points(TINY, site, ["job.tasks_per_node=2", "train.global_batch=5"], [1], "weak", None, tmp_path)
    assert "`train.global_batch` = 5 over the spec's 1 nodes × 2 tasks = 2 ranks" in err.value.messages[0]
    with pytest.raises(ConfigError) as err:
        scale.prepare_points(TINY, site, ["job.tasks_per_node=2"], [1, 4], "weak", None, tmp_path)
    assert "at 4 nodes:" in err.value.messages[0] and "at most 2 nodes" in err.value.messages[0]


def test_parse_nodes():
    assert scale.parse_nodes("4,1,2,2") == [1, 2, 4]
    for bad in ("", "0,1", "1,x"):
        with pytest.raises(ConfigError):
            scale.parse_nodes(bad)


def test_start_study_keeps_going_when_one_submission_fails(tmp_path, monkeypatch):
    from hpc.login import submit as sub

    def fake_submit(spec, site, launch, spec_path, overrides):
        if spec.job.nodes == 2:
            raise RuntimeError("sbatch: error: Batch job submission failed: Node count specification invalid")
        run = runs.new_run_dir(Path(spec.job.run_root), spec.job.name, False)
        return sub.Submitted(run, "41", "slurm")

    monkeypatch.setattr(sub, "submit", fake_submit)
    study_dir = scale.start_study(TINY, load_site("sandbox"), [f"job.run_root={tmp_path}", "job.tasks_per_node=2"],
                                  [1, 2], "weak", 6)
    assert study_dir.parent == tmp_path and study_dir.name.startswith("scale-tiny-ddp-")
    study = scale.read_study(study_dir)
    one, two = study["points"]
    assert Path(one["run_dir"]).parent == study_dir and one["job_id"] == "41"
    assert two["run_dir"] is None and two["error"].endswith("Node count specification invalid")
    assert (study_dir / "spec.toml").read_text() == TINY.read_text()
    report = scale.build_report(study_dir, states({1: "RUNNING"}))
    assert [r["state"] for r in report["points"]] == ["RUNNING", "SUBMIT FAILED"]


# ---------------------------------------------------------------- predict

def test_predict_matches_hand_computed_alpha_beta():
    """tiny GPT (2 layers, d=64, seq 64, vocab 256) with DDP on pcie-4gpu, weak scaling from 1 node × 4 ranks."""
    n_params = (256 * 64 + 64 * 64) + 2 * (12 * 64 * 64 + 4 * 64) + (2 * 64 + 256 * 64)  # 135,808
    grad_bytes = 4 * n_params  # fp32 gradients, one 25 MB bucket
    flops_per_token = 6 * (n_params - (256 * 64 + 64 * 64)) + 12 * 2 * 64 * 64
    rows = scale.predict_table(load_spec(TINY), load_site("pcie-4gpu"), [1, 2], "weak")
    one, two = rows
    # NCCL's tuning model (hpc.plan.collectives; issue 23 replaced the flat α-β ring, so these figures changed)
    # 1 node: ring/LL128 over 4 ranks on PCIe: 14 µs + 6 hops × 2.5 µs × (8 / 5.7, the site's Simple hop
    # over NCCL's), and 2·3/4 of the bytes at 92 % of 25 GB/s
    assert one["comm_s"] == pytest.approx((14.0 + 6 * 2.5 * 8 / 5.7) * 1e-6 + 1.5 * grad_bytes / (0.92 * 25e9))
    assert one["limiting_link"] == "PCIe"
    # 2 nodes: tree/LL128 (cheaper than the ring): 14 µs + 2·(3 PCIe hops + log2(2) Ethernet hops at
    # 8.5 µs × 30/14); bandwidth twice the 3 GB/s share on two nodes, × 0.92 × 120/128, × 1/2 (tree),
    # × 0.6 (NCCL's tree correction at 512 KB)
    latency = (14.0 + 2 * (3 * 1.9 * 8 / 5.7 + 8.5 * 30 / 14)) * 1e-6
    assert two["comm_s"] == pytest.approx(latency + grad_bytes / (6e9 * 0.92 * 120 / 128 * 0.5 * 0.6))
    assert two["comm_s"] == pytest.approx(416.336e-6, rel=1e-5)
    assert two["limiting_link"].startswith("inter-node (ethernet")
    # compute: 2 samples × 64 tokens per rank at 40% of the L40S's 362 TFLOP/s
    compute = flops_per_token * 2 * 64 / (362e12 * scale.ASSUMED_MFU)
    assert two["compute_s"] == pytest.approx(compute)
    assert two["tokens_per_s"] == pytest.approx(16 * 64 / (compute + two["comm_s"]))
    assert two["efficiency"] == pytest.approx((two["tokens_per_s"] / 8) / (one["tokens_per_s"] / 4))


def test_predict_cli_json_and_impossible_sizes():
    runner = CliRunner()
    result = runner.invoke(scale_group, ["predict", str(TINY), "--site", "pcie-4gpu", "--nodes", "1,2,1024", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["points"]
    assert [r["nodes"] for r in rows] == [1, 2, 1024] and rows[2]["ranks"] == 4096
    result = runner.invoke(scale_group, ["predict", str(TINY), "--site", "pcie-4gpu", "--nodes", "1,2", "--mode", "strong"])
    assert result.exit_code == 0
    assert "2  strong scaling keeps `train.global_batch` = 8, but at 2 nodes" in result.output
    assert "PCIe" in result.output.splitlines()[2]


# ---------------------------------------------------------------- CLI shape

def test_scale_job_means_scale_run(tmp_path):
    runner = CliRunner()
    # 2 tasks per node (the sandbox's nodes have 2 CPUs: 4 tasks there are refused on their own since
    # issue 24) and a micro batch of 4: at 2 nodes, 2 × 2 × 4 = 16 ranks × micro_batch against 8
    args = [str(TINY), "--nodes", "1,2", "--site", "sandbox", "--mode", "strong",
            "--set", f"job.run_root={tmp_path}", "--set", "job.tasks_per_node=2", "--set", "train.micro_batch=4"]
    result = runner.invoke(scale_group, args)
    assert result.exit_code == 2
    assert result.output == ("error: strong scaling keeps `train.global_batch` = 8, but at 2 nodes it must divide "
                             "by ranks × micro_batch = 2 × 2 × 4 = 16\n")
    assert list(tmp_path.iterdir()) == []  # nothing created, nothing submitted
    assert runner.invoke(scale_group, ["run", *args]).output == result.output
    assert "report" in runner.invoke(scale_group, ["--help"]).output


def test_report_cli_on_a_study(tmp_path, monkeypatch):
    study = make_study(tmp_path, "sandbox", 2, {1: {"steps": WARM + [0.1] * 4}, 2: {"steps": WARM + [0.2] * 4}})
    monkeypatch.setattr(scale.study, "point_state", lambda point: "COMPLETED")
    result = CliRunner().invoke(scale_group, ["report", str(study), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [r["efficiency"] for r in report["points"]] == [1.0, pytest.approx(0.5)]
    assert set(report["files"]) == {"csv", "md", "png"}
    text = CliRunner().invoke(scale_group, ["report", str(study)]).output
    assert "2 nodes: unexplained (efficiency 50%" in text
    bad = CliRunner().invoke(scale_group, ["report", str(tmp_path)])
    assert bad.exit_code == 2 and "not a scaling study" in bad.output


def test_report_without_matplotlib_writes_the_rest_and_names_the_extra(tmp_path):
    import subprocess
    import sys

    study = make_study(tmp_path, "sandbox", 2, {1: {"steps": WARM + [0.1] * 4}, 2: {"steps": WARM + [0.2] * 4}})
    code = ("import sys; sys.modules['matplotlib'] = None; "  # what a missing matplotlib looks like to import
            "from hpc.cli import main; sys.argv = ['hpcx', 'scale', 'report', sys.argv[1]]; main()")
    out = subprocess.run([sys.executable, "-c", code, str(study)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and "ModuleNotFoundError" not in out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("warning:")] == [
        "warning: the scaling plot (report.png) needs matplotlib: pip install 'hpcx[plot]' "
        "(report.csv and report.md need nothing more)"]
    assert (study / "report.csv").exists() and (study / "report.md").exists() and not (study / "report.png").exists()
    assert "written: " in out.stdout and "report.png" not in out.stdout


def test_no_torch_or_matplotlib_at_import():
    import subprocess
    import sys

    code = ("import sys, hpc.scale, hpc.cli.scale, hpc.core.nccl; "
            "print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_hand_figures_are_consistent():
    assert math.isclose(2 * 7 / 8 * 4 * 135808 / 3e9 + 14 * 30e-6, 736.885e-6, rel_tol=1e-5)
