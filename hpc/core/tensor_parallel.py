"""``parallel.tp``: what a tensor-parallel degree must divide, checked on the login node. Torch-free.

A tensor-parallel group splits each block's matrices by heads (attention) and by columns of the
MLP, and exchanges activations inside every block (all-gathers and reduce-scatters of the sequence),
so its ranks must sit in one NVLink domain: one node (``node.gpus`` GPUs; on a CPU site, the node's
tasks, only with ``parallel.tp_on_cpu``: a rehearsal of the layout over gloo). Each rank computes whole
heads, so ``tp`` divides what the family's plan names (``TpPlan.divides``: the query heads, and the
key/value heads). A user model has no plan (``hpc.core.models.tp_plan``): which of
its matrices split by rows or columns is its own business.
The trainer's side is ``trainer.tp``.
"""

from __future__ import annotations

import typing as tp

from hpc.core.dims import FSDP_STRATEGIES
from hpc.core.models import family, model_facts
from hpc.core.models.tp_plan import tp_plan_of
from hpc.core.site import nvlink_domain as site_domain
from hpc.core.validate import check_batch

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.site import SiteProfile
    from hpc.core.spec import JobSpec


def nvlink_domain(site: SiteProfile, tasks_per_node: int) -> int:
    """Ranks of one NVLink domain: ``node.nvlink_domain`` (by default the node's GPUs on an NVLink or NVSwitch
    node, 1 on pcie; ``hpc.core.site.nvlink_domain``); a CPU site's node (its tasks)."""
    return site_domain(site.node) if site.node.gpus else tasks_per_node


def allowed_degrees(facts: tp.Any, site: SiteProfile, tasks_per_node: int, cross_domain: bool = False) -> list[int]:
    """The tensor-parallel degrees a plan may use: divisors of one NVLink domain (``node.nvlink_domain``; with
    ``cross_domain``, the node) that divide the node's ranks and the model's heads and KV heads; [1] for a model
    without a TP plan or a site without NVLink."""
    domain = site.node.gpus if cross_domain and site.node.gpus else nvlink_domain(site, tasks_per_node)
    if not site.node.gpus:
        domain = 1  # the planner plans tp on GPU sites (a CPU site's explicit tp is the dryrun's)
    if not facts.tp_split or domain <= 1:
        return [1]
    return [t for t in range(1, domain + 1) if domain % t == 0 and tasks_per_node % t == 0
            and all(n % t == 0 for n in facts.tp_divides)]


def batch_problems(spec: JobSpec, site: SiteProfile, tasks_per_node: int) -> list[str]:
    """``train.global_batch`` against the data-parallel ranks: at the spec's ``tp``, or, under ``auto`` at tp 1,
    at every degree the planner may choose (it picks among the degrees where the batch divides)."""
    world, micro, batch = spec.job.nodes * tasks_per_node, spec.train.micro_batch, spec.train.global_batch
    tp_ = spec.parallel.tp if not tasks_per_node % spec.parallel.tp else 1
    degrees = [tp_]
    if spec.parallel.strategy == "auto" and tp_ == 1:
        degrees = allowed_degrees(model_facts(spec.model), site, tasks_per_node, spec.parallel.tp_cross_domain)
    fails = [check_batch(batch, micro, world // t, f"{spec.job.nodes} nodes × {tasks_per_node} tasks"
                         + (f" / tp {t}" if t > 1 else "")) for t in degrees]
    if not all(fails):
        return []
    if len(degrees) == 1:
        return fails[0]
    return [f"`train.global_batch` = {batch} is not divisible by the data-parallel ranks × micro_batch at any "
            f"tensor-parallel degree `auto` may use: " + "; ".join(
                f"tp {t}: {world // t} × {micro} = {world // t * micro}" for t in degrees)]


def check_tp(spec: JobSpec, site: SiteProfile, tasks_per_node: int) -> list[str]:
    """Every problem of ``parallel.tp`` against the strategy, the site and the model, with the arithmetic."""
    degree = spec.parallel.tp
    if degree == 1:
        return []
    key, errors = f"`parallel.tp` = {degree}", []
    if not site.node.gpus and not spec.parallel.tp_on_cpu:
        return [f"{key} on site {site.name!r}, which has no GPUs (`node.gpus` = 0): tensor parallelism splits each "
                "layer over the GPUs of one NVLink domain, and over CPU processes it saves nothing; expected tp = 1, "
                "or `parallel.tp_on_cpu` = true to rehearse the layout on CPUs"]
    if spec.parallel.strategy not in FSDP_STRATEGIES:
        errors.append(f"{key} needs strategy fsdp or hsdp (FSDP shards over the data-parallel ranks, TP inside "
                      f"them), but `parallel.strategy` = {spec.parallel.strategy!r}")
    domain = nvlink_domain(site, tasks_per_node)
    what = f"{site.node.gpus} GPUs per node" if site.node.gpus else f"{tasks_per_node} tasks per node (a CPU site)"
    node = site.node.gpus or tasks_per_node
    islands = '' if domain == node else f', NVLink islands of {domain}: `node.nvlink_domain`'
    if node % degree and domain != node:
        errors.append(f"{key} does not divide the {node} ranks of a node on site {site.name!r} ({what}): "
                      f"{node} / {degree} = {node / degree:.4g}; a tensor-parallel group stays within one node")
    elif domain % degree and (node % degree or not spec.parallel.tp_cross_domain):
        hint = "" if node % degree else (f"; `parallel.tp_cross_domain` = true allows a group across islands, over "
                                         f"{site.node.intra_link}")
        errors.append(f"{key} does not divide the {domain} ranks of one NVLink domain on site {site.name!r} "
                      f"({what}{islands}): {domain} / {degree} = {domain / degree:.4g}{hint}")
    elif tasks_per_node % degree:
        errors.append(f"{key} does not divide `job.tasks_per_node` = {tasks_per_node}: a tensor-parallel group "
                      f"stays within one node ({tasks_per_node} / {degree} = {tasks_per_node / degree:.4g})")
    if spec.lora.rank:
        errors.append(f"{key} with `[lora]` (rank {spec.lora.rank}): the adapters have no tensor-parallel plan yet "
                      "(LoRA fits 8B on one GPU and 70B on one node without TP); use tp = 1")
    if spec.data.packing == "document":
        errors.append(f"{key} with `data.packing` = 'document': the document mask has not been run under sequence "
                      "parallelism yet; use tp = 1 or packing 'causal'")
    return one_line(errors + model_problems(spec, degree, key), key)


def one_line(errors: list[str], key: str) -> list[str]:
    """The problems of one value as one line: the first whole, each further one after "; and" without
    the key it repeats (a tp of 3 on 4 heads and 2 GPUs is one bad value, not three)."""
    if len(errors) <= 1:
        return errors
    rest = [e.removeprefix(f"{key} ").removeprefix("with ") for e in errors[1:]]
    return [f"{errors[0]}; and {'; and '.join(rest)}"]


def model_problems(spec: JobSpec, degree: int, key: str) -> list[str]:
    """What the model says against ``degree``: a user model, heads or key/value heads not divisible, dropout."""
    plan = tp_plan_of(family(spec.model.arch))
    if plan is None:
        return [f"{key} but `model.arch` = {spec.model.arch!r} is a user model: hpcx has a tensor-parallel plan "
                "for its built-in families only (which matrices of a user's module split by rows or columns is "
                "the model's own); use tp = 1"]
    errors, shape = [], model_facts(spec.model).shape
    for name in plan.divides:  # what the family's plan says the degree must divide
        heads = getattr(shape, name)
        if heads % degree:
            errors.append(f"{key} does not divide the model's {heads} {_heads_word(name)} (`model.{name}`): "
                          f"{heads} / {degree} = {heads / degree:.4g} per rank; each rank computes whole heads")
    if spec.model.dropout > 0:
        errors.append(f"{key} with `model.dropout` = {spec.model.dropout}: the ranks of a tensor-parallel group "
                      "would draw different dropout masks on the same activations; use dropout = 0")
    return errors


def _heads_word(name: str) -> str:
    return "key/value heads" if name == "n_kv_heads" else "attention heads"
