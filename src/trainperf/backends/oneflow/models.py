"""OneFlow backbones equal to the PyTorch ones in ``trainperf.backends.torch.backbones``: every
family of the catalogue (IResNet, MobileFaceNet, ResNet v1b).

OneFlow's ``nn`` mirrors torch's, so each module here is its torch twin written again with
``oneflow.nn``: the same layers in the same order, registered under the same attribute names
(and ``Sequential`` indices), so a OneFlow ``state_dict`` key *is* the torch key and the layouts
are the same (OIHW convolutions, depthwise ones [C, 1, k, k], [out, in] linear weights, PReLU
[C], BatchNorm ``weight``/``bias``/``running_mean``/``running_var``/``num_batches_tracked``).
:func:`load_torch_arrays` therefore loads the ``backbone/<torch name>`` arrays of an alignment
``.npz`` (``trainperf.config.AlignSpec.start``) without renaming or transposing anything. Layers
without parameters (ReLU, pooling, identity) are modules where torch has them as modules, so
that the ``Sequential`` indices after them stay torch's.

IResNet (InsightFace's): the unit is BN, 3x3 conv, BN, PReLU, 3x3 conv with the stride, BN,
plus the shortcut (1x1 conv with the stride and BN where the shape changes), no activation after
the addition. Output blocks as insightface's MXNet ``get_fc1``: ``E`` is BN, dropout, FC (with
bias), BN; ``FC`` the same without dropout. The embedding BN's gamma is fixed at 1 (MXNet's
``fix_gamma``): a parameter that takes no gradient, counted in the parameter count as torch
counts it.

MobileFaceNet (``mobilefacenet_y1`` is InsightFace's Y1): conv-BN-PReLU units, inverted
bottlenecks (1x1 expand, 3x3 depthwise with the stride, 1x1 linear projection, a residual where
the shape stays), and the GDC output block: a depthwise conv over the whole last map, BN, a
Linear without bias, BN with a learnable gamma. Depthwise convolutions are ``Conv2d`` with
``groups`` equal to the channels, as torch's (OneFlow's CPU kernel computes them in float64 too).

ResNet v1b: stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool), bottlenecks with the stride on the
3x3, the last BN's gamma of each starting at 0 (as torch's), global average pool, Linear to the
classes. ReLUs are not in place: the same arithmetic as torch's in-place ones, and nothing for
OneFlow's autograd or ``nn.Graph`` to order.

BatchNorm: eps 1e-5 and momentum 0.1 as torch's defaults; training-mode forward and backward use
the batch statistics. A float64 alignment run computes BatchNorm with tensor operations
(``exact_statistics``: OneFlow's kernel holds its epsilon and momentum as 32-bit floats,
``exact.py``), in every family. PReLU starts at 0.25 per channel; its slope is a tensor, so its
kernel computes in the network's dtype and needs no stand-in. Initialisation follows OneFlow's
defaults, which copy torch's (``kaiming_uniform_(a=sqrt(5))`` for conv and linear weights);
alignment overwrites every value.
"""

from __future__ import annotations

from typing import Any, Callable

import oneflow as flow
import oneflow.nn as nn

from .. import catalog, layouts
from . import exact
from .backend import BACKEND

__all__ = ["backbone_names", "backbone_task", "build_backbone", "load_torch_arrays",
           "param_count", "BN_EPS"]

BN_EPS = 1e-5


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _batch_norms(exact_statistics: bool) -> tuple[type, type]:
    """(BatchNorm1d, BatchNorm2d): OneFlow's, or for a float64 alignment run those that
    compute in float64 throughout, epsilon and momentum included (``exact.py`` says why)."""
    if exact_statistics:
        return exact.BatchNorm1d, exact.BatchNorm2d
    return nn.BatchNorm1d, nn.BatchNorm2d


class IBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, bn2d: type = nn.BatchNorm2d) -> None:
        super().__init__()
        self.bn1 = bn2d(cin, eps=BN_EPS)
        self.conv1 = _conv3x3(cin, cout)
        self.bn2 = bn2d(cout, eps=BN_EPS)
        self.prelu = nn.PReLU(cout)
        self.conv2 = _conv3x3(cout, cout, stride)
        self.bn3 = bn2d(cout, eps=BN_EPS)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            bn2d(cout, eps=BN_EPS))

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(nn.Module):
    def __init__(self, layers: tuple[int, int, int, int], *,
                 widths: tuple[int, int, int, int] = catalog.IRESNET_WIDTHS,
                 embedding_size: int = 512,
                 input_size: int = 112, output_block: str = "E", dropout: float = 0.0,
                 exact_statistics: bool = False) -> None:
        super().__init__()
        bn1d, bn2d = _batch_norms(exact_statistics)
        if input_size % 16:
            raise ValueError(f"IResNet needs an input side divisible by 16, got {input_size}")
        if output_block not in ("E", "FC"):
            raise ValueError(f"IResNet output block must be 'E' or 'FC', got {output_block!r}")
        stem = widths[0]
        self.conv1 = _conv3x3(3, stem)
        self.bn1 = bn2d(stem, eps=BN_EPS)
        self.prelu = nn.PReLU(stem)
        blocks = []
        cin = stem
        for width, count in zip(widths, layers):
            blocks.append(IBasicBlock(cin, width, 2, bn2d))
            blocks.extend(IBasicBlock(width, width, 1, bn2d) for _ in range(count - 1))
            cin = width
        self.body = nn.Sequential(*blocks)
        self.bn2 = bn2d(cin, eps=BN_EPS)
        self.dropout = nn.Dropout(dropout if output_block == "E" else 0.0)
        side = input_size // 16
        self.fc = nn.Linear(cin * side * side, embedding_size)
        self.features = bn1d(embedding_size, eps=BN_EPS)
        # InsightFace's fix_gamma: the embedding BN only centres and scales by the batch
        # statistics.
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad_(False)

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.bn2(self.body(x))
        x = self.dropout(flow.flatten(x, 1))
        return self.features(self.fc(x))


class ConvBN(nn.Module):
    """Conv, BN and (unless ``linear``) PReLU; children ``conv``, ``bn``, ``act`` as torch's."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, padding: int = 0,
                 groups: int = 1, linear: bool = False, bn2d: type = nn.BatchNorm2d) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=False)
        self.bn = bn2d(cout, eps=BN_EPS)
        self.act = nn.Identity() if linear else nn.PReLU(cout)

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        return self.act(self.bn(self.conv(x)))


class DepthWise(nn.Module):
    """Inverted bottleneck: expand (1x1), depthwise 3x3 with the stride, project (1x1,
    linear); ``residual`` adds the input back."""

    def __init__(self, cin: int, cout: int, hidden: int, stride: int, residual: bool,
                 bn2d: type = nn.BatchNorm2d) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvBN(cin, hidden, bn2d=bn2d),
            ConvBN(hidden, hidden, 3, stride, 1, groups=hidden, bn2d=bn2d),
            ConvBN(hidden, cout, linear=True, bn2d=bn2d))

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        out = self.layers(x)
        return x + out if self.residual else out


class MobileFaceNet(nn.Module):
    """MobileFaceNet with the GDC output block. ``width`` scales the block channels only: the
    expansion (hidden) widths and the second unit's 64 groups stay fixed, as in torch's (and
    InsightFace's) models."""

    def __init__(self, *, embedding_size: int = 128, width: int = 1, input_size: int = 112,
                 blocks: tuple[int, int, int] = (4, 6, 2), sep_channels: int = 512,
                 hidden: tuple[int, int, int, int] = (128, 256, 512, 256),
                 exact_statistics: bool = False) -> None:
        super().__init__()
        if input_size % 16:
            raise ValueError(f"MobileFaceNet needs an input side divisible by 16, got {input_size}")
        bn1d, bn2d = _batch_norms(exact_statistics)
        c64, c128 = 64 * width, 128 * width
        h_low, h_mid, h_down, h_high = hidden

        def unit(cin: int, cout: int, hid: int, stride: int, residual: bool) -> DepthWise:
            return DepthWise(cin, cout, hid, stride, residual, bn2d)

        layers = [ConvBN(3, c64, 3, 2, 1, bn2d=bn2d),
                  ConvBN(c64, c64, 3, 1, 1, groups=64, bn2d=bn2d),
                  unit(c64, c64, h_low, 2, False)]
        layers += [unit(c64, c64, h_low, 1, True) for _ in range(blocks[0])]
        layers.append(unit(c64, c128, h_mid, 2, False))
        layers += [unit(c128, c128, h_mid, 1, True) for _ in range(blocks[1])]
        layers.append(unit(c128, c128, h_down, 2, False))
        layers += [unit(c128, c128, h_high, 1, True) for _ in range(blocks[2])]
        layers.append(ConvBN(c128, sep_channels, bn2d=bn2d))
        self.body = nn.Sequential(*layers)
        side = input_size // 16
        # GDC: a depthwise conv over the whole last map in place of pooling.
        self.gdc = ConvBN(sep_channels, sep_channels, side, groups=sep_channels, linear=True,
                          bn2d=bn2d)
        self.fc = nn.Linear(sep_channels, embedding_size, bias=False)
        self.features = bn1d(embedding_size, eps=BN_EPS)

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        x = self.gdc(self.body(x))
        return self.features(self.fc(flow.flatten(x, 1)))


class Bottleneck(nn.Module):
    """1x1, 3x3 with the stride (v1b), 1x1 to four times the width, plus the shortcut; ReLU
    after the sum. The last BN's gamma starts at 0, so the block starts as its shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, bn2d: type = nn.BatchNorm2d) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = bn2d(width, eps=BN_EPS)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = bn2d(width, eps=BN_EPS)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = bn2d(cout, eps=BN_EPS)
        nn.init.zeros_(self.bn3.weight)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            bn2d(cout, eps=BN_EPS))

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNetV1b(nn.Module):
    """Classification ResNet v1b: images -> logits over ``num_classes``."""

    def __init__(self, layers: tuple[int, int, int, int], *, num_classes: int = 1000,
                 base_width: int = 64, exact_statistics: bool = False) -> None:
        super().__init__()
        _, bn2d = _batch_norms(exact_statistics)
        self.stem = nn.Sequential(nn.Conv2d(3, base_width, 7, 2, 3, bias=False),
                                  bn2d(base_width, eps=BN_EPS), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks = []
        cin = base_width
        for stage, count in enumerate(layers):
            width = base_width * 2**stage
            for i in range(count):
                blocks.append(Bottleneck(cin, width, 2 if (i == 0 and stage > 0) else 1, bn2d))
                cin = width * Bottleneck.expansion
        self.body = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        return self.fc(flow.flatten(self.pool(self.body(self.stem(x))), 1))


# -- builders of the catalogue's families: each takes every argument, uses its own ----------

def _iresnet(b: catalog.Backbone, *, embedding_size: int, input_size: int, output_block: str,
             dropout: float, exact_statistics: bool, **_: Any) -> IResNet:
    return IResNet(**b.arch, embedding_size=embedding_size, input_size=input_size,
                   output_block=output_block, dropout=dropout,
                   exact_statistics=exact_statistics)


def _mobilefacenet(b: catalog.Backbone, *, embedding_size: int, input_size: int,
                   exact_statistics: bool, **_: Any) -> MobileFaceNet:
    return MobileFaceNet(**b.arch, embedding_size=embedding_size, input_size=input_size,
                         exact_statistics=exact_statistics)


def _resnet_v1b(b: catalog.Backbone, *, num_classes: int, exact_statistics: bool,
                **_: Any) -> ResNetV1b:
    return ResNetV1b(**b.arch, num_classes=num_classes, exact_statistics=exact_statistics)


# family -> builder of a catalogue entry; every family the backend declares has one.
_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "iresnet": _iresnet, "mobilefacenet": _mobilefacenet, "resnet_v1b": _resnet_v1b}
CATALOG = catalog.BackendCatalog(BACKEND.capabilities.families, BACKEND.name)
backbone_names = CATALOG.names
backbone_task = CATALOG.task


def build_backbone(name: str, *, embedding_size: int | None = None,
                   num_classes: int | None = None, input_size: int = 112,
                   output_block: str = "E", dropout: float = 0.0,
                   exact_statistics: bool = False) -> nn.Module:
    """The OneFlow twin of torch's ``build_backbone(name, ...)``. Face backbones use
    ``embedding_size`` and ``input_size``, IResNet also ``output_block`` and ``dropout``;
    classification backbones use ``num_classes``; None takes the catalogue's default (torch's).
    ``exact_statistics``: BatchNorm computed in the network's own dtype, epsilon and momentum
    included (a float64 alignment run's)."""
    entry = CATALOG.lookup(name)
    return _BUILDERS[entry.family](
        entry, embedding_size=entry.embedding(embedding_size),
        num_classes=entry.classes(num_classes), input_size=input_size,
        output_block=output_block, dropout=dropout, exact_statistics=exact_statistics)


def param_count(net: nn.Module) -> int:
    """``sum(p.numel() for p in net.parameters())``, as torch counts (the fixed gamma
    included, BN running statistics not)."""
    return sum(int(p.numel()) for p in net.parameters())


def load_torch_arrays(net: nn.Module, arrays: Any, prefix: str = "backbone/") -> None:
    """Set every parameter and buffer of ``net`` from ``arrays[prefix + torch name]`` (a dict or
    an ``np.load`` result). ``num_batches_tracked`` is optional on both sides; any other
    missing, unexpected or wrongly shaped array is a ValueError naming all of them, raised
    before anything changes."""
    state = net.state_dict()
    values = layouts.checked_torch_arrays(
        arrays, prefix, {k: tuple(v.shape) for k, v in state.items()
                         if not k.endswith("num_batches_tracked")})
    net.load_state_dict({**state, **{k: flow.tensor(v, dtype=state[k].dtype)
                                     for k, v in values.items()}})
