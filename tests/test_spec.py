"""Strict loading of job specs and site profiles, driven by the corpus of broken files.

Each file under tests/corpus/ starts with `# expect:` lines: the exact messages
(with the file's path written as FILE) that loading it must produce, in order.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.config import ConfigError, apply_overrides, parse_override
from hpc.resolve import resolve
from hpc.site import choose_site, list_sites, load_site
from hpc.spec import load_spec, looks_secret, spec_from_dict

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


def test_corpus_is_large_enough():
    assert len(list(CORPUS.glob("*/*.toml"))) >= 30


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
        assert all("\n" not in m for m in expected(path)), path


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

    from hpc.site import SECTIONS as SITE_SECTIONS
    from hpc.spec import SECTIONS

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
