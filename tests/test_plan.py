"""The planner: the seeds' scenarios as table-driven cases, the α-β model by hand, the CLI."""

from __future__ import annotations

import json

import pytest

from hpc.comm import Group, Link, group_link, ring_bytes, ring_seconds, step_comm
from hpc.config import ConfigError
from hpc.memory import GB, Config, model_states
from hpc.models import gpt_facts
from hpc.models import gpt_shape
from hpc.dims import ParallelDims, parallel_dims
from hpc.plan import choose, format_plan, plan_job
from hpc.site import load_site, parse_site
from hpc.spec import spec_from_dict

from tests.conftest import REPO, hpcx


def site(gpus: int, mem: float, link: str, intra: float, fabric: str = "infiniband", net: float = 400.0,
         host: float = 2048.0, peak: float = 989.0):
    doc = {"scheduler": {"kind": "slurm", "gpu_directive": "gpus-per-node"},
           "node": {"gpus": gpus, "gpu_memory_gb": mem, "gpu_peak_tflops": peak, "memory_gb": host, "cpus": 64,
                    "intra_link": link if gpus > 1 else "none", "intra_bandwidth_gbs": intra},
           "network": {"fabric": fabric, "bandwidth_gbs": net}}
    return parse_site(doc, "test", "<test>")


def spec(size: str, nodes: int = 1, global_batch: int = 0, micro: int = 1, ac: bool = True, offload: bool = False,
         tpn: int = 0, strategy: str = "auto"):
    return spec_from_dict({"job": {"nodes": nodes, "tasks_per_node": tpn},
                           "model": {"size": size},
                           "train": {"global_batch": global_batch or 8, "micro_batch": micro},
                           "parallel": {"strategy": strategy, "mixed_precision": "bf16",
                                        "activation_checkpointing": ac, "cpu_offload": offload}})


NVSWITCH_8X80 = dict(gpus=8, mem=80, link="nvswitch", intra=450)
PCIE_4X80 = dict(gpus=4, mem=80, link="pcie", intra=25, fabric="ethernet", net=3)
ONE_24GB = dict(gpus=1, mem=24, link="none", intra=0, fabric="none", net=0, peak=165)

# (name, site, spec kwargs, expected label prefix, words the recommendation must contain)
SCENARIOS = [
    ("350M on 8x80GB NVSwitch -> DDP", NVSWITCH_8X80, dict(size="350m", global_batch=64, micro=8, ac=False),
     "ddp", ["least communication", "under 1B parameters → DDP': agrees"]),
    ("7B on 4x80GB PCIe -> FSDP", PCIE_4X80, dict(size="6.7b", global_batch=16),
     "fsdp", ["110 GB total", "full replica (ddp) does not fit", "1–10B parameters → FSDP': agrees"]),
    ("13B on 4 nodes x 8x80GB -> HSDP shard 8", NVSWITCH_8X80, dict(size="13b", nodes=4, global_batch=512),
     "hsdp 8", ["26.2 GB", "inside one node", "offload is not needed"]),
    ("70B on 16 nodes x 8x80GB -> shard group over several nodes", NVSWITCH_8X80,
     dict(size="70b", nodes=16, global_batch=1024), "hsdp 32", ["spans 4 nodes", "sharded over one node it needs"]),
    # Seeds' table: 1-10B -> FSDP; the numbers say DDP fits on 80 GB and all-reduces less.
    ("1.3B on 8x80GB departs from '1-10B -> FSDP'", NVSWITCH_8X80, dict(size="1.3b", global_batch=64, micro=4),
     "ddp", ["departs — DDP fits", "since FSDP all-gathers every micro-batch"]),
    # Seeds' table: >10B -> FSDP + CPU offload; on one 8x80GB node sharding alone fits.
    ("13B on one 8x80GB node: no offload needed", NVSWITCH_8X80, dict(size="13b", global_batch=64),
     "fsdp", ["offload is not needed"]),
    # Seeds' table: GPU < 40 GB -> FSDP; a 350M model still fits DDP on 4x24 GB.
    ("350M on 4x24GB PCIe: DDP still fits", dict(PCIE_4X80, mem=24), dict(size="350m", global_batch=16),
     "ddp", ["agrees"]),
    # Seeds' decision tree: under 1B and fits one GPU -> no parallelism.
    ("125M on one GPU -> none", ONE_24GB, dict(size="125m", global_batch=4), "none", ["fits one GPU → no parallelism': none agrees"]),
    # Seeds: PCIe-only -> weigh the communication: small micro-batches on PCIe are communication-bound.
    # With no accumulation, shard_grad_op's bf16 all-gather + fp32 reduce-scatter (6 B/param) beats
    # DDP's fp32 all-reduce (8 B/param), and on PCIe that is most of the step.
    ("1.3B on 4x80GB PCIe, micro 1 -> communication-bound", PCIE_4X80, dict(size="1.3b", global_batch=4),
     "fsdp shard_grad_op", ["communication-bound on pcie", "least communication"]),
]


@pytest.mark.parametrize("name,site_kw,spec_kw,expected,words", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_seed_scenarios(name, site_kw, spec_kw, expected, words):
    plan = plan_job(spec(**spec_kw), site(**site_kw))
    assert plan.choice is not None, format_plan(plan)
    assert plan.choice.label.startswith(expected), format_plan(plan)
    text = " ".join(plan.recommendation)
    for word in words:
        assert word in text, f"{word!r} not in: {text}"


def test_7b_model_states_do_not_fit_one_gpu_but_sharded_do():
    plan = plan_job(spec("6.7b", global_batch=16), site(**PCIE_4X80))
    ddp = next(r for r in plan.rows if r.label == "ddp")
    full = next(r for r in plan.rows if r.label == "fsdp full_shard")
    assert ddp.memory.params + ddp.memory.grads + ddp.memory.optimizer == pytest.approx(16 * 6.863462400, rel=1e-6)
    assert full.memory.params + full.memory.grads + full.memory.optimizer == pytest.approx(16 * 6.8634624 / 4, rel=1e-6)
    assert ddp.fits is False and full.fits is True


def test_7b_on_one_24gb_gpu_needs_offload_and_host_memory():
    small = plan_job(spec("6.7b", global_batch=1), site(**ONE_24GB))
    assert small.choice is None
    advice = " ".join(small.advice)
    assert "Nothing fits: the leanest, none" in advice
    assert "cpu_offload = true: fsdp full_shard + offload fits" in advice
    assert "host 110 GB per node" in advice
    offload = plan_job(spec("6.7b", global_batch=1, offload=True), site(**ONE_24GB))
    assert offload.choice is not None and offload.choice.label == "fsdp full_shard + offload"
    dims = choose(spec("6.7b", global_batch=1, offload=True), site(**ONE_24GB), 1)[0]
    assert (dims.strategy, dims.sharding) == ("fsdp", "full_shard")
    too_little_host = plan_job(spec("6.7b", global_batch=1, offload=True), site(**dict(ONE_24GB, host=64)))
    assert too_little_host.choice is None
    assert "no (host)" in format_plan(too_little_host)


def test_auto_with_nothing_fitting_is_a_config_error_that_says_what_would():
    with pytest.raises(ConfigError) as err:
        choose(spec("6.7b", global_batch=1), site(**ONE_24GB), 1)
    text = "\n".join(err.value.messages)
    assert "no strategy fits gpt 6.7b" in text and "cpu_offload = true" in text


def test_70b_node_sized_shard_does_not_fit():
    plan = plan_job(spec("70b", nodes=16, global_batch=1024), site(**NVSWITCH_8X80))
    node = [r for r in plan.rows if r.label.startswith("hsdp 8 ")]
    assert node and all(r.fits is False for r in node)
    states = node[0].memory.params + node[0].memory.grads + node[0].memory.optimizer
    assert states == pytest.approx(16 * 65.268105216 / 8, rel=1e-6)  # 130 GB per GPU > 80 GB
    assert plan.choice.dims.dp_shard > 8


def test_explicit_strategy_is_respected():
    assert choose(spec("70b", strategy="ddp", global_batch=8), site(**NVSWITCH_8X80), 1) == \
        (ParallelDims("ddp", "full_shard", 8, 1), ["strategy 'ddp' set in the spec"])
    s = spec("tiny", nodes=2, strategy="hsdp", global_batch=16)
    assert choose(s, site(**NVSWITCH_8X80), 2)[0] == ParallelDims("hsdp", "full_shard", 2, 8)


def test_shipped_job_resolves_to_the_plan():
    from hpc.resolve import resolve
    from hpc.spec import load_spec

    s = load_spec(REPO / "jobs" / "gpt-13b-auto.toml")
    launch = resolve(s, load_site("dgx-h100"))
    plan = plan_job(s, load_site("dgx-h100"))
    assert launch.dims == plan.choice.dims and launch.dims.dp_shard == 8 and launch.dims.dp_replicate == 4
    assert launch.plan_reasons == plan.recommendation


def test_cpu_site_plans_host_memory():
    s = spec_from_dict({"model": {"size": "tiny"}, "train": {"global_batch": 4, "micro_batch": 2}})
    plan = plan_job(s, load_site("local"))
    assert plan.choice.label == "ddp"
    assert any("CPU site" in n for n in plan.notes)
    assert choose(s, load_site("local"), 1)[0].strategy == "ddp"


def test_user_model_activations_unknown():
    s = spec_from_dict({"model": {"arch": "pkg.mod:build", "seq_len": 128, "vocab_size": 1000}, "train": {"global_batch": 8}})
    plan = plan_job(s, site(**NVSWITCH_8X80))
    assert plan.n_params is None and plan.choice is None
    assert choose(s, site(**NVSWITCH_8X80), 1)[0] == ParallelDims("fsdp", "full_shard", 1, 8)
    assert "parameters unknown" in format_plan(plan)


def test_gpt_activations_unknown_only_for_user_models():
    from hpc.memory import estimate
    from hpc.models import ModelFacts

    facts = ModelFacts("user", 1000, 100, 100, 4, None, seq_len=8, vocab_size=16)
    mem = estimate(facts, Config(parallel_dims("ddp", "full_shard", 1), False, "none", False, 1), 1)
    assert mem.activations is None and any("activations unknown" in n for n in mem.notes)


# --- the α-β model, checked by hand ------------------------------------------------------------

def test_ring_formulas_by_hand():
    # 4 ranks, 1 GB message, 100 GB/s, 10 µs: all-reduce sends 2·3/4·1 GB = 1.5 GB;
    # time = 1.5 GB / 100 GB/s + 2·3·10 µs = 0.015 + 0.00006 s.
    link = Link(100.0, 10.0, "nvlink")
    assert ring_bytes("all_reduce", 1 * GB, 4) == pytest.approx(1.5 * GB)
    assert ring_seconds("all_reduce", 1 * GB, 4, link) == pytest.approx(0.015 + 6e-5)
    # all-gather: 3/4 GB, 0.0075 s + 3 steps × 10 µs per call, 2 calls
    assert ring_seconds("all_gather", 1 * GB, 4, link, calls=2) == pytest.approx(0.0075 + 6e-5)
    assert ring_seconds("all_reduce", 1 * GB, 1, link) == 0.0


def test_group_bandwidth_inside_and_across_nodes():
    s = site(**NVSWITCH_8X80)
    assert group_link(Group(8, 8), s, 8).bandwidth_gbs == 450  # one node: NVSwitch
    assert group_link(Group(32, 8), s, 8).bandwidth_gbs == 400  # ring over 4 nodes: min(450, 400)
    assert group_link(Group(4, 1), s, 8).bandwidth_gbs == 50  # 8 replica groups share the node's 400 GB/s


def test_ddp_step_comm_by_hand():
    # tiny GPT (135808 params), 2 ranks on one node at 10 GB/s, 5 µs: one fp32 all-reduce per step
    s = site(gpus=2, mem=80, link="pcie", intra=10)
    facts = gpt_facts("tiny", gpt_shape("tiny"))
    comm = step_comm(facts, Config(parallel_dims("ddp", "full_shard", 2), False, "none", False, 1), s, 1, 2, grad_accum=4)
    message = 135808 * 4
    assert comm.gb == pytest.approx(message / GB)  # 2·(1/2)·M
    assert comm.seconds == pytest.approx(message / (10 * GB) + 2 * 1 * 5e-6)  # one 25 MB bucket


def test_fsdp_step_comm_by_hand():
    s = site(gpus=2, mem=80, link="pcie", intra=10)
    shape = gpt_shape("tiny")
    facts = gpt_facts("tiny", shape)
    comm = step_comm(facts, Config(parallel_dims("fsdp", "full_shard", 2), False, "bf16", False, 1), s, 1, 2, grad_accum=3)
    n, root = shape.n_params, shape.embedding_params + shape.head_params
    sent = 3 * 0.5 * (2 * n + 2 * (n - root) + 4 * n)  # AG fwd + AG bwd (bf16) + RS (fp32), per micro-batch
    assert comm.gb == pytest.approx(sent / GB)


def test_model_states_are_16_bytes_per_parameter_divided_by_the_shard():
    cfg = Config(parallel_dims("fsdp", "full_shard", 4), False, "bf16", False, 1)
    assert sum(model_states(1000, cfg)) == 16 * 250


# --- the command line ---------------------------------------------------------------------------

def test_plan_cli_text_and_json():
    out = hpcx("plan", "jobs/gpt-13b-auto.toml", "--site", "dgx-h100")
    assert out.returncode == 0, out.stderr
    assert "recommendation: hsdp 8" in out.stdout and "comm s" in out.stdout
    out = hpcx("plan", "jobs/gpt-13b-auto.toml", "--site", "dgx-h100", "--nodes", "16", "--json")
    doc = json.loads(out.stdout)
    assert doc["world_size"] == 128 and doc["choice"]["strategy"] in ("hsdp", "fsdp")


def test_plan_cli_errors_exit_2_without_traceback():
    out = hpcx("plan", "jobs/gpt-13b-auto.toml", "--site", "dgx-h100", "--set", "train.global_batch=7")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "global_batch" in out.stderr
