"""NVLink islands (issue 45 item 1): `node.nvlink_domain` in site profiles, drafted by `hpcx site detect`, checked
against `parallel.tp`, and the planner never placing a tensor-parallel group across an island unless
`parallel.tp_cross_domain = true` asks, which it then costs. The paired-NVLink site (4× H100 NVL: NVLink bridges
between GPU pairs, PCIe between the pairs) is hand-checked with the arithmetic beside it.

The detect cases are the recorded matrices of tests/data/recorded (SOURCES.md there), or edits of them: the 8-GPU
PCIe-only node with NV# cells edited in (no recorded matrix of a paired node could be sourced).
"""

from __future__ import annotations

import pytest

from hpc.core.config import ConfigError
from hpc.core.resolve import cross_check
from hpc.core.site import nvlink_domain, parse_site
from hpc.core.spec import spec_from_dict
from hpc.plan import choose, format_plan, plan_job
from hpc.plan.memory import GB
from hpc.plan.rows import tp_degrees
from hpc.schedulers.slurm.detect import draft_site, island_domain, parse_topo, render_toml
from tests.conftest import RECORDED

PCIE8 = "nvidia-smi-topo-m_8gpu-pcie-only_all-SYS_2-numa.txt"
A6000 = "nvidia-smi-topo-m_3x-rtx-a6000_nv4-bridged-pair_plus-pcie-gpu.txt"
HOMELAB = "nvidia-smi-topo-m_2x-v100-sxm2-nv6-pair_plus-rtx3090_homelab_raw-file.txt"
H100 = "nvidia-smi-topo-m_8x-h100-80gb-hbm3_nv18_12x-mlx5_nic-legend_numa-off.txt"


def node(**kw) -> dict:
    base = {"gpus": 4, "gpu_model": "NVIDIA H100 NVL", "gpu_memory_gb": 94, "gpu_peak_tflops": 835,
            "memory_gb": 1024, "cpus": 64, "intra_link": "pcie", "intra_bandwidth_gbs": 50}
    return {**base, **kw}


def site_of(**kw):
    doc = {"scheduler": {"kind": "slurm", "gpu_directive": "gpus-per-node"}, "node": node(**kw),
           "network": {"fabric": "infiniband", "bandwidth_gbs": 100}}
    return parse_site(doc, "h100nvl", "<test>")


# 4× H100 NVL per node: NV12 bridges in pairs (12 links × 25 GB/s = 300 GB/s each way), PCIe Gen5 between the
# pairs (~50 GB/s), 100 GB/s of InfiniBand per node; 835 TFLOP/s dense bf16, 94 GB per GPU.
NVL = dict(nvlink_domain=2, nvlink_bandwidth_gbs=300)


def llama70b(nodes: int, seq: int, micro: int, batch: int, cross: bool = False, **parallel):
    return spec_from_dict({"job": {"nodes": nodes}, "model": {"arch": "llama", "size": "llama3.1-70b", "seq_len": seq},
                           "train": {"global_batch": batch, "micro_batch": micro},
                           "parallel": {"strategy": "auto", "activation_checkpointing": True,
                                        "tp_cross_domain": cross, **parallel}})


# ---------------------------------------------------------------- the profile key


@pytest.mark.parametrize("kw,domain", [
    ({"intra_link": "nvswitch", "gpus": 8, "intra_bandwidth_gbs": 370}, 8),  # a full NVSwitch: the node
    ({"intra_link": "nvlink"}, 4),  # every pair NVLink (a direct mesh): the node
    ({}, 1),  # PCIe only
    (NVL, 2),
    ({"intra_link": "nvswitch", "gpus": 8, "intra_bandwidth_gbs": 370, "nvlink_domain": 4}, 4),
])
def test_the_domain_defaults_to_the_node_on_nvlink_and_one_on_pcie(kw, domain):
    assert nvlink_domain(site_of(**kw).node) == domain


@pytest.mark.parametrize("kw,words", [
    ({"nvlink_domain": 3, "nvlink_bandwidth_gbs": 300}, "`node.nvlink_domain` = 3 does not divide `node.gpus` = 4"),
    ({"nvlink_domain": 8, "nvlink_bandwidth_gbs": 300}, "`node.nvlink_domain` = 8 does not divide `node.gpus` = 4"),
    ({"nvlink_domain": 2}, "`node.nvlink_bandwidth_gbs` is unset"),
    ({"nvlink_domain": -1}, "node.nvlink_domain"),
])
def test_a_bad_domain_is_one_line_naming_the_key(kw, words):
    with pytest.raises(ConfigError) as err:
        site_of(**kw)
    assert any(words in line and line.startswith("<test>: ") for line in err.value.messages), err.value.messages


def test_a_cpu_site_has_no_nvlink_domain():
    doc = {"scheduler": {"kind": "slurm"}, "node": {"gpus": 0, "cpus": 8, "nvlink_domain": 2}}
    with pytest.raises(ConfigError) as err:
        parse_site(doc, "cpu", "<test>")
    assert "`node.nvlink_domain` = 2" in " ".join(err.value.messages)


# ---------------------------------------------------------------- an explicit tp against the islands


def test_tp_across_islands_is_refused_unless_asked():
    nvl = site_of(**NVL)
    errors = cross_check(llama70b(2, 4096, 1, 8, strategy="fsdp", tp=4), nvl)
    assert any("`parallel.tp` = 4 does not divide the 2 ranks of one NVLink domain" in e
               and "`parallel.tp_cross_domain` = true allows" in e for e in errors), errors
    assert not cross_check(llama70b(2, 4096, 1, 8, strategy="fsdp", tp=2), nvl)
    assert not cross_check(llama70b(2, 4096, 1, 8, cross=True, strategy="fsdp", tp=4), nvl)
    wide = cross_check(llama70b(2, 4096, 1, 8, cross=True, strategy="fsdp", tp=8), nvl)
    assert any("does not divide the 4 ranks of a node" in e for e in wide), wide  # never across nodes


def test_the_degrees_stay_in_an_island():
    from hpc.core.models import model_facts

    f = model_facts(llama70b(1, 4096, 1, 4).model)
    assert tp_degrees(f, site_of(**NVL), 4) == [1, 2]
    assert tp_degrees(f, site_of(**NVL), 4, cross_domain=True) == [1, 2, 4]
    assert tp_degrees(f, site_of(), 4) == [1]  # PCIe only: no island
    assert tp_degrees(f, site_of(), 4, cross_domain=True) == [1, 2, 4]


# ---------------------------------------------------------------- the paired site, by hand


def test_paired_site_tp_2_runs_on_the_nvlink_bridge():
    """70B (d = 8192, 80 layers), seq 4096, micro-batch 1, global batch 32 on 8 nodes × 4 H100 NVL, checkpointed.
    tp 2: 16 data-parallel ranks → 2 micro-batches per step. Per micro-batch forward, 2·80 + 1 = 161 all-gathers
    of one activation, 4096 tokens × 8192 × 2 B = 67.1 MB, each rank sending half: 33.55 MB × 161 × 2 = 10.80 GB,
    at the bridge's 300 GB/s = 36.0 ms of bandwidth time (PCIe's 50 GB/s would be 216 ms)."""
    plan = plan_job(llama70b(8, 4096, 1, 32), site_of(**NVL))
    assert plan.choice.dims.tp == 2 and [r.dims.tp for r in plan.tp_rows] == [1, 2]
    part = next(p for p in plan.choice.comm.parts if p.what == "tp all-gather activations forward")
    message = 4096 * 8192 * 2
    assert part.calls * part.repeat == 161 * 2 and part.group == 2 and part.link == "nvlink"
    assert part.gb == pytest.approx(message / 2 * 161 * 2 / GB)
    assert part.gb == pytest.approx(10.80, abs=0.01)
    assert part.bandwidth_s == pytest.approx(part.gb / 300, rel=0.02)
    text = format_plan(plan)
    assert "NVLink islands of 2 GPUs (`node.nvlink_domain`): no tensor-parallel group spans two" in text
    assert "(across islands)" not in text


def test_paired_site_never_crosses_an_island_unasked_and_says_what_would():
    """70B, seq 8192, micro-batch 4 on 8 nodes: tp 1 needs 127 GB and tp 2 108 GB of 94: nothing fits inside an
    island. The refusal names each family's degrees, and what tp 4 across the islands would give."""
    plan = plan_job(llama70b(8, 8192, 4, 128), site_of(**NVL))
    assert plan.choice is None
    text = "\n".join(plan.advice)
    assert "fsdp full_shard: tp 1: needs 127 GB of 94.0 GB per GPU; tp 2: needs 108 GB of 94.0 GB per GPU" in text
    assert "tp 4" not in text.split("with parallel.tp_cross_domain = true")[0]
    assert "with parallel.tp_cross_domain = true: fsdp full_shard × tp 4 fits (74.5 GB of 94.0 GB per GPU)" in text
    with pytest.raises(ConfigError):
        choose(llama70b(8, 8192, 4, 128), site_of(**NVL), 8)


def test_paired_site_crosses_when_asked_and_says_the_cost():
    """Asked: tp 4 fits (74.5 GB of 94). Its groups span both pairs, so the sequence-parallel collectives run on
    PCIe. 32 ranks / tp 4 = 8 data-parallel ranks × micro-batch 4 = 32 samples: 4 micro-batches of the 128.
    Per micro-batch, 161 all-gathers + 161 reduce-scatters forward and 321 + 321 backward (161 mirrored + 160 of the
    recomputed forward): 964 calls, each on one micro-batch's activation, 4 × 8192 tokens × 8192 × 2 B = 536.9 MB,
    of which each rank sends 3/4. 0.75 × 536.9 MB × 964 × 4 = 1552 GB per GPU per step; / 50 GB/s = 31.0 s of
    bandwidth time, none of it hidden (tp 2 inside an island would be 1.75 s, but does not fit: 108 GB)."""
    plan = plan_job(llama70b(8, 8192, 4, 128, cross=True), site_of(**NVL))
    assert plan.choice.dims.tp == 4 and plan.grad_accum == 4
    tp_parts = [p for p in plan.choice.comm.parts if p.what.startswith("tp ")]
    assert sum(p.calls for p in tp_parts) * 4 == (161 * 2 + 321 * 2) * 4
    assert all(p.link == "pcie" and p.group == 4 for p in tp_parts)
    sent = sum(p.gb for p in tp_parts)
    assert sent == pytest.approx(0.75 * 4 * 8192 * 8192 * 2 * 964 * 4 / GB, rel=1e-6)
    assert sent == pytest.approx(1552, abs=1)
    assert sum(p.bandwidth_s for p in tp_parts) == pytest.approx(sent / 50, rel=0.02)
    text = format_plan(plan)
    assert "4 (across islands)" in text
    line = next(r for r in plan.recommendation if r.startswith("`parallel.tp_cross_domain = true`"))
    assert "tp 4 spans NVLink islands of 2" in line and "over pcie (50 GB/s per GPU)" in line and "it is the choice" in line


# ---------------------------------------------------------------- detect


def _pairs(text: str, pairs: list[tuple[int, int]], cell: str = "NV12") -> str:
    """The recorded 8-GPU PCIe matrix with ``cell`` edited into both (i, j) and (j, i) of each pair."""
    lines = text.splitlines(keepends=True)
    for i, j in pairs + [(j, i) for i, j in pairs]:
        at = next(k for k, ln in enumerate(lines) if ln.startswith(f"GPU{i}\t"))
        cells = lines[at].rstrip("\n").split("\t")
        cells[cells.index(f"GPU{i}") + 1 + j] = cell
        lines[at] = "\t".join(cells) + "\n"
    return "".join(lines)


def _recorded(name: str) -> str:
    return (RECORDED / name).read_text()


@pytest.mark.parametrize("pairs,domain,words", [
    ([(0, 1), (2, 3), (4, 5), (6, 7)], 2, "NVLink islands of 2 GPUs: {GPU0,GPU1} {GPU2,GPU3}"),
    ([(a, b) for q in (0, 4) for a in range(q, q + 4) for b in range(a + 1, q + 4)], 4, "NVLink islands of 4 GPUs"),
    ([(0, 4), (1, 5), (2, 6), (3, 7)], 1, "islands that are not consecutive GPUs"),
    ([(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)], 1, "not all joined pairwise"),  # chains, no direct 0–2
    ([(0, 1), (2, 3), (4, 5)], 1, "islands of different sizes"),
])
def test_detect_drafts_the_islands_of_an_edited_recording(pairs, domain, words):
    topo = parse_topo(_pairs(_recorded(PCIE8), pairs))
    assert island_domain(8, topo)[0] == domain
    text = render_toml(draft_site("t", topo, None, None))
    assert f"nvlink_domain = {domain}" in text and words in text
    assert 'intra_link = "pcie"' in text  # a ring over all 8 still runs at PCIe speed
    if domain > 1:
        assert "nvlink_bandwidth_gbs = 300" in text  # NV12 × 25 GB/s


@pytest.mark.parametrize("name,words", [(A6000, "{GPU0,GPU1} only, islands of different sizes"),
                                        (HOMELAB, "{GPU1,GPU2} only, islands of different sizes")])
def test_detect_on_recorded_partial_nvlink_nodes(name, words):
    text = render_toml(draft_site("t", parse_topo(_recorded(name)), None, None))
    assert "nvlink_domain = 1" in text and words in text


def test_detect_leaves_a_full_nvswitch_node_at_its_default():
    topo = parse_topo(_recorded(H100))
    text = render_toml(draft_site("t", topo, None, None))
    assert "nvlink_domain" not in text and 'intra_link = "nvswitch"' in text  # the default: the node's 8 GPUs
