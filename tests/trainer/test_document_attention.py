"""The kernels packed documents attend through (``trainer.models.decoder.DocumentAttention``, issue 44):
``segments`` (SDPA's causal kernel per document span: the CPU's, and a GPU's with dropout) and ``flex``
(flex_attention over a document BlockMask: a GPU's) give the losses and gradients of the dense-mask path
they replace, within 1e-5, for the GPT, a grouped-query Llama, a Qwen2 (q/k/v biases) and a Mistral
(sliding window shorter than the documents), over several document layouts. flex_attention has no
backward on the CPU in torch 2.13, so here its forward is compared (the eval path); its backward is
compared on CUDA in the ``gpu`` test below.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.profiler import profile

from hpc.core.models.decoder import block_mask_bytes, document_kernel
from hpc.core.models.gpt import GPTShape
from hpc.core.models.llama import LlamaShape
from trainer.models.decoder import document_attention, native_gqa
from trainer.models.gpt import GPT
from trainer.models.llama import Llama
from trainer.objective import document_targets, masked_scale, micro_loss

SEQ, VOCAB = 48, 61
SHAPES = {
    "gpt": lambda: GPT(GPTShape(2, 32, 4, SEQ, VOCAB)),
    "llama": lambda: Llama(LlamaShape(2, 32, 4, 2, 64, SEQ, VOCAB)),
    "qwen2": lambda: Llama(LlamaShape(2, 32, 4, 1, 64, SEQ, VOCAB, qkv_bias=True)),
    "mistral": lambda: Llama(LlamaShape(2, 32, 4, 2, 64, SEQ, VOCAB, window=7)),
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = SHAPES[family]()
    with torch.no_grad():  # weights large enough that attention shapes the logits
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5)
    return model


def _documents(layout: str, rows: int, rng: random.Random) -> torch.Tensor:
    """[rows, SEQ + 1] document numbers of one layout."""
    out = []
    for _ in range(rows):
        if layout == "one":
            lengths = [SEQ + 1]
        elif layout == "singles":  # one-token documents between longer ones
            lengths = [1, 1, 20, 1, SEQ - 22]
        elif layout == "short":
            lengths = [rng.randint(1, 5) for _ in range(SEQ)]
        else:
            lengths = [rng.randint(4, SEQ // 2) for _ in range(6)]
        out.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:SEQ + 1])
        out[-1] = torch.cat([out[-1], out[-1][-1:].expand(SEQ + 1 - len(out[-1]))])
    return torch.stack(out)


def _loss_and_grads(model: torch.nn.Module, kernel: str, tokens, docs) -> tuple[float, list[torch.Tensor]]:
    model.document_kernel = kernel
    model.zero_grad()
    counted = document_targets(None, docs)
    loss = micro_loss(model(tokens[:, :-1], docs[:, :-1]), tokens, counted, masked_scale(counted[:, 1:].sum(), 1))
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("layout", ["one", "singles", "short", "mixed"])
def test_segments_give_the_masked_paths_loss_and_gradients(family, layout):
    rng = random.Random(f"{family}{layout}")
    model = _model(family)
    docs = _documents(layout, 3, rng)
    tokens = torch.randint(0, VOCAB, docs.shape, generator=torch.Generator().manual_seed(1))
    reference, ref_grads = _loss_and_grads(model, "mask", tokens, docs)
    loss, grads = _loss_and_grads(model, "segments", tokens, docs)
    assert loss == pytest.approx(reference, rel=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()) + 1e-7)
    if layout != "one":  # the reference can fail: plain causal attention gives another loss
        model.document_kernel = "mask"
        with torch.no_grad():
            plain = micro_loss(model(tokens[:, :-1]), tokens, document_targets(None, docs),
                               masked_scale(document_targets(None, docs)[:, 1:].sum(), 1))
        assert abs(float(plain) - reference) > 1e-3


@pytest.mark.parametrize("family", sorted(SHAPES))
@pytest.mark.parametrize("layout", ["singles", "mixed"])
def test_flex_forward_gives_the_masked_paths_logits(family, layout):
    model = _model(family).eval()
    docs = _documents(layout, 2, random.Random(layout))[:, :SEQ]
    tokens = torch.randint(0, VOCAB, docs.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.document_kernel = "mask"
        reference = model(tokens, docs)
        model.document_kernel = "flex"
        got = model(tokens, docs)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


def test_the_kernel_follows_the_device_and_dropout():
    assert document_kernel(gpu=True, dropout=0.0) == "flex"
    assert document_kernel(gpu=True, dropout=0.1) == "segments"  # flex_attention has no dropout
    assert document_kernel(gpu=False, dropout=0.0) == "segments"  # no flex backward on the CPU
    docs = torch.zeros(2, 8, dtype=torch.long)
    assert document_attention(docs).kernel == "segments"
    assert document_attention(docs.to("meta")).kernel == "mask"  # hpcx dryrun: no span can be read
    assert document_attention(docs, "segments").dense is None  # no [b, 1, s, s] anywhere
    with pytest.raises(ValueError, match="expected flex, segments or mask"):
        document_attention(docs, "varlen")


def test_a_gpt_with_dropout_takes_the_segments_kernel_in_training(monkeypatch):
    seen = []
    import trainer.models.gpt as gpt

    real = gpt.document_attention
    monkeypatch.setattr(gpt, "document_attention", lambda d, k, p: seen.append(p) or real(d, k, p))
    model = GPT(GPTShape(1, 16, 2, 8, VOCAB), dropout=0.1)
    docs = torch.zeros(1, 8, dtype=torch.long)
    model.train()(torch.zeros(1, 8, dtype=torch.long), docs)
    model.eval()(torch.zeros(1, 8, dtype=torch.long), docs)
    assert seen == [0.1, 0.0]


def _ops(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_gqa_keys_are_not_repeated_and_the_fused_kernel_runs():
    """The segments kernel hands SDPA the 2 key/value heads of 4 query heads (``enable_gqa``): no
    repeat_interleave, and the CPU's flash kernel, not the math one, forward and backward."""
    model = _model("llama")
    docs = _documents("mixed", 2, random.Random(0))
    tokens = torch.randint(0, VOCAB, docs.shape)
    ops = _ops(lambda: _loss_and_grads(model, "segments", tokens, docs))
    assert "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ops
    assert "aten::repeat_interleave" not in ops and "aten::_scaled_dot_product_attention_math" not in ops


def test_gqa_is_native_where_the_kernel_takes_it():
    assert native_gqa("cpu", torch.float32, masked=False) and native_gqa("cpu", torch.float32, masked=True)
    assert native_gqa("cuda", torch.bfloat16, masked=False)  # flash
    assert not native_gqa("cuda", torch.float32, masked=False)  # fp32: repeat k/v for the efficient kernel
    assert not native_gqa("cuda", torch.bfloat16, masked=True)  # a mask: no flash on CUDA


@pytest.mark.parametrize("batch, seq", [(1, 64), (2, 300), (3, 1024)])
def test_the_block_mask_holds_what_the_planner_counts(batch, seq):
    docs = torch.repeat_interleave(torch.arange(4), seq // 4).expand(batch, -1)
    docs = torch.cat([docs, docs[:, -1:].expand(batch, seq - docs.shape[1])], dim=1)
    mask = document_attention(docs, "flex").block_mask
    held = sum(t.numel() * t.element_size() for t in mask.as_tuple() if isinstance(t, torch.Tensor))
    assert held == block_mask_bytes(batch, seq)
    assert held < batch * seq * seq or seq <= 128  # the dense mask's bytes


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt", "llama", "mistral"])
def test_flex_on_cuda_gives_the_masked_paths_loss_and_gradients(family):
    model = _model(family).cuda()
    docs = _documents("mixed", 2, random.Random(family)).cuda()
    tokens = torch.randint(0, VOCAB, docs.shape, device="cuda")
    reference, ref_grads = _loss_and_grads(model, "mask", tokens, docs)
    loss, grads = _loss_and_grads(model, "flex", tokens, docs)
    assert loss == pytest.approx(reference, rel=1e-4)  # TF32 off by default: fp32 kernels, different sums
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()) + 1e-6)
