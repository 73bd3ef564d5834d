"""The built-in language models as a task (``trainer.tasks.LoopTask``): the spec's ``[model]`` family,
its token data (``trainer.data``), next-token cross-entropy (``trainer.objective``) and the validation
loss (``trainer.evaluate``). Only calls: what these do is in their modules.
"""

from __future__ import annotations

import math
import typing as tp

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from hpc.core.models import model_facts
from trainer.data import build_dataset, shuffle_enabled
from trainer.evaluate import Evaluator, build_eval
from trainer.model import build_model, model_blocks
from hpc.core.manifest import PREPARED, load_manifest, manifest_path
from trainer.objective import (batch_documents, counted_targets, eval_token_losses, loss_context, masked_scale,
                               micro_loss, padding_tokens, split_batch, to_device)

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import JobSpec


class LanguageModelTask:
    """``[model]`` trained on ``[data]``'s tokens (``data_source``: ``Launch.data_source``)."""

    def __init__(self, spec: JobSpec, data_source: str | None = None):
        self.spec, self.kind = spec, data_source
        facts = model_facts(spec.model)
        self.seq_len, self.vocab_size = facts.seq_len, facts.vocab_size
        self.tokens_per_sample = facts.seq_len
        self.flops_per_token = facts.flops_per_token
        self.counted: torch.Tensor | None = None  # the last step's counted targets (a masked loss), for metrics
        self.padded: torch.Tensor | int = 0  # the last step's pad tokens, whole batch (for metrics: real tokens/s)
        self._pad_id: int | None | bool = False  # the windowed folder's pad id (None: no padding); False: not read yet

    def _kind(self) -> str:
        assert self.kind is not None  # the trainer passes ``Launch.data_source``; ``decided`` fills older folders
        return self.kind

    def meta_model(self) -> nn.Module:
        return build_model(self.spec.model, "meta")

    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return model_blocks(model, self.spec.model.blocks)

    def train_dataset(self) -> Dataset:
        return build_dataset(self.spec.data, self._kind(), self.seq_len, self.vocab_size, self.spec.train.seed)

    def shuffle(self) -> bool:
        return shuffle_enabled(self.spec.data, self._kind())

    def collate(self, samples: list[tp.Any]) -> tp.Any:
        return default_collate(samples)

    def evaluator(self, spec: JobSpec, rank: int, world_size: int) -> Evaluator | None:
        ev = build_eval(spec, self._kind(), self.seq_len, rank, world_size)
        if ev is not None:
            ev.task = self
        return ev

    def to_device(self, batch: tp.Any, device: torch.device) -> tp.Any:
        return to_device(batch, device)

    def step_scale(self, micro_batches: tp.Sequence[tp.Any], world_size: int) -> float | torch.Tensor:
        tp_degree = int(getattr(self.spec.parallel, "tp", 1) or 1)  # a tp group shares its batches
        count = self.counted = counted_targets(micro_batches, world_size, tp_degree)
        pad_id = self.pad_id()
        if pad_id is not None:
            self.padded = padding_tokens(micro_batches, pad_id, world_size, tp_degree)
        # gradients are averaged over the data-parallel ranks: world / tp of them
        return 1.0 / len(micro_batches) if count is None else masked_scale(count, world_size // tp_degree)

    def pad_id(self) -> int | None:
        """The pad token of a windowed training folder (``hpcx data prepare --window``), else None: the
        windows' padding is counted (``padding_tokens``) for real tokens/s; other data has none."""
        if self._pad_id is False:
            self._pad_id = None
            if self.kind == PREPARED:
                manifest = load_manifest(manifest_path(self.spec.data.source) or self.spec.data.source)
                self._pad_id = int(manifest["pad_id"]) if manifest.get("window") else None
        return self._pad_id  # False was replaced above

    def micro_loss(self, model: nn.Module, batch: tp.Any, scale: float | torch.Tensor,
                   autocast: tp.ContextManager) -> torch.Tensor:
        (tokens, mask), logits = split_batch(batch), self._logits(model, batch, autocast)
        return micro_loss(logits, tokens, mask, scale)

    @staticmethod
    def _logits(model: nn.Module, batch: tp.Any, autocast: tp.ContextManager) -> torch.Tensor:
        """The model's logits of a batch; packed documents pass each position's document number too
        (``data.packing = "document"``)."""
        tokens, _ = split_batch(batch)
        documents = batch_documents(batch)
        with autocast:
            if documents is None:
                return model(tokens[:, :-1])
            return model(tokens[:, :-1], documents[:, :-1].to(tokens.device))

    def eval_terms(self, model: nn.Module, batch: tp.Any, samples: int, autocast: tp.ContextManager) -> torch.Tensor:
        """(sum of target losses, number of targets), float64; a loss mask counts its targets only."""
        (tokens, mask), logits = split_batch(batch), self._logits(model, batch, autocast)
        with loss_context(logits):  # tp: the vocabulary stays split (no backward here)
            losses = eval_token_losses(logits, tokens).double()  # chunked, as the training loss
        weight = mask[:, 1:].to(losses.device, torch.float64) if mask is not None else torch.ones_like(losses)
        return torch.stack([(losses * weight).sum(), weight.sum()])

    def eval_record(self, sums: list[float]) -> dict[str, tp.Any]:
        loss_sum, count = sums
        loss = loss_sum / max(1.0, count)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)), "eval_tokens": int(count)}

    def start_weights(self, model: nn.Module) -> None:
        """Nothing: a language model's pretrained weights are ``checkpoint.init_from``'s (``trainer.init_from``)."""

    def state_dict(self) -> dict[str, tp.Any]:
        return {}

    def load_state_dict(self, state: dict[str, tp.Any]) -> None:
        """A language model keeps no state of its own."""


def token_task() -> LanguageModelTask:
    """The language model's eval terms and record without a spec (they read none): for an evaluator or a
    loop built by hand (tests)."""
    return LanguageModelTask.__new__(LanguageModelTask)
