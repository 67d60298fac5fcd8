"""IResNet: InsightFace's improved residual network for 112x112 faces.

The unit is BN-conv3x3-BN-PReLU-conv3x3(stride)-BN plus the shortcut: the stride sits on the second
convolution and there is no activation after the addition.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ... import catalog
from .registry import family

BN_EPS = 1e-5


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, eps=BN_EPS)
        self.conv1 = _conv3x3(cin, cout)
        self.bn2 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.prelu = nn.PReLU(cout)
        self.conv2 = _conv3x3(cout, cout, stride)
        self.bn3 = nn.BatchNorm2d(cout, eps=BN_EPS)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout, eps=BN_EPS)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(nn.Module):
    def __init__(
        self,
        layers: tuple[int, int, int, int],
        *,
        widths: tuple[int, int, int, int] = catalog.IRESNET_WIDTHS,
        embedding_size: int = 512,
        input_size: int = 112,
        output_block: str = "E",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if input_size % 16:
            raise ValueError(f"IResNet needs an input side divisible by 16, got {input_size}")
        if output_block not in ("E", "FC"):
            raise ValueError(f"IResNet output block must be 'E' or 'FC', got {output_block!r}")
        stem = widths[0]
        self.conv1 = _conv3x3(3, stem)
        self.bn1 = nn.BatchNorm2d(stem, eps=BN_EPS)
        self.prelu = nn.PReLU(stem)
        blocks: list[nn.Module] = []
        cin = stem
        for width, count in zip(widths, layers):
            blocks.append(IBasicBlock(cin, width, stride=2))
            blocks.extend(IBasicBlock(width, width, stride=1) for _ in range(count - 1))
            cin = width
        self.body = nn.Sequential(*blocks)
        self.bn2 = nn.BatchNorm2d(cin, eps=BN_EPS)
        # "E" is BN, dropout, FC, BN; "FC" is the same without dropout.
        self.dropout = nn.Dropout(dropout if output_block == "E" else 0.0, inplace=True)
        side = input_size // 16
        self.fc = nn.Linear(cin * side * side, embedding_size)
        self.features = nn.BatchNorm1d(embedding_size, eps=BN_EPS)
        # InsightFace fixes the embedding BN's gamma at 1 (fix_gamma=True in MXNet).
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.bn2(self.body(x))
        x = self.dropout(torch.flatten(x, 1))
        return self.features(self.fc(x))


@family("iresnet")
def build(entry: catalog.Backbone, *, embedding_size: int, input_size: int = 112,
          output_block: str = "E", dropout: float = 0.0, **_: object) -> IResNet:
    return IResNet(**entry.arch, embedding_size=embedding_size, input_size=input_size,
                   output_block=output_block, dropout=dropout)
