"""A BERT-style sequence classifier fine-tuned from a Hugging Face folder (``jobs/bert-ddp.toml``,
``jobs/bert-fsdp.toml``). Needs ``transformers`` (and ``safetensors``) where the job runs.

``pretrained`` is a folder written by ``BertForSequenceClassification.save_pretrained``: the model is
built from its ``config.json`` on the meta device, its encoder layers are the units, and the
weights are read from its ``model.safetensors`` at step 0 (``pretrained``). The data is generated
from a seed: token sequences of random length (padded, with an attention mask), labelled by whether
most of their tokens are in the lower half of the vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset


class GeneratedSentences(Dataset):
    """``samples`` padded sequences of ``seq_len`` token ids (id 0 is padding) with a 0/1 label."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int, seed: int, split: int):
        self.samples, self.seq_len, self.vocab_size, self.seed, self.split = samples, seq_len, vocab_size, seed, split

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.split) * 1_000_003 + index)
        length = int(torch.randint(self.seq_len // 2, self.seq_len + 1, (), generator=gen))
        tokens = torch.randint(1, self.vocab_size, (length,), generator=gen)
        label = int((tokens < self.vocab_size // 2).sum() * 2 > length)
        ids = torch.zeros(self.seq_len, dtype=torch.long)
        ids[:length] = tokens
        mask = (torch.arange(self.seq_len) < length).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(label)}


def _reset_embedding_buffers(embeddings: nn.Module) -> None:
    """BertEmbeddings owns two buffers (position and token-type ids) and no ``reset_parameters``: give it
    one, so hpcx can initialise the model built on the meta device."""

    def reset_parameters() -> None:
        n = embeddings.position_ids.shape[-1]
        embeddings.position_ids.copy_(torch.arange(n, device=embeddings.position_ids.device).expand(1, -1))
        embeddings.token_type_ids.zero_()

    embeddings.reset_parameters = reset_parameters


class SequenceClassificationTask:
    """The task (``[task] target = "examples.bert:SequenceClassificationTask"``)."""

    def __init__(self, pretrained: str, seq_len: int = 16, train_samples: int = 512, eval_samples: int = 64,
                 seed: int = 0):
        self.folder, self.seq_len = Path(pretrained), seq_len
        self.train_samples, self.eval_samples, self.seed = train_samples, eval_samples, seed

    def _config(self):  # noqa: ANN202  (transformers' type)
        from transformers import BertConfig

        return BertConfig.from_pretrained(self.folder)

    def build_model(self) -> nn.Module:
        from transformers import BertForSequenceClassification

        model = BertForSequenceClassification(self._config())
        _reset_embedding_buffers(model.bert.embeddings)
        return model

    def units(self, model: nn.Module) -> nn.ModuleList:
        return model.bert.encoder.layer

    def pretrained(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(self.folder / "model.safetensors")

    def train_dataset(self) -> Dataset:
        return GeneratedSentences(self.train_samples, self.seq_len, self._config().vocab_size, self.seed, split=0)

    def eval_dataset(self) -> Dataset:
        return GeneratedSentences(self.eval_samples, self.seq_len, self._config().vocab_size, self.seed, split=1)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    def metrics(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return {"accuracy": ((logits.argmax(dim=-1) == batch["labels"]).sum(), batch["labels"].numel())}


def save_tiny(folder: str, seed: int = 0) -> None:
    """A tiny randomly initialised BertForSequenceClassification (2 layers, width 32), saved with
    ``save_pretrained``: something to fine-tune where nothing can be downloaded."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertForSequenceClassification(config).save_pretrained(folder)


if __name__ == "__main__":
    import sys

    save_tiny(sys.argv[1] if len(sys.argv) > 1 else "bert-tiny")
