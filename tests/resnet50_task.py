"""ResNet-50 as a task (``[task] target = "tests.resnet50_task:ResNet50Task"``), for the planner's FLOP count.

torchvision is not a dependency here, so the network is written out: torchvision's ``resnet50`` layout (He et
al. 2015, Table 1, with the stride on the 3×3 convolution as torchvision has it): a 7×7/2 stem with 64 channels,
a 3×3/2 max-pool, four stages of 3, 4, 6 and 3 bottleneck blocks (1×1, 3×3, 1×1 with a 4× expansion) at 64, 128,
256 and 512 channels, global average pooling and a 1000-way linear head: 25,557,032 parameters, torchvision's
count. The images are zeros: only their shape matters to a FLOP count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Bottleneck(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        out = planes * 4
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = None if stride == 1 and inplanes == out else nn.Sequential(
            nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        blocks, inplanes = [], 64
        for planes, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(count):
                blocks.append(Bottleneck(inplanes, planes, stride if i == 0 else 1))
                inplanes = planes * 4
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(2048, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))


class Zeros(Dataset):
    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(3, self.size, self.size), torch.tensor(index % 1000)


class ResNet50Task:
    def __init__(self, size: int = 224):
        self.size = size

    def build_model(self) -> nn.Module:
        return ResNet50()

    def units(self, model: nn.Module) -> nn.ModuleList:
        return model.blocks

    def train_dataset(self) -> Dataset:
        return Zeros(self.size)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)
