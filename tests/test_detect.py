"""Site detection, parsed from the verbatim recorded tool outputs in tests/data/recorded (see SOURCES.md there)."""

from __future__ import annotations

from hpc.core.config import tomllib

import pytest

from hpc.schedulers.slurm.detect import (Host, SlurmNode, draft_site, parse_query_gpu, parse_scontrol_nodes, parse_topo,
                        render_toml)
from hpc.core.site import parse_site

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
    slurm = [SlurmNode("gpu01", 112, 2000.0, 8, ["gpu"])]
    text = render_toml(draft_site("h100", topo, query, slurm))
    site = parse_site(tomllib.loads(text), "h100", "<draft>")
    assert (site.node.gpus, site.node.intra_link, site.node.gpu_peak_tflops) == (8, "nvswitch", 989.0)
    assert site.network.fabric == "infiniband" and site.nccl == {"NCCL_IB_HCA": "mlx5"}
    assert site.scheduler.kind == "slurm" and site.scheduler.partition == "gpu"
    assert "# unknown: network.bandwidth_gbs" in text and "InfiniBand or RoCE" in text
    assert "# assumed: node.intra_bandwidth_gbs = 450: 18 links × 25 GB/s per link" in text


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


# --- refusing what a draft would misread ------------------------------------------------------
# Every bad case below is cut from, or edited into, a recorded real output; no matrix is invented.

ALL_TOPO = [H100, H200, A100, NV18_SPACES, PCIE8, A6000, V100_PAIR, DGX1_MP]


def _lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines(keepends=True)


def _gpu_rows(name: str) -> tuple[int, int]:
    """(index of the header line, index after the last GPU row)."""
    lines = _lines(name)
    header = next(i for i, ln in enumerate(lines) if "GPU0" in ln and ln[:1] in ("\t", " "))
    last = max(i for i, ln in enumerate(lines) if ln.startswith("GPU"))
    return header, last + 1


def _cuts(name: str) -> list[int]:
    """Byte offsets inside the GPU rows: every line start, and the middle of every row's cells."""
    lines = _lines(name)
    header, end = _gpu_rows(name)
    starts = [sum(len(x) for x in lines[:i]) for i in range(len(lines) + 1)]
    cuts = [starts[i] for i in range(header + 1, end)]  # header alone, header + some rows
    cuts += [starts[i] + k * len(lines[i]) // 4 for i in range(header + 1, end) for k in (1, 2, 3)]
    cuts.append(starts[header] + len(lines[header]) // 2)  # inside the header itself
    return sorted(set(cuts))


TRUNCATED = [(name, cut) for name in ALL_TOPO for cut in _cuts(name)]


@pytest.mark.parametrize("name,cut", TRUNCATED, ids=[f"{n[:28]}@{c}" for n, c in TRUNCATED])
def test_truncated_matrix_is_refused(name, cut):
    text = (DATA / name).read_text()[:cut]
    with pytest.raises(ValueError, match="not square|cut short|no `nvidia-smi topo -m` matrix|expected GPU0"):
        parse_topo(text)


def test_first_300_bytes_of_the_a100_matrix_are_refused():
    text = (DATA / A100).read_text()[:300]
    with pytest.raises(ValueError, match="not square: its header lists 8 GPUs but rows for 2 \\(GPU0, GPU1\\)"):
        parse_topo(text)
    with pytest.raises(ValueError, match="but rows for 0"):
        parse_topo(_lines(A100)[0])  # the header alone


@pytest.mark.parametrize("name", ALL_TOPO)
def test_cut_after_the_gpu_rows_still_parses(name):
    """The GPU rows whole, the NIC rows and legends lost: the same GPUs and links, and no claim the cut
    output cannot support."""
    lines = _lines(name)
    whole = parse_topo("".join(lines))
    cut = parse_topo("".join(lines[:_gpu_rows(name)[1]]))
    assert cut.gpus == whole.gpus and cut.links == whole.links
    if not any(v.startswith("NV") for v in cut.links.values()):
        assert cut.nvlink_visible is None  # without the legend, -m and -mp cannot be told apart
        text = render_toml(draft_site("t", cut, None, None))
        assert "no NVLink" not in text and "cannot tell" in text


def _edit(name: str, row: int, col: int, value: str) -> str:
    """The recorded matrix with GPU``row``'s cell in column GPU``col`` replaced."""
    lines = _lines(name)
    header, _ = _gpu_rows(name)
    at = next(i for i in range(header + 1, len(lines)) if lines[i].split()[:1] == [f"GPU{row}"])
    sep = "\t" if "\t" in lines[at] else None
    cells = lines[at].rstrip("\n").split(sep)
    label = cells.index(f"GPU{row}")
    cells[label + 1 + col] = value if sep else value.ljust(len(cells[label + 1 + col]))
    lines[at] = ("\t" if sep else "   ").join(cells) + "\n"
    return "".join(lines)


def _other_cell(name: str, row: int, col: int) -> str:
    """A defined cell name different from the recorded one (so the edit is asymmetric, not unknown)."""
    current = parse_topo((DATA / name).read_text()).links[(row, col)]
    return next(c for c in ("SYS", "NODE", "PHB", "PIX") if c != current)


ASYMMETRIC = [(name, i, j) for name in ALL_TOPO for i, j in ((0, 1), (1, 0), (0, 2), (2, 1))
              if not (name in (A6000, V100_PAIR) and max(i, j) > 2)]


@pytest.mark.parametrize("name,row,col", ASYMMETRIC, ids=[f"{n[:28]}-{i}{j}" for n, i, j in ASYMMETRIC])
def test_asymmetric_matrix_is_refused(name, row, col):
    with pytest.raises(ValueError, match=f"not symmetric: GPU{min(row, col)}→GPU{max(row, col)}"):
        parse_topo(_edit(name, row, col, _other_cell(name, row, col)))


UNKNOWN = [(name, token) for name in (H100, A100, PCIE8, NV18_SPACES, DGX1_MP)
           for token in ("NV", "nv12", "NV12a", "PCI", "QPI", "?", "XX", "N/A")]


@pytest.mark.parametrize("name,token", UNKNOWN, ids=[f"{n[:28]}-{t}" for n, t in UNKNOWN])
def test_unknown_cells_are_refused(name, token):
    with pytest.raises(ValueError, match=f"holds {token!r}"):
        parse_topo(_edit(name, 0, 3, token))


def test_nvlink_cell_in_mp_output_is_unknown_to_its_legend():
    """`topo -mp`'s legend defines no NV#: an NV cell there was edited in."""
    with pytest.raises(ValueError, match="holds 'NV2'.*its legend's cell names"):
        parse_topo(_edit(DGX1_MP, 0, 3, "NV2"))


@pytest.mark.parametrize("name", [H100, A100, PCIE8, NV18_SPACES])
def test_self_cell_must_be_x(name):
    with pytest.raises(ValueError, match="GPU2's own cell is 'SYS'|not symmetric"):
        parse_topo(_edit(name, 2, 2, "SYS"))


@pytest.mark.parametrize("name", ALL_TOPO)
@pytest.mark.parametrize("drop", [0, 1, -1])
def test_missing_gpu_row_is_refused(name, drop):
    lines = _lines(name)
    header, end = _gpu_rows(name)
    rows = [i for i in range(header + 1, end) if lines[i].startswith("GPU")]
    del lines[rows[drop]]
    with pytest.raises(ValueError, match="not square"):
        parse_topo("".join(lines))


@pytest.mark.parametrize("name", [H100, PCIE8, A6000])
def test_rows_from_another_machine_are_refused(name):
    """A GPU row the header does not list (two pastes run together)."""
    lines = _lines(name)
    header, end = _gpu_rows(name)
    n = end - header - 1 if name != H100 else 8
    extra = lines[header + 1].replace("GPU0", f"GPU{n}", 1)
    lines.insert(end, extra)
    with pytest.raises(ValueError, match=f"and for GPU{n}"):
        parse_topo("".join(lines))


# --- what a clipped header, -mp output and no Slurm draft ---------------------------------------

def _clip_header(name: str, keep: str) -> str:
    """The recorded output with its header line cut right after column ``keep`` (as a narrow paste)."""
    lines = _lines(name)
    header, _ = _gpu_rows(name)
    lines[header] = lines[header][:lines[header].index(keep) + len(keep)] + "\n"
    return "".join(lines)


@pytest.mark.parametrize("name,keep,nics", [(H100, "GPU7", 12), (H100, "NIC3", 12), (H200, "GPU7", 10),
                                           (A100, "GPU7", 12), (A100, "mlx5_1", 12)])
def test_clipped_header_takes_nics_from_the_legend_and_rows(name, keep, nics):
    topo = parse_topo(_clip_header(name, keep))
    assert len(topo.nics) == nics and topo.nics[0] == "mlx5_0" and topo.nics[-1] == f"mlx5_{nics - 1}"
    draft = draft_site("t", topo, None, [SlurmNode("n", 64, 512.0, 8, [])])
    assert draft.network["fabric"] == "infiniband"
    assert not any("no RDMA" in a for a in draft.assumed + draft.unknown)


def test_mp_output_never_claims_no_nvlink():
    topo = parse_topo((DATA / DGX1_MP).read_text())
    assert topo.nvlink_visible is False
    text = render_toml(draft_site("dgx1", topo, None, None))
    assert "no NVLink" not in text and "NVLink is not shown by -mp" in text
    assert "# assumed: node.intra_link = pcie: the lower bound" in text


def test_m_output_without_nvlink_says_so():
    text = render_toml(draft_site("pcie", parse_topo((DATA / PCIE8).read_text()), None, None))
    assert "no NVLink between the 8 GPUs" in text
    assert "# assumed: node.intra_bandwidth_gbs = 25: PCIe Gen4 x16 assumed" in text


def test_draft_without_slurm_is_a_local_gpu_site_that_resolves():
    from hpc.plan.resolve import resolve
    from hpc.core.spec import spec_from_dict

    topo = parse_topo((DATA / H100).read_text())
    query = parse_query_gpu((DATA / QUERY).read_text())
    text = render_toml(draft_site("box", topo, query, None, Host(cpus=192, memory_gb=2113.6)))
    site = parse_site(tomllib.loads(text), "box", "<draft>")
    assert (site.scheduler.kind, site.scheduler.gpu_directive, site.network.fabric) == ("local", "none", "none")
    assert (site.node.gpus, site.node.cpus, site.node.memory_gb, site.backend) == (8, 192, 2113.6, "nccl")
    assert site.nccl == {}  # no network: no InfiniBand settings
    launch = resolve(spec_from_dict({"train": {"global_batch": 8}, "parallel": {"strategy": "ddp"}}), site)
    assert (launch.tasks_per_node, launch.gpus_per_node, launch.backend) == (8, 8, "nccl")
    assert "# found: no Slurm: a `local` site" in text and "one process per GPU (8, NCCL)" in text
    assert "# assumed: node.intra_bandwidth_gbs = 450" in text and "# assumed: node.intra_latency_us" in text
    assert "192 CPUs (os.cpu_count)" in text


def test_local_draft_from_saved_files_says_cpus_and_memory_are_unknown():
    draft = draft_site("box", parse_topo((DATA / PCIE8).read_text()), None, None, None)
    assert any(u.startswith("node.cpus, node.memory_gb") for u in draft.unknown)


# --- --query-gpu and the two outputs together -----------------------------------------------------

@pytest.mark.parametrize("cut", [-1, -3, -8, -12, -20])
def test_query_cut_inside_a_line_is_refused(cut):
    text = (DATA / QUERY).read_text().rstrip("\n")[:cut]
    with pytest.raises(ValueError):
        parse_query_gpu(text)


def test_query_and_topo_gpu_counts_must_agree():
    topo = parse_topo((DATA / H100).read_text())
    five = "".join((DATA / QUERY).read_text().splitlines(keepends=True)[:6])  # header + 5 GPUs
    with pytest.raises(ValueError, match="topo -m` shows 8 GPUs but --query-gpu lists 5"):
        draft_site("t", topo, parse_query_gpu(five), None)


@pytest.mark.parametrize("cut", [300, 600, 900])
def test_detect_cli_refuses_a_truncated_matrix_in_one_line(tmp_path, cut):
    bad = tmp_path / "topo.txt"
    bad.write_text((DATA / A100).read_text()[:cut])
    out = hpcx("site", "detect", "--topo", str(bad), "--query", str(DATA / QUERY), "--scontrol", "/dev/null")
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "not square" in errors[0]
