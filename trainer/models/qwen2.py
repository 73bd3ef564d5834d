"""The Qwen2 family's trainer side: the Llama block (``trainer.models.decoder.Llama``) of a
``hpc.core.models.qwen2`` shape, whose q, k and v projections carry biases."""

from __future__ import annotations

from torch import nn

from hpc.core.models import model_facts
from hpc.core.spec import Model as ModelSpec
from trainer.models.decoder import Llama


def build(spec: ModelSpec) -> nn.Module:
    """The Qwen2 of ``spec`` (under the caller's ``torch.device``)."""
    return Llama(model_facts(spec).shape)
