"""The Llama family's trainer side: ``Llama(shape)`` from ``hpc.core.models.llama.LlamaShape``.

The model is the Llama block's (``trainer.models.decoder``: RMSNorm, grouped-query attention with rotary
embeddings, RMSNorm, SwiGLU MLP; the names ``wq``/``wk``/``wv``/``wo``/``w1``/``w2``/``w3`` the parallel
plans and LoRA targets use), shared with the Qwen2 and Mistral families; the Llama's own part is Llama
3's rotary frequency scaling, which ``rope_frequencies`` applies when ``shape.rope_factor`` > 1.
"""

from __future__ import annotations

from torch import nn

from hpc.core.models import model_facts
from hpc.core.spec import Model as ModelSpec
from trainer.models.decoder import (Attention, Llama, LlamaBlock, RMSNorm, Rotary, SwiGLU,  # noqa: F401  (re-exported)
                                    rope_frequencies, rotate)


def build(spec: ModelSpec) -> nn.Module:
    """The Llama of ``spec`` (under the caller's ``torch.device``)."""
    return Llama(model_facts(spec).shape)
