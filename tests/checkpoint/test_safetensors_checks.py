"""safetensors inputs that are malformed, lie about their bytes, or come with an index that lies:
each is one ``error:`` line per problem (exit 2) naming the file, for inspect, convert and verify,
and nothing is written."""

from __future__ import annotations

import base64
import io
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import malformed as mf  # noqa: E402
from ckpt_helpers import assert_refused, cli, refused_everywhere  # noqa: E402

from hpc.ckpt.safetensors import SafetensorsReader  # noqa: E402
from hpc.core.errors import CheckpointError  # noqa: E402

F4 = b"\x00\x00\x80\x3f" * 4  # four float32 ones


MALFORMED = {
    "header-list": ([], "header is a list"),
    "header-string": ("w", "header is a string"),
    "header-number": (3, "header is a number"),
    "header-null": (None, "header is null"),
    "entry-list": ({"w": [1, 2]}, "tensor 'w' is a list"),
    "entry-string": ({"w": "F32"}, "tensor 'w' is a string"),
    "entry-number": ({"w": 4}, "tensor 'w' is a number"),
    "entry-null": ({"w": None}, "tensor 'w' is null"),
    "no-data_offsets": ({"w": {"dtype": "F32", "shape": [1]}}, "has no data_offsets"),
    "no-dtype": ({"w": {"shape": [1], "data_offsets": [0, 4]}}, "has no dtype"),
    "no-shape": ({"w": {"dtype": "F32", "data_offsets": [0, 4]}}, "has no shape"),
    "empty-entry": ({"w": {}}, "has no dtype or shape or data_offsets"),
    "offsets-strings": ({"w": mf.entry(offsets=["0", "4"])}, "data_offsets ['0', '4']"),
    "offsets-floats": ({"w": mf.entry(offsets=[0.0, 4.0])}, "data_offsets [0.0, 4.0]"),
    "offsets-one": ({"w": mf.entry(offsets=[4])}, "expected [begin, end]"),
    "offsets-three": ({"w": mf.entry(offsets=[0, 4, 8])}, "expected [begin, end]"),
    "offsets-negative": ({"w": mf.entry(offsets=[-8, 4])}, "data_offsets [-8, 4]"),
    "offsets-bools": ({"w": mf.entry(offsets=[False, True])}, "expected [begin, end]"),
    "offsets-null": ({"w": mf.entry(offsets=None)}, "data_offsets None"),
    "offsets-object": ({"w": mf.entry(offsets={"b": 0})}, "expected [begin, end]"),
    "shape-letters": ({"w": mf.entry(shape=["a"])}, "shape ['a']"),
    "shape-negative": ({"w": mf.entry(shape=[-4])}, "shape [-4]"),
    "shape-floats-1e6": ({"w": mf.entry(shape=[1e6, 1e6])}, "shape [1000000.0, 1000000.0]"),
    "shape-fraction": ({"w": mf.entry(shape=[1.5])}, "non-negative integers"),
    "shape-string": ({"w": mf.entry(shape="4")}, "shape '4'"),
    "shape-null": ({"w": mf.entry(shape=None)}, "shape None"),
    "shape-bool": ({"w": mf.entry(shape=[True])}, "shape [True]"),
    "shape-nested": ({"w": mf.entry(shape=[[1]])}, "shape [[1]]"),
    "dtype-unknown": ({"w": mf.entry(dtype="F33")}, "dtype 'F33'"),
    "dtype-number": ({"w": mf.entry(dtype=32)}, "dtype 32"),
    "dtype-lowercase": ({"w": mf.entry(dtype="f32")}, "dtype 'f32'"),
    "dtype-null": ({"w": mf.entry(dtype=None)}, "dtype None"),
    "metadata-list": ({"__metadata__": ["a"], "w": mf.entry()}, "__metadata__ is a list"),
    "metadata-string": ({"__metadata__": "x", "w": mf.entry()}, "__metadata__ is a string"),
    "metadata-number-value": ({"__metadata__": {"format": 1}, "w": mf.entry()}, "__metadata__['format'] is a number"),
    "metadata-object-value": ({"__metadata__": {"a": {}}, "w": mf.entry()}, "__metadata__['a'] is an object"),
    "metadata-null-value": ({"__metadata__": {"a": None}, "w": mf.entry()}, "__metadata__['a'] is null"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_header_is_one_line_per_problem(tmp_path: Path, case: str) -> None:
    header, expect = MALFORMED[case]
    src = mf.write_st(tmp_path / "x.safetensors", header, F4[:4])
    refused_everywhere(tmp_path, src, expect)


RAW = {  # (header bytes or None, whole-file bytes or None, expected)
    "duplicate-key": (b'{"w":' + json.dumps(mf.entry()).encode() + b',"w":' + json.dumps(mf.entry()).encode() + b"}",
                      None, "'w' appears twice"),
    "nan-literal": (b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', None, "NaN is not JSON"),
    "infinity-literal": (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,Infinity]}}', None, "Infinity is not JSON"),
    "invalid-json": (b'{"w": {"dtype": "F32"', None, "not valid JSON"),
    "trailing-garbage": (b"{}xyz", None, "not valid JSON"),
    "not-utf8": (b'{"w\xff\xfe": 1}', None, "not UTF-8"),
    "deep-nesting": (b"[" * 100_000 + b"]" * 100_000, None, "nested deeper than 8 levels"),
    "deep-objects": (b'{"a":' * 40 + b"1" + b"}" * 40, None, "nested deeper than 8 levels"),
    "deep-in-metadata": (b'{"__metadata__":{"k":' + b"[" * 20 + b"]" * 20 + b"}}", None, "nested deeper"),
    "length-zero": (None, mf.st_bytes(b"", F4), "not valid JSON"),
    "length-past-end": (None, mf.st_bytes(b"{}", b"", length=4096), "header length 4096 runs past the end"),
    "length-huge": (None, mf.st_bytes(b"{}", b"", length=2**63), "runs past the end"),
    "empty-file": (None, b"", "(0 bytes)"),
    "five-bytes": (None, b"\x02\x00\x00\x00\x00", "5 bytes long"),
}


@pytest.mark.parametrize("case", sorted(RAW))
def test_unparsable_header_is_one_line(tmp_path: Path, case: str) -> None:
    header, whole, expect = RAW[case]
    src = tmp_path / "x.safetensors"
    src.write_bytes(whole if whole is not None else mf.st_bytes(header, F4[:4]))
    refused_everywhere(tmp_path, src, expect)


LIES = {  # header, data, expected
    "4096-floats-over-4-bytes": ({"w": mf.entry(shape=[4096], offsets=[0, 4])}, F4[:4], "16384 bytes, but its data_offsets [0, 4] span 4"),
    "offsets-past-eof": ({"w": mf.entry(shape=[4], offsets=[0, 16])}, F4[:8], "past the end of the data (8 bytes)"),
    "begin-after-end": ({"w": mf.entry(shape=[1], offsets=[8, 4])}, F4[:8], "begin is after end"),
    "overlap": ({"a": mf.entry(shape=[4], offsets=[0, 16]), "b": mf.entry(shape=[4], offsets=[8, 24])},
                F4 + F4[:8], "tensors 'a' and 'b' overlap at data bytes 8..16"),
    "same-range": ({"a": mf.entry(shape=[2], offsets=[0, 8]), "b": mf.entry(shape=[2], offsets=[0, 8])},
                   F4[:8], "overlap"),
    "empty-tensor-inside-another": ({"a": mf.entry(shape=[2], offsets=[0, 8]), "z": mf.entry(shape=[0], offsets=[4, 4])},
                                    F4[:8], "overlap"),
    "shape-larger-than-span": ({"w": mf.entry(shape=[8], offsets=[0, 16])}, F4, "32 bytes, but its data_offsets"),
    "shape-smaller-than-span": ({"w": mf.entry(shape=[2], offsets=[0, 16])}, F4, "8 bytes, but its data_offsets"),
    "bf16-odd-span": ({"w": mf.entry(dtype="BF16", shape=[3], offsets=[0, 4])}, F4[:4], "BF16[3], 6 bytes"),
    "zero-numel-nonzero-span": ({"w": mf.entry(shape=[0, 4], offsets=[0, 16])}, F4, "0 bytes, but its data_offsets"),
    "huge-int-shape": ({"w": mf.entry(shape=[1000000, 1000000], offsets=[0, 4])}, F4[:4], "4000000000000 bytes"),
    "gap-between": ({"a": mf.entry(shape=[2], offsets=[0, 8]), "b": mf.entry(shape=[2], offsets=[16, 24])},
                    F4 + F4[:8], "data bytes 8..16 belong to no tensor"),
    "gap-at-start": ({"a": mf.entry(shape=[2], offsets=[4, 12])}, F4[:12], "data bytes 0..4 belong to no tensor"),
    "trailing-bytes": ({"a": mf.entry(shape=[2], offsets=[0, 8])}, F4[:12], "4 bytes after the last tensor"),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_lying_header_is_refused_like_safetensors_refuses_it(tmp_path: Path, case: str) -> None:
    import safetensors.torch

    header, data, expect = LIES[case]
    src = mf.write_st(tmp_path / "x.safetensors", header, data)
    refused_everywhere(tmp_path, src, expect)
    with pytest.raises(Exception):  # the reference library refuses every one of these too
        safetensors.torch.load_file(src)


def test_every_problem_of_a_file_is_listed(tmp_path: Path) -> None:
    header = {"a": mf.entry(shape=["x"]), "b": mf.entry(dtype="Q"), "c": [], "d": mf.entry(offsets=[4, 0])}
    out = assert_refused(("inspect", mf.write_st(tmp_path / "x.safetensors", header, F4)),
                         "'a'", "'b'", "'c'", "'d'")
    assert len(out.strip().splitlines()) == 4


def test_truncated_file_is_refused_before_reading(tmp_path: Path) -> None:
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.randn(64), "v": torch.randn(8)})
    mf.truncate(src, src.stat().st_size - 1)
    refused_everywhere(tmp_path, src, "past the end of the data")


def test_a_file_that_shrinks_after_it_was_checked_is_an_error_not_stale_bytes(tmp_path: Path) -> None:
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.randn(1024)})
    reader = SafetensorsReader(src)
    try:
        mf.truncate(src, src.stat().st_size - 100)
        with pytest.raises(CheckpointError, match="truncated"):
            reader.read("model.w")
    finally:
        reader.close()


def objects_blob(obj: object) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode()


HPCX_METADATA = {
    "objects-not-base64": ({"hpcx.objects": "%%%"}, "is not base64"),
    "objects-not-torch": ({"hpcx.objects": base64.b64encode(b"garbage").decode()}, "refused the non-tensor entries"),
    "objects-a-list": ({"hpcx.objects": objects_blob([1, 2])}, "holds a list"),
    "paths-not-json": ({"hpcx.paths": "{"}, "hpcx.paths is not JSON"),
    "paths-not-lists": ({"hpcx.paths": json.dumps({"model.w": "model"})}, "object path of 'model.w'"),
    "paths-negative-index": ({"hpcx.paths": json.dumps({"model.w": ["model", -1]})}, "object path of 'model.w'"),
    "paths-huge-index": ({"hpcx.paths": json.dumps({"model.w": ["model", 10**12]})}, "object path of 'model.w'"),
    "paths-a-list": ({"hpcx.paths": "[1]"}, "expected a mapping"),
    "meta-a-list": ({"hpcx.meta": "[1]"}, "hpcx.meta is a list"),
    "meta-not-json": ({"hpcx.meta": "nope"}, "hpcx.meta is not JSON"),
}


@pytest.mark.parametrize("case", sorted(HPCX_METADATA))
def test_hpcx_metadata_that_lies_is_one_line(tmp_path: Path, case: str) -> None:
    metadata, expect = HPCX_METADATA[case]
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.ones(2)}, metadata)
    refused_everywhere(tmp_path, src, expect)


def test_planted_pickle_in_safetensors_metadata_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    blob = base64.b64encode(pickle.dumps({"x": mf.Planted(marker)}, protocol=2)).decode()
    src = mf.valid_st(tmp_path / "x.safetensors", {"w": torch.ones(2)}, {"hpcx.objects": blob})
    refused_everywhere(tmp_path, src, "refused")
    assert not marker.exists()


# ---------------------------------------------------------------- index


def two_shards() -> dict:
    return {"s1.safetensors": {"a": torch.ones(2)}, "s2.safetensors": {"b": torch.zeros(3)}}


INDEX_LIES = {
    "ghost-tensor": ({"a": "s1.safetensors", "b": "s2.safetensors", "ghost": "s1.safetensors"},
                     "lists 'ghost' in s1.safetensors, which does not hold it"),
    "wrong-shard": ({"a": "s2.safetensors", "b": "s2.safetensors", "x": "s1.safetensors"},
                    "lists 'a' in s2.safetensors, which does not hold it (it is in s1.safetensors)"),
    "missing-shard": ({"a": "s1.safetensors", "b": "s3.safetensors"}, "s3.safetensors: missing"),
}


@pytest.mark.parametrize("case", ["ghost-tensor", "wrong-shard", "missing-shard"])
def test_index_that_lies_about_its_shards(tmp_path: Path, case: str) -> None:
    weight_map, expect = INDEX_LIES[case]
    src = mf.st_index(tmp_path / "st", weight_map, two_shards())
    refused_everywhere(tmp_path, src, expect)


def test_a_shard_tensor_the_index_does_not_list_and_one_in_two_shards(tmp_path: Path) -> None:
    shards = {"s1.safetensors": {"a": torch.ones(2), "extra": torch.ones(1)}, "s2.safetensors": {"b": torch.ones(1)}}
    src = mf.st_index(tmp_path / "st", {"a": "s1.safetensors", "b": "s2.safetensors"}, shards)
    refused_everywhere(tmp_path, src, "holds 'extra', which model.safetensors.index.json does not list")
    shards = {"s1.safetensors": {"a": torch.ones(2)}, "s2.safetensors": {"a": torch.ones(2), "b": torch.ones(1)}}
    src = mf.st_index(tmp_path / "st2", {"a": "s1.safetensors", "b": "s2.safetensors"}, shards)
    refused_everywhere(tmp_path, src, "tensor 'a' is in s1.safetensors and s2.safetensors")


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABS", "sub/x.safetensors", "..", ".", "",
                                  "s1.safetensors/../../outside.safetensors"])
def test_index_naming_a_file_outside_its_folder_is_reported_as_traversal(tmp_path: Path, name: str) -> None:
    mf.valid_st(tmp_path / "outside.safetensors", {"b": torch.zeros(3)})  # exists: not "missing"
    (tmp_path / "st" / "sub").mkdir(parents=True)
    mf.valid_st(tmp_path / "st" / "sub" / "x.safetensors", {"b": torch.zeros(3)})
    name = str(tmp_path / "outside.safetensors") if name == "ABS" else name
    src = mf.st_index(tmp_path / "st", {"a": "s1.safetensors", "b": name}, {"s1.safetensors": {"a": torch.ones(2)}})
    refused_everywhere(tmp_path, src, "points outside the folder")


BAD_INDEX = {
    "weight-map-list": (json.dumps({"weight_map": ["s1.safetensors"]}), "weight_map that is a list"),
    "weight-map-string": (json.dumps({"weight_map": "s1.safetensors"}), "weight_map that is a string"),
    "no-weight-map": (json.dumps({"metadata": {}}), "weight_map that is null"),
    "index-a-list": ("[]", "has a list"),
    "value-number": (json.dumps({"weight_map": {"a": 1}}), "weight_map['a'] is a number"),
    "value-null": (json.dumps({"weight_map": {"a": None}}), "weight_map['a'] is null"),
    "value-list": (json.dumps({"weight_map": {"a": ["s1.safetensors"]}}), "weight_map['a'] is a list"),
    "value-object": (json.dumps({"weight_map": {"a": {}}}), "weight_map['a'] is an object"),
    "not-json": ("{weight_map", "not a JSON safetensors index"),
    "nan": ('{"weight_map": {"a": NaN}}', "not a JSON safetensors index"),
    "duplicate-key": ('{"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}}', "appears twice"),
}


@pytest.mark.parametrize("case", sorted(BAD_INDEX))
def test_malformed_index_is_one_line(tmp_path: Path, case: str) -> None:
    raw, expect = BAD_INDEX[case]
    src = mf.st_index(tmp_path / "st", None, {"s1.safetensors": {"a": torch.ones(2)}}, raw=raw)
    refused_everywhere(tmp_path, src, "model.safetensors.index.json", expect)


def test_a_folder_without_index_needs_exactly_one_file(tmp_path: Path) -> None:
    (tmp_path / "two").mkdir()
    mf.valid_st(tmp_path / "two" / "a.safetensors", {"a": torch.ones(1)})
    mf.valid_st(tmp_path / "two" / "b.safetensors", {"b": torch.ones(1)})
    refused_everywhere(tmp_path, tmp_path / "two", "found 2 files")
    (tmp_path / "empty").mkdir()
    refused_everywhere(tmp_path, tmp_path / "empty", "neither a DCP .metadata nor .safetensors")


# ---------------------------------------------------------------- what must still pass


def test_valid_edge_cases_are_accepted(tmp_path: Path) -> None:
    cases = {
        "empty-header.safetensors": ({}, b""),
        "metadata-only.safetensors": ({"__metadata__": {"format": "pt"}}, b""),
        "scalar-and-empty.safetensors": ({"s": mf.entry(shape=[], offsets=[0, 4]), "e": mf.entry(shape=[0, 3], offsets=[4, 4])},
                                         F4[:4]),
        "padded.safetensors": (json.dumps({"w": mf.entry()}).encode() + b"        ", F4[:4]),
    }
    for name, (header, data) in cases.items():
        code, out = cli("inspect", mf.write_st(tmp_path / name, header, data))
        assert code == 0 and "complete:     True" in out, (name, out)


def test_files_from_the_safetensors_library_convert_bit_exact(tmp_path: Path) -> None:
    import safetensors.torch

    g = torch.Generator().manual_seed(0)
    state = {"f32": torch.randn(5, 7, generator=g), "bf16": torch.randn(3, generator=g).bfloat16(),
             "f16": torch.randn(4, 2, generator=g).half(), "i64": torch.arange(-3, 3), "u8": torch.arange(7).to(torch.uint8),
             "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(1.5), "empty": torch.zeros(0, 2),
             "u16": torch.arange(5).to(torch.uint16), "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn)}
    safetensors.torch.save_file(state, tmp_path / "lib.safetensors")
    assert cli("inspect", tmp_path / "lib.safetensors")[0] == 0
    for to, dst in (("dcp", "o.dcp"), ("torch", "o.pt"), ("safetensors", "o.safetensors")):
        assert cli("convert", tmp_path / "lib.safetensors", tmp_path / dst, "--to", to)[0] == 0
        assert cli("verify", tmp_path / "lib.safetensors", tmp_path / dst)[0] == 0
    back = safetensors.torch.load_file(tmp_path / "o.safetensors")
    assert all(torch.equal(back[f"model.{k}"].reshape(-1).view(torch.uint8), state[k].reshape(-1).view(torch.uint8)) for k in state)
