"""What a Paddle alignment run (``trainperf.config.AlignSpec``) does differently from a
throughput run, and the state it dumps after every step (``step_state``).

An alignment run holds every tensor in the asked dtype (``step.py`` builds the backbone, the
batch and the head in it) and otherwise runs the throughput run's code, with three exceptions
in a float64 run. Each of these Paddle kernels holds a number of its rule as a 32-bit float
whatever the dtype of its tensors (seen with Paddle 3.3.1 on the CPU), so in float64 it cannot
compute its own rule to float64 rounding; the run uses a stand-in written with Paddle's tensor
operations that computes the same rule with the number held exactly:

- ``momentum`` (``paddle.optimizer.Momentum``; its multi-tensor form, which throughput runs
  use, refuses float64 outright) holds ``mu`` and the L2 decay coefficient as float32: 0.9
  arrives as 0.89999998, and the velocity moves by about 1e-8 of itself per step. Stand-in:
  :class:`ExactMomentum`.
- ``batch_norm`` holds ``epsilon`` and ``momentum`` as float32: 1e-5 arrives as 9.9999997e-06
  and 0.9 as 0.89999998, so the running mean's update is 2.4e-7 off. Epsilon's error is
  about 1e-14 / var in a normalisation, nothing over a large batch; but over two samples (a
  full-size check at batch 2, whose embedding BatchNorm sees one value per sample) the output
  is +-1 whatever the input and its gradient is proportional to epsilon itself, so every
  gradient below it moves with epsilon's error (seen: 1e-8 after one step of IResNet-100).
  Stand-in: :class:`ExactBatchNorm`, which moves the running statistics as the kernel does.
- ``pool2d``'s backward (``AdaptiveAvgPool2D(1)``) scales the gradient by 1 / (h * w) in
  float32: 1/49 is 2.0e-8 off, and with it every gradient below ResNet's global pool.
  Stand-in: ``paddle.mean`` over the map (:func:`use_exact_kernels`).

Each stand-in follows the Paddle kernel's rule, not torch's, and ``tests/test_paddle_stand_ins
.py`` shows it: in float32, on random inputs, it computes what the native kernel computes
(outputs, every gradient and the state it moves) to float32 rounding, and in float64 it is
exact where the native kernel is off by its 32-bit number. Where Paddle's rule is not torch's
(``batch_norm`` moves its running variance with the biased batch variance, torch with the
unbiased one), the alignment run keeps Paddle's rule and the backend declares the difference
(``Capabilities.rule_differences`` in ``backend.py``). A throughput run, and a float32
alignment run, use none of this.

In ``static`` mode (``step.py``) the backbone's stand-ins run inside its static program, where
two more things would cost float64 its exactness or its gradient (seen with Paddle 3.3.1): a
Python float operand of an arithmetic operation becomes a 32-bit attribute (``x * 0.9`` is a
``scale`` operation off by 2.9e-8), so the stand-ins hold every constant as a tensor of the
run's dtype (:func:`_held`); and dy2static cannot derive the backward of a PyLayer whose forward
writes to a parameter, so the running statistics move beside :class:`ExactBatchNorm`, not in
it. Both modes run the same stand-ins (three steps of each tiny backbone in float64 gave
the same numbers in both, to the last bit).
"""

from __future__ import annotations

import math
import types
from typing import Any

import paddle
import paddle.nn as nn
from paddle.autograd import PyLayer

from ..workerkit import StepState
from . import models


def _channel_axes(x: paddle.Tensor) -> tuple[list[int], list[int]]:
    """The axes a BatchNorm reduces over (every one but the channels'), and the shape that
    broadcasts a per-channel vector against ``x``."""
    return [0, *range(2, x.ndim)], [1, -1] + [1] * (x.ndim - 2)


# ------------------------------------------------------------------------------- optimizer

class ExactMomentum:
    """Paddle's ``momentum`` op as ``paddle.optimizer.Momentum(weight_decay=...)`` runs it (the
    L2 decay inside the op), written with Paddle's operations one parameter at a time, with
    ``mu`` and the decay coefficient held as Python floats: ``v = mu * v + (g + coeff * w)``
    with ``v`` starting at zero, then ``w -= lr * v``. Used by a float64 run instead of the
    optimizer (module doc); it answers the calls ``TrainStep`` makes of it."""

    def __init__(self, params: list[paddle.Tensor], lr: float, momentum: float,
                 weight_decay: float) -> None:
        self.params = params
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self._lr = float(lr)
        self.velocity = [paddle.zeros_like(p) for p in params]
        """Each parameter's velocity, as Paddle's optimizer keeps it."""

    def set_lr(self, lr: float) -> None:
        self._lr = float(lr)

    def get_lr(self) -> float:
        return self._lr

    @paddle.no_grad()
    def step(self) -> None:
        for p, v in zip(self.params, self.velocity):
            d = p.grad + self.weight_decay * p if self.weight_decay else p.grad
            v.scale_(self.momentum).add_(d)
            p.subtract_(self._lr * v)

    def clear_grad(self, set_to_zero: bool = True) -> None:
        for p in self.params:
            p.clear_gradient(set_to_zero)


# ------------------------------------------------------------------------------- BatchNorm

def _held(value: float, like: paddle.Tensor) -> paddle.Tensor:
    """``value`` as a 0-d tensor of ``like``'s dtype, for a constant of a stand-in's rule: in a
    static program (``static`` mode) a Python float operand becomes a 32-bit attribute of a
    ``scale`` operation (``x * 0.9`` is off by 2.9e-8 in float64, seen with Paddle 3.3.1), the
    kernels' own fault again; a tensor operand stays exact in both modes."""
    return paddle.full([], value, dtype=like.dtype)


def _batch_statistics(x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """Per channel: the batch mean, ``x`` centred on it, and the *biased* variance."""
    axes, shape = _channel_axes(x)
    mean = paddle.mean(x, axis=axes)
    centred = x - mean.reshape(shape)
    return mean, centred, paddle.mean(centred * centred, axis=axes)


class ExactBatchNorm(PyLayer):
    """Paddle's training-mode ``batch_norm`` kernel with the layer's epsilon held as a Python
    float. Per channel, over the ``n`` values of a batch: ``mean``, the *biased* variance ``var
    = sum((x - mean)^2) / n`` and ``invstd = sqrt(1 / (var + eps))``; ``y = x * (invstd * w) +
    (b - mean * invstd * w)``. Backward: ``dx = (dy - sum(dy) / n - (x - mean) * dot * invstd^2
    / n) * invstd * w``, ``dw = dot * invstd``, ``db = sum(dy)`` with ``dot = sum((x - mean) *
    dy)``. The kernel's move of the running statistics is :func:`_move_running_statistics`,
    outside: inside a static program (``static`` mode) dy2static cannot derive the backward of
    a PyLayer whose forward writes to a parameter (seen with Paddle 3.3.1)."""

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, weight: paddle.Tensor, bias: paddle.Tensor,
                layer: nn.Layer) -> paddle.Tensor:
        _, shape = _channel_axes(x)
        mean, centred, var = _batch_statistics(x)
        invstd = paddle.sqrt(1.0 / (var + _held(layer._epsilon, var)))
        alpha = invstd * weight
        ctx.save_for_backward(centred, invstd, weight)
        return x * alpha.reshape(shape) + (bias - mean * alpha).reshape(shape)

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> tuple[paddle.Tensor, ...]:
        centred, invstd, weight = ctx.saved_tensor()
        axes, shape = _channel_axes(dy)
        n = _held(math.prod(int(d) for d in dy.shape) // int(dy.shape[1]), dy)
        total = paddle.sum(dy, axis=axes)
        dot = paddle.sum(centred * dy, axis=axes)
        k = dot * invstd * invstd / n
        dx = (dy - (total / n).reshape(shape) - centred * k.reshape(shape)) \
            * (invstd * weight).reshape(shape)
        return dx, dot * invstd, total


@paddle.no_grad()
def _move_running_statistics(layer: nn.Layer, x: paddle.Tensor) -> None:
    """The running statistics' move that Paddle's kernel makes in its forward, in place, with
    the layer's momentum ``m`` held as a Python float: ``r = r * m + s * (1 - m)``, ``s`` the
    batch mean or its biased variance. Safe here: no graph holds the running tensors under
    :class:`ExactBatchNorm`."""
    mean, _, var = _batch_statistics(x)
    m, rest = _held(layer._momentum, x), _held(1.0 - float(layer._momentum), x)
    paddle.assign(layer._mean * m + mean * rest, output=layer._mean)
    paddle.assign(layer._variance * m + var * rest, output=layer._variance)


def use_exact_kernels(net: nn.Layer) -> None:
    """A float64 run's layers (module doc): every BatchNorm normalises with
    :class:`ExactBatchNorm` in training mode (in evaluation mode it stays Paddle's), and a
    global average pool is a ``paddle.mean`` over the map."""
    # Bound methods, not partials: dy2static (``static`` mode) transcribes a layer's forward
    # only where it is a function or a method.
    for layer in net.sublayers(include_self=True):
        if isinstance(layer, (nn.BatchNorm1D, nn.BatchNorm2D)):
            layer.forward = types.MethodType(_exact_batch_norm_forward, layer)
        elif isinstance(layer, nn.AdaptiveAvgPool2D) and _is_global(layer._output_size):
            layer.forward = _exact_global_pool


def _is_global(output_size: Any) -> bool:
    sizes = (output_size,) * 2 if isinstance(output_size, int) else tuple(output_size)
    return sizes == (1, 1)


def _exact_global_pool(x: paddle.Tensor) -> paddle.Tensor:
    return paddle.mean(x, axis=[2, 3], keepdim=True)


def _exact_batch_norm_forward(layer: nn.Layer, x: paddle.Tensor) -> paddle.Tensor:
    if not layer.training:
        return type(layer).forward(layer, x)
    _move_running_statistics(layer, x)
    return ExactBatchNorm.apply(x, layer.weight, layer.bias, layer)


# ------------------------------------------------------------------------------------ dump

def step_state(step: Any) -> StepState:
    """A ``step.TrainStep``'s state after its last update, as the dump holds it: the
    backbone's parameters and BatchNorm statistics by torch name and in torch's layouts, this
    rank's rows of the class matrix, the last gradient norm before clipping and the optimizer's
    rate (each read from the device here)."""
    arrays = {f"backbone/{k}": v for k, v in models.torch_state(step.net).items()}
    if step.head is not None:
        arrays["head/weight"] = step.head.weight.numpy().copy()
    norm = step.last_grad_norm
    return StepState(arrays, None if norm is None else float(norm), step.lr)
