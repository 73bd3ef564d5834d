"""Packed windows with document masking (``data.packing = "document"``): the loss per counted token of a
packed batch equals the same documents run one by one, each alone and unpadded (issue 32 item 3).

Documents of random lengths (one token, a whole window, many short ones) are packed into windows of
``seq_len`` inputs; the packed batch runs through the model with each position's document number
(positions restart per document, attention block-diagonal causal) and the objective's loss; each
document then runs alone. Without the document numbers the same batch gives another loss (the test
can fail).
"""

from __future__ import annotations

import random

import pytest
import torch

from hpc.core.models.gpt import GPTShape
from hpc.core.models.llama import LlamaShape
from trainer.models.decoder import document_mask, document_positions, document_spans
from trainer.models.gpt import GPT
from trainer.models.llama import Llama
from trainer.objective import document_targets, masked_scale, micro_loss, token_losses

SEQ, VOCAB = 32, 97


def _models() -> dict[str, torch.nn.Module]:
    """A GPT and a grouped-query Llama with weights large enough that attention shapes the logits
    (GPT-2's init leaves them almost uniform, and every mask alike)."""
    torch.manual_seed(0)
    models = {"gpt": GPT(GPTShape(2, 32, 4, SEQ, VOCAB)).eval(),
              "llama": Llama(LlamaShape(2, 32, 4, 2, 64, SEQ, VOCAB)).eval()}
    with torch.no_grad():
        for model in models.values():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 1.0)
    return models


MODELS = _models()


def _lengths(pattern: str, rng: random.Random) -> list[list[int]]:
    """Windows of document lengths, each window's lengths summing to SEQ + 1 (inputs and the last target)."""
    windows = []
    for _ in range(3):
        if pattern == "whole":
            lengths = [SEQ + 1]
        elif pattern == "ones":
            lengths = [1] * 5 + [SEQ + 1 - 5]
        elif pattern == "short":
            lengths = [rng.randint(1, 4) for _ in range(40)]
        else:
            lengths = [rng.randint(1, SEQ) for _ in range(6)]
        cut, total = [], 0
        for n in lengths:
            n = min(n, SEQ + 1 - total)
            if n:
                cut.append(n)
                total += n
        if total < SEQ + 1:
            cut.append(SEQ + 1 - total)
        windows.append(cut)
    return windows


def _batch(windows: list[list[int]], rng: random.Random, prompt_masks: bool):
    """(tokens [B, SEQ+1], loss mask, document numbers, the documents as (tokens, mask) pairs)."""
    tokens, masks, docs, pieces = [], [], [], []
    for lengths in windows:
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        mask = torch.ones(SEQ + 1, dtype=torch.bool)
        if prompt_masks:
            mask = torch.tensor([rng.random() < 0.6 for _ in range(SEQ + 1)])
        numbers = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        start = 0
        for n in lengths:
            pieces.append((ids[start:start + n], mask[start:start + n]))
            start += n
        tokens.append(ids)
        masks.append(mask)
        docs.append(numbers)
    return torch.stack(tokens), torch.stack(masks), torch.stack(docs), pieces


def _one_by_one(model: torch.nn.Module, pieces) -> float:
    """Sum of the counted targets' losses over the documents, each run alone, over their count."""
    total, count = 0.0, 0
    for ids, mask in pieces:
        if len(ids) < 2:
            continue  # a one-token document has no target
        with torch.no_grad():
            losses = token_losses(model(ids[None, :-1]), ids[None])
        total += float((losses * mask[None, 1:]).sum())
        count += int(mask[1:].sum())
    return total / count


def _packed(model: torch.nn.Module, tokens, mask, docs, with_documents: bool, kernel: str | None = None) -> float:
    counted = document_targets(mask, docs)
    model.document_kernel = kernel
    with torch.no_grad():
        logits = model(tokens[:, :-1], docs[:, :-1]) if with_documents else model(tokens[:, :-1])
        loss = micro_loss(logits, tokens, counted, masked_scale(counted[:, 1:].sum(), 1))
    return float(loss)


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("pattern", ["whole", "ones", "short", "mixed"])
@pytest.mark.parametrize("prompt_masks", [False, True])
@pytest.mark.parametrize("kernel", ["mask", "segments", "flex"])  # flex: its forward (the CPU has no backward)
def test_packed_loss_with_document_masks_equals_one_by_one(family, pattern, prompt_masks, kernel):
    rng = random.Random(f"{family}{pattern}{prompt_masks}")
    model = MODELS[family]
    tokens, mask, docs, pieces = _batch(_lengths(pattern, rng), rng, prompt_masks)
    alone = _one_by_one(model, pieces)
    packed = _packed(model, tokens, mask, docs, with_documents=True, kernel=kernel)
    assert packed == pytest.approx(alone, rel=1e-5, abs=1e-6)
    if pattern != "whole":  # one document per window: plain causal attention is the same thing
        assert abs(_packed(model, tokens, mask, docs, with_documents=False) - alone) > 1e-2


def test_document_positions_and_mask():
    docs = torch.tensor([[0, 0, 0, 1, 2, 2], [5, 5, 5, 5, 5, 5]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]]
    mask = document_mask(docs)
    assert document_spans(docs) == (((0, 3), (3, 4), (4, 6)), ((0, 6),))
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert mask[1, 0].equal(torch.ones(6, 6, dtype=torch.bool).tril())
    assert mask[0, 0, 4].tolist() == [False, False, False, False, True, False]
    assert mask[0, 0, 2].tolist() == [True, True, True, False, False, False]


def test_targets_across_a_document_boundary_are_not_counted():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = torch.tensor([[True, True, True, False, True, True]])
    assert document_targets(mask, docs).tolist() == [[False, True, False, False, True, False]]
    assert document_targets(None, docs).tolist() == [[False, True, False, True, True, False]]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_packing_runs_on_meta(family):
    """The dryrun's path: the mask and positions build on the meta device."""
    shape = MODELS[family].shape
    with torch.device("meta"):
        model = type(MODELS[family])(shape)
        tokens = torch.zeros(2, SEQ, dtype=torch.long)
        out = model(tokens, torch.zeros(2, SEQ, dtype=torch.long))
    assert out.shape == (2, SEQ, VOCAB) and out.is_meta


@pytest.mark.parametrize("family", sorted(MODELS))
def test_plain_path_is_unchanged(family):
    """Without documents the model runs SDPA's causal path: the same bits as one document per window
    through the mask (to fp32 rounding) and exactly the same bits as before (no mask built)."""
    model = MODELS[family]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(tokens)
        masked = model(tokens, torch.zeros(2, SEQ, dtype=torch.long))
    torch.testing.assert_close(plain, masked, rtol=1e-5, atol=1e-5)
