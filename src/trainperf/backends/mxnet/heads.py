"""The margin-softmax head of face workloads, equal to torch's ``MarginSoftmaxHead`` (dp, mp).

- ``dp``: every rank holds the whole class matrix; its gradient is averaged with the backbone's
  (``step.py``).
- ``mp``: rank r holds the balanced shard ``shard_of(C, r, W)`` of the classes (the first
  ``C % W`` ranks one more). Embeddings and labels are gathered from every rank (in one
  all-gather, the labels as two exact parts beside the embedding), each rank
  computes the logits of its shard for the whole gathered batch, and the softmax runs across
  shards: the row max, the row sum of exponentials and the target logit are combined over ranks.
  The loss is the mean over the gathered batch, the same on every rank.
- ``pfc`` is not implemented here (``check_fc``).

The forward and the backward are written out by hand with NDArray operations (no autograd
inside the head), as derived in ``docs/margin_softmax_backward.md``; the embedding gradient is
injected into the backbone's graph with ``emb.backward(out_grad)``.

For ``mp`` each rank holds a partial gradient of the one global loss for every gathered row, so
a rank's embedding gradient is the sum over ranks of the gathered gradients of its own rows
(an all-reduce of the [N, D] gradient, then this rank's slice), while the shard's class-matrix
gradient stays local.

The margin is the combined cos(m1 * theta + m2) - m3 of torch's ``margin.py``: the cosine is
clamped to [-1 + 1e-6, 1 - 1e-6] before arccos (the clamp passes no gradient outside, as torch's
clamp backward), and past theta_max = (pi - m2) / m1 the logit continues as
cos(theta) - m3 - (1 + cos(theta_max)). CosFace and plain softmax (m1 = 1, m2 = 0) are c - m3.
An alignment control (``AlignSpec.breaks`` ``margin_straight_through``) keeps that forward but
gives the margin the derivative 1 (``straight_through``), as insightface's arcface_torch does.

Precision: the head holds its class matrix and computes everything (cosines, margin, softmax,
loss, both gradients) in ``dtype``: float32, or float64 in a strict alignment run. In fp16 only
its three class-matrix products run in half precision (``mm_dtype``). Every scalar it uses
reaches MXNet as a C double (its ``*_scalar`` operators), except ``clip``'s bounds, which MXNet
holds as C floats: float64 clamps with ``maximum``/``minimum`` instead (:func:`_clamp`).

Memory: two [N, C] arrays at most (the logits and their exponentials; the gradient reuses the
second), plus one [C, D] temporary for the weight gradient's radial correction, which MXNet has no
fused in-place multiply-add for.
"""

from __future__ import annotations

import math

import mxnet as mx
import numpy as np

from ..base import require
from ..layouts import shard_of
from .backend import BACKEND
from .comm import Comm

COS_EPS = 1e-6
NORM_EPS = 1e-12
FC_MODES = ("dp", "mp")
MAX_INDEX = 2 ** 24
"""MXNet's pick and scatter take float32 indices: exact below 2**24 columns per shard."""
LABEL_BASE = 4096.0
"""Labels travel in the (float32) embedding gather as label // 4096 and label % 4096: exact for
class ids below 2**36."""


def check_fc(mode: str) -> None:
    """ValueError unless the backend's declaration runs head mode ``mode``."""
    require(BACKEND.head_refusal(mode))


def _clamp(x: mx.nd.NDArray, low: float, high: float) -> mx.nd.NDArray:
    """``x`` limited to [low, high]. ``clip`` takes its bounds as C floats, which is exact for
    float32 data (the kernel rounds them to float32 anyway) but would move float64's bounds by
    up to 1e-8; ``maximum`` and ``minimum`` take a C double (the same values as ``clip`` in
    float32, bit for bit: ``tests/test_mxnet_standins.py``)."""
    if x.dtype == np.float32:
        return mx.nd.clip(x, low, high)
    return mx.nd.minimum(mx.nd.maximum(x, low), high)


def margin_target_logit(c: mx.nd.NDArray, m1: float, m2: float, m3: float,
                        straight_through: bool = False
                        ) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    """Unscaled target logit of target cosines ``c`` (float32 or float64, computed in their
    dtype) and its derivative d/dc; ``straight_through`` (an alignment control only): the
    same logit with the derivative 1 everywhere."""
    if m1 == 1.0 and m2 == 0.0:
        return c - m3, mx.nd.ones_like(c)
    cc = _clamp(c, -1.0 + COS_EPS, 1.0 - COS_EPS)
    theta = mx.nd.arccos(cc)
    theta_max = (math.pi - m2) / m1
    angle = m1 * theta + m2
    with_margin = mx.nd.cos(angle) - m3
    # d/dc cos(m1 * acos(cc) + m2) = m1 * sin(angle) / sqrt(1 - cc^2); zero where clamped.
    inside_clamp = cc == c
    d_margin = (m1 * mx.nd.sin(angle) / mx.nd.sqrt(1.0 - cc * cc)) * inside_clamp
    beyond = c - m3 - (1.0 + math.cos(theta_max))
    inside = theta <= theta_max
    value = mx.nd.where(inside, with_margin, beyond)
    if straight_through:
        return value, mx.nd.ones_like(c)
    return value, mx.nd.where(inside, d_margin, mx.nd.ones_like(c))


def _rowdot(a: mx.nd.NDArray, b: mx.nd.NDArray) -> mx.nd.NDArray:
    """Per-row dot products of two [R, D] arrays, without an [R, D] temporary."""
    rows, width = a.shape
    return mx.nd.batch_dot(a.reshape((rows, 1, width)), b.reshape((rows, width, 1))
                           ).reshape((rows,))


class MarginSoftmaxHead:
    """The class matrix (this rank's shard of it) on one context, and its hand-written forward
    and backward. ``weight`` and ``grad`` are plain NDArrays [count, D] in ``dtype`` that the
    step updates."""

    def __init__(self, num_classes: int, embedding_size: int,
                 margins: tuple[float, float, float], scale: float, comm: Comm,
                 ctx: mx.Context, mode: str = "dp", rank: int | None = None,
                 seed: int = 0, mm_dtype: str | None = None, dtype: str = "float32",
                 straight_through: bool = False) -> None:
        check_fc(mode)
        if mode == "mp" and comm.mode == "device":
            raise ValueError("kvstore device runs data parallel only: --fc dp")
        self.mode = mode
        self.comm = comm
        self.ctx = ctx
        self.margins = tuple(float(m) for m in margins)
        self.scale = float(scale)
        self.sharded = mode == "mp"
        self.rank = comm.rank if rank is None else rank
        self.start, self.count = (shard_of(num_classes, self.rank, comm.world_size)
                                  if self.sharded else (0, num_classes))
        if self.count > MAX_INDEX:
            raise ValueError(f"a class shard of {self.count} rows is past what MXNet's float32 "
                             f"indices address exactly ({MAX_INDEX}); use more ranks with --fc mp")
        self.dtype = dtype
        """What the class matrix, its gradient and all of the head's arithmetic are in."""
        self.mm_dtype = mm_dtype or dtype
        """``float16`` runs the three class-matrix products in half precision (AMP)."""
        self.straight_through = straight_through
        """Give the margin the derivative 1 (an alignment run's negative control only)."""
        # Throughput runs: N(0, 0.01), as torch's head; dp ranks draw the same matrix (torch's
        # DDP broadcasts rank 0's), mp ranks each their own shard. ``set_weight`` overrides it.
        draw_rank = self.rank if self.sharded else 0
        mx.random.seed(seed * 1000 + 7919 * (draw_rank + 1), ctx=ctx)
        self.weight = mx.nd.random.normal(0.0, 0.01, shape=(self.count, embedding_size),
                                          ctx=ctx, dtype=dtype)
        self.grad = mx.nd.zeros((self.count, embedding_size), ctx=ctx, dtype=dtype)
        self._rows: dict[int, mx.nd.NDArray] = {}
        self.logits: mx.nd.NDArray | None = None

    def set_weight(self, full_matrix) -> None:
        """Load this head's rows from the whole class matrix [C, D] (a numpy array)."""
        rows = full_matrix[self.start:self.start + self.count]
        if tuple(rows.shape) != tuple(self.weight.shape):
            raise ValueError(f"head weight rows {tuple(rows.shape)} do not fit the head's "
                             f"{tuple(self.weight.shape)}")
        self.weight[:] = mx.nd.array(rows, ctx=self.ctx, dtype=self.dtype)

    def _arange(self, n: int) -> mx.nd.NDArray:
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = mx.nd.arange(n, ctx=self.ctx, dtype="float32")
        return rows

    def _mm(self, a: mx.nd.NDArray, b: mx.nd.NDArray, **kwargs) -> mx.nd.NDArray:
        if self.mm_dtype == self.dtype:
            return mx.nd.dot(a, b, **kwargs)
        return mx.nd.dot(a.astype(self.mm_dtype), b.astype(self.mm_dtype),
                         **kwargs).astype(self.dtype)

    def forward_backward(self, emb: mx.nd.NDArray, labels: mx.nd.NDArray,
                         grad_scale: float = 1.0, keep_logits: bool = False
                         ) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
        """Loss of the batch and d(loss * grad_scale)/d emb.

        ``emb`` [n, D] is this rank's embeddings (any float dtype), ``labels`` [n] its global
        class ids as float64. Writes d(loss * grad_scale)/d weight into ``self.grad``.
        Returns (loss [1] in the head's dtype, gradient of ``emb`` in ``emb``'s dtype).
        Nothing is read back to the host; in ``mp`` it talks to the other ranks through
        ``comm``. With ``keep_logits`` (tests) a copy of this shard's scaled logits [N, C] is
        kept in ``self.logits``.
        """
        comm = self.comm
        m1, m2, m3 = self.margins
        s = self.scale
        e = emb.astype(self.dtype, copy=False)
        local_rows, width = e.shape
        if self.sharded:
            # One gather of embeddings and labels together. The labels alone would not depend
            # on the last update, so their push could reach the server a round early (see
            # comm.py); float32 carries a label exactly as two parts below 2**24 (float64 as
            # well: one packing for both).
            hi = mx.nd.floor(labels / LABEL_BASE)
            lo = labels - hi * LABEL_BASE
            packed = mx.nd.concat(e, hi.astype(self.dtype).reshape((-1, 1)),
                                  lo.astype(self.dtype).reshape((-1, 1)), dim=1)
            packed = comm.all_gather("head/embeddings_labels", packed)
            e = mx.nd.slice_axis(packed, axis=1, begin=0, end=width)
            parts = mx.nd.slice_axis(packed, axis=1, begin=width, end=width + 2
                                     ).astype("float64")
            labels = parts[:, 0] * LABEL_BASE + parts[:, 1]
        n = e.shape[0]

        # Each sample's column in this shard; samples of other shards point at column 0 and
        # are masked by ``has`` (their column-0 entry is written back unchanged).
        local = labels - self.start
        has64 = (local >= 0) * (local < self.count)
        has = has64.astype(self.dtype)  # MXNet's arithmetic takes no mixed dtypes
        cols = (local * has64).astype("float32")
        index = mx.nd.stack(self._arange(n), cols)

        norm = mx.nd.sqrt(mx.nd.sum(mx.nd.square(e), axis=1))
        e_hat = mx.nd.broadcast_div(e, mx.nd.maximum(norm, NORM_EPS).reshape((-1, 1)))
        w = self.weight
        inv = 1.0 / mx.nd.maximum(mx.nd.sqrt(mx.nd.sum(mx.nd.square(w), axis=1)), NORM_EPS)

        z = self._mm(e_hat, w, transpose_b=True)                      # [n, C]
        z *= inv.reshape((1, -1))                                     # cos
        target = mx.nd.pick(z, cols, axis=1)
        value, d_value = margin_target_logit(target, m1, m2, m3, self.straight_through)
        value = mx.nd.where(has, value, target)
        d_value = mx.nd.where(has, d_value, mx.nd.ones_like(d_value))
        z *= s
        mx.nd._internal._scatter_set_nd(z, value * s, index, shape=z.shape, out=z)
        if keep_logits:
            self.logits = z.copy()

        row_max = comm.allreduce_max("head/row_max", mx.nd.max(z, axis=1)) \
            if self.sharded else mx.nd.max(z, axis=1)
        target_logit = mx.nd.pick(z, cols, axis=1) * has
        p = mx.nd.broadcast_sub(z, row_max.reshape((-1, 1)))
        del z
        mx.nd.exp(p, out=p)
        row_sum = mx.nd.sum(p, axis=1)
        if self.sharded:
            row_sum = comm.allreduce_sum_("head/row_sum", row_sum)
            target_logit = comm.allreduce_sum_("head/target_logit", target_logit)
        loss = mx.nd.mean(mx.nd.log(row_sum) + row_max - target_logit)

        # d loss / d z = (softmax - onehot) / n; the target entry through the margin.
        p = mx.nd.broadcast_div(p, row_sum.reshape((-1, 1)), out=p)
        p_target = mx.nd.pick(p, cols, axis=1)
        mx.nd._internal._scatter_set_nd(p, (p_target - has) * d_value, index, shape=p.shape,
                                        out=p)
        # G = d loss / d cos * inv, times the loss scale: one pass over [n, C].
        p *= (inv * (s * grad_scale / n)).reshape((1, -1))
        grad_e_hat = self._mm(p, w)                                   # [n, D]
        m = self._mm(p, e_hat, transpose_a=True)                      # [C, D]
        del p
        coef = _rowdot(m, w) * mx.nd.square(inv)
        mx.nd.elemwise_sub(m, mx.nd.broadcast_mul(w, coef.reshape((-1, 1))), out=self.grad)

        radial = mx.nd.sum(grad_e_hat * e_hat, axis=1) * (norm > NORM_EPS)
        grad_e = mx.nd.broadcast_div(
            grad_e_hat - mx.nd.broadcast_mul(e_hat, radial.reshape((-1, 1))),
            mx.nd.maximum(norm, NORM_EPS).reshape((-1, 1)))
        if self.sharded:
            grad_e = comm.allreduce_sum_("head/grad_embeddings", grad_e)
            grad_e = grad_e[self.rank * local_rows:(self.rank + 1) * local_rows]
        return loss, grad_e.astype(emb.dtype, copy=False)
