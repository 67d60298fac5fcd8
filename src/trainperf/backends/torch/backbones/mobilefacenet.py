"""MobileFaceNet (Chen et al. 2018) as InsightFace builds it, with the GDC output block.

``mobilefacenet_y1`` is InsightFace's "y1": a 128-d embedding on the paper's widths.
``mobilefacenet`` is the 512-d model used by current InsightFace recipes (channels doubled).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ... import catalog
from .registry import family


class ConvBN(nn.Module):
    """Conv, BN and (unless ``linear``) PReLU."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, padding: int = 0,
                 groups: int = 1, linear: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.act: nn.Module = nn.Identity() if linear else nn.PReLU(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class DepthWise(nn.Module):
    """Inverted bottleneck: expand (1x1), depthwise 3x3, project (1x1, linear)."""

    def __init__(self, cin: int, cout: int, hidden: int, stride: int, residual: bool) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvBN(cin, hidden),
            ConvBN(hidden, hidden, 3, stride, 1, groups=hidden),
            ConvBN(hidden, cout, linear=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(x)
        return x + out if self.residual else out


class MobileFaceNet(nn.Module):
    """``width`` scales the block channels; the expansion (hidden) widths and the stem's group
    count stay fixed, as in InsightFace's models, so the 512-d model is not simply Y1 doubled."""

    def __init__(self, *, embedding_size: int = 128, width: int = 1, input_size: int = 112,
                 blocks: tuple[int, int, int] = (4, 6, 2), sep_channels: int = 512,
                 hidden: tuple[int, int, int, int] = (128, 256, 512, 256)) -> None:
        super().__init__()
        if input_size % 16:
            raise ValueError(f"MobileFaceNet needs an input side divisible by 16, got {input_size}")
        c64, c128 = 64 * width, 128 * width
        h_low, h_mid, h_down, h_high = hidden
        layers: list[nn.Module] = [
            ConvBN(3, c64, 3, 2, 1),
            ConvBN(c64, c64, 3, 1, 1, groups=64),
            DepthWise(c64, c64, h_low, 2, residual=False),
        ]
        layers += [DepthWise(c64, c64, h_low, 1, residual=True) for _ in range(blocks[0])]
        layers.append(DepthWise(c64, c128, h_mid, 2, residual=False))
        layers += [DepthWise(c128, c128, h_mid, 1, residual=True) for _ in range(blocks[1])]
        layers.append(DepthWise(c128, c128, h_down, 2, residual=False))
        layers += [DepthWise(c128, c128, h_high, 1, residual=True) for _ in range(blocks[2])]
        layers.append(ConvBN(c128, sep_channels))
        self.body = nn.Sequential(*layers)
        side = input_size // 16
        # GDC: a global depthwise conv over the whole map replaces pooling.
        self.gdc = ConvBN(sep_channels, sep_channels, side, groups=sep_channels, linear=True)
        self.fc = nn.Linear(sep_channels, embedding_size, bias=False)
        self.features = nn.BatchNorm1d(embedding_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gdc(self.body(x))
        return self.features(self.fc(torch.flatten(x, 1)))


@family("mobilefacenet")
def build(entry: catalog.Backbone, *, embedding_size: int, input_size: int = 112,
          **_: object) -> MobileFaceNet:
    return MobileFaceNet(**entry.arch, embedding_size=embedding_size, input_size=input_size)
