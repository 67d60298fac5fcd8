"""TensorFlow backbones equal to the PyTorch ones in ``trainperf.backends.torch.backbones``.

Written as plain Python layers over ``tf.Variable``s and ``tf.nn`` ops rather than Keras 3
layers, because:

- every variable is created under its torch ``state_dict`` name, so loading torch's weights
  (alignment) and comparing names, shapes and parameter counts with torch is a dictionary lookup
  plus one layout conversion (:func:`to_tf_layout`), with no Keras naming or deferred building
  between the two;
- training-mode BatchNorm is TensorFlow's fused kernel (``FusedBatchNormV3``), whose
  ``exponential_avg_factor`` is torch's momentum (0.1) and whose running variance is updated
  with the unbiased batch variance, exactly torch's rule (Keras 3's BatchNormalization
  composes unfused ops, keeps ``momentum`` as the weight of the old value, 0.9 for torch's 0.1,
  and updates with the biased variance). The fused kernel has no float64 version, so a float64
  network (a strict alignment run) composes the same rule from ``tf.nn`` ops instead;
- padding is torch's explicit symmetric padding (``padding=[[0, 0], [p, p], [p, p], [0, 0]]``;
  TensorFlow's "SAME" pads a strided layer asymmetrically and would shift every window).

Layout: activations NHWC, convolution kernels HWIO, dense weights [in, out]. torch's arrays
(OIHW, [out, in]) are converted in ONE place, :func:`to_tf_layout` (the conversions of
``trainperf.backends.layouts``, as float32; its inverse :func:`to_torch_layout` beside it),
used both by the initialisation (drawn in torch's layout, so the distributions are torch's) and
by :func:`load_torch_arrays`. One dense layer needs more than a transpose: IResNet's ``fc`` reads a
flattened feature map, which torch flattens in (C, H, W) order and NHWC in (H, W, C) order, so its
rows are permuted once at load instead of transposing the activation at every step.

Dtype: the variables are float32 (fp16 runs cast them in the layers), or float64 for a strict
alignment run (``build_backbone(dtype=...)``); every layer computes in its input's dtype.

Initialisation (throughput runs; alignment overwrites it): convolution and dense weights and dense
biases from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the distribution of torch's default
``kaiming_uniform_(a=sqrt(5))``; BatchNorm gamma 1, beta 0 (gamma 0 for the last BN of each
ResNet v1b bottleneck), running mean 0, running variance 1; PReLU slopes 0.25 per channel.
IResNet's embedding BN keeps its gamma fixed at 1 (a non-trainable variable, counted as torch
counts its ``requires_grad=False`` parameter). Numbers are drawn with numpy from ``seed``, so every
rank builds the same network without a broadcast.

Families: IResNet (``iresnet18`` ... ``iresnet200``, ``iresnet_tiny``; output blocks ``E`` =
BN, dropout, FC, BN and ``FC``), MobileFaceNet (``mobilefacenet_y1``, ``mobilefacenet``,
``mobilefacenet_tiny``; GDC output block) and ResNet v1b (``resnet50_v1b``: stride on the 3x3
convolution, as DLPerf's TensorFlow 2 ResNet50 v1.5; ``resnet_v1b_tiny``). MobileFaceNet's
depthwise convolutions are ``tf.nn.depthwise_conv2d``; the one grouped convolution that is not
depthwise (the 512-d model's second stem convolution, 64 groups of 2 channels) is a depthwise
convolution whose per-group outputs are summed (``_grouped_conv``), because TensorFlow's CPU
kernels have no gradient for a grouped ``conv2d``; it runs so on every device, so that what an
alignment run checks is what a timed run computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from .. import catalog, layouts
from .backend import BACKEND

__all__ = [
    "Backbone", "backbone_names", "backbone_task", "build_backbone", "load_torch_arrays",
    "param_count", "to_tf_layout", "to_torch_layout", "torch_arrays", "torch_shapes", "BN_EPS",
    "BN_MOMENTUM",
]

BN_EPS = 1e-5
"""torch's BatchNorm default, used by every torch backbone."""
BN_MOMENTUM = 0.1
"""torch's BatchNorm momentum: the weight of the new batch statistic (``fused_batch_norm``'s
``exponential_avg_factor``; Keras would call it momentum 0.9)."""
_RUNNING = ("running_mean", "running_var")


# ------------------------------------------------------------------------------- layouts

def to_tf_layout(value: np.ndarray, layout: str, chw: tuple[int, int, int] | None = None,
                 dtype: Any = np.float32) -> np.ndarray:
    """torch's array -> TensorFlow's, as ``dtype``. ``layout`` (``trainperf.backends.layouts``):
    ``conv`` (OIHW -> HWIO), ``linear`` ([out, in] -> [in, out]), ``linear_chw`` (a linear
    layer after a flatten of a (C, H, W) map: [out, C*H*W] -> [H*W*C, out], rows in NHWC
    flatten order; ``chw`` gives (C, H, W)) or ``vector`` (unchanged)."""
    return layouts.from_torch(np.asarray(value, dtype=dtype), layout, chw)


to_torch_layout = layouts.to_torch
"""The inverse of :func:`to_tf_layout` (TensorFlow's array -> torch's)."""


@dataclass
class Param:
    variable: tf.Variable
    torch_shape: tuple[int, ...]
    layout: str
    chw: tuple[int, int, int] | None = None
    running: bool = False
    """A BatchNorm running statistic (a torch buffer, not a parameter)."""


class Params:
    """A network's variables under their torch ``state_dict`` names, in torch's order, all in
    ``dtype`` (numpy's name)."""

    def __init__(self, seed: int, dtype: str = "float32") -> None:
        self.rng = np.random.RandomState(seed)
        self.dtype = np.dtype(dtype)
        self.entries: dict[str, Param] = {}

    def add(self, name: str, torch_value: np.ndarray, layout: str, trainable: bool = True,
            chw: tuple[int, int, int] | None = None) -> tf.Variable:
        if name in self.entries:
            raise RuntimeError(f"two variables named {name!r}")
        var = tf.Variable(to_tf_layout(torch_value, layout, chw, self.dtype), trainable=trainable,
                          name=name)
        self.entries[name] = Param(var, tuple(np.shape(torch_value)), layout, chw,
                                   running=name.endswith(_RUNNING))
        return var

    def uniform(self, fan_in: int, shape: tuple[int, ...]) -> np.ndarray:
        bound = 1.0 / math.sqrt(fan_in)
        return self.rng.uniform(-bound, bound, shape)


# -------------------------------------------------------------------------------- layers

def _padding(pad: int) -> Any:
    return "VALID" if pad == 0 else [[0, 0], [pad, pad], [pad, pad], [0, 0]]


class Conv:
    """Bias-free 2-D convolution with torch's symmetric padding; ``groups`` as torch's (its
    kernel HWIO ``[k, k, cin / groups, cout]``, torch's ``(cout, cin / groups, k, k)``)."""

    def __init__(self, params: Params, name: str, cin: int, cout: int, kernel: int,
                 stride: int = 1, pad: int = 0, groups: int = 1) -> None:
        if cin % groups or cout % groups:
            raise ValueError(f"channels {cin}->{cout} are not divisible by groups={groups}")
        fan_in = cin // groups * kernel * kernel
        self.kernel = params.add(f"{name}.weight",
                                 params.uniform(fan_in, (cout, cin // groups, kernel, kernel)),
                                 "conv")
        self.stride, self.pad, self.groups = stride, pad, groups

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        kernel = tf.cast(self.kernel, x.dtype)
        if self.groups == 1:
            return tf.nn.conv2d(x, kernel, self.stride, _padding(self.pad))
        return _grouped_conv(x, kernel, self.groups, self.stride, _padding(self.pad))


def _grouped_conv(x: tf.Tensor, kernel: tf.Tensor, groups: int, stride: int,
                  padding: Any) -> tf.Tensor:
    """torch's grouped convolution, of an HWIO kernel ``[k, k, ci, groups * co]`` (``ci``, ``co``
    the channels per group), as TensorFlow's depthwise convolution: TensorFlow's CPU kernels
    take no gradient of a grouped ``conv2d`` ("Gradients for grouped convolutions are not
    supported on CPU"). Each input channel ``g * ci + i`` is convolved with the ``co`` filters
    of its group's output channels, in a ``[k, k, groups * ci, co]`` depthwise kernel; the
    ``ci`` inputs of each group are then summed, leaving output channel ``g * co + j`` where
    torch has it. A depthwise convolution (``ci`` 1) needs no sum."""
    k, _, ci, cout = kernel.shape
    co = cout // groups
    depthwise = tf.reshape(tf.transpose(tf.reshape(kernel, [k, k, ci, groups, co]),
                                        [0, 1, 3, 2, 4]), [k, k, groups * ci, co])
    y = tf.nn.depthwise_conv2d(x, depthwise, [1, stride, stride, 1], padding)
    if ci == 1:
        return y
    shape = tf.shape(y)
    y = tf.reduce_sum(tf.reshape(y, [shape[0], shape[1], shape[2], groups, ci, co]), axis=4)
    return tf.reshape(y, [shape[0], shape[1], shape[2], cout])


class BatchNorm:
    """torch's BatchNorm2d / BatchNorm1d (eps 1e-5, momentum 0.1) on the last axis, as the fused
    kernel (a [N, C] input runs as [N, 1, 1, C]). In training it normalises with the batch
    statistics and moves the running ones (unbiased variance, as torch).

    The fused kernel takes float32 variables only ("Value for attr U of double is not in the
    list of allowed values"): float64 variables run the fused kernel's rule in ``tf.nn`` ops
    (:meth:`_composed`), which float32 runs never trace. That stand-in is held, in float32, to
    compute what the fused kernel computes (output, gradients, running statistics, inference)
    by ``tests/test_tf_models_heads.py``; ``fused`` is what chooses the path."""

    def __init__(self, params: Params, name: str, channels: int, gamma: float = 1.0,
                 fixed_gamma: bool = False) -> None:
        self.weight = params.add(f"{name}.weight", np.full(channels, gamma), "vector",
                                 trainable=not fixed_gamma)
        self.bias = params.add(f"{name}.bias", np.zeros(channels), "vector")
        self.running_mean = params.add(f"{name}.running_mean", np.zeros(channels), "vector",
                                       trainable=False)
        self.running_var = params.add(f"{name}.running_var", np.ones(channels), "vector",
                                      trainable=False)
        self.fused = self.weight.dtype == tf.float32

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        if not self.fused:
            return self._composed(x, training)
        flat = x.shape.rank == 2
        if flat:
            x = x[:, None, None, :]
        if training:
            y, mean, var = tf.compat.v1.nn.fused_batch_norm(
                x, self.weight, self.bias, mean=self.running_mean, variance=self.running_var,
                epsilon=BN_EPS, is_training=True, exponential_avg_factor=BN_MOMENTUM)
            self.running_mean.assign(mean)
            self.running_var.assign(var)
        else:
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(
                x, self.weight, self.bias, mean=self.running_mean, variance=self.running_var,
                epsilon=BN_EPS, is_training=False)
        return y[:, 0, 0, :] if flat else y

    def _composed(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        """The fused kernel's arithmetic in separate ops, for any dtype: normalise with the
        batch's mean and biased variance, and move the running statistics by the fused
        kernel's rule (which is torch's), ``r = (1 - m) * r + m * s`` with the unbiased
        variance (n / (n - 1) times the biased one, n the values per channel)."""
        if not training:
            return tf.nn.batch_normalization(x, self.running_mean, self.running_var, self.bias,
                                             self.weight, BN_EPS)
        mean, var = tf.nn.moments(x, axes=list(range(x.shape.rank - 1)))
        n = tf.cast(tf.size(x) // tf.shape(x)[-1], var.dtype)
        unbiased = var * (n / (n - 1.0))
        self.running_mean.assign((1.0 - BN_MOMENTUM) * self.running_mean + BN_MOMENTUM * mean)
        self.running_var.assign((1.0 - BN_MOMENTUM) * self.running_var + BN_MOMENTUM * unbiased)
        return tf.nn.batch_normalization(x, mean, var, self.bias, self.weight, BN_EPS)


class PReLU:
    """torch's ``nn.PReLU(C)``: x where x > 0, else slope[c] * x (slopes start at 0.25)."""

    def __init__(self, params: Params, name: str, channels: int) -> None:
        self.weight = params.add(f"{name}.weight", np.full(channels, 0.25), "vector")

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        return tf.where(x > 0, x, x * tf.cast(self.weight, x.dtype))


class Dense:
    """torch's ``nn.Linear``; ``chw`` when its input is a flattened (C, H, W) map."""

    def __init__(self, params: Params, name: str, cin: int, cout: int,
                 chw: tuple[int, int, int] | None = None, bias: bool = True) -> None:
        self.weight = params.add(f"{name}.weight", params.uniform(cin, (cout, cin)),
                                 "linear_chw" if chw else "linear", chw=chw)
        self.bias = (params.add(f"{name}.bias", params.uniform(cin, (cout,)), "vector")
                     if bias else None)

    def __call__(self, x: tf.Tensor) -> tf.Tensor:
        y = tf.matmul(x, tf.cast(self.weight, x.dtype))
        return y if self.bias is None else y + tf.cast(self.bias, x.dtype)


# ------------------------------------------------------------------------------- IResNet

class IBasicBlock:
    """BN-conv3x3-BN-PReLU-conv3x3(stride)-BN plus shortcut, no activation after the sum."""

    def __init__(self, p: Params, name: str, cin: int, cout: int, stride: int) -> None:
        self.bn1 = BatchNorm(p, f"{name}.bn1", cin)
        self.conv1 = Conv(p, f"{name}.conv1", cin, cout, 3, 1, 1)
        self.bn2 = BatchNorm(p, f"{name}.bn2", cout)
        self.prelu = PReLU(p, f"{name}.prelu", cout)
        self.conv2 = Conv(p, f"{name}.conv2", cout, cout, 3, stride, 1)
        self.bn3 = BatchNorm(p, f"{name}.bn3", cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = (Conv(p, f"{name}.downsample.0", cin, cout, 1, stride),
                         BatchNorm(p, f"{name}.downsample.1", cout))

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        out = self.bn1(x, training)
        out = self.prelu(self.bn2(self.conv1(out), training))
        out = self.bn3(self.conv2(out), training)
        shortcut = x if self.down is None else self.down[1](self.down[0](x), training)
        return out + shortcut


class IResNet:
    def __init__(self, p: Params, layers: tuple[int, ...], widths: tuple[int, ...],
                 embedding_size: int, input_size: int, output_block: str,
                 dropout: float) -> None:
        if input_size % 16:
            raise ValueError(f"IResNet needs an input side divisible by 16, got {input_size}")
        if output_block not in ("E", "FC"):
            raise ValueError(f"IResNet output block must be 'E' or 'FC', got {output_block!r}")
        stem = widths[0]
        self.conv1 = Conv(p, "conv1", 3, stem, 3, 1, 1)
        self.bn1 = BatchNorm(p, "bn1", stem)
        self.prelu = PReLU(p, "prelu", stem)
        self.body = []
        cin = stem
        for width, count in zip(widths, layers):
            for i in range(count):
                self.body.append(IBasicBlock(p, f"body.{len(self.body)}", cin, width,
                                             2 if i == 0 else 1))
                cin = width
        self.bn2 = BatchNorm(p, "bn2", cin)
        self.dropout = dropout if output_block == "E" else 0.0
        side = input_size // 16
        self.fc = Dense(p, "fc", cin * side * side, embedding_size, chw=(cin, side, side))
        self.features = BatchNorm(p, "features", embedding_size, fixed_gamma=True)

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        x = self.prelu(self.bn1(self.conv1(x), training))
        for block in self.body:
            x = block(x, training)
        x = self.bn2(x, training)
        x = tf.reshape(x, [tf.shape(x)[0], -1])  # (H, W, C) order, as fc's rows are stored
        if training and self.dropout > 0:
            x = tf.nn.dropout(x, rate=self.dropout)
        return self.features(self.fc(x), training)


# ------------------------------------------------------------------------- MobileFaceNet

class ConvBN:
    """Conv, BN and (unless ``linear``) PReLU, named ``conv``, ``bn``, ``act`` as torch's."""

    def __init__(self, p: Params, name: str, cin: int, cout: int, kernel: int = 1,
                 stride: int = 1, pad: int = 0, groups: int = 1, linear: bool = False) -> None:
        self.conv = Conv(p, f"{name}.conv", cin, cout, kernel, stride, pad, groups)
        self.bn = BatchNorm(p, f"{name}.bn", cout)
        self.act = None if linear else PReLU(p, f"{name}.act", cout)

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        y = self.bn(self.conv(x), training)
        return y if self.act is None else self.act(y)


class DepthWise:
    """Inverted bottleneck: expand (1x1), depthwise 3x3 (stride), project (1x1, linear), plus
    the input where ``residual``; torch's ``layers.0`` to ``layers.2``."""

    def __init__(self, p: Params, name: str, cin: int, cout: int, hidden: int, stride: int,
                 residual: bool) -> None:
        self.layers = (ConvBN(p, f"{name}.layers.0", cin, hidden),
                       ConvBN(p, f"{name}.layers.1", hidden, hidden, 3, stride, 1, groups=hidden),
                       ConvBN(p, f"{name}.layers.2", hidden, cout, linear=True))
        self.residual = residual

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        out = x
        for layer in self.layers:
            out = layer(out, training)
        return x + out if self.residual else out


class MobileFaceNet:
    """torch's MobileFaceNet (InsightFace's, with the GDC output block): ``width`` scales the
    block channels, the expansion widths and the second stem convolution's 64 groups stay
    fixed (so the 512-d model's is a grouped convolution, Y1's a depthwise one); the GDC is a
    depthwise convolution over the whole 1/16 map, then a bias-free Dense and a BatchNorm with
    a trained gamma."""

    def __init__(self, p: Params, *, embedding_size: int, width: int = 1, input_size: int = 112,
                 blocks: tuple[int, int, int] = (4, 6, 2), sep_channels: int = 512,
                 hidden: tuple[int, int, int, int] = (128, 256, 512, 256)) -> None:
        if input_size % 16:
            raise ValueError(f"MobileFaceNet needs an input side divisible by 16, got {input_size}")
        c64, c128 = 64 * width, 128 * width
        h_low, h_mid, h_down, h_high = hidden
        # (cin, cout, hidden, stride, residual) of each bottleneck, in torch's order.
        plan = ([(c64, c64, h_low, 2, False)] + [(c64, c64, h_low, 1, True)] * blocks[0]
                + [(c64, c128, h_mid, 2, False)] + [(c128, c128, h_mid, 1, True)] * blocks[1]
                + [(c128, c128, h_down, 2, False)] + [(c128, c128, h_high, 1, True)] * blocks[2])
        self.body: list[Any] = [ConvBN(p, "body.0", 3, c64, 3, 2, 1),
                                ConvBN(p, "body.1", c64, c64, 3, 1, 1, groups=64)]
        for cin, cout, expand, stride, residual in plan:
            self.body.append(DepthWise(p, f"body.{len(self.body)}", cin, cout, expand,
                                       stride, residual))
        self.body.append(ConvBN(p, f"body.{len(self.body)}", c128, sep_channels))
        side = input_size // 16
        self.gdc = ConvBN(p, "gdc", sep_channels, sep_channels, side, groups=sep_channels,
                          linear=True)
        self.fc = Dense(p, "fc", sep_channels, embedding_size, bias=False)
        self.features = BatchNorm(p, "features", embedding_size)

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        for layer in self.body:
            x = layer(x, training)
        x = self.gdc(x, training)  # [N, 1, 1, C]: its flatten has no order to convert
        return self.features(self.fc(tf.reshape(x, [tf.shape(x)[0], -1])), training)


# ---------------------------------------------------------------------------- ResNet v1b

class Bottleneck:
    """1x1, 3x3 (stride), 1x1 with the stride on the 3x3 (v1b); last BN gamma 0."""

    expansion = 4

    def __init__(self, p: Params, name: str, cin: int, width: int, stride: int) -> None:
        cout = width * self.expansion
        self.conv1 = Conv(p, f"{name}.conv1", cin, width, 1)
        self.bn1 = BatchNorm(p, f"{name}.bn1", width)
        self.conv2 = Conv(p, f"{name}.conv2", width, width, 3, stride, 1)
        self.bn2 = BatchNorm(p, f"{name}.bn2", width)
        self.conv3 = Conv(p, f"{name}.conv3", width, cout, 1)
        self.bn3 = BatchNorm(p, f"{name}.bn3", cout, gamma=0.0)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = (Conv(p, f"{name}.downsample.0", cin, cout, 1, stride),
                         BatchNorm(p, f"{name}.downsample.1", cout))

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        out = tf.nn.relu(self.bn1(self.conv1(x), training))
        out = tf.nn.relu(self.bn2(self.conv2(out), training))
        out = self.bn3(self.conv3(out), training)
        shortcut = x if self.down is None else self.down[1](self.down[0](x), training)
        return tf.nn.relu(out + shortcut)


class ResNetV1b:
    """Stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool padded by 1), bottlenecks, global average
    pool, Dense to ``num_classes``."""

    def __init__(self, p: Params, layers: tuple[int, ...], base_width: int,
                 num_classes: int) -> None:
        self.conv = Conv(p, "stem.0", 3, base_width, 7, 2, 3)
        self.bn = BatchNorm(p, "stem.1", base_width)
        self.body = []
        cin = base_width
        for stage, count in enumerate(layers):
            width = base_width * 2 ** stage
            for i in range(count):
                self.body.append(Bottleneck(p, f"body.{len(self.body)}", cin, width,
                                            2 if (i == 0 and stage > 0) else 1))
                cin = width * Bottleneck.expansion
        self.fc = Dense(p, "fc", cin, num_classes)

    def __call__(self, x: tf.Tensor, training: bool) -> tf.Tensor:
        x = tf.nn.relu(self.bn(self.conv(x), training))
        # torch's MaxPool2d(3, 2, 1) pads with -inf. Padded here with tf.pad rather than the
        # pool's own explicit padding, which XLA does not compile ("XLA does not support
        # pooling ops with explicit padding": --mode xla, on every device).
        x = tf.nn.max_pool2d(tf.pad(x, _padding(1), constant_values=float("-inf")), 3, 2,
                             "VALID")
        for block in self.body:
            x = block(x, training)
        return self.fc(tf.reduce_mean(x, axis=[1, 2]))


# --------------------------------------------------- built networks and family builders

class Backbone:
    """A built network: call it on NHWC images; ``params`` holds its variables by torch name."""

    def __init__(self, name: str, task: str, params: Params, net: Callable) -> None:
        self.name = name
        self.task = task
        self.params = params
        self._net = net

    def __call__(self, images: tf.Tensor, training: bool = True) -> tf.Tensor:
        return self._net(images, training)

    @property
    def trainable_variables(self) -> list[tf.Variable]:
        """What the optimizer updates, in torch's order (not the running statistics, not a
        fixed gamma)."""
        return [e.variable for e in self.params.entries.values() if e.variable.trainable]


def _iresnet(p: Params, b: catalog.Backbone, *, embedding_size: int, input_size: int,
             output_block: str, dropout: float, **_: Any) -> IResNet:
    return IResNet(p, **b.arch, embedding_size=embedding_size, input_size=input_size,
                   output_block=output_block, dropout=dropout)


def _mobilefacenet(p: Params, b: catalog.Backbone, *, embedding_size: int, input_size: int,
                   **_: Any) -> MobileFaceNet:
    return MobileFaceNet(p, **b.arch, embedding_size=embedding_size, input_size=input_size)


def _resnet_v1b(p: Params, b: catalog.Backbone, *, num_classes: int, **_: Any) -> ResNetV1b:
    return ResNetV1b(p, **b.arch, num_classes=num_classes)


# family -> builder of a catalogue entry; every family the backend declares has one.
_BUILDERS: dict[str, Callable[..., Any]] = {"iresnet": _iresnet, "mobilefacenet": _mobilefacenet,
                                            "resnet_v1b": _resnet_v1b}
CATALOG = catalog.BackendCatalog(BACKEND.capabilities.families, BACKEND.name)
backbone_names = CATALOG.names
backbone_task = CATALOG.task


def build_backbone(name: str, *, embedding_size: int | None = None,
                   num_classes: int | None = None, input_size: int = 112,
                   output_block: str = "E", dropout: float = 0.0, seed: int = 0,
                   dtype: str = "float32") -> Backbone:
    """The TensorFlow twin of torch's ``build_backbone(name, ...)``, its variables created on
    the current device in ``dtype`` and initialised from ``seed``. Arguments a family does not
    use are ignored, as in torch; ``None`` takes the catalogue's default (``backends.catalog``:
    torch's defaults)."""
    entry = CATALOG.lookup(name)
    params = Params(seed, dtype)
    net = _BUILDERS[entry.family](
        params, entry, embedding_size=entry.embedding(embedding_size),
        num_classes=entry.classes(num_classes), input_size=input_size,
        output_block=output_block, dropout=dropout)
    return Backbone(name, entry.task, params, net)


def load_torch_arrays(net: Backbone, arrays: Any, prefix: str = "backbone/") -> None:
    """Set every variable of ``net`` from ``arrays[prefix + torch_name]`` (torch layouts; a dict
    or an ``np.load`` result), converted by :func:`to_tf_layout`. Keys ending in
    ``num_batches_tracked`` are ignored. Raises ValueError naming every missing, unexpected or
    wrongly shaped array (and a fixed gamma that is not all ones) before changing anything."""
    entries = net.params.entries
    values = layouts.checked_torch_arrays(
        arrays, prefix, {name: e.torch_shape for name, e in entries.items()},
        fixed_gamma={name for name, e in entries.items()
                     if not e.variable.trainable and not e.running})
    for name, e in entries.items():
        # In the network's dtype: float32 arrays held as float64 stay exact.
        e.variable.assign(to_tf_layout(values[name], e.layout, e.chw, net.params.dtype))


def torch_arrays(net: Backbone, prefix: str = "backbone/") -> dict[str, np.ndarray]:
    """The inverse of :func:`load_torch_arrays`: every variable (the running statistics and a
    fixed gamma included) read back as ``prefix + torch_name`` in torch's layout and in the
    network's dtype, as torch's ``state_dict`` lists them (but ``num_batches_tracked``)."""
    return {prefix + name: to_torch_layout(e.variable.numpy(), e.layout, e.chw)
            for name, e in net.params.entries.items()}


def param_count(net: Backbone) -> int:
    """Scalars in the parameters torch counts (``sum(p.numel() for p in m.parameters())``):
    every variable but the BN running statistics, IResNet's fixed embedding gamma included."""
    return sum(int(np.prod(e.torch_shape)) for e in net.params.entries.values()
               if not e.running)


def torch_shapes(net: Backbone) -> dict[str, list[int]]:
    """Every torch ``state_dict`` key (but ``num_batches_tracked``) -> its torch shape, in
    torch's order."""
    return {name: list(e.torch_shape) for name, e in net.params.entries.items()}
