"""ResNet50 v1b (GluonCV naming; "v1.5" elsewhere): the stride of a downsampling bottleneck sits
on its 3x3 convolution, not on the first 1x1."""

from __future__ import annotations

import torch
import torch.nn as nn

from ... import catalog
from .registry import family


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        # Zero-init the last BN gamma so each block starts as identity (common v1b practice).
        nn.init.zeros_(self.bn3.weight)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNetV1b(nn.Module):
    def __init__(self, layers: tuple[int, int, int, int], *, num_classes: int = 1000,
                 base_width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base_width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(base_width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks: list[nn.Module] = []
        cin = base_width
        for stage, count in enumerate(layers):
            width = base_width * 2**stage
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride=2 if (i == 0 and stage > 0) else 1))
                cin = width * Bottleneck.expansion
        self.body = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.body(self.stem(x))), 1))


@family("resnet_v1b")
def build(entry: catalog.Backbone, *, num_classes: int, **_: object) -> ResNetV1b:
    return ResNetV1b(**entry.arch, num_classes=num_classes)
