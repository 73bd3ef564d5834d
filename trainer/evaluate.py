"""Validation loss: every ``train.eval_every`` steps and after the last, the mean next-token loss over
the first ``train.eval_steps × global_batch`` validation samples in order (``eval_steps`` = 0: the whole
split), each counted once: a split that holds fewer is evaluated whole, never wrapped around.

The samples are cut into micro-batches of ``micro_batch`` consecutive samples, dealt to the ranks in
turn; every rank makes the same number of forward passes (FSDP gathers in each), a rank short of one
passes over sample 0 and counts nothing. Each rank sums its targets' losses and counts in float64, and
one all-reduce adds them: the same samples and the same mean at every world size. With a loss mask
only the counted (response) targets enter both sums. The ranks of a tensor-parallel group evaluate the
same samples, so only one of them adds its sums (``sum_over_data``): the counts are the true ones. The
losses are the training's chunked cross-entropy (``eval_token_losses``), and the batches come through a
DataLoader with the training loader's workers and pinned memory (``Evaluator.loader``).
"""

from __future__ import annotations

import logging
import time
import typing as tp
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, Dataset

from hpc.core.spec import JobSpec
from trainer.objective import autocast_of, sum_over_data

if tp.TYPE_CHECKING:  # pragma: no cover
    from trainer.loop import Trainer  # which imports this module

log = logging.getLogger("hpcx.trainer")


@dataclass
class Evaluator:
    """What one rank evaluates on, and how often."""

    dataset: Dataset
    batches: list[list[int]]  # this rank's micro-batches of sample indices; [] is a pass that counts nothing
    every: int
    samples: int  # the validation samples each evaluation counts, once each
    task: tp.Any = None  # the ``trainer.tasks.LoopTask`` whose terms it sums (the task that builds it sets itself)
    workers: int = 0  # loader processes (the launch's ``hpc.core.spec.loader_workers``, as training's)
    pin_memory: bool = False  # page-locked batches (with a GPU), copied to it without waiting
    _loader: DataLoader | None = field(default=None, repr=False, compare=False)  # made by ``loader``

    def due(self, step: int, last: int) -> bool:
        """After every ``every``-th step and after the last one."""
        return step % self.every == 0 or step == last

    def loader(self, collate: tp.Callable[[list], tp.Any]) -> DataLoader:
        """This rank's micro-batches in order (a padding pass ``[]`` reads sample 0), through ``workers``
        processes kept from one evaluation to the next, into pinned memory where asked: made once."""
        if self._loader is None:
            self._loader = DataLoader(self.dataset, batch_sampler=[b or [0] for b in self.batches],
                                      num_workers=self.workers, pin_memory=self.pin_memory, collate_fn=collate,
                                      persistent_workers=self.workers > 0)
        return self._loader


def eval_samples(available: int, steps: int, global_batch: int) -> int:
    """How many validation samples an evaluation counts: ``steps × global_batch`` of the ``available``
    (``steps`` = 0: all of them), never more than there are."""
    return available if steps == 0 else min(available, steps * global_batch)


def eval_batches(samples: int, micro_batch: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's micro-batches of samples ``0 .. samples-1``: micro-batch ``c`` (``micro_batch``
    consecutive samples, the last maybe fewer) on rank ``c % world_size``; as many passes on every rank,
    a rank short of one getting ``[]``."""
    chunks = [list(range(i, min(i + micro_batch, samples))) for i in range(0, samples, micro_batch)]
    mine = chunks[rank::world_size]
    return mine + [[] for _ in range(-(-len(chunks) // world_size) - len(mine))]


def build_evaluator(dataset: Dataset, global_batch: int, micro_batch: int, rank: int, world_size: int,
                    every: int, steps: int) -> Evaluator:
    """This rank's share of the validation samples (``steps`` batches of ``global_batch``; 0: all)."""
    samples = eval_samples(len(dataset), steps, global_batch)  # type: ignore[arg-type]  # map-style: sized
    return Evaluator(dataset, eval_batches(samples, micro_batch, rank, world_size), every, samples)


def _sums(t: Trainer, ev: Evaluator) -> torch.Tensor:
    """The task's summed terms over this rank's share (``LoopTask.eval_terms``), float64 on the device."""
    task = ev.task
    sums: torch.Tensor | None = None
    for indices, batch in zip(ev.batches, ev.loader(task.collate)):
        batch = task.to_device(batch, t.device)
        terms = task.eval_terms(t.model, batch, len(indices) or 1, autocast_of(t.device, t.amp_dtype))
        if not indices:  # the padding pass: the collectives of a forward, nothing counted
            terms = torch.zeros_like(terms)
        sums = terms if sums is None else sums + terms
    assert sums is not None  # every rank makes one pass at least (``eval_batches``)
    return sums


def evaluate(t: Trainer, ev: Evaluator, step: int) -> dict[str, tp.Any]:
    """The eval record of ``step`` (every rank takes part): the task's values (a language model's loss,
    perplexity and targets), samples, seconds."""
    started = time.perf_counter()
    t.model.eval()
    with torch.no_grad():
        sums = _sums(t, ev)
    t.model.train()
    sums = sum_over_data(sums, t.world_size, t.dims.tp)  # a tp group's ranks evaluated the same samples
    task = ev.task
    return {"step": step, **task.eval_record([float(x) for x in sums.cpu()]), "eval_samples": ev.samples,
            "eval_s": time.perf_counter() - started}


def eval_step(t: Trainer, step: int) -> dict[str, tp.Any]:
    """Evaluate, write the record to metrics.jsonl (rank 0) and the log; its seconds are left out of the
    training phases (``PhaseClock.skip``), so the next metrics line's throughput is the training's."""
    if t.evaluator is None:
        raise ValueError("eval_step: the trainer has no evaluator (train.eval_every = 0)")
    record = evaluate(t, t.evaluator, step)
    t.metrics.write(record)
    log.info("step %d/%d | %s | %.1f s", step, t.steps, eval_words(record), record["eval_s"])
    t.clock.skip()
    return record


def eval_words(record: dict[str, tp.Any]) -> str:
    """"eval loss 2.3456 | perplexity 10.44 | 4096 tokens", or a task's "eval loss 0.4 | accuracy 0.91"."""
    words = [f"eval loss {record['eval_loss']:.4f}"]
    if "eval_perplexity" in record:
        words += [f"perplexity {record['eval_perplexity']:.2f}", f"{record['eval_tokens']} tokens"]
    words += [f"{k.removeprefix('eval_')} {v:.4g}" for k, v in record.items() if k not in EVAL_KEYS]
    return " | ".join(words)


EVAL_KEYS = ("step", "eval_loss", "eval_perplexity", "eval_tokens", "eval_samples", "eval_s", "start")


def build_eval(spec: JobSpec, kind: str, seq_len: int, rank: int, world_size: int) -> Evaluator | None:
    """The evaluator of a spec (None when ``train.eval_every`` is 0 or there is nothing to evaluate on;
    ``kind``: ``Launch.data_source``)."""
    from trainer.tokens import ManifestTokens, val_split_source  # lazy: numpy

    where = val_split_source(spec.data, kind) if spec.train.eval_every else None
    if where is None:
        return None
    dataset = ManifestTokens(where[0], where[1], seq_len, documents=spec.data.packing == "document")
    return build_evaluator(dataset, spec.train.global_batch, spec.train.micro_batch, rank, world_size,
                           spec.train.eval_every, spec.train.eval_steps)
