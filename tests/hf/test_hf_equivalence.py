"""hpcx's Llama and GPT compute what ``transformers`` computes on the same weights (fp32).

``transformers`` is the judge, not a dependency of the trainer: tiny random configurations are
built here (nothing is downloaded), the hpcx model's weights are copied into ``LlamaForCausalLM`` /
``GPT2LMHeadModel`` under the export's name and layout mapping (``hpc.ckpt.hf.hf_tensors``), and
the logits must agree to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.extras import extra

transformers = extra("transformers")

from hpc.ckpt.hf import hf_tensors  # noqa: E402
from hpc.core.hf import hf_config  # noqa: E402
from hpc.core.models.llama import LlamaShape  # noqa: E402
from hpc.core.models.gpt import GPTShape  # noqa: E402
from trainer.models.llama import Llama  # noqa: E402
from trainer.models.gpt import GPT  # noqa: E402

LLAMAS = [LlamaShape(2, 64, 4, 2, 160, 32, 300),  # grouped-query attention
          LlamaShape(3, 48, 6, 6, 96, 40, 200, tied=True, rope_theta=500000.0),  # tied, multi-head
          LlamaShape(2, 64, 4, 1, 128, 48, 256, rope_theta=500000.0, rope_factor=8.0,  # Llama 3.1 scaling
                     rope_original_seq_len=16, norm_eps=1e-6)]
GPTS = [GPTShape(2, 64, 4, 32, 300), GPTShape(3, 48, 6, 40, 200, tied=True)]


def hf_model(config: dict, state: dict) -> torch.nn.Module:
    """A transformers model built from ``config`` (config.json's dict) holding ``state`` exactly."""
    cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config["tie_word_embeddings"] else set()  # shared with the embedding
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    if tied:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def max_diff(ours: torch.nn.Module, arch: str, shape) -> float:
    ours.eval()
    state = dict(hf_tensors(ours.state_dict(), arch, shape))
    theirs = hf_model(hf_config(arch, shape), state)
    vocab, seq = shape.vocab_size, shape.seq_len
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(tokens) - theirs(tokens).logits).abs().max().item()


@pytest.mark.parametrize("shape", LLAMAS, ids=str)
def test_llama_forward_equals_transformers(shape):
    torch.manual_seed(0)
    model = Llama(shape)
    with torch.no_grad():  # norms away from ones, so a swapped norm would show
        for p in model.parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.1)
    assert max_diff(model, "llama", shape) <= 1e-5


@pytest.mark.parametrize("shape", GPTS, ids=str)
def test_gpt_forward_equals_gpt2(shape):
    torch.manual_seed(0)
    model = GPT(shape)
    assert max_diff(model, "gpt", shape) <= 1e-5
