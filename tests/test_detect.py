"""Site detection, parsed from the verbatim recorded tool outputs in tests/data/recorded (see SOURCES.md there)."""

from __future__ import annotations

from hpc.config import tomllib
from pathlib import Path

import pytest

from hpc.detect import (draft_site, parse_query_gpu, parse_scontrol_nodes, parse_topo, render_toml)
from hpc.site import parse_site

from tests.conftest import RECORDED, hpcx

DATA = RECORDED

H100 = "nvidia-smi-topo-m_8x-h100-80gb-hbm3_nv18_12x-mlx5_nic-legend_numa-off.txt"
H200 = "nvidia-smi-topo-m_8x-h200-sxm_nv18_10x-mlx5_nic-legend_raw-file.txt"
A100 = "nvidia-smi-topo-m_dgx-a100_nv12_12x-mlx5_old-format.txt"
NV18_SPACES = "nvidia-smi-topo-m_8gpu-nv18_no-nics_space-separated.txt"
PCIE8 = "nvidia-smi-topo-m_8gpu-pcie-only_all-SYS_2-numa.txt"
A6000 = "nvidia-smi-topo-m_3x-rtx-a6000_nv4-bridged-pair_plus-pcie-gpu.txt"
V100_PAIR = "nvidia-smi-topo-m_2x-v100-sxm2-nv6-pair_plus-rtx3090_homelab_raw-file.txt"
DGX1_MP = "nvidia-smi-topo-mp_dgx1-v100_pcie-paths-only.txt"
QUERY = "nvidia-smi-query-gpu-name-memory-total_csv_8x-h100-80gb-hbm3.txt"

# file, GPUs, NICs (first, count), distinct GPU-GPU links, NUMA of GPU0 and GPU7 (or last), intra_link, GB/s
TOPOLOGIES = [
    (H100, 8, ("mlx5_0", 12), {"NV18"}, ("0", "0"), "nvswitch", 450.0),
    (H200, 8, ("mlx5_0", 10), {"NV18"}, ("0", "1"), "nvswitch", 450.0),
    (A100, 8, ("mlx5_0", 12), {"NV12"}, ("3", "5"), "nvswitch", 300.0),
    (NV18_SPACES, 8, (None, 0), {"NV18"}, ("0", "1"), "nvswitch", 450.0),
    (PCIE8, 8, (None, 0), {"SYS"}, ("0", "1"), "pcie", 25.0),
    (A6000, 3, (None, 0), {"NV4", "NODE"}, ("0", "0"), "pcie", 25.0),
    (V100_PAIR, 3, (None, 0), {"NV6", "NODE"}, ("0", "0"), "pcie", 25.0),
    (DGX1_MP, 8, ("mlx5_0", 4), {"PIX", "PHB", "SYS"}, ("0", "1"), "pcie", 25.0),
]


@pytest.mark.parametrize("name,gpus,nics,links,numa,link,gbs", TOPOLOGIES, ids=[t[0][:40] for t in TOPOLOGIES])
def test_parse_recorded_topologies(name, gpus, nics, links, numa, link, gbs):
    topo = parse_topo((DATA / name).read_text())
    assert len(topo.gpus) == gpus
    first, count = nics
    assert len(topo.nics) == count and (topo.nics[0] if topo.nics else None) == first
    assert set(topo.links.values()) == links
    assert len(topo.links) == gpus * (gpus - 1)
    assert (topo.numa[0], topo.numa[-1]) == numa
    draft = draft_site("t", topo, None, None)
    assert draft.node["intra_link"] == link and draft.node["intra_bandwidth_gbs"] == gbs


def test_nic_legend_and_gpu_nic_affinity():
    h200 = parse_topo((DATA / H200).read_text())  # the header carries ANSI escapes in this raw file
    assert h200.nics[-1] == "mlx5_9"
    assert h200.gpu_nic[3][:3] == ["PIX", "PIX", "PIX"]  # NIC0-2 share a PCIe switch with GPU3
    a100 = parse_topo((DATA / A100).read_text())
    assert a100.nics[-1] == "mlx5_11" and a100.gpu_nic[0][:2] == ["PXB", "PXB"]


def test_partial_nvlink_is_reported():
    draft = draft_site("t", parse_topo((DATA / A6000).read_text()), None, None)
    assert any("NVLink joins only 1 of 3 GPU pairs" in f for f in draft.found)


def test_parse_query_gpu():
    q = parse_query_gpu((DATA / QUERY).read_text())
    assert q.names == ["NVIDIA H100 80GB HBM3"] * 8
    assert q.memory_gb == [85.5] * 8  # 81559 MiB = 85.52e9 bytes


def test_draft_from_recorded_h100_node_is_a_valid_profile():
    topo = parse_topo((DATA / H100).read_text())
    query = parse_query_gpu((DATA / QUERY).read_text())
    text = render_toml(draft_site("h100", topo, query, None))
    site = parse_site(tomllib.loads(text), "h100", "<draft>")
    assert (site.node.gpus, site.node.intra_link, site.node.gpu_peak_tflops) == (8, "nvswitch", 989.0)
    assert site.network.fabric == "infiniband" and site.nccl == {"NCCL_IB_HCA": "mlx5"}
    assert "# unknown: network.bandwidth_gbs" in text and "InfiniBand or RoCE" in text


def test_garbage_is_refused():
    with pytest.raises(ValueError):
        parse_topo("no matrix here\n")
    with pytest.raises(ValueError):
        parse_query_gpu("name, memory.total [MiB]\nfoo\n")


# No recorded `scontrol show node` of a GPU node could be sourced (SOURCES.md). This only checks
# the record structure Slurm documents (whitespace-separated Key=Value tokens, one record per
# node, blank lines between records), with the keys the draft reads; values are made up, and
# the GPU count from Gres is *not* tested against any real GPU output.
def test_scontrol_key_value_records():
    text = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1\n   CPUAlloc=0 CPUTot=2 CPULoad=0.01\n"
            "   Gres=(null)\n   RealMemory=7977 AllocMem=0 FreeMem=1000\n   Partitions=debug\n\n"
            "NodeName=n2 Arch=x86_64 CoresPerSocket=1\n   CPUTot=2\n   RealMemory=7977\n   Partitions=debug,long\n")
    nodes = parse_scontrol_nodes(text)
    assert [n.name for n in nodes] == ["n1", "n2"]
    assert (nodes[0].cpus, nodes[0].memory_gb, nodes[0].gpus) == (2, 8.4, 0)
    assert nodes[1].partitions == ["debug", "long"]


def test_detect_cli_from_files():
    out = hpcx("site", "detect", "--name", "a100", "--topo", str(DATA / A100), "--query", str(DATA / QUERY),
               "--scontrol", "/dev/null")
    assert out.returncode == 0, out.stderr
    doc = tomllib.loads(out.stdout)
    assert doc["node"]["intra_link"] == "nvswitch" and doc["node"]["gpus"] == 8


def test_detect_cli_bad_file_exits_2(tmp_path):
    bad = tmp_path / "topo.txt"
    bad.write_text("nothing\n")
    out = hpcx("site", "detect", "--topo", str(bad), "--query", str(DATA / QUERY), "--scontrol", "/dev/null")
    assert out.returncode == 2 and "Traceback" not in out.stderr
