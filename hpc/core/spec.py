"""The job spec: one TOML file, one dataclass per section.

Each component takes only its own section (``spec.train``, ``spec.parallel`` …).
``load_spec`` reports every problem in the file at once; ``cross_check``
validates the arithmetic against a site and prints the numbers it used.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import typing as tp
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc import schedulers
from hpc.core import runroot, validate as v
from hpc.core.container import JobContainer
from hpc.core.health import Health
from hpc.core.config import ConfigError, apply_overrides, build_document, field, read_toml, untouched
from hpc.core.lora import Lora, lora_problems, without_rank
from hpc.core.manifest import (PREPARED, check_data_source, check_validation, source_kind, split_samples,
                               val_split_source)
from hpc.core.optim import SCHEDULES, Optim, adamw_fields_given, optim_problems
from hpc.core.models import DEFAULT_ARCH, FAMILIES, model_facts, model_problems, section_class
from hpc.core.tasks import Task, apply_task, class_problems, task_problems, without_target
from hpc.core.validate import looks_secret  # noqa: F401  (re-exported: the one secret-name policy)
from hpc.core.workload import TaskWorkload, Workload, workload_of

STRATEGIES = ("auto", "none", "dp", "ddp", "fsdp", "hsdp")
SHARDINGS = ("full_shard", "shard_grad_op", "no_shard")


@dataclass
class Job:
    name: str = field("hpcx", doc="Job name shown by Slurm (`--job-name`) and the start of the run folder's "
                      "name: printable, not empty, not starting with `-`.", max_len=v.NAME_MAX)
    nodes: int = field(1, doc="Number of nodes.", minimum=1)
    tasks_per_node: int = field(0, doc="Tasks (ranks) per node; one per GPU. 0: the site's GPUs per "
                                "node, or its CPU task count.", minimum=0, maximum=schedulers.LIMITS["tasks"])
    cpus_per_task: int = field(0, doc="CPU cores per task (0: the node's cores divided by the tasks).",
                               minimum=0, maximum=schedulers.LIMITS["cpus"])
    time_limit_min: int = field(60, doc="Wall-clock limit in minutes (`--time`).", minimum=1,
                                maximum=schedulers.LIMITS["time_limit_min"])
    partition: str | None = field(None, doc="Overrides the site's partition.")
    account: str | None = field(None, doc="Overrides the site's account.")
    qos: str | None = field(None, doc="Overrides the site's QOS.")
    max_requeues: int = field(3, doc="How many times a preempted or timed-out job is requeued.",
                              minimum=0, maximum=schedulers.LIMITS["requeues"])
    signal_lead_s: int = field(0, doc="Seconds of warning before the time limit (0: the site's value).",
                               minimum=0, maximum=schedulers.LIMITS["signal_lead_s"])
    site: str | None = field(None, doc="Site profile to use when neither --site nor $HPCX_SITE is given.")
    run_root: str | None = field(None, doc="Where this job's run folder goes (default: the site's run root). "
                                 "Absolute, or starting with `~` or `$VAR` (expanded when the spec is "
                                 "loaded; an unset variable is an error); no `%` or `\\`, which Slurm "
                                 "would read in log file names. Runs made here are found again by "
                                 "`status`/`logs`/`cancel` through an index of run roots.", max_len=v.PATH_MAX)
    command: list[str] = field(doc="Script mode: your own training command as an argument list (never a shell "
                               "string), e.g. `[\"python\", \"train.py\", \"--lr\", \"3e-4\"]`, run on every rank "
                               "in the folder `hpcx submit` ran in, with torchrun's variables (`RANK`, `LOCAL_RANK`, "
                               "`WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` …). `python`/`python3` first is the "
                               "interpreter of the task; anything else is looked up on the task's PATH. Empty: "
                               "hpcx's trainer. With a command, `[model]`, `[data]`, `[train]`, `[parallel]` and "
                               "`[checkpoint]` do not apply and are refused. See docs/tasks.md.",
                               factory=list, max_len=v.PATH_MAX)


@dataclass
class CommonModel:
    """The spec's ``[model]`` section: these fields, which every family has, then each family's own
    (``Family.fields`` in ``hpc/core/models/<family>.py``, joined by ``hpc.core.models.section_class``
    into ``Model`` when it is first asked for)."""

    arch: str = field(DEFAULT_ARCH, doc=f"A built-in family ({', '.join(f'`{a}`' for a in FAMILIES)}) or "
                      "`package.module:function` returning an nn.Module: dotted Python identifiers, not a module "
                      "of the standard library; `render` and `submit` say which file will be imported.")
    size: str = field("tiny", doc="Preset of a built-in family, with the real parameter counts listed above.")
    dim: int = field(0, doc="Width (d_model) of a built-in family (0: the preset's); for a user model with "
                     "`n_params`, its width.", minimum=0)
    n_layers: int = field(0, doc="Transformer blocks of a built-in family (0: the preset's); for a user model "
                          "with `n_params`, its number of blocks.", minimum=0)
    n_heads: int = field(0, doc="Attention heads of a built-in family (0: the preset's); must divide `dim`.",
                         minimum=0)
    seq_len: int = field(0, doc="Tokens of a training sample (0: the preset's, or a Llama's `context_len`); "
                         "a Llama may train on samples shorter than its context.", minimum=0)
    vocab_size: int = field(0, doc="Vocabulary size (0: the preset's).", minimum=0)
    tie_embeddings: bool = field(False, doc="The output head reuses the token embedding's matrix "
                                 "(the presets have their own head).")
    dropout: float = field(0.0, doc="Dropout probability, below 1.", minimum=0, maximum=1)
    hf_config: str = field("", doc="A Hugging Face model folder (or its `config.json`): sets `arch` and every "
                           "shape field from it on the login node (the classes listed above); a spec value that "
                           "contradicts it is an error. Relative to the current folder; recorded absolute.",
                           max_len=v.PATH_MAX)


@dataclass
class Data:
    source: str = field("synthetic", doc="`synthetic` (seeded random tokens), a folder made by `hpcx data prepare` "
                        "(or its `manifest.json`: every shard memory-mapped, samples of `seq_len + 1` tokens), or a "
                        "path to a flat `.bin` token file (relative to the current folder; `~` and `$VAR` expanded). "
                        "Checked when the spec is loaded: for a manifest, that its tokenizer fits `model.vocab_size` "
                        "and every file has the size the manifest says (`hpcx data verify` checks the hashes); for "
                        "a `.bin` file, a readable regular file, a whole number of `dtype` tokens, at least one "
                        "sample, and — on up to 4 MiB read from across the file — no token id at or above "
                        "the model's vocabulary.", max_len=v.PATH_MAX)
    dtype: str = field("uint16", doc="Token dtype of a `.bin` file (a manifest names its own).", choices=("uint16", "uint32"))
    shuffle: bool = field(True, doc="Reshuffle the samples each epoch (deterministic from train.seed).")
    num_workers: int = field(-1, doc="DataLoader worker processes per rank; -1: on a site with GPUs half the "
                             "task's CPUs (1 to 4, with pinned memory and persistent workers), on a CPU site 0.",
                             minimum=-1, maximum=1024)
    val_source: str = field("", doc="What `train.eval_every` evaluates on: empty for the validation split of "
                            "`data.source`'s manifest, a folder made by `hpcx data prepare` (its validation split, "
                            "else its train split), or `none`.", max_len=v.PATH_MAX)
    packing: str = field("causal", doc="What a window of `seq_len` tokens lets its documents see: `causal` "
                         "(every token attends to every earlier one of the window, the documents before it "
                         "included) or `document` (positions restart at each document, attention stays inside "
                         "it, and no target across a boundary is counted: a packed batch's loss per counted "
                         "token is that of its documents run one by one). `document` needs a folder made by "
                         "`hpcx data prepare` (its index records where each document starts) and a built-in "
                         "model; it attends through flex_attention's block mask on a GPU and SDPA per "
                         "document on a CPU, no dense mask (`hpcx plan` counts what each holds). See "
                         "docs/data.md.", choices=("causal", "document"))


def loader_workers(num_workers: int, gpus: bool, cpus_per_task: int) -> int:
    """``data.num_workers`` for a launch: -1 is half the task's CPUs (1–4) where there are GPUs, else 0."""
    if num_workers >= 0:
        return num_workers
    return min(4, max(1, cpus_per_task // 2)) if gpus else 0


@dataclass
class Train:
    steps: int = field(100, doc="Optimizer steps to run.", minimum=1)
    global_batch: int = field(8, doc="Samples per optimizer step across all ranks.", minimum=1)
    micro_batch: int = field(1, doc="Samples per rank per forward/backward; the gradient-accumulation "
                             "count is global_batch / (ranks × micro_batch).", minimum=1)
    optimizer: str = field("adamw", doc="Kept for older specs: the optimizer is `optim.name` (AdamW by default).",
                           choices=("adamw",))
    lr: float = field(3e-4, doc="Peak learning rate, of any optimizer.", minimum=0)
    min_lr_ratio: float = field(0.1, doc="Final LR of the `cosine`, `linear` and `onecycle` schedules as a fraction "
                                "of `lr`.", minimum=0, maximum=1)
    warmup_steps: int = field(10, doc="Linear warm-up steps, from `lr / warmup_steps` to `lr`, before every "
                              "schedule (`onecycle`: its cosine rise; 0 there is 30% of the steps, as torch's "
                              "`pct_start`).", minimum=0)
    schedule: str = field("cosine", doc="LR schedule after warm-up: `cosine` (down to `min_lr_ratio × lr` at the "
                          "last step), `constant`, `linear` (straight down to `min_lr_ratio × lr`), `step` (× "
                          "`optim.gamma` every `optim.step_size` steps), `multistep` (× `optim.gamma` at each of "
                          "`optim.milestones`), `onecycle` (from `lr / optim.div_factor` up to `lr` and down to "
                          "`min_lr_ratio × lr`, both halves cosine). See docs/spec.md.", choices=SCHEDULES)
    weight_decay: float = field(0.1, doc="AdamW's weight decay (other optimizers: `optim.kwargs.weight_decay`).",
                                minimum=0)
    betas: list[float] = field(doc="AdamW's betas (other optimizers: `optim.kwargs.betas`).",
                               factory=lambda: [0.9, 0.95])
    grad_clip: float = field(1.0, doc="Clip the global gradient norm to this (0: off).", minimum=0)
    seed: int = field(0, doc="Seed for model init, data order and dropout.", minimum=0, maximum=v.SEED_MAX)
    deterministic: bool = field(False, doc="Deterministic kernels (`torch.use_deterministic_algorithms`, "
                                "cuBLAS's fixed workspace, cuDNN's deterministic mode): on a GPU a resumed run then "
                                "equals an uninterrupted one bit for bit (without it, attention's backward adds with "
                                "atomics: the last bits may differ); slower, and an op with no deterministic kernel "
                                "fails naming itself. See docs/checkpoints.md.")
    log_every: int = field(10, doc="Write a metrics line every N steps (reading the loss waits for the GPU: "
                           "the steps in between never do).", minimum=1)
    warmup_metrics_steps: int = field(2, doc="Leading steps left out of throughput summaries.", minimum=0)
    gc_every: int = field(50, doc="Python's automatic garbage collection is off during training; every rank "
                          "collects after every N-th step, together (0: Python's automatic collector).", minimum=0)
    eval_every: int = field(0, doc="Evaluate on `data.val_source` every N steps and after the last (0: never): "
                            "mean loss and perplexity over the same samples at every world size.", minimum=0)
    early_stop_patience: int = field(0, doc="Stop after this many evaluations in a row without an improvement of "
                                     "the watched metric (`checkpoint.keep_best`'s, else `eval_loss`), saved, as "
                                     "completed; a resumed run counts on (0: never). Needs `eval_every`.", minimum=0)
    early_stop_min_delta: float = field(0.0, doc="An evaluation improves only when better than the best so far by "
                                        "more than this.", minimum=0)
    eval_steps: int = field(10, doc="Batches of `global_batch` samples per evaluation (the validation samples "
                            "in order, from the first; 0: the whole split). Each sample counts once: a split "
                            "that holds fewer is evaluated whole (`hpcx submit` says so).", minimum=0)


@dataclass
class Parallel:
    strategy: str = field("auto", doc="`auto` (the planner's choice), `none`, `dp`, `ddp`, `fsdp` or `hsdp`.",
                          choices=STRATEGIES)
    sharding: str = field("full_shard", doc="FSDP sharding: full_shard, shard_grad_op or no_shard.",
                          choices=SHARDINGS)
    shard_size: int = field(0, doc="HSDP shard group size (0: one node's ranks).", minimum=0)
    tp: int = field(1, doc="Tensor-parallel degree (1: none): each block's matrices split over groups of `tp` "
                    "ranks within one node (fsdp or hsdp shard over the rest); must divide the node's GPUs (its "
                    "NVLink domain) and the model's heads and key/value heads. Built-in families only.", minimum=1)
    tp_cross_domain: bool = field(False, doc="Allow a tensor-parallel group wider than the site's NVLink island "
                                  "(`node.nvlink_domain`, e.g. 2 on 4× H100 NVL): its per-layer collectives then "
                                  "run over `node.intra_link` (pcie), and `hpcx plan` says what that costs. Off: "
                                  "`tp` stays within one island, under `auto` too.")
    tp_on_cpu: bool = field(False, doc="Run `tp` > 1 on a site without GPUs (`node.gpus` = 0): its groups are CPU "
                            "processes talking gloo, which only rehearses a tensor-parallel layout (the split "
                            "matrices, the DTensor checkpoints) and saves no time. Off: such a spec is refused.")
    reshard_after_forward: bool = field(True, doc="FSDP2's `reshard_after_forward`. false: each unit's gathered "
                                        "parameters stay gathered from its forward to its backward (as "
                                        "shard_grad_op's do) and across the gradient-accumulation micro-batches of "
                                        "a step (no reshard after backward until the last): one all-gather per unit "
                                        "per step instead of one or two per micro-batch, for the whole unsharded "
                                        "compute copy held all step. fsdp/hsdp only.")
    mixed_precision: str = field("auto", doc="Compute dtype: `auto` (bf16 on a site with GPUs, fp32 on a CPU "
                                 "site), `none` (fp32), `bf16` or `fp16`; reductions stay fp32.",
                                 choices=("auto", "none", "bf16", "fp16"))
    cpu_offload: bool = field(False, doc="Keep sharded parameters, gradients and optimizer state in host memory.")
    activation_checkpointing: bool = field(False, doc="Recompute each block's activations in backward.")
    compile: bool = field(False, doc="torch.compile each block.")
    timeout_s: int = field(600, doc="Collective and rendezvous timeout in seconds while starting, resuming "
                           "and saving.", minimum=1)
    step_timeout_s: int = field(120, doc="Collective timeout once every rank finished its first step (at most "
                                "`timeout_s`: a larger value given is refused, the default is lowered to it): a "
                                "rank that hangs mid-run is noticed this fast.", minimum=1)


def compute_precision(mixed_precision: str, gpus: bool) -> str:
    """``parallel.mixed_precision`` for a site: `auto` is bf16 where the site has GPUs, else `none`."""
    if mixed_precision != "auto":
        return mixed_precision
    return "bf16" if gpus else "none"


@dataclass
class Checkpoint:
    interval_steps: int = field(0, doc="Save every N steps (0: only by minutes, on preemption and at the end).",
                                minimum=0)
    interval_minutes: float = field(0.0, doc="Save every N minutes of training (0: off).", minimum=0)
    keep: int = field(2, doc="Committed checkpoints to keep (at least 2: the newest may be in flight).",
                      minimum=2)
    keep_best: str = field("", doc="An evaluation metric as metrics.jsonl names it (`eval_loss`, `eval_accuracy`; "
                           "`eval/accuracy` is the same): the checkpoint of the best evaluation so far is saved and kept "
                           "beside the newest `keep` until a better one comes; `checkpoints/best.json` names it. "
                           "Needs `train.eval_every`.", max_len=v.NAME_MAX)
    best_mode: str = field("auto", doc="Which way `keep_best` (and early stopping) improves: `min`, `max`, or `auto` "
                           "(`max` for a name with acc, f1, precision, recall, auc, bleu, rouge, score, map, iou, "
                           "dice or correct in it; else `min`).", choices=("auto", "min", "max"))
    async_save: bool = field(False, doc="Save in the background on a separate process group.")
    resume: bool = field(True, doc="Resume from the newest committed checkpoint of the run folder.")
    init_from: str = field("", doc="Start from these weights (model only: step 0, a fresh optimizer and "
                           "schedule): a Hugging Face folder (`config.json` + `model.safetensors` or shards with "
                           "`model.safetensors.index.json`), an hpcx run or step folder (DCP), or one "
                           "`.safetensors`/`torch.save` file. Used only while the run has no checkpoint of its "
                           "own (a requeued fine-tune resumes from its own newest step). Names, shapes and dtypes "
                           "are checked at submit and dryrun from the headers; each rank reads only its shard's "
                           "bytes. Relative to the current folder; recorded absolute.", max_len=v.PATH_MAX)


@dataclass
class Env:
    set: dict[str, str] = field(doc="Environment variables set for every task (values are quoted; "
                                "credential-looking names and values are refused here: use `passthrough`; so "
                                "are the variables Slurm, srun, submitit, torchrun's rendezvous and hpcx set or "
                                "read: `SLURM_*`, `SRUN_*`, `SUBMITIT_*`, `TORCHELASTIC_*`, `HPCX_*`, `RANK`, "
                                "`WORLD_SIZE`, `MASTER_ADDR`, `CUDA_VISIBLE_DEVICES` …).",
                                factory=dict, max_len=v.PATH_MAX)
    passthrough: list[str] = field(doc="Names of variables taken from the submitting shell by name "
                                   "only; their values never reach the script or the run folder. "
                                   "`render` and `submit` warn about names the shell does not set. A name is "
                                   "in `set` or here, not both.",
                                   factory=list)


@dataclass
class JobSpec:
    job: Job
    model: Model
    data: Data
    train: Train
    parallel: Parallel
    checkpoint: Checkpoint
    env: Env
    lora: Lora = dataclasses.field(default_factory=Lora)
    optim: Optim = dataclasses.field(default_factory=Optim)
    task: Task = dataclasses.field(default_factory=Task)
    container: JobContainer = dataclasses.field(default_factory=JobContainer)  # over the site's [container]
    health: Health = dataclasses.field(default_factory=Health)  # node exclusion, hang watchdog (hpc.core.health)
    source: str = ""

    @functools.cached_property
    def workload(self) -> Workload:
        """What the job runs (``hpc.core.workload``), resolved when first asked and kept: the spec is not
        changed after loading (a changed copy, ``dataclasses.replace``, resolves its own)."""
        return workload_of(self)

    def to_dict(self) -> dict[str, tp.Any]:
        out = asdict(self)
        out.pop("source")
        if not isinstance(self.workload, TaskWorkload):  # a language model's resolved.json stays as it was
            out.pop("task")
        return out


if tp.TYPE_CHECKING:  # the class is joined when first asked for: mypy sees the common fields, each family's as Any
    class Model(CommonModel):
        def __getattr__(self, name: str) -> tp.Any: ...


@functools.cache
def sections() -> dict[str, type]:
    """Each section's class by name; ``[model]`` is joined from the families when first asked
    (``hpc.core.models.section_class``), so importing this module loads no family."""
    return {"job": Job, "model": section_class(CommonModel), "data": Data, "train": Train, "parallel": Parallel,
            "checkpoint": Checkpoint, "env": Env, "lora": Lora, "optim": Optim, "task": Task,
            "container": JobContainer, "health": Health}


def __getattr__(name: str) -> tp.Any:
    """``Model`` (the joined ``[model]`` section) and ``SECTIONS``, built when first asked for."""
    if name == "Model":
        return sections()["model"]
    if name == "SECTIONS":
        return sections()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def spec_from_dict(doc: dict, source: str = "<spec>", read_hf_config: bool = True) -> JobSpec:
    """Build and self-check a JobSpec; raises ConfigError listing every problem. With ``read_hf_config``
    a ``model.hf_config`` fills the model's fields from its config.json (a run's resolved.json has
    them already, so the job and the export do not read it again)."""
    errors: list[str] = []
    if read_hf_config and isinstance(doc.get("model"), dict) and doc["model"].get("hf_config"):
        from hpc.core.hf import apply_hf_config  # lazy: startup

        doc = {**doc, "model": dict(doc["model"])}
        errors += apply_hf_config(doc["model"])
    spec = JobSpec(source=source, **build_document(sections(), doc, errors))
    errors += _check_env(doc.get("env"))
    # a field that failed its type check was left at its default: each check runs when its fields are well-typed
    errors += _check_job(spec.job, lambda *keys: _typed(errors, "job", keys))
    if _typed(errors, "job", ("command",)):
        errors += check_command(spec.job.command)
    if _typed(errors, "model", MODEL_SHAPE_FIELDS):
        errors += _check_model(spec.model)
    errors += _check_train(spec.train, spec.model, lambda *keys: _typed(errors, "", keys))
    errors += watch_problems(spec)
    if _typed(errors, "optim", ("name", "kwargs", "step_size", "milestones", "gamma", "div_factor")) and \
            _typed(errors, "train", ("schedule",)):
        errors += optim_problems(spec)
    if _typed(errors, "lora", ("rank", "targets", "trainable")) and not errors:
        errors += lora_problems(spec)
    if _typed(errors, "model", ("kwargs",)):
        errors += v.check_model_kwargs(spec.model.kwargs)
    if _typed(errors, "model", ("blocks",)):
        errors += v.check_model_blocks(spec.model.blocks)
    if _typed(errors, "health", ("hang_timeout_s",)) and _typed(errors, "parallel", ("step_timeout_s", "timeout_s")):
        errors += _check_health(spec)
    if _typed(errors, "task", ("target", "kwargs")):
        errors += task_problems(spec, doc)
        apply_task(spec)
    if errors:
        raise ConfigError([f"{source}: {e}" for e in errors])
    return spec


# The fields ``hpc.core.models.model_problems`` reads.
MODEL_SHAPE_FIELDS = ("arch", "size", "dim", "n_layers", "n_heads", "seq_len", "vocab_size", "tie_embeddings", "n_params")


def _typed(errors: list[str], section: str, keys: tp.Iterable[str]) -> bool:
    """No message so far names ``section`` as a whole or one of its ``keys`` (``hpc.config.untouched``)."""
    return untouched(errors, [f"{section}.{k}" if section else k for k in keys])


def load_spec(path: str | Path, overrides: tp.Sequence[str] = (), paths: bool = True) -> JobSpec:
    """Read, override and check a spec on the login node: besides ``spec_from_dict``'s checks, the run
    root is expanded to an absolute path and the data file is checked (both recorded absolute).
    ``paths=False`` skips the last two, for re-reading the spec of a past run (a report)."""
    path = Path(path)
    doc = apply_overrides(read_toml(path), overrides)
    as_written = [f"{path}: {e}" for e in given_timeouts(doc.get("parallel")) + trainer_sections_given(doc)
                  + given_for_nothing(doc) + adamw_fields_given(doc)]
    try:
        spec = spec_from_dict(doc, str(path))
    except ConfigError as exc:
        raise ConfigError(set_origins(exc.messages + as_written, str(path), overrides)) from None
    errors = as_written + [f"{path}: {e}" for e in (resolve_paths(spec) if paths else [])]
    if errors:
        raise ConfigError(set_origins(errors, str(path), overrides))
    return spec


def set_origins(messages: tp.Sequence[str], source: str, overrides: tp.Sequence[str]) -> list[str]:
    """``FILE: `train.steps` …`` as ``--set: `train.steps` …`` for each message about a value that came
    from ``--set`` (the first key a message names decides)."""
    keys = [item.split("=", 1)[0].strip() for item in overrides]
    return [_named_origin(m, source, keys) for m in messages]


def _named_origin(message: str, source: str, keys: tp.Sequence[str]) -> str:
    body = message.removeprefix(f"{source}: ")
    named = re.search(r"`([^`]*)`", body)
    path = named.group(1).strip("[]") if named else ""  # `[trian]`: a section only --set named
    if path and any(path == k or path.startswith((f"{k}.", f"{k}[", f"{k} ")) or k.startswith(f"{path}.")
                    for k in keys if k):
        return f"--set: {body}"
    return message


def resolve_paths(spec: JobSpec) -> list[str]:
    """Expand ``job.run_root`` and check ``data.source`` where the user is (not inside the job, whose
    environment and file system may differ); both are rewritten as absolute paths."""
    errors = []
    if spec.job.run_root:
        try:
            spec.job.run_root = str(runroot.expand_run_root(spec.job.run_root, f"`job.run_root` = {spec.job.run_root!r}"))
        except ConfigError as exc:
            errors += exc.messages
    if spec.checkpoint.init_from:
        spec.checkpoint.init_from = str(Path(os.path.expandvars(os.path.expanduser(spec.checkpoint.init_from)))
                                        .absolute())
    facts = model_facts(spec.model)
    problems, spec.data.source, kind = check_data_source(spec.data.source, spec.data.dtype, facts.seq_len,
                                                         facts.vocab_size)
    if not problems and spec.data.packing == "document":
        problems += _packing_problems(spec, kind)
    user_task = spec.workload if isinstance(spec.workload, TaskWorkload) else None
    if user_task:  # its class, read from its source (hpcx never imports a user's module here)
        problems += class_problems(user_task)
    if not problems and not user_task:  # a task evaluates on its own eval_dataset()
        more, spec.data.val_source = check_validation(spec.data, spec.train, facts.seq_len, facts.vocab_size, kind)
        problems += more
    return errors + problems


def _packing_problems(spec: JobSpec, kind: str) -> list[str]:
    """``data.packing = "document"`` needs document boundaries (a prepared folder's index) and a model
    whose forward takes them (a built-in family)."""
    if kind != PREPARED:
        what = "synthetic samples" if kind == "synthetic" else "a flat token file"
        return [f"`data.packing` = 'document': `data.source` = {spec.data.source!r} is {what}, which records no "
                "document boundaries: expected a folder made by `hpcx data prepare`"]
    if not model_facts(spec.model).builtin:
        return [f"`data.packing` = 'document': `model.arch` = {spec.model.arch!r} is a user model: expected a "
                "built-in family (its forward takes each position's document number)"]
    return []


def _check_health(spec: JobSpec) -> list[str]:
    """A hang timeout the collective timeout would beat (the waiting ranks fail first, naming no one)."""
    hang, step = spec.health.hang_timeout_s, min(spec.parallel.step_timeout_s, spec.parallel.timeout_s)
    if hang and hang >= step:
        return [f"`health.hang_timeout_s` = {hang:g} is not below the collective timeout "
                f"(`parallel.step_timeout_s` = {step}): expected less, or raise `parallel.step_timeout_s`"]
    return []


def _check_job(job: Job, typed: tp.Callable[..., bool]) -> list[str]:
    errors = v.check_job_name(job.name) if typed("name") else []
    if job.run_root is not None and typed("run_root"):
        errors += runroot.check_run_root("job.run_root", job.run_root)
    return errors


# What ``job.command`` replaces: hpcx's trainer reads these sections, a user's script does not.
TRAINER_SECTIONS = ("model", "data", "train", "parallel", "checkpoint", "lora", "optim", "task")


def check_command(command: list[str]) -> list[str]:
    """``job.command``: a program name without surrounding spaces, no NUL in any argument, and not one
    string holding a whole command line (hpcx never runs a shell; a path with spaces is one program)."""
    if not command:
        return []
    errors: list[str] = []
    if not command[0].strip() or command[0] != command[0].strip():
        errors.append(f"`job.command[0]` = {command[0]!r}: expected the program to run (e.g. \"python\"), "
                      "without surrounding spaces")
    errors += [f"`job.command[{i}]` holds a NUL character: expected plain text"
               for i, arg in enumerate(command) if "\0" in arg]
    words = command[0].split()
    if len(command) == 1 and len(words) > 1 and os.sep not in words[0]:
        errors.append(f"`job.command` = [{command[0]!r}] is one string holding a command line: expected an "
                      f"argument list, e.g. {json_list(words)} (hpcx never runs a shell)")
    return errors


def given_for_nothing(doc: dict) -> list[str]:
    """Keys the file sets that cannot mean anything (checked as written: a run's resolved.json records
    every field): an empty ``job.command``, ``[lora]`` keys with LoRA off, ``[task]`` keys without a task,
    ``parallel.tp_on_cpu`` without a ``tp``."""
    job: dict[str, tp.Any] = doc["job"] if isinstance(doc.get("job"), dict) else {}
    errors = (["`job.command` = []: an empty command runs nothing: give the program and its arguments, e.g. "
               "[\"python\", \"train.py\"], or remove the key to run hpcx's trainer"] if job.get("command") == [] else [])
    return errors + without_rank(doc) + without_target(doc) + tp_on_cpu_without_tp(doc)


def tp_on_cpu_without_tp(doc: dict) -> list[str]:
    """``parallel.tp_on_cpu`` = true with ``parallel.tp`` 1 (or absent): there is no layout to rehearse."""
    given: dict[str, tp.Any] = doc["parallel"] if isinstance(doc.get("parallel"), dict) else {}
    degree = given.get("tp", 1)
    if given.get("tp_on_cpu") is not True or type(degree) is not int or degree != 1:
        return []
    return ["`parallel.tp_on_cpu` = true but `parallel.tp` = 1: there is no tensor-parallel layout to rehearse: "
            "set `parallel.tp` above 1 (or remove `tp_on_cpu`)"]


def trainer_sections_given(doc: dict) -> list[str]:
    """With ``job.command``, each section of hpcx's trainer (``TRAINER_SECTIONS``) the file (or ``--set``)
    gives: it would be silently unused. Checked on the document as written, not on a resolved.json."""
    job = doc.get("job")
    if not isinstance(job, dict) or not job.get("command"):
        return []
    given = [f"`[{name}]`" for name in TRAINER_SECTIONS if name in doc]
    if not given:
        return []
    also = f" (and {', '.join(given[1:])})" if len(given) > 1 else ""
    return [f"{given[0]}{also} configures hpcx's trainer, but `job.command` runs your own script: remove the "
            f"section{'s' if also else ''} (or `job.command`)"]


def json_list(items: tp.Sequence[str]) -> str:
    """``["a", "b"]`` as TOML and JSON write it."""
    return json.dumps(list(items))


def _check_env(env: tp.Any) -> list[str]:
    """Names and values of the raw ``[env]`` table: a name is checked also beside a value of the wrong type
    (which the loader reports), so every problem of an entry is said at once."""
    env = env if isinstance(env, dict) else {}
    table = env.get("set") if isinstance(env.get("set"), dict) else {}
    passthrough = env.get("passthrough") if isinstance(env.get("passthrough"), list) else []
    # the loader reports names with unprintable characters
    table = {k: x for k, x in table.items() if v.first_unprintable(k) is None}
    passthrough = [n for n in passthrough if isinstance(n, str) and v.first_unprintable(n) is None]
    errors = []
    for name in table:
        errors += v.check_env_name(f"env.set.{v.shown(name)}", name)
    for name in passthrough:
        errors += v.check_env_name("env.passthrough", name)
    for name, value in table.items():
        if looks_secret(name):
            errors.append(f"`env.set.{v.shown(name)}` looks like a secret: put \"{v.shown(name)}\" in "
                          "`env.passthrough` and export it in your shell, so its value is never written to disk")
        elif isinstance(value, str) and (kind := v.secret_value_kind(value)):
            errors.append(f"`env.set.{v.shown(name)}` holds what looks like {kind}: pass it by name with "
                          "`env.passthrough`, so its value is never written to disk")
    return errors + v.check_env_names(table, passthrough, schedulers.ENV_OWNERS)


def _check_model(model: Model) -> list[str]:
    return model_problems(model)


def _check_train(train: Train, model: Model, typed: tp.Callable[..., bool]) -> list[str]:
    errors = []
    if typed("train.betas") and (len(train.betas) != 2 or not all(0 <= b < 1 for b in train.betas)):
        errors.append(f"`train.betas` = {train.betas!r}: expected two numbers in [0, 1)")
    if typed("model.dropout") and model.dropout >= 1:
        errors.append(f"`model.dropout` = {model.dropout!r}: expected a probability below 1")
    return errors


LM_METRICS = ("eval_loss", "eval_perplexity")  # what the built-in language models' evaluation gives


def watch_problems(spec: JobSpec) -> list[str]:
    """``checkpoint.keep_best`` and ``train.early_stop_patience``: an evaluation to watch, a metric name it
    can give (a task's own metrics are known when it first evaluates). ``eval/x`` is recorded as ``eval_x``."""
    c, t, out = spec.checkpoint, spec.train, []
    name = c.keep_best.replace("eval/", "eval_", 1) if c.keep_best.startswith("eval/") else c.keep_best
    if name and not (name.startswith("eval_") and name[5:].isidentifier()):
        out.append(f"`checkpoint.keep_best` = {c.keep_best!r}: expected an evaluation metric, e.g. 'eval_loss' "
                   "or 'eval_accuracy'")
    elif name and not isinstance(spec.workload, TaskWorkload) and name not in LM_METRICS:
        out.append(f"`checkpoint.keep_best` = {c.keep_best!r}: the language model's evaluation gives "
                   f"{' and '.join(LM_METRICS)}")
    c.keep_best = name
    for key, given in (("checkpoint.keep_best", bool(name)), ("train.early_stop_patience", t.early_stop_patience > 0)):
        if given and not t.eval_every:
            out.append(f"`{key}` watches an evaluation, but `train.eval_every` = 0: set it (evaluate every N steps)")
    return out


def given_timeouts(parallel: tp.Any) -> list[str]:
    """A ``parallel.step_timeout_s`` given above ``timeout_s`` (given or default), in a spec as written. The
    default step timeout is lowered to a smaller ``timeout_s`` (as the trainer does), so it is not checked."""
    given = parallel if isinstance(parallel, dict) else {}
    step, timeout = given.get("step_timeout_s"), given.get("timeout_s", Parallel.timeout_s)
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (step, timeout)) or step <= timeout:
        return []
    return [f"`parallel.step_timeout_s` = {step} is longer than `parallel.timeout_s` = {timeout}: expected at most "
            f"{timeout} s (the step timeout is the short one, once every rank has finished a step)"]


def spec_warnings(spec: JobSpec) -> list[str]:
    """Settings that load but are unlikely to be meant: one line each, naming the file."""
    t, out = spec.train, []
    if t.warmup_steps >= t.steps:
        out.append(f"`train.warmup_steps` = {t.warmup_steps} is not shorter than `train.steps` = {t.steps}: the "
                   f"learning rate never reaches `train.lr` = {t.lr:g}")
    if t.warmup_metrics_steps >= t.steps:
        out.append(f"`train.warmup_metrics_steps` = {t.warmup_metrics_steps} is not shorter than `train.steps` = "
                   f"{t.steps}: throughput summaries will have no steps to measure")
    out += _eval_shortfall(spec) + _late_decays(spec)
    return [f"{spec.source}: {line}" for line in out]


def _late_decays(spec: JobSpec) -> list[str]:
    """Step-schedule decays at or past the last step: they never happen."""
    t, o = spec.train, spec.optim
    late = [m for m in o.milestones if m >= t.steps] if t.schedule == "multistep" else []
    out = [f"`optim.milestones` {late} are not before `train.steps` = {t.steps}: the learning rate never drops "
           "there"] if late else []
    if t.schedule == "step" and o.step_size >= t.steps:
        out.append(f"`optim.step_size` = {o.step_size} is not shorter than `train.steps` = {t.steps}: the learning "
                   "rate never drops")
    return out


def _eval_shortfall(spec: JobSpec) -> list[str]:
    """The validation split holds fewer samples than ``eval_steps × global_batch`` (each is counted once)."""
    t = spec.train
    where = val_split_source(spec.data, source_kind(spec.data.source)) if t.eval_every and t.eval_steps else None
    if where is None:
        return []
    held, asked = split_samples(where[0], where[1], model_facts(spec.model).seq_len), t.eval_steps * t.global_batch
    if held >= asked:
        return []
    return [f"`train.eval_steps` = {t.eval_steps} × `train.global_batch` = {t.global_batch} asks for {asked} "
            f"validation samples, but the {where[1]} split of {where[0]} holds {held}: each evaluation counts "
            f"those {held} once (`train.eval_steps = 0` says the whole split)"]
