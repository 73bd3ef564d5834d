"""The job spec: one TOML file, one dataclass per section.

Each component takes only its own section (``spec.train``, ``spec.parallel`` …).
``load_spec`` reports every problem in the file at once; ``cross_check``
validates the arithmetic against a site and prints the numbers it used.
"""

from __future__ import annotations

import typing as tp
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc import schedulers
from hpc.core import validate as v
from hpc.core.config import ConfigError, apply_overrides, build_document, field, read_toml
from hpc.core.models.gpt import preset_counts
from hpc.core.validate import looks_secret  # noqa: F401  (re-exported: the one secret-name policy)

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


@dataclass
class Model:
    arch: str = field("gpt", doc="`gpt` (built-in) or `package.module:function` returning an nn.Module.")
    size: str = field("tiny", doc="Preset of the built-in GPT, with its real parameter count: "
                      f"{preset_counts()}.")
    dim: int = field(0, doc="Width (d_model) of the built-in GPT (0: the preset's); for a user model with "
                     "`n_params`, its width.", minimum=0)
    n_layers: int = field(0, doc="Transformer blocks of the built-in GPT (0: the preset's); for a user model "
                          "with `n_params`, its number of blocks.", minimum=0)
    n_heads: int = field(0, doc="Attention heads of the built-in GPT (0: the preset's); must divide `dim`.",
                         minimum=0)
    seq_len: int = field(0, doc="Context length (0: the preset's).", minimum=0)
    vocab_size: int = field(0, doc="Vocabulary size (0: the preset's).", minimum=0)
    tie_embeddings: bool = field(False, doc="The output head reuses the token embedding's matrix "
                                 "(the presets have their own head).")
    n_params: int = field(0, doc="A user model's parameter count, for the planner (0: unknown; then "
                          "`hpcx plan --count-params` can count it where torch is installed). Needs "
                          "`n_layers` and `dim`.", minimum=0, maximum=10**15)
    dropout: float = field(0.0, doc="Dropout probability, below 1.", minimum=0, maximum=1)
    blocks: str = field("", doc="For user models: attribute path of the nn.ModuleList whose children "
                        "are the units to shard and checkpoint, e.g. `transformer.h` (default: `blocks`).")
    kwargs: dict[str, tp.Any] = field(doc="Keyword arguments for a `module:function` model: strings, finite "
                                      "numbers, booleans, arrays, tables; no credential-looking keys or values "
                                      "(they are written to resolved.json).", factory=dict)
    activation_gb: float = field(0.0, doc="Measured activation memory per micro-batch sample in GB, for "
                                 "the planner on user models (0: unknown).", minimum=0)


@dataclass
class Data:
    source: str = field("synthetic", doc="`synthetic` (seeded random tokens) or a path to a `.bin` token file "
                        "(relative to the current folder; `~` and `$VAR` expanded). Checked when the spec is "
                        "loaded: a readable regular file, a whole number of `dtype` tokens, at least one "
                        "sample, and — on up to 4 MiB read from across the file — no token id at or above "
                        "the model's vocabulary.", max_len=v.PATH_MAX)
    dtype: str = field("uint16", doc="Token dtype of a `.bin` file.", choices=("uint16", "uint32"))
    shuffle: bool = field(True, doc="Reshuffle the samples each epoch (deterministic from train.seed).")
    num_workers: int = field(0, doc="DataLoader worker processes per rank.", minimum=0, maximum=1024)


@dataclass
class Train:
    steps: int = field(100, doc="Optimizer steps to run.", minimum=1)
    global_batch: int = field(8, doc="Samples per optimizer step across all ranks.", minimum=1)
    micro_batch: int = field(1, doc="Samples per rank per forward/backward; the gradient-accumulation "
                             "count is global_batch / (ranks × micro_batch).", minimum=1)
    optimizer: str = field("adamw", doc="Optimizer (AdamW with decoupled weight decay; the only one for now).", choices=("adamw",))
    lr: float = field(3e-4, doc="Peak learning rate.", minimum=0)
    min_lr_ratio: float = field(0.1, doc="Final LR of the cosine schedule as a fraction of `lr`.", minimum=0,
                                maximum=1)
    warmup_steps: int = field(10, doc="Linear warm-up steps.", minimum=0)
    schedule: str = field("cosine", doc="LR schedule after warm-up.", choices=("cosine", "constant"))
    weight_decay: float = field(0.1, doc="AdamW weight decay.", minimum=0)
    betas: list[float] = field(doc="AdamW betas.", factory=lambda: [0.9, 0.95])
    grad_clip: float = field(1.0, doc="Clip the global gradient norm to this (0: off).", minimum=0)
    seed: int = field(0, doc="Seed for model init, data order and dropout.", minimum=0, maximum=v.SEED_MAX)
    log_every: int = field(10, doc="Write a metrics line every N steps (reading the loss waits for the GPU: "
                           "the steps in between never do).", minimum=1)
    warmup_metrics_steps: int = field(2, doc="Leading steps left out of throughput summaries.", minimum=0)


@dataclass
class Parallel:
    strategy: str = field("auto", doc="`auto` (the planner's choice), `none`, `dp`, `ddp`, `fsdp` or `hsdp`.",
                          choices=STRATEGIES)
    sharding: str = field("full_shard", doc="FSDP sharding: full_shard, shard_grad_op or no_shard.",
                          choices=SHARDINGS)
    shard_size: int = field(0, doc="HSDP shard group size (0: one node's ranks).", minimum=0)
    mixed_precision: str = field("auto", doc="Compute dtype: `auto` (bf16 on a site with GPUs, fp32 on a CPU "
                                 "site), `none` (fp32), `bf16` or `fp16`; reductions stay fp32.",
                                 choices=("auto", "none", "bf16", "fp16"))
    cpu_offload: bool = field(False, doc="Keep sharded parameters, gradients and optimizer state in host memory.")
    activation_checkpointing: bool = field(False, doc="Recompute each block's activations in backward.")
    compile: bool = field(False, doc="torch.compile each block.")
    timeout_s: int = field(600, doc="Collective and rendezvous timeout in seconds while starting, resuming "
                           "and saving.", minimum=1)
    step_timeout_s: int = field(120, doc="Collective timeout once every rank finished its first step (at most "
                                "`timeout_s`): a rank that hangs mid-run is noticed this fast.", minimum=1)


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
    async_save: bool = field(False, doc="Save in the background on a separate process group.")
    resume: bool = field(True, doc="Resume from the newest committed checkpoint of the run folder.")


@dataclass
class Env:
    set: dict[str, str] = field(doc="Environment variables set for every task (values are quoted; "
                                "credential-looking names and values are refused here: use `passthrough`).",
                                factory=dict, max_len=v.PATH_MAX)
    passthrough: list[str] = field(doc="Names of variables taken from the submitting shell by name "
                                   "only; their values never reach the script or the run folder. "
                                   "`render` and `submit` warn about names the shell does not set.",
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
    source: str = ""

    def to_dict(self) -> dict[str, tp.Any]:
        out = asdict(self)
        out.pop("source")
        return out


SECTIONS = {"job": Job, "model": Model, "data": Data, "train": Train, "parallel": Parallel,
            "checkpoint": Checkpoint, "env": Env}


def spec_from_dict(doc: dict, source: str = "<spec>") -> JobSpec:
    """Build and self-check a JobSpec; raises ConfigError listing every problem."""
    errors: list[str] = []
    sections = build_document(SECTIONS, doc, errors)
    spec = JobSpec(source=source, **sections)
    errors += _check_env(spec.env)
    if _clean(errors, "job"):
        errors += _check_job(spec.job)
    # checks across fields run only on sections whose fields are all well-typed
    if _clean(errors, "model"):
        errors += _check_model(spec.model)
    if _clean(errors, "train") and _clean(errors, "model"):
        errors += _check_train(spec.train, spec.model)
    if errors:
        raise ConfigError([f"{source}: {e}" for e in errors])
    return spec


def _clean(errors: list[str], section: str) -> bool:
    return not any(f"`{section}." in e or f"`{section}`" in e for e in errors)


def load_spec(path: str | Path, overrides: tp.Sequence[str] = (), paths: bool = True) -> JobSpec:
    """Read, override and check a spec on the login node: besides ``spec_from_dict``'s checks, the run
    root is expanded to an absolute path and the data file is checked (both recorded absolute).
    ``paths=False`` skips the last two, for re-reading the spec of a past run (a report)."""
    path = Path(path)
    doc = apply_overrides(read_toml(path), overrides)
    spec = spec_from_dict(doc, str(path))
    errors = resolve_paths(spec) if paths else []
    if errors:
        raise ConfigError([f"{path}: {e}" for e in errors])
    return spec


def resolve_paths(spec: JobSpec) -> list[str]:
    """Expand ``job.run_root`` and check ``data.source`` where the user is (not inside the job, whose
    environment and file system may differ); both are rewritten as absolute paths."""
    errors = []
    if spec.job.run_root:
        try:
            spec.job.run_root = str(v.expand_run_root(spec.job.run_root, f"`job.run_root` = {spec.job.run_root!r}"))
        except ConfigError as exc:
            errors += exc.messages
    from hpc.core.models import model_facts

    facts = model_facts(spec.model)
    problems, spec.data.source = v.check_data_source(spec.data.source, spec.data.dtype, facts.seq_len,
                                                     facts.vocab_size)
    return errors + problems


def _check_job(job: Job) -> list[str]:
    errors = v.check_job_name(job.name)
    if job.run_root is not None:
        errors += v.check_run_root("job.run_root", job.run_root)
    return errors


def _check_env(env: Env) -> list[str]:
    errors = []
    for name in env.set:
        errors += v.check_env_name(f"env.set.{v.shown(name)}", name)
    for name in env.passthrough:
        errors += v.check_env_name("env.passthrough", name)
    for name, value in env.set.items():
        if looks_secret(name):
            errors.append(f"`env.set.{v.shown(name)}` looks like a secret: put \"{v.shown(name)}\" in "
                          "`env.passthrough` and export it in your shell, so its value is never written to disk")
        elif kind := v.secret_value_kind(value):
            errors.append(f"`env.set.{v.shown(name)}` holds what looks like {kind}: pass it by name with "
                          "`env.passthrough`, so its value is never written to disk")
    return errors


def _check_model(model: Model) -> list[str]:
    from hpc.core.models import model_problems

    return model_problems(model)


def _check_train(train: Train, model: Model) -> list[str]:
    errors = []
    if len(train.betas) != 2 or not all(0 <= b < 1 for b in train.betas):
        errors.append(f"`train.betas` = {train.betas!r}: expected two numbers in [0, 1)")
    if model.dropout >= 1:
        errors.append(f"`model.dropout` = {model.dropout!r}: expected a probability below 1")
    return errors
