"""The NCCL transport parser, on NCCL INFO logs recorded verbatim from real runs (tests/data/recorded, see SOURCES.md there)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from hpc.core import nccl
from hpc.core.site import load_site

from tests.conftest import RECORDED

DATA = RECORDED

H100_2275 = "nccl-debug-info_2node-h100_nccl-2.27.5_net-ib-roce-gdrdma_p2p-ipc.txt"
H100_2293 = "nccl-debug-info_2node-h100_nccl-2.29.3_net-ib-roce-gdrdma_p2p-ipc.txt"
OLD_1NODE = "nccl-debug-info_1node-4gpu_nccl-2.7.8_p2p-ipc_direct-shared-memory_old-format.txt"
OLD_2NODE = "nccl-debug-info_2node-4gpu-each_nccl-2.7.8_net-socket_p2p-ipc_direct-shared-memory_old-format.txt"
A100_DIRECT = "nccl-debug-info_1node-2x-a100-80gb-pcie-nvlink-bridge_nccl-2.27.7_p2p-direct-pointer_nccl-tests.txt"
INTERLEAVED = "nccl-debug-info_1node-2gpu_net-socket-no-ib_shm-direct_interleaved-file.txt"
EFA = "nccl-debug-info_2node-aws-efa-eks_nccl-2.25.1_net-libfabric-aws-ofi.txt"
SOCKET_EXCERPT = "nccl-debug-info_4node-1gpu-eks_net-socket_excerpt.txt"


def recorded(name: str) -> Path:
    path = DATA / name
    if not path.is_file():
        pytest.fail(f"recorded NCCL log {path} is missing (see tests/data/recorded/SOURCES.md)")
    return path


def parse(name: str) -> nccl.NcclInfo:
    return nccl.parse_files([recorded(name)])


@pytest.fixture
def dgx():
    return load_site("dgx-h100")


# (file, NCCL versions, networks, connections per transport) as counted in the files themselves
EXPECTED = [
    (H100_2275, ["2.27.5+cuda12.9"], ["IB"], {"P2P/IPC": 240, "NET/IB": 64}),
    (H100_2293, ["2.29.3+cuda13.1"], ["IB"], {"P2P/IPC": 232, "NET/IB": 64}),
    (OLD_1NODE, ["2.7.8+cuda10.1"], ["Socket"], {"P2P/IPC": 12, "SHM": 24}),
    (OLD_2NODE, ["2.7.8+cuda10.1"], ["Socket"], {"P2P/IPC": 8, "SHM": 4, "NET/Socket": 8}),
    (A100_DIRECT, ["2.27.7+cuda13.0"], ["IB"], {"P2P/direct pointer": 48}),
    (INTERLEAVED, [], ["Socket"], {"SHM": 2}),
    (EFA, ["2.25.1+cuda12.8"], ["Libfabric"], {"NET/Libfabric": 8}),
    (SOCKET_EXCERPT, [], [], {"NET/Socket": 4}),
]


@pytest.mark.parametrize("name,versions,networks,transports", EXPECTED, ids=[e[0][16:40] for e in EXPECTED])
def test_recorded_logs_parse(name, versions, networks, transports):
    info = parse(name)
    assert info.versions == versions
    assert info.networks == networks
    assert dict(info.transports()) == transports


def test_connection_fields_new_format():
    info = parse(H100_2275)
    net = [c for c in info.connections if c.transport == "NET/IB"]
    assert {c.direction for c in net} == {"send", "receive"}
    assert all(c.detail.endswith("/GDRDMA") for c in net)  # GPUDirect RDMA kept in the detail
    assert {c.host for c in info.connections} == {"tpgds-aihub0008"}
    first = next(c for c in info.connections if c.transport == "P2P/IPC")
    assert (first.channel, first.src, first.dst, first.direction) == (0, 8, 15, None)


def test_old_format_wording_and_space_in_transport():
    old = parse(OLD_2NODE)
    assert {c.detail for c in old.connections if c.transport == "SHM"} == {"direct shared memory"}
    assert {c.detail for c in old.connections if c.transport == "NET/Socket"} == {"NET/Socket/0"}
    direct = parse(A100_DIRECT)
    assert {c.detail for c in direct.connections} == {"P2P/direct pointer/read"}


def test_interleaved_file_survives_spliced_lines():
    info = parse(INTERLEAVED)
    assert [c.detail for c in info.connections] == ["SHM/direct/direct", "SHM/direct/direct"]
    assert info.net_devices[0] == "NET/IB : No device found."


def test_h100_matches_dgx_profile(dgx):
    for name in (H100_2275, H100_2293):
        assert nccl.check(parse(name), dgx, nodes=2, tasks_per_node=8) == []
    line = nccl.describe(parse(H100_2275), tasks_per_node=8, nodes=2)
    assert "P2P/IPC ×240 (intra-node)" in line and "NET/IB ×64 (inter-node)" in line
    assert line.startswith("NCCL 2.27.5+cuda12.9; network IB")


def test_shm_inside_nvlink_node_is_flagged(dgx):
    four_gpu = replace(dgx, node=replace(dgx.node, gpus=4))
    problems = nccl.check(parse(OLD_1NODE), four_gpu, nodes=1, tasks_per_node=4)
    assert len(problems) == 1 and problems[0].startswith("24 intra-node connections use SHM")
    problems = nccl.check(parse(INTERLEAVED), replace(dgx, node=replace(dgx.node, intra_link="nvlink")), 1, 2)
    assert "2 intra-node connections use SHM" in problems[0] and "nvlink" in problems[0]


def test_sockets_where_infiniband_was_promised(dgx):
    problems = nccl.check(parse(OLD_2NODE), replace(dgx, node=replace(dgx.node, gpus=4)), nodes=2, tasks_per_node=4)
    assert any(p.startswith("8 connections use NET/Socket") and "infiniband" in p for p in problems)
    assert any("4 intra-node connections use SHM" in p for p in problems)
    excerpt = nccl.check(parse(SOCKET_EXCERPT), dgx, nodes=4, tasks_per_node=1)
    assert len(excerpt) == 1 and "NET/Socket" in excerpt[0]


def test_ethernet_pcie_site_accepts_sockets_and_shm():
    pcie = load_site("pcie-4gpu")
    assert nccl.check(parse(OLD_2NODE), pcie, nodes=2, tasks_per_node=4) == []
    assert nccl.check(parse(EFA), load_site("dgx-h100"), nodes=2, tasks_per_node=1) == []  # Libfabric is no socket


def test_run_folder_logs(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "submitit").mkdir()
    shutil.copyfile(recorded(H100_2275), run / "logs" / "rank-0.log")
    shutil.copyfile(recorded(OLD_2NODE), run / "submitit" / "17_0_log.err")
    (run / "submitit" / "17_0_result.pkl").write_bytes(b"")  # not a log
    files = nccl.run_log_files(run)
    assert [f.name for f in files] == ["rank-0.log", "17_0_log.err"]
    info = nccl.parse_files(files)
    assert info.versions == ["2.27.5+cuda12.9", "2.7.8+cuda10.1"]
    assert info.transports()["NET/Socket"] == 8


def test_no_nccl_lines(tmp_path):
    log = tmp_path / "rank-0.log"
    log.write_text("step 1/6 | loss 5.5\n")
    info = nccl.parse_files([log, tmp_path / "missing.log"])
    assert not info.found
    assert "NCCL_DEBUG=INFO" in nccl.describe(info)
