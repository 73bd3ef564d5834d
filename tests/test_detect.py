"""Site detection, parsed from the verbatim recorded tool outputs in tests/data/recorded (see SOURCES.md there)."""

from __future__ import annotations

import os
import shlex
import sys

from hpc.core.config import parse_toml, tomllib

import pytest

import hpc.schedulers.slurm.detect
from hpc.schedulers.slurm.detect import (Host, SlurmNode, draft_site, parse_query_gpu, parse_scontrol_nodes, parse_topo,
                        render_toml)
from hpc.core.site import parse_site

from tests.conftest import RECORDED, hpcx

DATA = RECORDED
DRAFTS: list[str] = []  # every draft the running test made (render_toml here, or `hpcx site detect`)


def assert_draft_loads(text: str) -> None:
    """A draft is always valid TOML, and a site `hpcx site show` accepts whenever the tools told the GPUs'
    memory (without `--query-gpu` the draft says the memory is unknown, and a GPU site needs it)."""
    doc = parse_toml(text, "draft")
    if "# unknown: node.gpu_model, node.gpu_memory_gb" not in text:
        parse_site(doc, "draft", "draft")


@pytest.fixture(autouse=True)
def every_draft_loads(monkeypatch):
    """Each test's drafts, however made, are loaded after it (issue 24: a draft that does not parse)."""
    real = hpc.schedulers.slurm.detect.render_toml

    def recording(draft):
        DRAFTS.append(real(draft))
        return DRAFTS[-1]

    monkeypatch.setattr(hpc.schedulers.slurm.detect, "render_toml", recording)
    monkeypatch.setattr(sys.modules[__name__], "render_toml", recording)
    DRAFTS.clear()
    yield
    for text in DRAFTS:
        assert_draft_loads(text)


def detect_cli(*args: str, env: dict | None = None):
    """`hpcx site detect ARGS` in a fresh interpreter; a draft it prints joins DRAFTS."""
    out = hpcx("site", "detect", *args, env=env)
    if out.returncode == 0:
        DRAFTS.append(out.stdout)
    return out

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
    out = detect_cli("--name", "a100", "--topo", str(DATA / A100), "--query", str(DATA / QUERY),
               "--scontrol", "/dev/null")
    assert out.returncode == 0, out.stderr
    doc = tomllib.loads(out.stdout)
    assert doc["node"]["intra_link"] == "nvswitch" and doc["node"]["gpus"] == 8


def test_detect_cli_bad_file_exits_2(tmp_path):
    bad = tmp_path / "topo.txt"
    bad.write_text("nothing\n")
    out = detect_cli("--topo", str(bad), "--query", str(DATA / QUERY), "--scontrol", "/dev/null")
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
    out = detect_cli("--topo", str(bad), "--query", str(DATA / QUERY), "--scontrol", "/dev/null")
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0] and "not square" in errors[0]


@pytest.mark.parametrize("stderr", [
    "scontrol: error: Munge encode failed: Failed to connect to \"/run/munge/munge.socket.2\": "
    "No such file or directory (retrying ...)\nscontrol: error: slurm_send_node_msg: auth_g_create: REQUEST_NODE_INFO "
    "has authentication error\nslurm_load_node error: Protocol authentication error\n",
    "line one\n\n[node]\ngpus = 99\n\x1b[31mred\x1b[0m\tand a tab\r\n# already a comment\n",
    "\n\n\n",
])
def test_a_probe_failing_with_several_lines_still_drafts_valid_toml(stderr, tmp_path):
    """Only the first line of a multi-line error was commented out: every such draft was invalid TOML."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(f"#!/bin/sh\nprintf '%s' {shlex.quote(stderr)} >&2\nexit 1\n")
    (fake / "scontrol").chmod(0o755)
    out = detect_cli("--topo", str(DATA / A100), "--query", str(DATA / QUERY),
                     env={"PATH": f"{fake}:{os.environ['PATH']}"})
    assert out.returncode == 0, out.stderr
    doc = tomllib.loads(out.stdout)  # the fixture also loads it as a site
    assert doc["node"]["gpus"] == 8 and doc["scheduler"]["kind"] == "local"
    assert "exited 1" in out.stdout
    assert all(line.startswith("#") or not line.strip() or "=" in line or line.startswith("[")
               for line in out.stdout.splitlines())


def test_draft_values_and_names_from_tools_are_escaped():
    query = parse_query_gpu("name, memory.total [MiB]\nNVIDIA \"H100\" \\\\ 80GB, 81559 MiB\n")
    draft = draft_site("odd\nname\x1b", parse_topo((DATA / H100).read_text()), None, None)
    draft.unknown.append("a\nmulti-line\x00 note")
    text = render_toml(draft)
    assert parse_toml(text, "draft")
    text = render_toml(draft_site("q", None, query, None, Host(cpus=8, memory_gb=64.0)))
    assert tomllib.loads(text)["node"]["gpu_model"] == 'NVIDIA "H100" \\\\ 80GB'


# --- separators, link counts, MIG and other tools (issue 24) -----------------------------------

ROCM_SMI = "rocm-smi_concise-info_8x-mi300x.txt"


def _mixed(text: str, how: str) -> str:
    """A recorded matrix with its separators mixed: tabs and runs of spaces side by side."""
    out = []
    for n, line in enumerate(text.splitlines(keepends=True)):
        if how == "alternate":  # every other tab becomes three spaces
            parts = line.split("\t")
            line = "".join(p + ("\t" if i % 2 else "   ") for i, p in enumerate(parts[:-1])) + parts[-1]
        elif how == "header" and "GPU0" in line and line[:1] in "\t ":
            line = line.replace("\t", "  ") if "\t" in line else line.replace("  ", "\t", 3)
        elif how == "rows" and line.startswith("GPU"):
            line = line.replace("\t", "    ") if "\t" in line else line.replace("    ", "\t")
        elif how == "tab-then-space":
            line = line.replace("\t", "\t ")
        out.append(line)
    return "".join(out)


@pytest.mark.parametrize("how", ["alternate", "header", "rows", "tab-then-space"])
@pytest.mark.parametrize("name", [H100, H200, A100, NV18_SPACES, PCIE8, A6000, V100_PAIR, DGX1_MP])
def test_matrix_with_tabs_and_spaces_mixed_parses_as_the_original(name, how):
    text = (DATA / name).read_text()
    want, got = parse_topo(text), parse_topo(_mixed(text, how))
    assert (got.gpus, got.nics, got.links, got.numa, got.gpu_nic) == \
        (want.gpus, want.nics, want.links, want.numa, want.gpu_nic)


def _nv_counts(name: str, counts) -> str:
    """The recorded matrix with each GPU pair's NV# cell edited to NV<counts(i, j)>, symmetric."""
    lines = _lines(name)
    header, end = _gpu_rows(name)
    for i in range(header + 1, end):
        cells = lines[i].split("\t")
        row = int(cells[0].removeprefix("GPU"))
        for j in range(8):
            if j != row:
                cells[1 + j] = f"NV{counts(min(row, j), max(row, j))}"
        lines[i] = "\t".join(cells)
    return "".join(lines)


@pytest.mark.parametrize("counts,low", [
    (lambda i, j: 1 + (i + j) % 2, 1),  # NV1 and NV2 mixed (V100 boards)
    (lambda i, j: 2 if j == i + 1 else 1, 1),
    (lambda i, j: 12 - (i + j) % 3, 10),
])
def test_every_pair_on_nvlink_with_mixed_counts_is_nvlink_not_pcie(counts, low):
    topo = parse_topo(_nv_counts(H100, counts))
    draft = draft_site("mesh", topo, None, None)
    assert draft.node["intra_link"] == "nvlink"
    assert draft.node["intra_bandwidth_gbs"] == low * 25.0
    assert any("every GPU pair is joined by NVLink" in f for f in draft.found)
    render_toml(draft)


def test_uniform_nv_counts_stay_a_switch():
    topo = parse_topo(_nv_counts(H100, lambda i, j: 2))
    assert draft_site("s", topo, None, None).node["intra_link"] == "nvswitch"


def _query_with_mig(enabled: set[int]) -> str:
    """The recorded --query-gpu output with a mig.mode.current column added."""
    lines = (DATA / QUERY).read_text().splitlines()
    out = [lines[0] + ", mig.mode.current"]
    out += [f"{line}, {'Enabled' if n in enabled else 'Disabled'}" for n, line in enumerate(lines[1:])]
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("enabled", [{1}, {0, 3, 7}, set(range(8))])
def test_mig_devices_are_said(enabled):
    query = parse_query_gpu(_query_with_mig(enabled))
    assert query.mig == [n in enabled for n in range(8)] and len(query.names) == 8
    draft = draft_site("mig", parse_topo((DATA / H100).read_text()), query, None, Host(cpus=8, memory_gb=64.0))
    said = [u for u in draft.unknown if u.startswith("MIG is enabled on GPU")]
    listed = sorted(enabled)
    assert said == [f"MIG is enabled on GPU {', '.join(map(str, listed))} (mig.mode.current): hpcx plans whole GPUs "
                    "and never counts a MIG device as one (a task there sees a slice, and one NCCL job cannot span MIG "
                    f"devices); for training, disable MIG (`sudo nvidia-smi -i {','.join(map(str, listed))} -mig 0`) "
                    "on the nodes hpcx runs on, or write the profile by hand (docs/site.md)"]
    assert draft.node["gpus"] == 8  # whole GPUs, however many MIG devices they hold
    assert "# unknown: MIG is enabled on GPU" in render_toml(draft)


def test_detect_cli_with_mig_enabled_drafts_a_loadable_profile_that_says_so(tmp_path):
    query = tmp_path / "query.csv"
    query.write_text(_query_with_mig({2, 5}))
    out = detect_cli("--topo", str(DATA / H100), "--query", str(query), "--scontrol", "/dev/null")
    assert out.returncode == 0, out.stderr
    assert "# unknown: MIG is enabled on GPU 2, 5 (mig.mode.current): hpcx plans whole GPUs" in out.stdout
    assert "`sudo nvidia-smi -i 2,5 -mig 0`" in out.stdout and "write the profile by hand" in out.stdout
    draft = tmp_path / "draft.toml"
    draft.write_text(out.stdout)
    shown = hpcx("site", "show", str(draft), "--json")
    assert shown.returncode == 0, shown.stderr
    assert '"gpus": 8' in shown.stdout


def test_mig_column_disabled_everywhere_says_nothing():
    query = parse_query_gpu(_query_with_mig(set()))
    draft = draft_site("q", None, query, None, Host(cpus=8, memory_gb=64.0))
    assert not [u for u in draft.unknown if "MIG" in u]


@pytest.mark.parametrize("cut", [None, (2, None), (0, 5), (4, 6)])
def test_rocm_smi_output_is_named(cut):
    text = (DATA / ROCM_SMI).read_text()
    if cut:
        text = "".join(text.splitlines(keepends=True)[cut[0]:cut[1]])
    for parser, tool in ((parse_topo, "nvidia-smi topo -m"),
                         (parse_query_gpu, "nvidia-smi --query-gpu=name,memory.total --format=csv")):
        with pytest.raises(ValueError) as info:
            parser(text)
        assert str(info.value) == (f"this is `rocm-smi` output (AMD GPUs), not `{tool}`: `hpcx site detect` reads "
                                   "NVIDIA's tools; write the profile by hand (docs/site.md)")


def test_rocm_smi_file_given_to_detect_exits_2_in_one_line():
    out = detect_cli("--topo", str(DATA / ROCM_SMI), "--query", str(DATA / QUERY), "--scontrol", "/dev/null")
    assert out.returncode == 2 and not out.stdout
    assert out.stderr.splitlines() == [f"error: {DATA / ROCM_SMI}: this is `rocm-smi` output (AMD GPUs), not "
                                       "`nvidia-smi topo -m`: `hpcx site detect` reads NVIDIA's tools; write the "
                                       "profile by hand (docs/site.md)"]


SMI_LIST = "nvidia-smi-L_1x-rtx-4070-laptop.txt"


@pytest.mark.parametrize("parser,tool", [(parse_query_gpu, "nvidia-smi --query-gpu=name,memory.total --format=csv"),
                                         (parse_topo, "nvidia-smi topo -m")])
def test_the_gpu_listing_is_named(parser, tool):
    with pytest.raises(ValueError) as info:
        parser((DATA / SMI_LIST).read_text())
    assert str(info.value) == f"this is `nvidia-smi -L` output, not `{tool}`"


SMI_LIST_MIG = "nvidia-smi-L_1x-a100-80gb-pcie_7x-mig-1g.10gb.txt"
MIG_ADVICE = ("MIG is enabled on GPU 0 (`nvidia-smi -L` lists MIG devices): hpcx plans whole GPUs and never counts a "
              "MIG device as one (a task there sees a slice, and one NCCL job cannot span MIG devices); for training, "
              "disable MIG (`sudo nvidia-smi -i 0 -mig 0`) on the nodes hpcx runs on, or write the profile by hand "
              "(docs/site.md)")


def test_mig_devices_of_a_gpu_listing_are_counted_apart_from_its_gpus():
    text = (DATA / SMI_LIST_MIG).read_text()
    assert hpc.schedulers.slurm.detect.smi_list_mig(text) == {0: 7}  # one GPU, seven 1g.10gb MIG devices
    assert hpc.schedulers.slurm.detect.smi_list_mig((DATA / SMI_LIST).read_text()) == {}


@pytest.mark.parametrize("parser,tool", [(parse_query_gpu, "nvidia-smi --query-gpu=name,memory.total --format=csv"),
                                         (parse_topo, "nvidia-smi topo -m")])
def test_a_gpu_listing_with_mig_devices_is_refused_with_what_to_do(parser, tool):
    with pytest.raises(ValueError) as info:
        parser((DATA / SMI_LIST_MIG).read_text())
    assert str(info.value) == f"this is `nvidia-smi -L` output with 7 MIG devices, not `{tool}`; {MIG_ADVICE}"


@pytest.mark.parametrize("option", ["--query", "--topo"])
def test_detect_cli_given_a_mig_listing_exits_2_in_one_line(option):
    other = "--topo" if option == "--query" else "--query"
    out = detect_cli(option, str(DATA / SMI_LIST_MIG), other, str(DATA / (H100 if other == "--topo" else QUERY)),
                     "--scontrol", "/dev/null")
    assert out.returncode == 2 and not out.stdout
    tool = "nvidia-smi --query-gpu=name,memory.total --format=csv" if option == "--query" else "nvidia-smi topo -m"
    assert out.stderr.splitlines() == [f"error: {DATA / SMI_LIST_MIG}: this is `nvidia-smi -L` output with 7 MIG "
                                       f"devices, not `{tool}`; {MIG_ADVICE}"]


def _relabelled(name: str, gpu: int, label: str) -> str:
    """The recorded matrix with GPU<gpu>'s column header and row label edited to ``label``. No recorded `topo -m`
    of a MIG-enabled node was found, with or without MIG devices in the matrix: this edit stands for one that
    would have them, so that such labels are never read as NICs or counted as GPUs."""
    lines = _lines(name)
    header, end = _gpu_rows(name)
    lines[header] = lines[header].replace(f"GPU{gpu}", label, 1)
    at = next(i for i in range(header + 1, end) if lines[i].startswith(f"GPU{gpu}\t"))
    lines[at] = label + lines[at][len(f"GPU{gpu}"):]
    return "".join(lines)


@pytest.mark.parametrize("label,parents", [("GPU7/1/0", "GPU 7"), ("MIG 1g.10gb Device 0", "this node's GPUs"),
                                           ("MIG-c1d3d074-7dc1-5e89-8a5f-6d0b08327092", "this node's GPUs")])
@pytest.mark.parametrize("name", [H100, A100])
def test_a_matrix_labelling_mig_devices_is_refused(name, label, parents):
    with pytest.raises(ValueError) as info:
        parse_topo(_relabelled(name, 7, label))
    message = str(info.value)
    assert message.startswith(f"the matrix labels MIG devices ({label}) where GPUs belong; MIG is enabled on {parents} "
                              "(`nvidia-smi topo -m`): hpcx plans whole GPUs")
    assert "write the profile by hand" in message and "\n" not in message


def test_recorded_matrices_have_no_mig_labels():
    for name in (H100, H200, A100, NV18_SPACES, PCIE8, A6000, V100_PAIR, DGX1_MP):
        hpc.schedulers.slurm.detect.check_no_mig((DATA / name).read_text().splitlines())
