"""Paddle dynamic-graph backbones equal to the PyTorch ones in
``trainperf.backends.torch.backbones``.

Every torch backbone has a Paddle twin here with the same operations in the same order: the same
convolution kernels, strides, paddings and groups, BatchNorm with eps 1e-5 and torch's momentum
0.1 (Paddle's ``momentum=0.9``: Paddle keeps ``momentum`` of the old running value), per-channel
PReLU starting at 0.25, dropout that rescales by 1 / (1 - p) in training (Paddle's
``upscale_in_train``, torch's only mode), and a flatten in (C, H, W) order before the fully
connected layer.

Naming: each child is registered under the attribute name (or ``Sequential`` index) that its
torch counterpart has, so a parameter's path in the Paddle tree is its torch ``state_dict`` key
once the leaf is renamed: BatchNorm ``_mean``/``_variance`` -> ``running_mean``/``running_var``,
PReLU ``_weight`` -> ``weight``. :func:`torch_names` gives that mapping.

Layouts, the one place they differ: convolution weights are OIHW in both frameworks, but a Paddle
``Linear`` keeps its weight as [in, out] where torch keeps [out, in]. :func:`load_torch_arrays`
transposes those (and only those) when it loads the ``backbone/<torch name>`` arrays of an
alignment ``.npz`` (``trainperf.config.AlignSpec.start``); :func:`torch_state` transposes back.

IResNet's embedding BatchNorm has its gamma fixed at 1, as torch's (a parameter that takes no
gradient): here a real ``weight`` parameter that SGD never updates (:func:`trainable_parameters`
leaves it out), so it counts and loads as torch's does. Paddle's own ``weight_attr=False`` would
drop the parameter altogether, and ``stop_gradient`` on it makes Paddle's batch-norm backward
drop the bias gradient too.

Initialisation (throughput runs; alignment overwrites it): convolution and Linear weights and
Linear biases draw from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the distribution of torch's default
``kaiming_uniform_(a=sqrt(5))`` (fan_in = in_channels / groups * kh * kw, or in_features);
BatchNorm starts at gamma 1, beta 0, running mean 0, running variance 1 (gamma 0 for the last
BN of each ResNet v1b bottleneck, as torch); PReLU at 0.25. The distributions equal torch's, the
random numbers do not.

Known difference from torch: Paddle updates a BatchNorm's running variance with the *biased*
batch variance, torch with the unbiased one. Training-mode forward and backward use the batch
statistics and are identical; only the running statistics (which evaluation would use) differ,
by a factor (n - 1) / n in the variance's update term. Every run keeps Paddle's rule, and the
backend declares the difference (``Capabilities.rule_differences``), which alignment measures
without counting it. Paddle's kernel also takes the momentum (and epsilon) as float32
attributes (0.9 arrives as 0.8999999762); a float64 alignment run holds them exactly
(``alignment.ExactBatchNorm``).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from .. import catalog, layouts
from .backend import BACKEND

__all__ = [
    "backbone_names", "backbone_task", "build_backbone", "torch_names", "load_torch_arrays",
    "torch_state", "param_count", "BN_EPS", "BN_MOMENTUM",
]

BN_EPS = 1e-5
"""torch's BatchNorm default, used by every torch backbone."""
BN_MOMENTUM = 0.9
"""Paddle's momentum equal to torch's default 0.1 (running = m * running + (1 - m) * batch)."""

_RUNNING = ("running_mean", "running_var")
# Paddle leaf name -> torch state_dict leaf name (others are the same in both).
_LEAF_TO_TORCH = {"_mean": "running_mean", "_variance": "running_var", "_weight": "weight"}


# --------------------------------------------------------------------------------------------
# Layers with torch-like initialisation
# --------------------------------------------------------------------------------------------

def _fan_in_uniform(fan_in: int) -> paddle.ParamAttr:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch's default for conv / linear weights and biases."""
    bound = 1.0 / math.sqrt(fan_in)
    return paddle.ParamAttr(initializer=nn.initializer.Uniform(-bound, bound))


def _conv(cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0,
          groups: int = 1) -> nn.Conv2D:
    """Bias-free 2-D convolution (weight OIHW: (cout, cin // groups, k, k), as torch)."""
    if cin % groups or cout % groups:
        raise ValueError(f"channels {cin}->{cout} are not divisible by groups={groups}")
    return nn.Conv2D(cin, cout, kernel, stride=stride, padding=padding, groups=groups,
                     weight_attr=_fan_in_uniform(cin // groups * kernel * kernel),
                     bias_attr=False)


def _bn2d(channels: int, *, zero_gamma: bool = False) -> nn.BatchNorm2D:
    gamma = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0)) if zero_gamma else None
    return nn.BatchNorm2D(channels, momentum=BN_MOMENTUM, epsilon=BN_EPS, weight_attr=gamma)


def _bn1d(channels: int, *, fixed_gamma: bool = False) -> nn.BatchNorm1D:
    bn = nn.BatchNorm1D(channels, momentum=BN_MOMENTUM, epsilon=BN_EPS)
    # torch's constant weight with requires_grad False (InsightFace's fix_gamma) is a weight
    # that SGD leaves alone (trainable_parameters). Not stop_gradient: Paddle's batch_norm
    # backward then returns no bias gradient either.
    bn.fixed_gamma = fixed_gamma
    return bn


def _prelu(channels: int) -> nn.PReLU:
    return nn.PReLU(num_parameters=channels, init=0.25)


def _linear(cin: int, cout: int, *, bias: bool = True) -> nn.Linear:
    init = _fan_in_uniform(cin)
    return nn.Linear(cin, cout, weight_attr=init, bias_attr=init if bias else False)


# --------------------------------------------------------------------------------------------
# IResNet
# --------------------------------------------------------------------------------------------

class IBasicBlock(nn.Layer):
    """BN-conv3x3-BN-PReLU-conv3x3(stride)-BN plus shortcut, no activation after the sum."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.bn1 = _bn2d(cin)
        self.conv1 = _conv(cin, cout, 3, 1, 1)
        self.bn2 = _bn2d(cout)
        self.prelu = _prelu(cout)
        self.conv2 = _conv(cout, cout, 3, stride, 1)
        self.bn3 = _bn2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride), _bn2d(cout))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(nn.Layer):
    """InsightFace's IResNet with output block "E" (BN, dropout, FC, BN with gamma fixed at 1)
    or "FC" (the same without dropout). PLSC's "ResNet50" is ``iresnet50`` with block E."""

    def __init__(self, layers: tuple[int, int, int, int], *,
                 widths: tuple[int, int, int, int] = catalog.IRESNET_WIDTHS,
                 embedding_size: int = 512, input_size: int = 112, output_block: str = "E",
                 dropout: float = 0.0) -> None:
        super().__init__()
        if input_size % 16:
            raise ValueError(f"IResNet needs an input side divisible by 16, got {input_size}")
        if output_block not in ("E", "FC"):
            raise ValueError(f"IResNet output block must be 'E' or 'FC', got {output_block!r}")
        stem = widths[0]
        side = input_size // 16
        self.conv1 = _conv(3, stem, 3, 1, 1)
        self.bn1 = _bn2d(stem)
        self.prelu = _prelu(stem)
        blocks = []
        cin = stem
        for width, count in zip(widths, layers):
            blocks.append(IBasicBlock(cin, width, 2))
            blocks.extend(IBasicBlock(width, width, 1) for _ in range(count - 1))
            cin = width
        self.body = nn.Sequential(*blocks)
        self.bn2 = _bn2d(cin)
        self.dropout = nn.Dropout(dropout if output_block == "E" else 0.0)
        self.fc = _linear(cin * side * side, embedding_size)
        self.features = _bn1d(embedding_size, fixed_gamma=True)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.bn2(self.body(x))
        x = self.dropout(paddle.flatten(x, 1))
        return self.features(self.fc(x))


# --------------------------------------------------------------------------------------------
# MobileFaceNet
# --------------------------------------------------------------------------------------------

class ConvBN(nn.Layer):
    """Conv, BN and (unless ``linear``) PReLU; children ``conv``, ``bn``, ``act`` as torch."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, padding: int = 0,
                 groups: int = 1, linear: bool = False) -> None:
        super().__init__()
        self.conv = _conv(cin, cout, kernel, stride, padding, groups)
        self.bn = _bn2d(cout)
        self.act = nn.Identity() if linear else _prelu(cout)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.act(self.bn(self.conv(x)))


class DepthWise(nn.Layer):
    """Inverted bottleneck: expand (1x1), depthwise 3x3, project (1x1, linear)."""

    def __init__(self, cin: int, cout: int, hidden: int, stride: int, residual: bool) -> None:
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(ConvBN(cin, hidden),
                                    ConvBN(hidden, hidden, 3, stride, 1, groups=hidden),
                                    ConvBN(hidden, cout, linear=True))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.layers(x)
        return x + out if self.residual else out


class MobileFaceNet(nn.Layer):
    """MobileFaceNet with the GDC output block (global depthwise conv, BN, Linear without bias,
    BN with learnable gamma). ``width`` scales the block channels only, as in torch."""

    def __init__(self, *, embedding_size: int = 128, width: int = 1, input_size: int = 112,
                 blocks: tuple[int, int, int] = (4, 6, 2), sep_channels: int = 512,
                 hidden: tuple[int, int, int, int] = (128, 256, 512, 256)) -> None:
        super().__init__()
        if input_size % 16:
            raise ValueError(f"MobileFaceNet needs an input side divisible by 16, got {input_size}")
        c64, c128 = 64 * width, 128 * width
        h_low, h_mid, h_down, h_high = hidden
        side = input_size // 16
        layers = [ConvBN(3, c64, 3, 2, 1), ConvBN(c64, c64, 3, 1, 1, groups=64),
                  DepthWise(c64, c64, h_low, 2, False)]
        layers += [DepthWise(c64, c64, h_low, 1, True) for _ in range(blocks[0])]
        layers.append(DepthWise(c64, c128, h_mid, 2, False))
        layers += [DepthWise(c128, c128, h_mid, 1, True) for _ in range(blocks[1])]
        layers.append(DepthWise(c128, c128, h_down, 2, False))
        layers += [DepthWise(c128, c128, h_high, 1, True) for _ in range(blocks[2])]
        layers.append(ConvBN(c128, sep_channels))
        self.body = nn.Sequential(*layers)
        self.gdc = ConvBN(sep_channels, sep_channels, side, groups=sep_channels, linear=True)
        self.fc = _linear(sep_channels, embedding_size, bias=False)
        self.features = _bn1d(embedding_size)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.gdc(self.body(x))
        return self.features(self.fc(paddle.flatten(x, 1)))


# --------------------------------------------------------------------------------------------
# ResNet v1b
# --------------------------------------------------------------------------------------------

class Bottleneck(nn.Layer):
    """1x1, 3x3 (stride), 1x1 bottleneck with the stride on the 3x3 (v1b); last BN gamma 0."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv(cin, width, 1)
        self.bn1 = _bn2d(width)
        self.conv2 = _conv(width, width, 3, stride, 1)
        self.bn2 = _bn2d(width)
        self.conv3 = _conv(width, cout, 1)
        self.bn3 = _bn2d(cout, zero_gamma=True)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride), _bn2d(cout))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNetV1b(nn.Layer):
    """Classification ResNet v1b: stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool), bottlenecks,
    global average pool, Linear to ``num_classes``."""

    def __init__(self, layers: tuple[int, int, int, int], *, num_classes: int = 1000,
                 base_width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv(3, base_width, 7, 2, 3), _bn2d(base_width), nn.ReLU(),
                                  nn.MaxPool2D(3, 2, 1))
        blocks = []
        cin = base_width
        for stage, count in enumerate(layers):
            width = base_width * 2**stage
            for i in range(count):
                blocks.append(Bottleneck(cin, width, 2 if (i == 0 and stage > 0) else 1))
                cin = width * Bottleneck.expansion
        self.body = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2D(1)
        self.fc = _linear(cin, num_classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.fc(paddle.flatten(self.pool(self.body(self.stem(x))), 1))


# --------------------------------------------------------------------------------------------
# Builders of the catalogue's families
# --------------------------------------------------------------------------------------------

def _iresnet(b: catalog.Backbone, *, embedding_size: int, input_size: int, output_block: str,
             dropout: float, **_: Any) -> IResNet:
    return IResNet(**b.arch, embedding_size=embedding_size, input_size=input_size,
                   output_block=output_block, dropout=dropout)


def _mobilefacenet(b: catalog.Backbone, *, embedding_size: int, input_size: int,
                   **_: Any) -> MobileFaceNet:
    return MobileFaceNet(**b.arch, embedding_size=embedding_size, input_size=input_size)


def _resnet_v1b(b: catalog.Backbone, *, num_classes: int, **_: Any) -> ResNetV1b:
    return ResNetV1b(**b.arch, num_classes=num_classes)


# family -> builder of a catalogue entry; every family the backend declares has one.
_BUILDERS: dict[str, Callable[..., nn.Layer]] = {
    "iresnet": _iresnet, "mobilefacenet": _mobilefacenet, "resnet_v1b": _resnet_v1b}
CATALOG = catalog.BackendCatalog(BACKEND.capabilities.families, BACKEND.name)
backbone_names = CATALOG.names
backbone_task = CATALOG.task


def build_backbone(name: str, *, embedding_size: int | None = None, num_classes: int | None = None,
                   input_size: int = 112, output_block: str = "E", dropout: float = 0.0
                   ) -> nn.Layer:
    """Build the Paddle twin of torch's ``build_backbone(name, ...)`` (initialised, in Paddle's
    default dtype). Face backbones use ``embedding_size``, ``input_size``, ``output_block`` and
    ``dropout`` (the last two: IResNet only); classification backbones use ``num_classes``.
    ``None`` takes the catalogue's default (``backends.catalog``: torch's defaults)."""
    entry = CATALOG.lookup(name)
    return _BUILDERS[entry.family](
        entry, embedding_size=entry.embedding(embedding_size),
        num_classes=entry.classes(num_classes), input_size=input_size,
        output_block=output_block, dropout=dropout)


# --------------------------------------------------------------------------------------------
# torch names, loading, counting
# --------------------------------------------------------------------------------------------

def _torch_name(paddle_name: str) -> str:
    path, _, leaf = paddle_name.rpartition(".")
    leaf = _LEAF_TO_TORCH.get(leaf, leaf)
    return f"{path}.{leaf}" if path else leaf


def _linear_weights(net: nn.Layer) -> set[int]:
    return {id(layer.weight) for layer in net.sublayers(include_self=True)
            if isinstance(layer, nn.Linear)}


def torch_names(net: nn.Layer) -> dict[str, tuple[paddle.Tensor, bool]]:
    """Every torch ``state_dict`` key of the equivalent torch module (parameters and BN running
    statistics; torch's ``num_batches_tracked`` has no counterpart) -> (the Paddle parameter
    that holds it, whether its layout is torch's transposed: Linear weights), in torch's
    order."""
    linear = _linear_weights(net)
    names: dict[str, tuple[paddle.Tensor, bool]] = {}
    for name, param in net.named_parameters():
        key = _torch_name(name)
        if key in names:
            raise RuntimeError(f"two Paddle parameters map to torch name {key!r}")
        names[key] = (param, id(param) in linear)
    return names


def torch_shape(param: paddle.Tensor, transposed: bool) -> tuple[int, ...]:
    shape = tuple(int(s) for s in param.shape)
    return layouts.torch_shape(shape, "linear") if transposed else shape


def torch_state(net: nn.Layer) -> dict[str, np.ndarray]:
    """The torch ``state_dict`` of ``net`` as numpy arrays, in torch's names and layouts."""
    return {name: (layouts.to_torch(p.numpy(), "linear") if t else p.numpy()).copy()
            for name, (p, t) in torch_names(net).items()}


def load_torch_arrays(net: nn.Layer, arrays: Any, prefix: str = "backbone/") -> None:
    """Set every parameter of ``net`` from ``arrays[prefix + torch_name]`` (a dict or an
    ``np.load`` result), transposing torch's [out, in] Linear weights to Paddle's [in, out].
    Keys under ``prefix`` ending in ``num_batches_tracked`` are ignored; keys outside ``prefix``
    are not looked at. Raises ValueError naming every missing, unexpected or wrongly shaped
    array before changing anything."""
    names = torch_names(net)
    values = layouts.checked_torch_arrays(
        arrays, prefix, {name: torch_shape(p, t) for name, (p, t) in names.items()})
    for name, (param, transposed) in names.items():
        value = layouts.from_torch(values[name], "linear") if transposed else values[name]
        param.set_value(np.ascontiguousarray(value, dtype=_numpy_dtype(param)))


def _numpy_dtype(param: paddle.Tensor) -> np.dtype:
    return np.dtype(str(param.dtype).rpartition(".")[2])


def param_count(net: nn.Layer) -> int:
    """Scalars in the parameters torch counts: ``sum(p.numel() for p in m.parameters())`` of the
    torch twin. Paddle holds BN running statistics as (gradient-free) parameters; torch holds
    them as buffers, so they are left out. IResNet's fixed embedding-BN gamma is in, as in
    torch (a parameter that takes no gradient)."""
    return sum(int(np.prod(p.shape)) for name, (p, _) in torch_names(net).items()
               if not name.endswith(_RUNNING))


def fixed_parameters(net: nn.Layer) -> list[paddle.Tensor]:
    """Parameters that torch holds with ``requires_grad=False``: IResNet's embedding gamma."""
    return [layer.weight for layer in net.sublayers(include_self=True)
            if getattr(layer, "fixed_gamma", False)]


def trainable_parameters(net: nn.Layer) -> list[paddle.Tensor]:
    """The parameters SGD updates, in registration order: not BN running statistics
    (``stop_gradient``), not the fixed embedding gamma."""
    fixed = {id(p) for p in fixed_parameters(net)}
    return [p for p in net.parameters() if not p.stop_gradient and id(p) not in fixed]
