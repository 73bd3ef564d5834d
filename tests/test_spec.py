"""Strict loading of job specs and site profiles, driven by the corpus of broken files.

Each file under tests/corpus/ starts with `# expect:` lines: the exact messages
(with the file's path written as FILE) that loading it must produce, in order;
`# expect: nothing` means it must load cleanly.

`specs/`, `sites/` and `cross/` are the first corpus. Every other folder is one class of input
defect (tests/corpus/README.md lists them); its files may carry more headers, read by
`run_case`: `# kind:` spec (default), site, cross (with `# site:`) or site-root (load the site,
then expand its run root); `# fixture:` files made in a temporary folder first; `# env:` /
`# unset:` environment for the load (`# env-escaped:` reads \\t, \\x1b …); `# set:` a --set override;
`# path:` load this path instead of the file; `# cwd:` the current folder. TMP in the file or its
headers is that temporary folder; the file itself is copied there (byte for byte otherwise) and
loaded as FILE.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpc.core.config import ConfigError, apply_overrides, parse_override
from hpc.plan.resolve import resolve
from hpc.core.site import choose_site, list_sites, load_site
from hpc.core.spec import load_spec, looks_secret, spec_from_dict

CORPUS = Path(__file__).parent / "corpus"
REPO = Path(__file__).resolve().parents[1]


def expected(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [line[len("# expect: "):].replace("FILE", str(path), 1) for line in lines if line.startswith("# expect: ")]


def header(path: Path, key: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in path.read_text().splitlines()
                if line.startswith(f"# {key}:"))


def messages(fn) -> list[str]:
    with pytest.raises(ConfigError) as info:
        fn()
    return info.value.messages


FIRST = ("specs", "sites", "cross")
CLASSES = sorted(p.name for p in CORPUS.iterdir() if p.is_dir() and p.name not in FIRST)


def test_corpus_is_large_enough():
    assert len(list(CORPUS.glob("*/*.toml"))) >= 30
    for name in CLASSES:
        assert len(list((CORPUS / name).glob("*.toml"))) >= 8, f"corpus class {name} has fewer than 8 cases"


def headers(path: Path, key: str) -> list[str]:
    prefix = f"# {key}: ".encode()
    lines = path.read_bytes().removeprefix(b"\xef\xbb\xbf").splitlines()
    return [line[len(prefix):].decode() for line in lines if line.startswith(prefix)]


def make_fixture(spec: str, tmp: Path) -> None:
    """`tokens NAME DTYPE COUNT MAX` (ids cycling 0..MAX, MAX last), `zeros-then NAME DTYPE COUNT MAX`,
    `bytes NAME N`, `text NAME N`, `fifo NAME`, `dir NAME`, `symlink NAME TARGET`, `socket NAME`."""
    import array
    import os
    import socket

    kind, name, *args = spec.split()
    target = tmp / name
    if kind == "tokens":
        dtype, count, top = args[0], int(args[1]), int(args[2])
        ids = [i % (top + 1) for i in range(count - 1)] + [top]  # cycling, and the largest id last
        with target.open("wb") as f:
            array.array("H" if dtype == "uint16" else "I", ids).tofile(f)
    elif kind == "zeros-then":  # COUNT tokens of 0, the last one MAX: only a read of the end finds it
        dtype, count, top = args[0], int(args[1]), int(args[2])
        width = 2 if dtype == "uint16" else 4
        target.write_bytes(b"\0" * (width * (count - 1)) + top.to_bytes(width, sys.byteorder))
    elif kind == "bytes":
        target.write_bytes(b"\0" * int(args[0]))
    elif kind == "text":
        target.write_text("# " + "x" * (int(args[0]) - 3) + "\n")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    elif kind == "symlink":
        target.symlink_to(args[0].replace("TMP", str(tmp)))
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(target))
        sock.close()
    else:
        raise AssertionError(f"unknown fixture {spec!r}")


def run_case(path: Path, tmp: Path, monkeypatch) -> list[str] | None:
    """Load one class-corpus file as its headers say; the messages, or None when it loads cleanly."""
    path = path.resolve()
    for spec in headers(path, "fixture"):
        make_fixture(spec.replace("TMP", str(tmp)), tmp)
    for item in headers(path, "env") + [h.encode().decode("unicode_escape") for h in headers(path, "env-escaped")]:
        name, value = item.split("=", 1)
        monkeypatch.setenv(name, value.replace("TMP", str(tmp)))
    for name in headers(path, "unset"):
        monkeypatch.delenv(name, raising=False)
    for folder in headers(path, "cwd"):
        monkeypatch.chdir(folder.replace("TMP", str(tmp)))
    copy = tmp / path.name
    copy.write_bytes(path.read_bytes().replace(b"TMP", str(tmp).encode()))
    target = Path(headers(path, "path")[0].replace("TMP", str(tmp))) if headers(path, "path") else copy
    overrides = [o.replace("TMP", str(tmp)) for o in headers(path, "set")]
    kind = (headers(path, "kind") or ["spec"])[0]
    load = {
        "spec": lambda: load_spec(target, overrides),
        "site": lambda: load_site(str(target)),
        "site-root": lambda: load_site(str(target)).run_root(),
        "cross": lambda: resolve(load_spec(target, overrides), load_site(headers(path, "site")[0])),
    }[kind]
    try:
        load()
    except ConfigError as exc:
        return [m.replace(str(tmp), "TMP") for m in exc.messages]
    return None


def class_cases() -> list[Path]:
    return sorted(p for name in CLASSES for p in (CORPUS / name).glob("*.toml"))


@pytest.mark.parametrize("path", class_cases(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_class_corpus(path: Path, tmp_path: Path, monkeypatch):
    want = [line.replace("FILE", str(tmp_path / path.name), 1).replace(str(tmp_path), "TMP")
            for line in headers(path, "expect")]
    got = run_case(path, tmp_path, monkeypatch)
    assert got == (None if want == ["nothing"] else want)


@pytest.mark.parametrize("path", sorted((CORPUS / "specs").glob("*.toml")), ids=lambda p: p.stem)
def test_broken_spec(path: Path):
    assert messages(lambda: load_spec(path)) == expected(path)


@pytest.mark.parametrize("path", sorted((CORPUS / "cross").glob("*.toml")), ids=lambda p: p.stem)
def test_cross_check(path: Path):
    site = load_site(header(path, "site"))
    assert messages(lambda: resolve(load_spec(path), site)) == expected(path)


@pytest.mark.parametrize("path", sorted((CORPUS / "sites").glob("*.toml")), ids=lambda p: p.stem)
def test_broken_site(path: Path):
    assert messages(lambda: load_site(str(path))) == expected(path)


def test_every_message_is_one_line():
    for path in CORPUS.glob("*/*.toml"):
        assert all("\n" not in m for m in headers(path, "expect")), path
        assert headers(path, "expect"), f"{path} states no expectation"


@pytest.mark.parametrize("name", list_sites())
def test_shipped_sites_load(name: str):
    site = load_site(name)
    assert site.name == name
    assert site.scheduler.kind in ("slurm", "local")


def test_shipped_sites_are_the_promised_ones():
    assert {"local", "sandbox", "dgx-h100", "pcie-4gpu"} <= set(list_sites())
    dgx, pcie = load_site("dgx-h100"), load_site("pcie-4gpu")
    assert (dgx.node.gpus, dgx.node.intra_link, dgx.network.fabric) == (8, "nvswitch", "infiniband")
    assert (pcie.node.gpus, pcie.node.intra_link, pcie.network.fabric) == (4, "pcie", "ethernet")
    assert pcie.scheduler.gpu_directive == "gres"


@pytest.mark.parametrize("path", sorted((REPO / "jobs").glob("*.toml")), ids=lambda p: p.stem)
def test_example_jobs_load(path: Path):
    spec = load_spec(path)
    assert spec.job.name


def test_defaults_are_documented():
    import dataclasses

    from hpc.core.site import SECTIONS as SITE_SECTIONS
    from hpc.core.spec import SECTIONS

    for cls in list(SECTIONS.values()) + list(SITE_SECTIONS.values()):
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("doc", "")) > 10, f"{cls.__name__}.{f.name} has no doc"


def test_overrides_apply_and_are_validated(tmp_path: Path):
    spec = load_spec(REPO / "jobs/tiny-ddp.toml", ["train.steps=7", "job.name=\"x y\"", "parallel.strategy=fsdp"])
    assert (spec.train.steps, spec.job.name, spec.parallel.strategy) == (7, "x y", "fsdp")
    assert messages(lambda: load_spec(REPO / "jobs/tiny-ddp.toml", ["train.stpes=7"])) == [
        f"{REPO / 'jobs/tiny-ddp.toml'}: unknown key `train.stpes`: did you mean `train.steps`?"]
    assert messages(lambda: load_spec(REPO / "jobs/tiny-ddp.toml", ["train.steps=many"])) == [
        f"{REPO / 'jobs/tiny-ddp.toml'}: `train.steps` = 'many' (str): expected an integer"]


def test_override_syntax():
    assert parse_override("train.lr=1e-3") == (["train", "lr"], 1e-3)
    assert parse_override("job.name=hello world") == (["job", "name"], "hello world")
    assert apply_overrides({"train": {"steps": 1}}, ["train.steps=2"]) == {"train": {"steps": 2}}
    with pytest.raises(ConfigError):
        parse_override("steps")
    with pytest.raises(ConfigError):
        parse_override("steps=3")


def test_missing_file_is_one_line(tmp_path: Path):
    missing = tmp_path / "nope.toml"
    assert messages(lambda: load_spec(missing)) == [f"{missing}: no such file"]


def test_secret_names():
    for name in ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "WANDB_API_KEY", "DB_PASSWORD", "my_secret"):
        assert looks_secret(name)
    for name in ("NCCL_DEBUG", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        assert not looks_secret(name)


def test_site_selection_order(monkeypatch):
    monkeypatch.delenv("HPCX_SITE", raising=False)
    assert choose_site(None, None) == "local"
    assert choose_site(None, "sandbox") == "sandbox"
    monkeypatch.setenv("HPCX_SITE", "dgx-h100")
    assert choose_site(None, "sandbox") == "dgx-h100"
    assert choose_site("pcie-4gpu", "sandbox") == "pcie-4gpu"


def test_unknown_site_suggests():
    [message] = messages(lambda: load_site("sandbx"))
    assert message.startswith("--site 'sandbx': no such site profile (did you mean `sandbox`?); searched ")


def test_resolve_numbers():
    spec = load_spec(REPO / "jobs/tiny-hsdp-2node.toml")
    launch = resolve(spec, load_site("sandbox"))
    assert (launch.world_size, launch.dims.dp_replicate, launch.dims.dp_shard, launch.grad_accum) == (4, 2, 2, 1)
    spec = load_spec(REPO / "jobs/tiny-ddp.toml")
    launch = resolve(spec, load_site("local"))
    assert (launch.world_size, launch.grad_accum, launch.backend) == (2, 4, "gloo")


@pytest.mark.parametrize("kind", ["spec", "site"])
def test_reference_docs_are_current(kind: str):
    from hpc.docs import reference

    committed = (REPO / "docs" / f"{kind}.md").read_text()
    assert committed == reference(kind), f"regenerate: python -m hpc.docs {kind} > docs/{kind}.md"


@pytest.mark.parametrize("missing", [{"seq_len": 128}, {"vocab_size": 1000}, {}])
def test_a_user_model_states_its_context_and_vocabulary_at_login(missing):
    needed = {"seq_len", "vocab_size"} - set(missing)
    found = messages(lambda: spec_from_dict({"model": {"arch": "pkg.mod:build", **missing}}, "u.toml"))
    assert found == [f"u.toml: `model.{key}` must be set for the user model 'pkg.mod:build' (0 means the preset's, "
                     "and a user model has none)" for key in ("seq_len", "vocab_size") if key in needed]


def test_a_user_model_may_state_a_70b_parameter_count():
    spec = spec_from_dict({"model": {"arch": "pkg.mod:build", "seq_len": 4096, "vocab_size": 128256,
                                     "n_params": 70_553_706_496, "n_layers": 80, "dim": 8192}})
    assert spec.model.n_params == 70_553_706_496
