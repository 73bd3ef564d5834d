"""The Mistral family's trainer side: the Llama block (``trainer.models.decoder.Llama``) of a
``hpc.core.models.mistral`` shape, with its sliding window where the shape has one."""

from __future__ import annotations

from torch import nn

from hpc.core.models import model_facts
from hpc.core.spec import Model as ModelSpec
from trainer.models.decoder import Llama


def build(spec: ModelSpec) -> nn.Module:
    """The Mistral of ``spec`` (under the caller's ``torch.device``)."""
    return Llama(model_facts(spec).shape)
