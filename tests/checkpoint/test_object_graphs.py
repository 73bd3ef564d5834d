"""Pickled object graphs that are no state dict (issue 24, class 2): containers that contain
themselves, nesting 200,000 deep, DAGs of shared containers with 2³⁰ leaves along every path. In a
torch file's data.pkl, a DCP object item or safetensors' stored objects, every command answers
with one line, at once: work is bounded by distinct objects and depth, never by paths, and never a
RecursionError. ``torch.load`` reads the same files (in milliseconds), so they are valid pickles."""

from __future__ import annotations

import base64
import io
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile as hs  # noqa: E402
import malformed as mf  # noqa: E402
from ckpt_helpers import cli, refused_everywhere  # noqa: E402

from hpc.ckpt.entries import MAX_DEPTH, graph_problem, short_repr  # noqa: E402

GRAPHS = {  # name: (pickled value, expected words)
    "self-list": (hs.self_list(), "contains itself"),
    "self-dict": (hs.self_dict(), "contains itself"),
    "mutual-lists": (hs.mutual(), "contains itself"),
    "deep-list-200000": (hs.deep_list(200_000), "nests deeper than"),
    "deep-dict-200000": (hs.deep_dict(200_000), "nests deeper than"),
    "deep-list-65": (hs.deep_list(MAX_DEPTH + 1), "nests deeper than"),
    "dag-2-pow-30": (hs.dag(30), "counted along every path"),
    "dag-of-dicts-2-pow-30": (hs.dag(30, dicts=True), "counted along every path"),
    "dag-wide-1000-pow-3": (hs.dag(3, width=1000), "counted along every path"),
    "dag-2-pow-21": (hs.dag(21), "counted along every path"),
}


def torch_file(tmp_path: Path, value: bytes, key: str = "train") -> Path:
    return hs.write(tmp_path / "g.pt", hs.torch_archive(hs.state_pickle(value, key)))


@pytest.mark.parametrize("case", sorted(GRAPHS))
def test_a_torch_file_whose_data_pkl_is_a_hostile_graph(tmp_path: Path, case: str) -> None:
    value, expect = GRAPHS[case]
    src = torch_file(tmp_path, value)
    started = time.monotonic()
    assert isinstance(torch.load(src, weights_only=True), dict)  # a valid pickle: torch reads it
    assert time.monotonic() - started < 600  # a hang guard (a graph torch expanded path by path), not a speed
    refused_everywhere(tmp_path, src, "g.pt: data.pkl", expect)


@pytest.mark.parametrize("key", ["model", "optim", "meta"])
def test_the_graph_may_sit_under_any_key(tmp_path: Path, key: str) -> None:
    refused_everywhere(tmp_path, torch_file(tmp_path, hs.dag(30), key), "counted along every path")


@pytest.mark.parametrize("case", ["self-list", "deep-list-200000", "dag-2-pow-30", "dag-of-dicts-2-pow-30"])
def test_a_dcp_object_item_that_is_a_hostile_graph(tmp_path: Path, case: str) -> None:
    value, expect = GRAPHS[case]
    src = mf.dcp_save(tmp_path / "c", {"model": {"w": torch.ones(2)}, "train": {"step": 1, "hist": [1.0]}})
    mf.replace_item(src, "train.hist", hs.torch_archive(hs.value_pickle(value)))
    refused_everywhere(tmp_path, src, "item 'train.hist'", "the stored object", expect)


@pytest.mark.parametrize("case", ["self-dict", "deep-dict-200000", "dag-of-dicts-2-pow-30"])
def test_safetensors_stored_objects_that_are_a_hostile_graph(tmp_path: Path, case: str) -> None:
    value, expect = GRAPHS[case]
    blob = hs.torch_archive(hs.PROTO + hs.EMPTY_DICT + hs.text("train.x") + value + hs.SETITEM + hs.STOP)
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.ones(2)},
                      {"hpcx.layout": "full", "hpcx.objects": base64.b64encode(blob).decode()})
    refused_everywhere(tmp_path, src, "hpcx.objects", expect)


def test_graph_problem_bounds_work_by_distinct_objects() -> None:
    leaf: list = [1]
    for _ in range(60):
        leaf = [leaf, leaf, leaf]  # 3^60 paths, 61 distinct lists
    assert "counted along every path" in graph_problem(leaf)
    shared = (0.9, 0.95)  # an optimizer's param groups share their betas tuple: fine
    assert graph_problem({"param_groups": [{"betas": shared, "params": [i]} for i in range(100)]}) is None
    assert graph_problem({"history": list(range(500_000))}) is None
    a: dict = {}
    a["b"] = {"c": [a]}
    assert graph_problem(a) == "contains itself at b.c.0"


def test_short_repr_is_safe_on_hostile_values() -> None:
    deep: list = []
    node = deep
    for _ in range(200_000):
        node.append([])
        node = node[0]
    loop: list = []
    loop.append(loop)
    assert len(short_repr(deep)) < 100 and len(short_repr(loop)) < 100
    assert short_repr("x" * 10**6).endswith("'") and len(short_repr("x" * 10**6)) < 100


def test_a_metadata_pickle_with_deep_values_is_one_line(tmp_path: Path) -> None:
    """.metadata whose entry size and planner_data are nested thousands deep (repr recursion)."""
    src = mf.dcp_save(tmp_path / "c", {"model": {"w": torch.ones(2)}})
    deep: list = [1]
    for _ in range(5000):
        deep = [deep]
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # for our own pickle.dump of the planted metadata
    try:
        md = mf.read_metadata(src)
        md.state_dict_metadata["model.w"].size = deep
        buf = io.BytesIO()
        import pickle

        pickle.dump(md, buf)
        md2 = mf.read_metadata(src)
        md2.planner_data = {"model.w": deep}
        buf2 = io.BytesIO()
        pickle.dump(md2, buf2)
    finally:
        sys.setrecursionlimit(before)
    (src / ".metadata").write_bytes(buf.getvalue())
    refused_everywhere(tmp_path, src, "entry 'model.w' has size [[[[...]]]]")
    (src / ".metadata").write_bytes(buf2.getvalue())
    refused_everywhere(tmp_path, src, "planner_data: object path of 'model.w' is [[[[...]]]]")


def test_honest_nesting_and_sharing_still_convert(tmp_path: Path) -> None:
    shared = (0.9, 0.95)
    state = {"model": {"w": torch.arange(4.0)},
             "optim": {"param_groups": [{"lr": 0.1, "betas": shared, "params": [0]},
                                        {"lr": 0.2, "betas": shared, "params": [1]}]},
             "train": {"step": 3, "nested": {"a": {"b": {"c": [1, [2, [3]]]}}}, "hist": list(range(1000))}}
    torch.save(state, tmp_path / "s.pt")
    for to, dst in (("torch", "o.pt"), ("dcp", "o.dcp"), ("safetensors", "o.st")):
        assert cli("convert", tmp_path / "s.pt", tmp_path / dst, "--to", to)[0] == 0, to
        code, out = cli("verify", tmp_path / "s.pt", tmp_path / dst)
        assert code == 0, out
    assert torch.load(tmp_path / "o.pt", weights_only=True)["train"]["nested"] == state["train"]["nested"]


def test_a_metadata_chunk_list_of_one_shared_chunk_is_refused_by_its_length(tmp_path: Path, monkeypatch) -> None:
    """A .metadata whose chunk list repeats one memoized chunk millions of times (a few bytes each):
    bounded by the number of chunks, not walked."""
    import hpc.ckpt.dcp as dcp_module

    monkeypatch.setattr(dcp_module, "MAX_CHUNKS", 1000)
    src = mf.dcp_save(tmp_path / "c", {"model": {"w": torch.ones(4)}})
    md = mf.read_metadata(src)
    entry = md.state_dict_metadata["model.w"]
    entry.chunks = [entry.chunks[0]] * 5000
    mf.write_metadata(src, md)
    refused_everywhere(tmp_path, src, "entry 'model.w' has 5000 chunks, more than the 1000")


@pytest.mark.parametrize("depth", [70, 900, 5000])
def test_safetensors_json_metadata_nested_deep(tmp_path: Path, depth: int) -> None:
    """hpcx.meta is JSON inside a header string: nested deep, it would recurse when printed."""
    meta = "[" * depth + "]" * depth
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.ones(2)}, {"hpcx.meta": '{"a": ' + meta + "}"})
    refused_everywhere(tmp_path, src, "__metadata__ hpcx.meta")
