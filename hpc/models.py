"""Shapes of the built-in GPT presets, without torch.

The trainer builds its model from these shapes and the planner counts
parameters from them, so both agree by construction. The architecture is a
pre-LN GPT: token + learned position embeddings, ``n_layers`` blocks of
(LayerNorm, causal self-attention, LayerNorm, 4× MLP), a final LayerNorm and an
untied output head; linear layers have no bias.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTShape:
    n_layers: int
    d_model: int
    n_heads: int
    seq_len: int
    vocab_size: int

    @property
    def block_params(self) -> int:
        d = self.d_model
        return 12 * d * d + 4 * d  # qkv 3d², proj d², mlp 8d², two LayerNorms 4d

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.d_model + self.seq_len * self.d_model

    @property
    def head_params(self) -> int:
        return 2 * self.d_model + self.vocab_size * self.d_model  # final LayerNorm + output head

    @property
    def n_params(self) -> int:
        return self.embedding_params + self.n_layers * self.block_params + self.head_params

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·d·S for attention scores."""
        non_embedding = self.n_params - self.embedding_params
        return 6.0 * non_embedding + 12.0 * self.n_layers * self.d_model * self.seq_len


# name: (layers, d_model, heads, seq_len, vocab)
GPT_PRESETS: dict[str, GPTShape] = {
    "tiny": GPTShape(2, 64, 4, 64, 256),
    "small": GPTShape(6, 384, 6, 256, 8192),
    "125m": GPTShape(12, 768, 12, 2048, 50304),
    "350m": GPTShape(24, 1024, 16, 2048, 50304),
    "760m": GPTShape(24, 1536, 16, 2048, 50304),
    "1.3b": GPTShape(24, 2048, 32, 2048, 50304),
    "2.7b": GPTShape(32, 2560, 32, 2048, 50304),
    "6.7b": GPTShape(32, 4096, 32, 2048, 50304),
    "13b": GPTShape(40, 5120, 40, 2048, 50304),
    "30b": GPTShape(60, 6656, 52, 2048, 50304),
    "70b": GPTShape(80, 8192, 64, 2048, 50304),
}


def gpt_shape(size: str, seq_len: int = 0, vocab_size: int = 0) -> GPTShape:
    """The preset's shape with the spec's optional overrides applied."""
    base = GPT_PRESETS[size]
    return GPTShape(base.n_layers, base.d_model, base.n_heads, seq_len or base.seq_len,
                    vocab_size or base.vocab_size)
