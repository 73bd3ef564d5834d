"""A small ResNet-style image classifier on a generated image set (``jobs/resnet-ddp.toml``).

The images are made from a seed, sample by sample: each class has a fixed random template and each
image is its class's template plus noise, so the set is the same on every rank and run, needs no
download, and is learnable (accuracy climbs from chance within a few dozen steps). The net is a
stem, a list of residual blocks (the units hpcx checkpoints and shards) and a pooled linear head.
``norm = "group"`` (the default) normalizes with GroupNorm, which keeps no running statistics;
``norm = "batch"`` with BatchNorm, as the classic ResNet recipe does: each rank's running statistics
come from its own batches unless ``task.sync_batchnorm`` is set (docs/tasks.md says what a checkpoint
keeps of them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class GeneratedImages(Dataset):
    """``samples`` images ``[3, size, size]`` with labels in ``[0, classes)``, sample ``i`` from the seed."""

    def __init__(self, samples: int, classes: int, size: int, seed: int, split: int, noise: float = 1.0):
        self.samples, self.classes, self.seed, self.split, self.noise = samples, classes, seed, split, noise
        gen = torch.Generator().manual_seed(seed)
        self.templates = torch.randn(classes, 3, size, size, generator=gen)

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.split) * 1_000_003 + index)
        label = int(torch.randint(0, self.classes, (), generator=gen))
        image = self.templates[label] + self.noise * torch.randn(self.templates.shape[1:], generator=gen)
        return image, torch.tensor(label)


NORMS = ("group", "batch")


def norm_layer(norm: str, width: int, groups: int) -> nn.Module:
    """GroupNorm (``"group"``) or BatchNorm (``"batch"``) over ``width`` channels."""
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r}: expected one of {NORMS}")
    return nn.GroupNorm(groups, width) if norm == "group" else nn.BatchNorm2d(width)


class ResidualBlock(nn.Module):
    """conv → norm → ReLU → conv → norm, added to its input, then ReLU."""

    def __init__(self, width: int, groups: int, norm: str = "group"):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm1 = norm_layer(norm, width, groups)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm2 = norm_layer(norm, width, groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(y)))


class SmallResNet(nn.Module):
    def __init__(self, width: int, depth: int, classes: int, groups: int, norm: str = "group"):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(ResidualBlock(width, groups, norm) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(images))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


class ImageTask:
    """The task (``[task] target = "examples.resnet:ImageTask"``); ``task.kwargs`` are these arguments."""

    def __init__(self, width: int = 16, depth: int = 2, classes: int = 4, size: int = 16, groups: int = 4,
                 train_samples: int = 1024, eval_samples: int = 128, seed: int = 0, norm: str = "group"):
        self.width, self.depth, self.classes, self.size, self.groups = width, depth, classes, size, groups
        self.train_samples, self.eval_samples, self.seed, self.norm = train_samples, eval_samples, seed, norm

    def build_model(self) -> nn.Module:
        return SmallResNet(self.width, self.depth, self.classes, self.groups, self.norm)

    def units(self, model: nn.Module) -> nn.ModuleList:
        return model.blocks

    def train_dataset(self) -> Dataset:
        return GeneratedImages(self.train_samples, self.classes, self.size, self.seed, split=0)

    def eval_dataset(self) -> Dataset:
        return GeneratedImages(self.eval_samples, self.classes, self.size, self.seed, split=1)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The loss, and the batch's accuracy beside it (logged per step as ``train_accuracy``)."""
        images, labels = batch
        logits = model(images)
        accuracy = (logits.argmax(dim=-1) == labels).float().mean()
        return F.cross_entropy(logits, labels), {"accuracy": accuracy}

    def metrics(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict:
        images, labels = batch
        correct = (model(images).argmax(dim=-1) == labels).sum()
        return {"accuracy": (correct, labels.numel())}
