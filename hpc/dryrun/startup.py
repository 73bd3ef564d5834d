"""What the job would hit before its first step that a build on the meta device can show.

In the job these fail every start the same way (``hpc.core.failures.would_repeat``: never requeued);
``hpcx dryrun`` finds them on the login node, as one line each naming the file and the key, all at
once (a ``ConfigError``: exit 2):

- ``model.arch`` = ``pkg.mod:fn``: the module does not import, the function is missing or not
  callable, or it raises with ``model.kwargs``, or returns no ``nn.Module``;
- ``model.blocks`` does not resolve to an ``nn.ModuleList``;
- modules that own parameters or buffers but define no ``reset_parameters()`` (``trainer.model.WeightInit``
  calls it on every such module; the rule is ``trainer.model.missing_resets``);
- a user model's forward on a tiny meta batch returns what the loss cannot use (not a tensor of
  logits ``[batch, seq, vocab]``, e.g. an output object with ``.logits``). A forward that raises on
  meta proves nothing (meta tensors cannot run data-dependent code): it is noted, not refused.
"""

from __future__ import annotations

import re
import typing as tp

import torch
from torch import nn

from hpc.core.errors import ConfigError
from hpc.core.models import model_facts
from hpc.core.resolve import Launch, launch_parallel
from hpc.core.spec import JobSpec
from hpc.core.workload import TaskWorkload
from trainer.model import build_model, missing_resets
from trainer.objective import micro_loss
from trainer.parallelize import blocks_for

BATCH, SEQ = 2, 8  # the meta batch of the forward check: [BATCH, min(SEQ, seq_len)] token ids


def checked_model(spec: JobSpec, launch: Launch) -> tuple[nn.Module, str | None]:
    """(the bare model on meta, what the forward check found) when nothing above would fail the job;
    else a ConfigError with one line per problem, each prefixed by the spec's file."""
    from trainer.tasks import task_for  # lazy: numpy

    model = built_model(spec)
    problems: list[str] = []
    try:  # the data is not read: the units only, where a feature works per block
        blocks_for(task_for(spec, "synthetic").blocks, model, launch_parallel(spec, launch), launch.dims)
    except ConfigError as exc:
        problems += exc.messages
    problems += reset_problems(model, spec)
    note = None
    if not model_facts(spec.model).builtin and not isinstance(spec.workload, TaskWorkload):  # its loss's forward
        forward, note = forward_problems(model, spec)
        problems += forward
    if problems:
        raise ConfigError([f"{spec.source}: {p}" for p in problems])
    return model, note


def built_model(spec: JobSpec) -> nn.Module:
    """``trainer.model.build_model`` on meta; whatever the user's function raises is one line."""
    from trainer.tasks import task_for  # lazy: numpy

    user_task = spec.workload if isinstance(spec.workload, TaskWorkload) else None
    try:
        return task_for(spec, "synthetic").meta_model() if user_task else build_model(spec.model, "meta")
    except ConfigError as exc:
        raise ConfigError([f"{spec.source}: {m}" for m in exc.messages]) from None
    except Exception as exc:  # noqa: BLE001  (the user's code: the job would raise the same in every start)
        if user_task:
            from trainer.tasks import raised_at  # lazy: numpy

            raise ConfigError([f"{spec.source}: `task.target` = {user_task.target!r}: build_model() raised "
                               f"{raised_at(exc, user_task.module)}; expected it to return the nn.Module"]) from None
        call = f"{spec.model.arch.split(':')[-1]}({', '.join(f'{k}={v!r}' for k, v in spec.model.kwargs.items())})"
        raise ConfigError([f"{spec.source}: `model.arch` = {spec.model.arch!r}: {call} (with `model.kwargs`) raised "
                           f"{type(exc).__name__}: {_one_line(exc)}; expected it to return the nn.Module"]) from None


def reset_problems(model: nn.Module, spec: JobSpec) -> list[str]:
    """One line naming every module ``WeightInit`` would refuse (paths and classes), or none."""
    missing = missing_resets(model)
    if not missing:
        return []
    names = ", ".join(collapsed([(name or "(root)", type(m).__name__) for name, m in missing]))
    verbs = "owns parameters or buffers but defines" if len(missing) == 1 else "own parameters or buffers but define"
    return [f"`model.arch` = {spec.model.arch!r}: {names} {verbs} no "
            "reset_parameters(); expected one on every such module, setting exactly its tensors (hpcx initialises "
            "the model built on the meta device module by module, trainer.model.WeightInit: the job would fail "
            "before step 1)"]


def collapsed(items: tp.Sequence[tuple[str, str]]) -> list[str]:
    """``path (Class)`` for each item, paths that differ only in one list index as one:
    ``layers.{0..31}.norm (RMSNorm)``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for path, cls in items:
        match = re.search(r"(?:^|\.)(\d+)(?=\.|$)", path)
        key = path[:match.start(1)] + "#" + path[match.end(1):] if match else path
        groups.setdefault((key, cls), []).append(int(match.group(1)) if match else -1)
    out = []
    for (key, cls), indices in groups.items():
        if indices == [-1]:
            out.append(f"{key} ({cls})")
            continue
        contiguous = len(indices) > 2 and indices == list(range(indices[0], indices[-1] + 1))
        index = (str(indices[0]) if len(indices) == 1 else f"{{{indices[0]}..{indices[-1]}}}" if contiguous
                 else "{" + ",".join(map(str, indices)) + "}")
        out.append(f"{key.replace('#', index, 1)} ({cls})")
    return out


def forward_problems(model: nn.Module, spec: JobSpec) -> tuple[list[str], str]:
    """(problems, what was checked): the user model's forward on a ``[BATCH, seq]`` meta batch, as the
    loop calls it (``tokens[:, :-1]``), and the loss (``trainer.objective.micro_loss``) on its output."""
    facts = model_facts(spec.model)
    seq = max(1, min(SEQ, facts.seq_len))
    tokens = torch.zeros((BATCH, seq + 1), dtype=torch.long, device="meta")
    head = f"`model.arch` = {spec.model.arch!r}: its forward on a [{BATCH}, {seq}] batch of token ids returned"
    try:
        with torch.no_grad(), torch.device("meta"):
            out = model(tokens[:, :-1])
    except Exception as exc:  # noqa: BLE001  (meta cannot run everything (.item(), data-dependent shapes): not evidence)
        return [], f"not checked: it raises on the meta device ({type(exc).__name__}: {_one_line(exc)[:200]})"
    problem = output_problem(out, seq, facts.vocab_size)
    if problem:
        return [f"{head} {problem}"], ""
    try:
        with torch.no_grad():
            micro_loss(out, tokens, None, 1.0)
    except Exception as exc:  # noqa: BLE001  (the user's logits: whatever the loss raises is the report)
        return [f"{head} logits the loss cannot use (trainer.objective.micro_loss raised {type(exc).__name__}: "
                f"{_one_line(exc)})"], ""
    return [], f"a [{BATCH}, {seq}] meta batch gives logits {list(out.shape)}, which the loss takes"


def output_problem(out: tp.Any, seq: int, vocab: int) -> str | None:
    """Why ``out`` is not the ``[BATCH, seq, >= vocab]`` float logits the loop needs, or None."""
    want = f"expected a tensor of logits [batch, seq, vocab] = [{BATCH}, {seq}, {vocab}]"
    if not isinstance(out, torch.Tensor):
        logits = getattr(out, "logits", None)
        hint = ": return its .logits" if isinstance(logits, torch.Tensor) else ""
        return f"{type(out).__name__} (not a tensor), {want}{hint}"
    if out.dim() != 3 or tuple(out.shape[:2]) != (BATCH, seq):
        return f"a tensor of shape {list(out.shape)}, {want}"
    if out.shape[-1] < vocab:
        return f"logits over {out.shape[-1]} tokens, fewer than `model.vocab_size` = {vocab}; {want}"
    if not out.is_floating_point():
        return f"a {out.dtype} tensor, {want} in floating point"
    return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or "(no message)"
