"""flax (linen) backbones equal to the PyTorch ones in ``trainperf.backends.torch.backbones``.

Why linen: a linen model is a pure function of explicit variable collections, so the whole
training step (backbone, head, reductions, update) is one function of plain pytrees that
``jax.jit`` and ``jax.shard_map`` take as they are, whose buffers can be donated, and whose
nested names are the torch ``state_dict`` keys (see below). NNX would need a split/merge around
every jitted call to get the same.

Layout: activations are NHWC and convolution kernels HWIO ([kh, kw, in / groups, out]), dense
kernels [in, out] (XLA's native layouts on every backend). Every torch layer has a twin here
with the same kernel, stride, padding and groups, and the same operations in the same order.
The one place that converts torch's layouts (OIHW convolutions, [out, in] linear weights) is
:func:`from_torch_layout` (with ``trainperf.backends.layouts``' conversions), used by
:func:`load_torch_arrays`. IResNet's flatten before its fully connected layer transposes the
NHWC map to NCHW first, so the dense kernel's rows are in torch's (C, H, W) order and its
weight is torch's transposed, nothing more.

The layers are written here (not flax's ``nn.Conv`` / ``nn.BatchNorm``) for three reasons:
their variables carry torch's leaf names (``weight``, ``bias``, ``running_mean``,
``running_var``), so a variable's path joined with dots *is* its torch name; BatchNorm keeps
torch's semantics exactly (momentum 0.1 on the new value, i.e. flax's 0.9, running variance
updated with the *unbiased* batch variance, batch moments exact to float32 rounding, where
flax's default ``E[x^2] - E[x]^2`` loses digits: see :data:`BN_MOMENTS_CHOICES`); and a
compute dtype (bf16, fp16) applies to convolutions and dense layers only, BatchNorm statistics
staying fp32.

float64 (a strict alignment run, ``jax_enable_x64`` on): the variables are float64 as loaded,
the compute dtype is float64, and every place that lifts a narrow value to fp32 (BatchNorm,
the embedding's BN, the classifier's pooling and logits) keeps a float64 one as it is
(:func:`at_least_fp32`), as torch's ``at_least_fp32`` does.

Collections: ``params`` (trained), ``batch_stats`` (BN running statistics, torch buffers) and
``frozen``: IResNet's embedding-BN gamma, fixed at 1 (torch: a parameter with
``requires_grad=False``, MXNet's ``fix_gamma``). It is counted as a parameter, as torch counts
it, but no optimizer ever sees it (weight decay would otherwise shrink it).

BatchNorm runs in training mode only (batch statistics), which is all trainperf measures.

Initialisation (throughput runs; alignment loads torch's weights instead): convolution and
dense weights and dense biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)) as torch's default
``kaiming_uniform_(a=sqrt(5))``; BN gamma 1 (0 for ResNet v1b's last BN of a bottleneck), beta
0, running mean 0, running variance 1; PReLU 0.25. Same distributions as torch, not the same
numbers. Every variable is declared with an :class:`Init`, which flax's ``model.init`` calls
as usual and :func:`init_variables` draws on the host instead (no compilation).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax.core import unfreeze

from .. import catalog, layouts
from .backend import BACKEND

__all__ = [
    "backbone_names", "backbone_task", "build_backbone", "init_variables", "param_count",
    "torch_names", "torch_shape", "from_torch_layout", "load_torch_arrays", "torch_arrays",
    "at_least_fp32", "BN_EPS", "BN_MOMENTUM",
]

BN_EPS = 1e-5
BN_MOMENTUM = 0.1
"""torch's convention: running = (1 - momentum) * running + momentum * batch (flax's 0.9)."""
BN_MOMENTS_CHOICES = ("two_pass", "one_pass", "shifted", "running_shift")
"""How training-mode BatchNorm can take its batch mean and variance in a float32 / bf16 / fp16
run (a float64 alignment run always takes ``two_pass``):

- ``two_pass``: the mean, then the mean of the squared deviations (three reads of the input
  with the normalisation);
- ``one_pass``: ``E[x^2] - E[x]^2`` in float32, as flax's ``nn.BatchNorm`` (XLA fuses both
  sums into one read on a GPU; loses digits where the mean is large against the spread);
- ``shifted``: the same single read of ``x - s``, with ``s`` the batch's first sample at its
  first position, per channel (held constant for autodiff; the variance does not depend on
  it). ``s`` lies within a few standard deviations of the mean, so the cancellation costs no
  more than a few digits' worth of rounding. It comes from the batch, not from the running
  statistics, so the forward pass stays a function of the batch and the weights alone, as in
  torch: running statistics that a skipped fp16 step left non-finite change nothing;
- ``running_shift``: shifted by the running mean instead (kept to reproduce the GPU
  measurement below: after a step that left the running mean non-finite, every later step is
  too).

Which one a step traces with is :data:`BN_MOMENTS_BY_DEVICE`'s choice for its device (set
with :func:`bn_moments` around the tracing)."""
BN_MOMENTS_BY_DEVICE = {"cuda": "shifted", "cpu": "two_pass"}
"""The faster, measured with ``benchmarks/jax_step_ablation.py`` against flax's own step
(``benchmarks/results/gpu-h200-2026-11-26/jax_bn_ablation/``, ``native_parity-cpu/``). On an
H200 (JAX 0.11.2, batch 128) ``two_pass`` held trainperf's ResNet50 step at 0.927 of flax's in
fp32 and 0.911 in bf16, where one read (unshifted, or shifted by the running mean) gave
0.98-1.01. On the 2-core CPU (JAX 0.10.2, ResNet50 at batch 2) XLA's CPU code went the other
way: ``two_pass`` 0.981, ``running_shift`` 0.946, ``shifted`` 0.912."""
_MOMENTS: contextvars.ContextVar[str] = contextvars.ContextVar("trainperf_bn_moments",
                                                                 default="two_pass")


@contextlib.contextmanager
def bn_moments(mode: str) -> Iterator[None]:
    """BatchNorms traced inside take their moments by ``mode`` (one of
    :data:`BN_MOMENTS_CHOICES`)."""
    if mode not in BN_MOMENTS_CHOICES:
        raise ValueError(f"BatchNorm moments must be one of {BN_MOMENTS_CHOICES}, not {mode!r}")
    token = _MOMENTS.set(mode)
    try:
        yield
    finally:
        _MOMENTS.reset(token)


COLLECTIONS = ("params", "frozen", "batch_stats")

Dtype = Any


def at_least_fp32(x: jax.Array) -> jax.Array:
    """``x`` in fp32, or as it is when it is wider (float64, an alignment run's): the dtype in
    which statistics, the margin and the loss are computed."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


@dataclass(frozen=True)
class Init:
    """An initializer that flax calls (``kind`` ``uniform``: U(-value, value) by jax.random;
    ``const``: filled with ``value``) and that :func:`init_variables` draws on the host with
    numpy instead: drawing the weights inside a jitted ``model.init`` costs a compilation of
    the forward pass and of one random-bits kernel per parameter shape (about 20 s for
    ``iresnet_tiny`` on a loaded 2-core machine), the host draw nothing."""

    kind: str
    value: float

    def __call__(self, key: Any, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        if self.kind == "uniform":
            return jax.random.uniform(key, shape, dtype, -self.value, self.value)
        return jnp.full(shape, self.value, dtype)

    def host(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        if self.kind == "uniform":
            return rng.uniform(-self.value, self.value, shape).astype(np.float32)
        return np.full(shape, self.value, np.float32)


def _fan_in_uniform(fan_in: int) -> Init:
    return Init("uniform", 1.0 / math.sqrt(fan_in))


_RECORDER: contextvars.ContextVar[dict | None] = contextvars.ContextVar("trainperf_inits",
                                                                         default=None)


def _note(module: nn.Module, collection: str, name: str, init: Init) -> None:
    """Remember which initializer made a variable (while :func:`init_variables` traces)."""
    record = _RECORDER.get()
    if record is not None:
        record[(collection, *module.scope.path, name)] = init


def _param(module: nn.Module, name: str, init: Init, shape: tuple[int, ...]) -> jax.Array:
    _note(module, "params", name, init)
    return module.param(name, init, shape)


def _variable(module: nn.Module, collection: str, name: str, init: Init,
              shape: tuple[int, ...]) -> Any:
    _note(module, collection, name, init)
    return module.variable(collection, name, lambda: init(None, shape))


ONES, ZEROS = Init("const", 1.0), Init("const", 0.0)


class Conv(nn.Module):
    """Bias-free 2-D convolution, NHWC input, HWIO kernel named ``weight``."""

    features: int
    kernel: int
    stride: int = 1
    padding: int = 0
    groups: int = 1
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cin = x.shape[-1]
        if cin % self.groups or self.features % self.groups:
            raise ValueError(f"channels {cin}->{self.features} are not divisible by "
                             f"groups={self.groups}")
        k = self.kernel
        weight = _param(self, "weight", _fan_in_uniform(cin // self.groups * k * k),
                        (k, k, cin // self.groups, self.features))
        p = self.padding
        return jax.lax.conv_general_dilated(
            x.astype(self.dtype), weight.astype(self.dtype), (self.stride, self.stride),
            [(p, p), (p, p)], dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=self.groups)


class Dense(nn.Module):
    """Fully connected layer, kernel ``weight`` [in, out] (torch's transposed)."""

    features: int
    use_bias: bool = True
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cin = x.shape[-1]
        weight = _param(self, "weight", _fan_in_uniform(cin), (cin, self.features))
        y = jnp.dot(x.astype(self.dtype), weight.astype(self.dtype))
        if self.use_bias:
            y = y + _param(self, "bias", _fan_in_uniform(cin), (self.features,)).astype(y.dtype)
        return y


class BatchNorm(nn.Module):
    """Training-mode BatchNorm over the last axis with torch's arithmetic (see the module
    docstring). ``gamma``: ``learn`` (init 1), ``zero`` (learned, init 0) or ``fixed`` (held
    at 1 in the ``frozen`` collection). The output has the input's dtype; statistics and
    normalisation run in fp32 (float64 for a float64 input)."""

    momentum: float = BN_MOMENTUM
    eps: float = BN_EPS
    gamma: str = "learn"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        if self.gamma == "fixed":
            weight = _variable(self, "frozen", "weight", ONES, (c,)).value
        else:
            weight = _param(self, "weight", ZEROS if self.gamma == "zero" else ONES, (c,))
        bias = _param(self, "bias", ZEROS, (c,))
        running_mean = _variable(self, "batch_stats", "running_mean", ZEROS, (c,))
        running_var = _variable(self, "batch_stats", "running_var", ONES, (c,))
        xf = at_least_fp32(x)
        mean, var = batch_moments(xf, tuple(range(x.ndim - 1)), running_mean.value)
        if not self.is_initializing():
            n = math.prod(x.shape[:-1])
            m = self.momentum
            unbiased = jax.lax.stop_gradient(var) * (n / max(n - 1, 1))
            running_mean.value = (1 - m) * running_mean.value + m * jax.lax.stop_gradient(mean)
            running_var.value = (1 - m) * running_var.value + m * unbiased
        y = (xf - mean) * (jax.lax.rsqrt(var + self.eps) * weight) + bias
        return y.astype(x.dtype)


def batch_moments(xf: jax.Array, axes: tuple[int, ...], running_mean: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    """(mean, biased variance) of ``xf`` over ``axes`` (all but the last) by
    the mode :func:`bn_moments` set (``two_pass`` outside one, and always for float64)."""
    mode = "two_pass" if xf.dtype == jnp.float64 else _MOMENTS.get()
    if mode == "two_pass":
        mean = jnp.mean(xf, axis=axes)
        return mean, jnp.mean(jnp.square(xf - mean), axis=axes)
    if mode == "shifted":
        shift = jax.lax.stop_gradient(xf[(0,) * len(axes)])
    elif mode == "running_shift":
        shift = jax.lax.stop_gradient(running_mean).astype(xf.dtype)
    else:
        shift = jnp.zeros((), xf.dtype)
    d = xf - shift
    m1 = jnp.mean(d, axis=axes)
    var = jnp.maximum(jnp.mean(jnp.square(d), axis=axes) - jnp.square(m1), 0.0)
    return m1 + shift, var


class PReLU(nn.Module):
    """Per-channel PReLU (last axis), slopes ``weight`` starting at 0.25 as ``nn.PReLU(C)``."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = _param(self, "weight", Init("const", 0.25), (x.shape[-1],))
        return jnp.where(x > 0, x, weight.astype(x.dtype) * x)


# --------------------------------------------------------------------------------- IResNet

class IBasicBlock(nn.Module):
    """BN-conv3x3-BN-PReLU-conv3x3(stride)-BN plus shortcut, no activation after the sum."""

    features: int
    stride: int
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = self.dtype
        out = BatchNorm(name="bn1")(x)
        out = Conv(self.features, 3, 1, 1, dtype=d, name="conv1")(out)
        out = BatchNorm(name="bn2")(out)
        out = PReLU(name="prelu")(out)
        out = Conv(self.features, 3, self.stride, 1, dtype=d, name="conv2")(out)
        out = BatchNorm(name="bn3")(out)
        shortcut = x
        if self.stride != 1 or x.shape[-1] != self.features:
            shortcut = Conv(self.features, 1, self.stride, dtype=d, name="downsample.0")(x)
            shortcut = BatchNorm(name="downsample.1")(shortcut)
        return out + shortcut.astype(out.dtype)


class IResNet(nn.Module):
    """InsightFace's IResNet with output block "E" (BN, dropout, FC, BN with gamma fixed at 1)
    or "FC" (the same without dropout)."""

    layers: tuple[int, int, int, int]
    widths: tuple[int, int, int, int] = catalog.IRESNET_WIDTHS
    embedding_size: int = 512
    output_block: str = "E"
    dropout: float = 0.0
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[1] % 16 or x.shape[2] % 16:
            raise ValueError(f"IResNet needs an input side divisible by 16, got {x.shape[1:3]}")
        if self.output_block not in ("E", "FC"):
            raise ValueError(f"IResNet output block must be 'E' or 'FC', "
                             f"got {self.output_block!r}")
        d = self.dtype
        x = Conv(self.widths[0], 3, 1, 1, dtype=d, name="conv1")(x)
        x = PReLU(name="prelu")(BatchNorm(name="bn1")(x))
        index = 0
        for width, count in zip(self.widths, self.layers):
            for i in range(count):
                x = IBasicBlock(width, 2 if i == 0 else 1, dtype=d, name=f"body.{index}")(x)
                index += 1
        x = BatchNorm(name="bn2")(x)
        # torch flattens NCHW in (C, H, W) order; flattening that order keeps torch's FC rows.
        x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)
        rate = self.dropout if self.output_block == "E" else 0.0
        if rate > 0:
            x = nn.Dropout(rate, deterministic=False)(x)
        x = Dense(self.embedding_size, dtype=d, name="fc")(x)
        return BatchNorm(gamma="fixed", name="features")(at_least_fp32(x))


# --------------------------------------------------------------------------- MobileFaceNet

class ConvBN(nn.Module):
    """Conv, BN and (unless ``linear``) PReLU; children ``conv``, ``bn``, ``act`` as torch."""

    features: int
    kernel: int = 1
    stride: int = 1
    padding: int = 0
    groups: int = 1
    linear: bool = False
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = Conv(self.features, self.kernel, self.stride, self.padding, self.groups,
                 dtype=self.dtype, name="conv")(x)
        x = BatchNorm(name="bn")(x)
        return x if self.linear else PReLU(name="act")(x)


class DepthWise(nn.Module):
    """Inverted bottleneck: expand (1x1), depthwise 3x3, project (1x1, linear)."""

    features: int
    hidden: int
    stride: int
    residual: bool
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = self.dtype
        out = ConvBN(self.hidden, dtype=d, name="layers.0")(x)
        out = ConvBN(self.hidden, 3, self.stride, 1, groups=self.hidden, dtype=d,
                     name="layers.1")(out)
        out = ConvBN(self.features, linear=True, dtype=d, name="layers.2")(out)
        return x + out if self.residual else out


class MobileFaceNet(nn.Module):
    """MobileFaceNet with the GDC output block (global depthwise conv, BN, FC without bias, BN
    with learnable gamma); ``width`` scales the block channels only, as in torch."""

    embedding_size: int = 128
    width: int = 1
    blocks: tuple[int, int, int] = (4, 6, 2)
    sep_channels: int = 512
    hidden: tuple[int, int, int, int] = (128, 256, 512, 256)
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[1] % 16 or x.shape[2] % 16:
            raise ValueError(f"MobileFaceNet needs an input side divisible by 16, "
                             f"got {x.shape[1:3]}")
        d = self.dtype
        c64, c128 = 64 * self.width, 128 * self.width
        h_low, h_mid, h_down, h_high = self.hidden
        plan: list[Callable[[str], nn.Module]] = [
            lambda n: ConvBN(c64, 3, 2, 1, dtype=d, name=n),
            lambda n: ConvBN(c64, 3, 1, 1, groups=64, dtype=d, name=n),
            lambda n: DepthWise(c64, h_low, 2, False, dtype=d, name=n),
        ]
        plan += [lambda n: DepthWise(c64, h_low, 1, True, dtype=d, name=n)] * self.blocks[0]
        plan.append(lambda n: DepthWise(c128, h_mid, 2, False, dtype=d, name=n))
        plan += [lambda n: DepthWise(c128, h_mid, 1, True, dtype=d, name=n)] * self.blocks[1]
        plan.append(lambda n: DepthWise(c128, h_down, 2, False, dtype=d, name=n))
        plan += [lambda n: DepthWise(c128, h_high, 1, True, dtype=d, name=n)] * self.blocks[2]
        plan.append(lambda n: ConvBN(self.sep_channels, dtype=d, name=n))
        for i, make in enumerate(plan):
            x = make(f"body.{i}")(x)
        side = x.shape[1]
        x = ConvBN(self.sep_channels, side, groups=self.sep_channels, linear=True, dtype=d,
                   name="gdc")(x)
        x = Dense(self.embedding_size, use_bias=False, dtype=d, name="fc")(
            x.reshape(x.shape[0], -1))
        return BatchNorm(name="features")(at_least_fp32(x))


# ------------------------------------------------------------------------------ ResNet v1b

class Bottleneck(nn.Module):
    """1x1, 3x3 (stride), 1x1 bottleneck with the stride on the 3x3 (v1b); last BN gamma 0."""

    width: int
    stride: int
    dtype: Dtype = jnp.float32
    expansion = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = self.dtype
        cout = self.width * self.expansion
        out = nn.relu(BatchNorm(name="bn1")(Conv(self.width, 1, dtype=d, name="conv1")(x)))
        out = nn.relu(BatchNorm(name="bn2")(
            Conv(self.width, 3, self.stride, 1, dtype=d, name="conv2")(out)))
        out = BatchNorm(gamma="zero", name="bn3")(Conv(cout, 1, dtype=d, name="conv3")(out))
        shortcut = x
        if self.stride != 1 or x.shape[-1] != cout:
            shortcut = BatchNorm(name="downsample.1")(
                Conv(cout, 1, self.stride, dtype=d, name="downsample.0")(x))
        return nn.relu(out + shortcut)


class ResNetV1b(nn.Module):
    """Classification ResNet v1b: stem (7x7/2 conv, BN, ReLU, 3x3/2 max pool), bottlenecks,
    global average pool, FC to ``num_classes``; returns fp32 logits (float64 in a float64
    run)."""

    layers: tuple[int, int, int, int]
    num_classes: int = 1000
    base_width: int = 64
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = self.dtype
        x = Conv(self.base_width, 7, 2, 3, dtype=d, name="stem.0")(x)
        x = nn.relu(BatchNorm(name="stem.1")(x))
        # torch pads max pooling with -inf, as flax's max_pool does.
        x = nn.max_pool(x, (3, 3), (2, 2), ((1, 1), (1, 1)))
        index = 0
        for stage, count in enumerate(self.layers):
            width = self.base_width * 2 ** stage
            for i in range(count):
                x = Bottleneck(width, 2 if (i == 0 and stage > 0) else 1, dtype=d,
                               name=f"body.{index}")(x)
                index += 1
        x = jnp.mean(at_least_fp32(x), axis=(1, 2))
        return at_least_fp32(Dense(self.num_classes, dtype=d, name="fc")(x))


# ------------------------------------------------------------------------- family builders

def _iresnet(b: catalog.Backbone, *, embedding_size: int, output_block: str, dropout: float,
             dtype: Dtype, **_: Any) -> IResNet:
    return IResNet(**b.arch, embedding_size=embedding_size, output_block=output_block,
                   dropout=dropout, dtype=dtype)


def _mobilefacenet(b: catalog.Backbone, *, embedding_size: int, dtype: Dtype,
                   **_: Any) -> MobileFaceNet:
    return MobileFaceNet(**b.arch, embedding_size=embedding_size, dtype=dtype)


def _resnet_v1b(b: catalog.Backbone, *, num_classes: int, dtype: Dtype, **_: Any) -> ResNetV1b:
    return ResNetV1b(**b.arch, num_classes=num_classes, dtype=dtype)


# family -> builder of a catalogue entry; every family the backend declares has one.
_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "iresnet": _iresnet, "mobilefacenet": _mobilefacenet, "resnet_v1b": _resnet_v1b}
CATALOG = catalog.BackendCatalog(BACKEND.capabilities.families, BACKEND.name)
backbone_names = CATALOG.names
backbone_task = CATALOG.task


def build_backbone(name: str, *, embedding_size: int | None = None,
                   num_classes: int | None = None, output_block: str = "E",
                   dropout: float = 0.0, dtype: Dtype = jnp.float32) -> nn.Module:
    """The flax twin of torch's ``build_backbone(name, ...)``; arguments a family does not use
    are ignored, ``None`` takes the catalogue's default (``backends.catalog``: torch's
    defaults). ``dtype`` is the compute dtype of convolutions and dense layers (parameters keep
    the dtype they are given: fp32, or float64 in an alignment run). The input side is the
    input's."""
    entry = CATALOG.lookup(name)
    return _BUILDERS[entry.family](
        entry, embedding_size=entry.embedding(embedding_size),
        num_classes=entry.classes(num_classes), output_block=output_block, dropout=dropout,
        dtype=dtype)


def init_variables(model: nn.Module, seed: int, input_size: int) -> dict:
    """Freshly drawn variables (every collection, numpy float32) for NHWC inputs of side
    ``input_size``: the shapes from an abstract trace of ``model.init``, each value drawn on
    the host from the initializer that declared it (see :class:`Init`), in a fixed order, so
    every process draws the same numbers from the same seed."""
    record: dict = {}
    token = _RECORDER.set(record)
    try:
        abstract = abstract_variables(model, input_size)
    finally:
        _RECORDER.reset(token)
    rng = np.random.default_rng(seed)
    out: dict = {}
    for collection in COLLECTIONS:
        for path, leaf in _leaves(abstract.get(collection, {}), (collection,)):
            if path not in record:
                raise RuntimeError(f"variable {'/'.join(path)} has no recorded initializer")
            out.setdefault(collection, {})
            _set_new(out, path, record[path].host(rng, tuple(leaf.shape)))
    return out


def abstract_variables(model: nn.Module, input_size: int) -> dict:
    """Shapes and dtypes of every variable, without computing anything."""
    x = jax.ShapeDtypeStruct((1, input_size, input_size, 3), jnp.float32)
    key = jax.random.key(0)
    return unfreeze(jax.eval_shape(lambda k, v: model.init({"params": k, "dropout": k}, v),
                                   key, x))


# ----------------------------------------------------------------- torch names and layouts

def _leaves(tree: dict, path: tuple[str, ...] = ()) -> Iterable[tuple[tuple[str, ...], Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, path + (key,))
        else:
            yield path + (key,), value


def torch_names(variables: dict) -> dict[str, tuple[str, ...]]:
    """torch ``state_dict`` key -> path of the flax variable that holds it ((collection,
    module, ..., leaf)); every variable of every collection has one."""
    names: dict[str, tuple[str, ...]] = {}
    for collection in COLLECTIONS:
        for path, _ in _leaves(variables.get(collection, {}), (collection,)):
            name = ".".join(path[1:])
            if name in names:
                raise RuntimeError(f"two flax variables map to torch name {name!r}")
            names[name] = path
    return names


def from_torch_layout(value: np.ndarray) -> np.ndarray:
    """torch's layout -> this module's: OIHW convolution weights -> HWIO, [out, in] linear
    weights -> [in, out] (this module's only 4-d and 2-d variables); vectors as they are."""
    value = np.asarray(value)
    return layouts.from_torch(value, layouts.layout_of_rank(value.ndim))


def torch_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape torch gives a variable of this module's ``shape`` (the inverse of
    :func:`from_torch_layout` on shapes)."""
    return layouts.torch_shape(shape, layouts.layout_of_rank(len(shape)))


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set_new(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def load_torch_arrays(variables: dict, arrays: Any, prefix: str = "backbone/",
                      dtype: Any = np.float32) -> dict:
    """``variables`` (nested dicts; only shapes are read, abstract ones do) with every variable
    set from ``arrays[prefix + torch_name]`` (a dict or an ``np.load`` result), converted by
    :func:`from_torch_layout`, as numpy arrays of ``dtype`` (float32; float64 for a float64
    alignment run). ``num_batches_tracked`` keys are ignored.
    Raises ValueError naming every missing, unexpected or wrongly shaped array, and a fixed BN
    gamma that is not all ones, before returning anything."""
    names = torch_names(variables)
    values = layouts.checked_torch_arrays(
        arrays, prefix, {name: torch_shape(_get(variables, path).shape)
                         for name, path in names.items()},
        fixed_gamma={name for name, path in names.items() if path[0] == "frozen"},
        dtype=dtype)
    out = {c: unfreeze(variables[c]) for c in COLLECTIONS if c in variables}
    for name, path in names.items():
        _set(out, path, from_torch_layout(values[name]))
    return out


def torch_arrays(variables: dict, prefix: str = "backbone/") -> dict[str, np.ndarray]:
    """The inverse of :func:`load_torch_arrays`: every variable of every collection (numpy or
    host-readable arrays) as ``prefix + torch name`` -> its value in torch's layout, dtype kept.
    The fixed BN gamma is there too: torch holds it as a parameter."""
    out = {}
    for name, path in torch_names(variables).items():
        value = np.asarray(_get(variables, path))
        out[prefix + name] = layouts.to_torch(value, layouts.layout_of_rank(value.ndim))
    return out


def param_count(variables: dict) -> int:
    """Scalars of what torch counts as parameters: ``params`` and ``frozen`` (the fixed gamma
    is a torch parameter), not BN running statistics (torch buffers)."""
    return sum(int(np.prod(leaf.shape)) for c in ("params", "frozen")
               for _, leaf in _leaves(variables.get(c, {})))

