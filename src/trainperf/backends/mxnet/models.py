"""MXNet Gluon backbones equal to the PyTorch ones in ``trainperf.backends.torch.backbones``.

Every torch backbone has a Gluon twin here with the same operations in the same order: the same
convolution kernels, strides, paddings and groups, BatchNorm with eps 1e-5 and torch's momentum
0.1 (Gluon's ``momentum=0.9``: MXNet keeps ``momentum`` of the old running value), per-channel
PReLU starting at 0.25, and a flatten in (C, H, W) order before the fully connected layer (Gluon's
``Dense(flatten=True)`` flattens NCHW exactly as ``torch.flatten(x, 1)`` does).

PReLU is composed from elementwise ops by default, not MXNet's fused ``LeakyReLU(prelu)`` op,
whose slope gradient MXNet 1.9.1 gets wrong in graph mode on its native (GPU) kernels; see
:class:`PReLU` and ``build_backbone(..., prelu="fused")``.

Naming: each Gluon child is registered under the attribute name (or ``HybridSequential`` index)
that its torch counterpart has, so a parameter's path in the Gluon tree *is* its torch
``state_dict`` key once the leaf is renamed (BatchNorm ``gamma``/``beta`` -> ``weight``/``bias``,
PReLU ``alpha`` -> ``weight``; ``running_mean``, ``running_var`` and conv / Dense ``weight`` and
``bias`` keep their names). :func:`torch_names` walks the tree to give that mapping and
:func:`load_torch_arrays` uses it to load the ``backbone/<torch name>`` arrays of an alignment
``.npz`` (``trainperf.config.AlignSpec.start``). Every layer is built with its input width
(``in_channels`` / ``in_units``), so all shapes are known before the first forward.

Initialisation (throughput runs; alignment overwrites it): every parameter carries its own
initializer, so ``net.initialize(ctx=ctx)`` is all a caller needs. Convolution and Dense weights
and Dense biases draw from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the distribution of torch's
default ``kaiming_uniform_(a=sqrt(5))`` (fan_in = in_channels / groups * kh * kw, or in_units);
BatchNorm starts at gamma 1, beta 0, running mean 0, running variance 1 (gamma 0 for the last
BN of each ResNet v1b bottleneck, as torch); PReLU at 0.25. The distributions equal torch's, the
random numbers do not (use :func:`load_torch_arrays` for identical weights).

Known difference from torch that this module cannot remove: MXNet updates a BatchNorm's running
variance with the *biased* batch variance (and does so in the backward pass), torch with the
unbiased one; the running variance of a layer that normalises over n values per channel
therefore moves by ``(1 - momentum) * var * (n - 1) / n`` instead of ``... * var``. Training-mode
forward and backward (which use the batch statistics) are identical; only the running statistics
that evaluation mode would use differ slightly. In float32 the two frameworks' results differ by
rounding, which a PReLU / ReLU / max-pool input lying within rounding of its kink can turn into
a visible local difference in the gradients; in float64 they agree to ~1e-13 (running
statistics to ~1e-8: MXNet holds the momentum as a C float, 0.9f = 0.89999998). A strict
alignment run keeps MXNet's rule but moves the running statistics itself, with the momentum as a
double (``alignment.py``, with :func:`batch_norms`); the backend declares the variance's rule
(``backend.RULE_DIFFERENCES``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import mxnet as mx
import numpy as np
from mxnet.gluon import HybridBlock, Parameter, nn

from .. import catalog, layouts
from .backend import BACKEND

__all__ = [
    "backbone_names", "backbone_task", "build_backbone", "torch_names", "load_torch_arrays",
    "param_count", "batch_norms", "BN_EPS", "BN_MOMENTUM", "PRELU_MODES", "PReLU",
]

BN_EPS = 1e-5
"""torch's BatchNorm default, used by every torch backbone."""
BN_MOMENTUM = 0.9
"""Gluon's momentum equal to torch's default 0.1 (running = m * running + (1 - m) * batch)."""

_RUNNING = ("running_mean", "running_var")
# Gluon leaf parameter name -> torch state_dict leaf name (others are the same in both).
_LEAF_TO_TORCH = {"gamma": "weight", "beta": "bias", "alpha": "weight"}


# --------------------------------------------------------------------------------------------
# Layers built with known input widths and torch-like initialisation
# --------------------------------------------------------------------------------------------

def _fan_in_uniform(fan_in: int) -> mx.init.Initializer:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)): torch's default for conv / linear weights and biases."""
    return mx.init.Uniform(1.0 / math.sqrt(fan_in))


def _conv(cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0,
          groups: int = 1) -> nn.Conv2D:
    """Bias-free 2-D convolution (weight OIHW: (cout, cin // groups, k, k), as torch)."""
    if cin % groups or cout % groups:
        raise ValueError(f"channels {cin}->{cout} are not divisible by groups={groups}")
    return nn.Conv2D(cout, kernel, strides=stride, padding=padding, groups=groups, use_bias=False,
                     in_channels=cin,
                     weight_initializer=_fan_in_uniform(cin // groups * kernel * kernel))


def _bn(channels: int, *, fixed_gamma: bool = False, zero_gamma: bool = False) -> nn.BatchNorm:
    """BatchNorm over axis 1 (NCHW or (N, C)). ``fixed_gamma``: gamma held at 1 (MXNet's
    fix_gamma, torch's constant weight with requires_grad False)."""
    return nn.BatchNorm(axis=1, momentum=BN_MOMENTUM, epsilon=BN_EPS, scale=not fixed_gamma,
                        gamma_initializer="zeros" if zero_gamma else "ones", in_channels=channels)


PRELU_MODES = ("exact", "fused")


class PReLU(HybridBlock):
    """Per-channel PReLU, slopes (``alpha``, shape (C,)) starting at 0.25 like torch's
    ``nn.PReLU(C)``: y = x where x > 0, else alpha[c] * x.

    ``mode="exact"`` (default) computes relu(x) + alpha * min(x, 0) from elementwise ops: the
    same values as torch's ``x if x > 0 else alpha * x`` and correct gradients everywhere, at
    the cost of a few more elementwise passes and saved tensors.

    ``mode="fused"`` uses MXNet's single ``LeakyReLU(act_type="prelu")`` op (what Gluon's
    ``nn.PReLU`` and InsightFace's MXNet code use): one kernel and less memory, but in MXNet
    1.9.1 its slope gradient comes out multiplied by alpha in graph mode (hybridized Gluon,
    or the symbolic API) when the PReLU input is an intermediate result. Seen here on CPU with
    the native kernels (float64, or float32 with MXNET_MKLDNN_ENABLED=0: the code a GPU build
    runs too) and, through the symbolic API, with oneDNN as well; hybridized Gluon float32 with
    oneDNN happened to be right. Likely cause: the op lets its output overwrite its input (a
    {0, 0} in-place option for every act_type) while the prelu backward reads that input.
    The forward pass and the data gradient are right in both modes, and run imperatively (not
    hybridized, trainperf's ``--mode imperative``) the slope gradient is right too (float64,
    iresnet_tiny: within 1.4e-7 of ``"exact"``'s, the op's own rounding, against 0.75 off when
    hybridized); speed is what ``"fused"`` is for. Both modes build ``"exact"``, so that they
    run the same network. Under MXNet AMP (float16) ``"fused"`` fails type inference (AMP
    leaves LeakyReLU's float32 slopes next to float16 data) unless ``amp.init`` is told where
    LeakyReLU runs (``fp16_ops`` / ``fp32_ops``); ``"exact"`` runs as is (AMP widens its
    products to float32).
    """

    def __init__(self, channels: int, mode: str = "exact", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if mode not in PRELU_MODES:
            raise ValueError(f"PReLU mode must be one of {PRELU_MODES}, got {mode!r}")
        self._mode = mode
        with self.name_scope():
            self.alpha = self.params.get("alpha", shape=(channels,),
                                         init=mx.init.Constant(0.25))

    def hybrid_forward(self, F, x, alpha):
        if self._mode == "fused":
            return F.LeakyReLU(x, gamma=alpha, act_type="prelu")
        # NCHW: the slopes broadcast along axis 1.
        slopes = F.reshape(alpha, shape=(1, -1, 1, 1))
        return F.Activation(x, act_type="relu") + F.broadcast_mul(F.minimum(x, 0.0), slopes)


def _prelu(channels: int, mode: str) -> PReLU:
    return PReLU(channels, mode)


def _dense(cin: int, cout: int, *, bias: bool = True) -> nn.Dense:
    """Fully connected layer that flattens its input (N, C, H, W) in C, H, W order."""
    init = _fan_in_uniform(cin)
    return nn.Dense(cout, use_bias=bias, flatten=True, in_units=cin, weight_initializer=init,
                    bias_initializer=init if bias else "zeros")


# --------------------------------------------------------------------------------------------
# IResNet
# --------------------------------------------------------------------------------------------

class IBasicBlock(HybridBlock):
    """BN-conv3x3-BN-PReLU-conv3x3(stride)-BN plus shortcut, no activation after the sum."""

    def __init__(self, cin: int, cout: int, stride: int, prelu: str = "exact",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with self.name_scope():
            self.bn1 = _bn(cin)
            self.conv1 = _conv(cin, cout, 3, 1, 1)
            self.bn2 = _bn(cout)
            self.prelu = _prelu(cout, prelu)
            self.conv2 = _conv(cout, cout, 3, stride, 1)
            self.bn3 = _bn(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.HybridSequential()
                self.downsample.add(_conv(cin, cout, 1, stride), _bn(cout))

    def hybrid_forward(self, F, x):
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet(HybridBlock):
    """InsightFace's IResNet with output block "E" (BN, dropout, FC, BN with gamma fixed at 1)
    or "FC" (the same without dropout)."""

    def __init__(self, layers: tuple[int, int, int, int], *,
                 widths: tuple[int, int, int, int] = catalog.IRESNET_WIDTHS,
                 embedding_size: int = 512, input_size: int = 112, output_block: str = "E",
                 dropout: float = 0.0, prelu: str = "exact", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if input_size % 16:
            raise ValueError(f"IResNet needs an input side divisible by 16, got {input_size}")
        if output_block not in ("E", "FC"):
            raise ValueError(f"IResNet output block must be 'E' or 'FC', got {output_block!r}")
        stem = widths[0]
        side = input_size // 16
        with self.name_scope():
            self.conv1 = _conv(3, stem, 3, 1, 1)
            self.bn1 = _bn(stem)
            self.prelu = _prelu(stem, prelu)
            self.body = nn.HybridSequential()
            cin = stem
            for width, count in zip(widths, layers):
                self.body.add(IBasicBlock(cin, width, 2, prelu))
                for _ in range(count - 1):
                    self.body.add(IBasicBlock(width, width, 1, prelu))
                cin = width
            self.bn2 = _bn(cin)
            self.dropout = nn.Dropout(dropout if output_block == "E" else 0.0)
            self.fc = _dense(cin * side * side, embedding_size)
            self.features = _bn(embedding_size, fixed_gamma=True)

    def hybrid_forward(self, F, x):
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.bn2(self.body(x))
        # Dropout is elementwise, so dropping before the Dense's flatten equals torch's order.
        return self.features(self.fc(self.dropout(x)))


# --------------------------------------------------------------------------------------------
# MobileFaceNet
# --------------------------------------------------------------------------------------------

class ConvBN(HybridBlock):
    """Conv, BN and (unless ``linear``) PReLU; children ``conv``, ``bn``, ``act`` as torch."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, padding: int = 0,
                 groups: int = 1, linear: bool = False, prelu: str = "exact",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with self.name_scope():
            self.conv = _conv(cin, cout, kernel, stride, padding, groups)
            self.bn = _bn(cout)
            self.act = None if linear else _prelu(cout, prelu)

    def hybrid_forward(self, F, x):
        x = self.bn(self.conv(x))
        return x if self.act is None else self.act(x)


class DepthWise(HybridBlock):
    """Inverted bottleneck: expand (1x1), depthwise 3x3, project (1x1, linear)."""

    def __init__(self, cin: int, cout: int, hidden: int, stride: int, residual: bool,
                 prelu: str = "exact", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.residual = residual
        with self.name_scope():
            self.layers = nn.HybridSequential()
            self.layers.add(ConvBN(cin, hidden, prelu=prelu),
                            ConvBN(hidden, hidden, 3, stride, 1, groups=hidden, prelu=prelu),
                            ConvBN(hidden, cout, linear=True))

    def hybrid_forward(self, F, x):
        out = self.layers(x)
        return x + out if self.residual else out


class MobileFaceNet(HybridBlock):
    """MobileFaceNet with the GDC output block (global depthwise conv, BN, Dense without bias,
    BN with learnable gamma). ``width`` scales the block channels only, as in torch."""

    def __init__(self, *, embedding_size: int = 128, width: int = 1, input_size: int = 112,
                 blocks: tuple[int, int, int] = (4, 6, 2), sep_channels: int = 512,
                 hidden: tuple[int, int, int, int] = (128, 256, 512, 256), prelu: str = "exact",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if input_size % 16:
            raise ValueError(f"MobileFaceNet needs an input side divisible by 16, got {input_size}")
        c64, c128 = 64 * width, 128 * width
        h_low, h_mid, h_down, h_high = hidden
        side = input_size // 16
        with self.name_scope():
            self.body = nn.HybridSequential()
            self.body.add(ConvBN(3, c64, 3, 2, 1, prelu=prelu),
                          ConvBN(c64, c64, 3, 1, 1, groups=64, prelu=prelu),
                          DepthWise(c64, c64, h_low, 2, False, prelu))
            for _ in range(blocks[0]):
                self.body.add(DepthWise(c64, c64, h_low, 1, True, prelu))
            self.body.add(DepthWise(c64, c128, h_mid, 2, False, prelu))
            for _ in range(blocks[1]):
                self.body.add(DepthWise(c128, c128, h_mid, 1, True, prelu))
            self.body.add(DepthWise(c128, c128, h_down, 2, False, prelu))
            for _ in range(blocks[2]):
                self.body.add(DepthWise(c128, c128, h_high, 1, True, prelu))
            self.body.add(ConvBN(c128, sep_channels, prelu=prelu))
            self.gdc = ConvBN(sep_channels, sep_channels, side, groups=sep_channels, linear=True)
            self.fc = _dense(sep_channels, embedding_size, bias=False)
            self.features = _bn(embedding_size)

    def hybrid_forward(self, F, x):
        return self.features(self.fc(self.gdc(self.body(x))))


# --------------------------------------------------------------------------------------------
# ResNet v1b
# --------------------------------------------------------------------------------------------

class Bottleneck(HybridBlock):
    """1x1, 3x3 (stride), 1x1 bottleneck with the stride on the 3x3 (v1b); last BN gamma 0."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cout = width * self.expansion
        with self.name_scope():
            self.conv1 = _conv(cin, width, 1)
            self.bn1 = _bn(width)
            self.conv2 = _conv(width, width, 3, stride, 1)
            self.bn2 = _bn(width)
            self.conv3 = _conv(width, cout, 1)
            self.bn3 = _bn(cout, zero_gamma=True)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.HybridSequential()
                self.downsample.add(_conv(cin, cout, 1, stride), _bn(cout))

    def hybrid_forward(self, F, x):
        out = F.Activation(self.bn1(self.conv1(x)), act_type="relu")
        out = F.Activation(self.bn2(self.conv2(out)), act_type="relu")
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.Activation(out + shortcut, act_type="relu")


class ResNetV1b(HybridBlock):
    """Classification ResNet v1b: stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool), bottlenecks,
    global average pool, Dense to ``num_classes``."""

    def __init__(self, layers: tuple[int, int, int, int], *, num_classes: int = 1000,
                 base_width: int = 64, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with self.name_scope():
            self.stem = nn.HybridSequential()
            self.stem.add(_conv(3, base_width, 7, 2, 3), _bn(base_width), nn.Activation("relu"),
                          nn.MaxPool2D(pool_size=3, strides=2, padding=1))
            self.body = nn.HybridSequential()
            cin = base_width
            for stage, count in enumerate(layers):
                width = base_width * 2**stage
                for i in range(count):
                    self.body.add(Bottleneck(cin, width, 2 if (i == 0 and stage > 0) else 1))
                    cin = width * Bottleneck.expansion
            self.pool = nn.GlobalAvgPool2D()
            self.fc = _dense(cin, num_classes)

    def hybrid_forward(self, F, x):
        return self.fc(self.pool(self.body(self.stem(x))))


# --------------------------------------------------------------------------------------------
# Builders of the catalogue's families
# --------------------------------------------------------------------------------------------

def _iresnet(b: catalog.Backbone, *, embedding_size: int, input_size: int, output_block: str,
             dropout: float, prelu: str, **_: Any) -> IResNet:
    return IResNet(**b.arch, embedding_size=embedding_size, input_size=input_size,
                   output_block=output_block, dropout=dropout, prelu=prelu)


def _mobilefacenet(b: catalog.Backbone, *, embedding_size: int, input_size: int, prelu: str,
                   **_: Any) -> MobileFaceNet:
    return MobileFaceNet(**b.arch, embedding_size=embedding_size, input_size=input_size,
                         prelu=prelu)


def _resnet_v1b(b: catalog.Backbone, *, num_classes: int, **_: Any) -> ResNetV1b:
    return ResNetV1b(**b.arch, num_classes=num_classes)


# family -> builder of a catalogue entry; every family the backend declares has one.
_BUILDERS: dict[str, Callable[..., HybridBlock]] = {
    "iresnet": _iresnet, "mobilefacenet": _mobilefacenet, "resnet_v1b": _resnet_v1b}
CATALOG = catalog.BackendCatalog(BACKEND.capabilities.families, BACKEND.name)
backbone_names = CATALOG.names
backbone_task = CATALOG.task


def build_backbone(name: str, *, embedding_size: int | None = None, num_classes: int | None = None,
                   input_size: int = 112, output_block: str = "E", dropout: float = 0.0,
                   prelu: str = "exact") -> HybridBlock:
    """Build (not initialise) the Gluon twin of torch's ``build_backbone(name, ...)``.

    Face backbones use ``embedding_size``, ``input_size``, ``output_block`` and ``dropout``
    (the last two: IResNet only); classification backbones use ``num_classes``. Arguments a
    family does not use are ignored, as in torch. ``None`` takes the catalogue's default
    (``backends.catalog``: torch's defaults). ``prelu`` (IResNet, MobileFaceNet): ``"exact"``
    (default) or ``"fused"``, see :class:`PReLU` (``"fused"`` is MXNet's own op, leaner, but its
    slope gradients are wrong in hybridized graphs on MXNet's native kernels, as used on GPU).
    Call ``net.initialize(ctx=ctx)`` (every parameter carries its own initializer) and/or
    :func:`load_torch_arrays` before use.
    """
    if prelu not in PRELU_MODES:
        raise ValueError(f"prelu must be one of {PRELU_MODES}, got {prelu!r}")
    entry = CATALOG.lookup(name)
    return _BUILDERS[entry.family](
        entry, embedding_size=entry.embedding(embedding_size),
        num_classes=entry.classes(num_classes), input_size=input_size,
        output_block=output_block, dropout=dropout, prelu=prelu)


# --------------------------------------------------------------------------------------------
# torch names, loading, counting
# --------------------------------------------------------------------------------------------

def _walk(block: nn.Block, path: str = "") -> Iterator[tuple[str, Parameter, nn.Block]]:
    """(torch state_dict name, parameter, owning block) in torch's state_dict order."""
    for leaf, param in block._reg_params.items():
        yield path + _LEAF_TO_TORCH.get(leaf, leaf), param, block
    for child_name, child in block._children.items():
        yield from _walk(child, f"{path}{child_name}.")


def torch_names(net: nn.Block) -> dict[str, Parameter]:
    """Every torch ``state_dict`` key of the equivalent torch module (parameters and BN running
    statistics; torch's ``num_batches_tracked`` has no counterpart) -> the Gluon parameter that
    holds it, with the same shape, in torch's order."""
    names: dict[str, Parameter] = {}
    for name, param, _ in _walk(net):
        if name in names:
            raise RuntimeError(f"two Gluon parameters map to torch name {name!r}")
        names[name] = param
    return names


def batch_norms(net: nn.Block) -> list[tuple[str, nn.BatchNorm]]:
    """Every BatchNorm of ``net`` with its torch name (``body.0.bn1``), in torch's order."""
    found: dict[int, tuple[str, nn.BatchNorm]] = {}
    for name, _, block in _walk(net):
        if isinstance(block, nn.BatchNorm):
            found.setdefault(id(block), (name.rsplit(".", 1)[0], block))
    return list(found.values())


def _fixed_gamma(block: nn.Block) -> bool:
    return isinstance(block, nn.BatchNorm) and bool(block._kwargs.get("fix_gamma"))


def load_torch_arrays(net: nn.Block, arrays: Any, prefix: str = "backbone/",
                      ctx: mx.Context | list | None = None) -> None:
    """Set every parameter of ``net`` from ``arrays[prefix + torch_name]`` (a dict or an
    ``np.load`` result). Keys under ``prefix`` ending in ``num_batches_tracked`` are ignored;
    keys outside ``prefix`` are not looked at. Raises ValueError naming every missing,
    unexpected or wrongly shaped array (and a fixed BN gamma that is not all ones, which MXNet
    would silently treat as 1) before changing anything. Parameters not yet initialised are
    initialised on ``ctx`` (default: CPU) first; initialised ones keep their contexts."""
    names = torch_names(net)
    fixed = {name for name, _, block in _walk(net)
             if _fixed_gamma(block) and name.endswith("weight")}
    values = layouts.checked_torch_arrays(
        arrays, prefix, {name: tuple(param.shape) for name, param in names.items()}, fixed)
    for name, param in names.items():
        if param._data is None and not param._deferred_init:
            param.initialize(ctx=ctx if ctx is not None else mx.cpu())
        param.set_data(mx.nd.array(values[name], dtype=param.dtype))


def param_count(net: nn.Block) -> int:
    """Scalars in the parameters torch counts: ``sum(p.numel() for p in m.parameters())`` of the
    torch twin. That is every Gluon parameter except BN running statistics (torch buffers), so
    it includes IResNet's fixed embedding-BN gamma (a torch parameter with requires_grad False,
    a Gluon parameter with grad_req 'null'), as published parameter counts do. Needs no
    initialisation (all shapes are known at construction)."""
    return sum(int(np.prod(p.shape)) for name, p in torch_names(net).items()
               if not name.endswith(_RUNNING))
