"""The task seam (``[task]``, ``trainer.tasks``): what the login side checks, what the trainer refuses
of a task's code (one line naming it), the built-in language model as a task, the examples' pieces
(ResNet-style, BERT-style judged by transformers), and `hpcx plan` of BERT-large on one A100 node.

The runs themselves (DDP and FSDP, drills, status and plot) are tests/resilience/test_tasks_local.py
and tests/slurm/test_tasks_slurm.py."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hpc.core.errors import ConfigError
from hpc.core.models import TASK, family, model_facts
from hpc.core.spec import spec_from_dict
from tests.conftest import REPO, hpcx
from tests.extras import extra

RESNET = {"task": {"target": "examples.resnet:ImageTask", "kwargs": {"width": 8, "train_samples": 64}}}


def problems(doc: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        spec_from_dict(doc)
    return [m.removeprefix("<spec>: ") for m in info.value.messages]


# ---------------------------------------------------------------- the login side, torch-free


def test_a_task_spec_hands_the_model_to_the_task_and_round_trips():
    spec = spec_from_dict({**RESNET, "train": {"global_batch": 8}})
    assert spec.model.arch == TASK and spec.model.seq_len == 1 and family(spec.model.arch).name == TASK
    facts = model_facts(spec.model)
    assert facts.n_params is None and not facts.builtin and facts.family == TASK
    again = spec_from_dict(spec.to_dict())  # resolved.json as the job reads it
    assert again.task == spec.task and again.model.arch == TASK
    assert "task" not in spec_from_dict({}).to_dict()  # a language model's resolved.json is as it was


@pytest.mark.parametrize("doc,expected", [
    ({"task": {"target": "os:Task"}}, "`task.target` = 'os:Task': `os` is Python's own, not a task"),
    ({"task": {"target": "pkg.mod"}}, "`task.target` = 'pkg.mod': expected 'package.module:Class'"),
    ({"task": {"target": "pkg.class:Task"}}, "`task.target` = 'pkg.class:Task': expected 'package.module:Class'"),
    ({"task": {"target": "a:B", "kwargs": {"for": 1}}}, "`task.kwargs` key 'for' is a Python keyword"),
    ({"task": {"target": "a:B"}, "model": {"size": "small"}}, "`model.size` = 'small' is set, but `[model]` is the task's"),
    ({"task": {"target": "a:B"}, "model": {"arch": "gpt"}}, "`model.arch` = 'gpt' is set, but `[model]` is the task's"),
    ({"task": {"target": "a:B"}, "data": {"source": "/x/tokens.bin"}}, "`data.source` = '/x/tokens.bin' is for the built-in"),
    ({"task": {"target": "a:B"}, "checkpoint": {"init_from": "/w"}}, "`checkpoint.init_from` is for the built-in families"),
    ({"model": {"arch": TASK}}, f"`model.arch` = {TASK!r} is set by `[task]`: set `task.target`"),
    ({"task": {"target": "a:B", "tokens_per_sample": 0}}, "`task.tokens_per_sample`"),
    ({"task": {"target": "a:B", "kwargs": {"api_token": "x"}}}, "`task.kwargs.api_token` looks like a secret"),
])
def test_a_wrong_task_spec_is_one_line_naming_the_key(doc, expected):
    found = problems(doc)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.parametrize("strategy,tasks,expected", [
    ("none", 1, "the strategy is 'none': it synchronizes across processes"),
    ("dp", 1, "the strategy is 'dp': it synchronizes across processes"),
    ("auto", 1, "the strategy is 'none' (the planner's choice for `auto`)"),
    ("ddp", 2, None), ("fsdp", 2, None), ("hsdp", 2, None), ("auto", 2, None),
])
def test_sync_batchnorm_is_refused_in_one_line_where_no_ranks_share_statistics(strategy, tasks, expected):
    from hpc.core.site import load_site
    from hpc.plan.resolve import resolve

    doc = {**RESNET, "task": {**RESNET["task"], "sync_batchnorm": True}, "job": {"tasks_per_node": tasks},
           "parallel": {"strategy": strategy, **({"shard_size": 1} if strategy == "hsdp" else {})}}
    spec = spec_from_dict(doc)
    if expected is None:
        assert resolve(spec, load_site("local")).dims.strategy in ("ddp", "fsdp", "hsdp")
        return
    with pytest.raises(ConfigError) as info:
        resolve(spec, load_site("local"))
    assert len(info.value.messages) == 1 and expected in info.value.messages[0] and "`task.sync_batchnorm`" in \
        info.value.messages[0]


def test_sync_batchnorm_without_a_task_is_one_line_and_the_command_exits_2():
    assert problems({"task": {"sync_batchnorm": True}}) == [
        "`task.sync_batchnorm` = true, but there is no task: the built-in language models have no BatchNorm "
        "(set `task.target`, or remove it)"]
    out = hpcx("render", str(REPO / "jobs" / "resnet-ddp.toml"), "--set", "task.sync_batchnorm=true",
               "--set", "parallel.strategy='none'", "--set", "job.tasks_per_node=1")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_the_task_is_named_in_render_and_submit_notices():
    from hpc.login.render import user_code_notice

    notice = user_code_notice(spec_from_dict(RESNET))
    assert "'examples.resnet'" in notice and "ImageTask(width, train_samples)" in notice and "task.target" in notice


def test_status_and_the_summary_show_a_tasks_metric_and_keep_a_language_models_words():
    from hpc.login.status import eval_text

    assert eval_text({"eval_loss": 2.0, "eval_perplexity": 7.389}, "  ") == "  eval loss 2.0000 (perplexity 7.39)"
    assert (eval_text({"eval_loss": 0.25, "eval_perplexity": None, "eval_metrics": {"eval_accuracy": 0.9375}}, ", ")
            == ", eval loss 0.2500, accuracy 0.9375")
    assert eval_text({"eval_loss": 0.5, "eval_accuracy": 0.5, "eval_samples": 64, "eval_s": 0.1}, "") == \
        "eval loss 0.5000, accuracy 0.5"
    assert eval_text({}, "  ") == ""


# ---------------------------------------------------------------- the trainer's side: strict


GOOD = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset


class Good:
    def build_model(self):
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))

    def units(self, model):
        return nn.ModuleList([model[1]])

    def train_dataset(self):
        return TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))

    def loss(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)
'''

BROKEN = GOOD + '''

class NoLoss:
    def build_model(self):
        return nn.Linear(2, 2)

    def units(self, model):
        return nn.ModuleList([model])

    def train_dataset(self):
        return []


class NotAModule(Good):
    def build_model(self):
        return "model"


class NoUnits(Good):
    def units(self, model):
        return [model[1]]


class Iterable(Good):
    def train_dataset(self):
        return iter(range(4))


class LossPerSample(Good):
    def loss(self, model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="none")


class IntLoss(Good):
    def loss(self, model, batch):
        return 3


class BadMetrics(Good):
    def metrics(self, model, batch):
        return {"accuracy": 0.5}


class BadPretrained(Good):
    def pretrained(self, model):
        return {"0.weight": torch.zeros(3, 3)}
'''


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(textwrap.dedent(BROKEN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("my_tasks", None)


def seam(name: str, **kwargs):
    from trainer.tasks import task_for

    return task_for(spec_from_dict({"task": {"target": f"my_tasks:{name}", "kwargs": kwargs}}))


def batch_of(task):
    ds = task.train_dataset()
    return task.collate([ds[i] for i in range(4)])


@pytest.mark.parametrize("name,call,expected", [
    ("NoLoss", None, "the task has no loss(): a task defines build_model(), units(), train_dataset(), loss()"),
    ("Missing", None, "module 'my_tasks' has no class 'Missing'"),
    ("NotAModule", "meta_model", "build_model() returned str, expected an nn.Module"),
    ("NoUnits", "blocks", "units(model) returned list, expected a non-empty nn.ModuleList"),
    ("Iterable", "train_dataset", "train_dataset() returned range_iterator, expected a map-style Dataset"),
    ("LossPerSample", "loss", "loss(model, batch) returned a torch.float32 tensor of shape (4,), expected a float scalar"),
    ("IntLoss", "loss", "loss(model, batch) returned int, expected a float scalar tensor"),
    ("BadMetrics", "metrics", "metrics(model, batch) gave 'accuracy' as float: expected {name: (sum, count)}"),
    ("BadPretrained", "pretrained", "pretrained(model) does not fit the model"),
])
def test_a_task_that_lacks_a_piece_or_returns_the_wrong_thing_is_one_line_naming_it(user_tasks, name, call, expected):
    with pytest.raises(ConfigError) as info:
        task = seam(name)
        model = task.meta_model()
        if call == "blocks":
            task.blocks(model)
        if call == "train_dataset":
            task.train_dataset()
        model = model.to_empty(device="cpu")
        if call in ("loss", "metrics"):
            batch = batch_of(task)
            task.micro_loss(model, batch, 1.0, torch.autocast("cpu", enabled=False)) if call == "loss" else \
                task.eval_terms(model, batch, 4, torch.autocast("cpu", enabled=False))
        if call == "pretrained":
            task.start_weights(model)
    (message,) = info.value.messages
    assert message.startswith(f"`task.target` = 'my_tasks:{name}': ") and expected in message, message
    from hpc.core.failures import would_repeat

    assert would_repeat(info.value, "train", 0)  # not requeued: a restart would fail the same way


def test_kwargs_the_class_does_not_take_are_one_line(user_tasks):
    with pytest.raises(ConfigError, match=r"Good\(\*\*task.kwargs\) raised TypeError: Good\(\) takes no arguments"):
        seam("Good", width=3)


def test_a_good_tasks_micro_loss_is_its_loss_scaled_and_eval_terms_count_samples(user_tasks):
    task = seam("Good")
    model = task.meta_model().to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p)
    batch = batch_of(task)
    off = torch.autocast("cpu", enabled=False)
    loss = task.task.loss(model, batch)
    assert torch.equal(task.micro_loss(model, batch, 0.25, off), loss * 0.25)
    assert task.step_scale([batch, batch], 2) == 0.5 and task.tokens_per_sample == 1
    terms = task.eval_terms(model, batch, 4, off)
    assert terms.dtype == torch.float64 and terms.tolist() == [loss.double().item() * 4, 4.0]
    assert task.eval_record([2.0, 4.0]) == {"eval_loss": 0.5}
    assert task.state_dict() == {} and len(task.blocks(model)) == 1


# ---------------------------------------------------------------- the built-in language model as a task


def test_the_language_model_task_computes_what_the_objective_does():
    from trainer.model import build_model
    from trainer.objective import micro_loss, token_losses
    from trainer.tasks import task_for
    from trainer.tasks.lm import LanguageModelTask

    spec = spec_from_dict({"model": {"size": "tiny"}})
    task = task_for(spec, "synthetic")
    assert isinstance(task, LanguageModelTask) and task.tokens_per_sample == model_facts(spec.model).seq_len
    torch.manual_seed(0)
    model = build_model(spec.model, "cpu")
    dataset = task.train_dataset()
    tokens = task.collate([dataset[i] for i in range(3)])
    mask = torch.rand(tokens.shape) < 0.5
    off = torch.autocast("cpu", enabled=False)
    logits = model(tokens[:, :-1])
    assert torch.equal(task.micro_loss(model, tokens, 0.5, off), micro_loss(logits, tokens, None, 0.5))
    assert torch.equal(task.micro_loss(model, (tokens, mask), 2.0, off), micro_loss(logits, tokens, mask, 2.0))
    terms = task.eval_terms(model, tokens, 3, off)
    assert torch.equal(terms, torch.stack([token_losses(logits, tokens).double().sum(),
                                           torch.tensor(float(tokens[:, 1:].numel()), dtype=torch.float64)]))
    record = task.eval_record(terms.tolist())
    assert list(record) == ["eval_loss", "eval_perplexity", "eval_tokens"]


# ---------------------------------------------------------------- the examples' pieces


def test_the_generated_images_are_the_same_from_the_seed_and_the_resnet_counts_on_meta():
    from trainer.model import missing_resets
    from trainer.tasks import task_for

    task = task_for(spec_from_dict(RESNET))
    a, b = task.train_dataset(), task.train_dataset()
    assert len(a) == 64 and all(torch.equal(a[i][0], b[i][0]) and int(a[i][1]) == int(b[i][1]) for i in (0, 7, 63))
    assert not torch.equal(a[0][0], a[1][0])
    model = task.meta_model()
    assert all(p.is_meta for p in model.parameters()) and missing_resets(model) == []
    assert len(task.blocks(model)) == 2


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A tiny BertForSequenceClassification, saved with save_pretrained (nothing downloaded)."""
    transformers = extra("transformers")
    folder = tmp_path_factory.mktemp("bert-tiny")
    config = transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=48, max_position_embeddings=32, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(3)
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_the_bert_task_on_hpcx_initialised_weights_then_pretrained_equals_transformers(tiny_bert):
    """The model built on meta, materialized by hpcx (WeightInit), then the saved weights: loss and
    logits equal transformers' own from_pretrained on the same batch."""
    from transformers import BertForSequenceClassification

    from trainer.model import WeightInit
    from trainer.tasks import task_for

    task = task_for(spec_from_dict({"task": {"target": "examples.bert:SequenceClassificationTask",
                                             "kwargs": {"pretrained": str(tiny_bert), "seq_len": 12}}}))
    model = task.meta_model()
    WeightInit.of(model, 0).materialize(model, torch.device("cpu"))
    task.start_weights(model)
    reference = BertForSequenceClassification.from_pretrained(tiny_bert).train()
    batch = batch_of(task)
    assert batch["input_ids"].shape == (4, 12) and int(batch["attention_mask"].sum()) < 48  # padded
    off = torch.autocast("cpu", enabled=False)
    assert task.micro_loss(model, batch, 1.0, off).item() == reference(**batch).loss.item()
    terms = task.eval_terms(model, batch, 4, off)
    logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert terms[2].item() == (logits.argmax(-1) == batch["labels"]).sum().item() and terms[3].item() == 4


A100 = """
[scheduler]
kind = "slurm"
partition = "gpu"
gpu_directive = "gpus-per-node"

[node]
gpus = 8
gpu_model = "NVIDIA A100-SXM4-80GB"
gpu_memory_gb = 80
gpu_peak_tflops = 312
cpus = 128
memory_gb = 1024
intra_link = "nvswitch"
intra_bandwidth_gbs = 300
intra_latency_us = 3

[network]
fabric = "infiniband"
bandwidth_gbs = 200
latency_us = 5
"""


def test_plan_of_bert_large_on_one_a100_node_picks_ddp(tmp_path):
    """BERT-large (335M) fine-tuning on 512-token sequences, counted on the meta device: DDP."""
    transformers = extra("transformers")
    folder = tmp_path / "bert-large"
    transformers.BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, num_labels=2).save_pretrained(folder)
    (tmp_path / "a100.toml").write_text(A100)
    out = hpcx("plan", str(REPO / "jobs" / "bert-ddp.toml"), "--site", str(tmp_path / "a100.toml"), "--json",
               "--set", f"task.kwargs.pretrained={json.dumps(str(folder))}", "--set", "parallel.strategy='auto'",
               "--set", "train.global_batch=256", "--set", "train.micro_batch=8",
               "--set", "task.tokens_per_sample=512", timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert 330e6 < plan["n_params"] < 340e6 and "counted" in plan["model"]
    assert plan["choice"]["strategy"] == "ddp" and plan["world_size"] == 8, plan["recommendation"]


@pytest.mark.slow
def test_dryrun_of_bert_large_with_fsdp_on_eight_ranks_shards_the_task_model_by_its_layers(tmp_path):
    """The real size on the fake process group: the task's model built on meta, 24 encoder layers + the
    root as FSDP units, rank 3's eighth of 335M parameters."""
    transformers = extra("transformers")
    folder = tmp_path / "bert-large"
    transformers.BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096, num_labels=2).save_pretrained(folder)
    (tmp_path / "a100.toml").write_text(A100)
    out = hpcx("dryrun", str(REPO / "jobs" / "bert-fsdp.toml"), "--site", str(tmp_path / "a100.toml"), "--json",
               "--rank", "3", "--set", f"task.kwargs.pretrained={json.dumps(str(folder))}",
               "--set", "train.global_batch=64", "--set", "train.micro_batch=8", timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["world_size"] == 8 and result["layout"].startswith("fsdp full_shard") and result["problems"] == []
    assert 330e6 < result["n_params"] < 340e6 and len(result["units"]) == 25
    assert abs(result["measured"]["params"] * 8 / 4 - result["n_params"]) < 1e5  # fp32 bytes of one eighth
