"""The margin-softmax head of face workloads, equal to torch's ``MarginSoftmaxHead`` (dp, mp, pfc).

- ``dp``: every rank holds the whole class matrix; its gradient is averaged with the backbone's
  (``step.py``).
- ``mp``: rank r holds the balanced shard ``shard_of(C, r, W)`` of the classes (the first
  ``C % W`` ranks one more). Embeddings and labels are gathered from every rank (in one
  all-gather, the labels as two exact parts beside the embedding), each rank
  computes the logits of its shard for the whole gathered batch, and the softmax runs across
  shards: the row max, the row sum of exponentials and the target logit are combined over ranks.
  The loss is the mean over the gathered batch, the same on every rank.
- ``pfc``: ``mp`` where each rank computes only on the classes it sampled this step
  (:func:`sample_classes`), as insightface's MXNet Partial FC (``recognition/partial_fc/mxnet``)
  keeps a memory bank of its shard and its momentum and trains the sampled rows: every positive
  class of the gathered batch that lives in the shard, topped up with uniformly drawn negatives
  to ``max(1, int(sample_ratio * shard))`` columns. The loss is the softmax over the sampled
  classes of all shards; at ratio 1.0 nothing is sampled and it is exactly ``mp``. The
  ``sparse`` update (default, insightface's memory bank) gathers the sampled rows of the weight
  and of its momentum, updates them (weight decay on those rows only) and writes both back; the
  other rows and their momentum are untouched (``step.py``). ``dense`` is arcface_torch's update:
  a whole-matrix gradient, zero off the sample, and momentum and weight decay on every row.
  Two choices differ from insightface's MXNet code on purpose: the sample is drawn on the device
  (insightface reads the gathered labels back to the host and draws with numpy every step), and
  when the positives alone outnumber the sample all of them are kept, as torch's head does
  (insightface keeps the first ``num_sample`` and leaves the other samples of the shard without
  their target class in the softmax).

The forward and the backward are written out by hand with NDArray operations, as derived in
``docs/margin_softmax_backward.md``, but for the class matrix's normalisation: MXNet's fused
``L2Normalization`` (``mode="instance"``, ``eps`` = 1e-24 under the square root, the same
numbers as dividing by ``max(norm, 1e-12)`` for any row not near zero), recorded by autograd,
whose backward turns d loss / d w_hat into the weight's gradient. Written out, that radial
correction took MXNet's generic broadcast kernels over [C, D] several times: 602 ms of a step
against 316 ms fused (85,742 x 512, batch 8, 2 CPU threads), and it held trainperf's face step
at 0.92 of gluon's own. The embedding gradient is injected into the backbone's graph with
``emb.backward(out_grad)``.

For ``mp`` and ``pfc`` each rank holds a partial gradient of the one global loss for every
gathered row, so a rank's embedding gradient is the sum over ranks of the gathered gradients of
its own rows (an all-reduce of the [N, D] gradient, then this rank's slice), while the shard's
class-matrix gradient stays local.

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
second), plus two [C, D] arrays: the normalised matrix, kept for the backward, and d loss /
d w_hat; C is the shard, or in a sampling ``pfc`` the sample S, whose rows [S, D] are gathered
once per step and whose gradient is [S, D] (sparse) or scattered into the shard's [C, D]
(dense).

Sampling reads one number back to the host, and only when the gathered batch has more samples
than a shard samples columns: the count of positives, which may then exceed the sample (torch's
head does the same). Nothing else in a step is read back.
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
FC_MODES = ("dp", "mp", "pfc")
PFC_UPDATES = ("sparse", "dense")
POSITIVE_SCORE = 2.0
"""Positives outrank every uniform [0, 1) score of a negative, so top-k keeps them all."""
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


def sample_classes(cols: mx.nd.NDArray, has: mx.nd.NDArray, num_local: int, num_sample: int,
                   scores: mx.nd.NDArray | None = None
                   ) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    """Pick ``num_sample`` class columns of a shard, every positive among them.

    ``cols`` [M] (float32) is each gathered sample's column in this shard, ``has`` [M] (any
    float dtype) 1 where the sample's class is in this shard and 0 elsewhere (``cols`` is then
    ignored). ``scores`` [num_local] in [0, 1) rank the negatives (default: drawn uniformly on
    ``cols``' context; tests pass their own). Returns the sorted column index [S] and every
    sample's column in it, both float32 (exact: the shard is below ``MAX_INDEX``); a sample
    of another shard gets column 0, to be masked by ``has`` as before. S is ``num_sample``
    unless the positives alone are more; only then, and only when M > ``num_sample`` makes it
    possible, does counting them read back to the host.
    """
    ctx = cols.context
    m = cols.shape[0]
    if scores is None:
        scores = mx.nd.random.uniform(0.0, 1.0, shape=(num_local,), ctx=ctx, dtype="float32")
    # One spare slot takes the samples of other shards, so no boolean mask is needed.
    score = mx.nd.concat(scores.astype("float32", copy=False),
                         mx.nd.zeros((1,), ctx=ctx, dtype="float32"), dim=0)
    inside = has.astype("float32", copy=False)
    slot = cols * inside + num_local * (1.0 - inside)
    mx.nd._internal._scatter_set_nd(score, mx.nd.full((m,), POSITIVE_SCORE, ctx=ctx),
                                    slot.reshape((1, -1)), shape=score.shape, out=score)
    score = mx.nd.slice_axis(score, axis=0, begin=0, end=num_local)
    count = num_sample
    if m > num_sample:
        # Deliberate sync: the positives might not fit in the sample.
        count = max(num_sample, int(mx.nd.sum(score == POSITIVE_SCORE).asscalar()))
    index = mx.nd.sort(mx.nd.topk(score, k=count, ret_typ="indices", dtype="float32"))
    # Each sampled column's position in the sample, read at every sample's column.
    position = mx.nd.scatter_nd(mx.nd.arange(count, ctx=ctx, dtype="float32"),
                                index.reshape((1, -1)), shape=(num_local,))
    return index, mx.nd.take(position, cols) * inside


def put_rows(target: mx.nd.NDArray, rows: mx.nd.NDArray, index: mx.nd.NDArray) -> None:
    """``target[index] = rows`` in place: ``rows`` [S, ...] into the distinct rows ``index``
    [S] (float32) of ``target``."""
    mx.nd._internal._scatter_set_nd(target, rows, index.reshape((1, -1)), shape=target.shape,
                                    out=target)


class MarginSoftmaxHead:
    """The class matrix (this rank's shard of it) on one context, and its hand-written forward
    and backward. ``weight`` is a plain NDArray [count, D] in ``dtype`` that the step updates;
    ``grad`` the last backward's gradient of it: [count, D], or in a sparse ``pfc`` step the
    sampled rows' [S, D] (None before the first)."""

    def __init__(self, num_classes: int, embedding_size: int,
                 margins: tuple[float, float, float], scale: float, comm: Comm,
                 ctx: mx.Context, mode: str = "dp", rank: int | None = None,
                 seed: int = 0, mm_dtype: str | None = None, dtype: str = "float32",
                 straight_through: bool = False, sample_ratio: float = 1.0,
                 update: str = "sparse") -> None:
        check_fc(mode)
        if mode != "dp" and comm.mode == "device":
            raise ValueError(f"kvstore device runs data parallel only (--fc dp); use horovod "
                             f"(the default) for --fc {mode}")
        if update not in PFC_UPDATES:
            raise ValueError(f"pfc update must be one of {PFC_UPDATES}, got {update!r}")
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
        self.mode = mode
        self.comm = comm
        self.ctx = ctx
        self.margins = tuple(float(m) for m in margins)
        self.scale = float(scale)
        self.sharded = mode != "dp"
        self.rank = comm.rank if rank is None else rank
        self.start, self.count = (shard_of(num_classes, self.rank, comm.world_size)
                                  if self.sharded else (0, num_classes))
        if self.count > MAX_INDEX:
            raise ValueError(f"a class shard of {self.count} rows is past what MXNet's float32 "
                             f"indices address exactly ({MAX_INDEX}); use more ranks with --fc "
                             f"{'mp' if mode == 'dp' else mode}")
        self.sampling = mode == "pfc" and sample_ratio < 1.0
        self.num_sample = max(1, int(sample_ratio * self.count))
        """Columns a sampling ``pfc`` shard keeps per step (more when the positives are more)."""
        self.sparse = self.sampling and update == "sparse"
        self.dtype = dtype
        """What the class matrix, its gradient and all of the head's arithmetic are in."""
        self.mm_dtype = mm_dtype or dtype
        """``float16`` runs the three class-matrix products in half precision (AMP)."""
        self.linalg_products = dtype == self.mm_dtype == "float32" and ctx.device_type == "gpu"
        """Run the class-matrix products as ``linalg.gemm2``: MXNet 1.9.1's ``dot`` leaves
        cuBLAS in its default math (full fp32), its linalg GEMM runs TF32 where the device has
        it, as ``Dense`` does (``Tuning.tf32``'s rule). The same products either way."""
        self.straight_through = straight_through
        """Give the margin the derivative 1 (an alignment run's negative control only)."""
        # Throughput runs: N(0, 0.01), as torch's head; dp ranks draw the same matrix (torch's
        # DDP broadcasts rank 0's), mp ranks each their own shard. ``set_weight`` overrides it.
        draw_rank = self.rank if self.sharded else 0
        mx.random.seed(seed * 1000 + 7919 * (draw_rank + 1), ctx=ctx)
        self.weight = mx.nd.random.normal(0.0, 0.01, shape=(self.count, embedding_size),
                                          ctx=ctx, dtype=dtype)
        # A sparse head's gradient is the sample's rows, made by each backward: no [count, D]
        # array that a step would never use (it sets what ``search max-classes`` finds).
        self.grad: mx.nd.NDArray | None = None
        if not self.sampling:
            # The backward of the weight's normalisation writes here (forward_backward).
            self.weight.attach_grad()
            self.grad = self.weight.grad
        elif not self.sparse:
            self.grad = mx.nd.zeros((self.count, embedding_size), ctx=ctx, dtype=dtype)
        self._rows: dict[int, mx.nd.NDArray] = {}
        self.logits: mx.nd.NDArray | None = None
        self.index: mx.nd.NDArray | None = None
        """Shard columns sampled by the last forward, sorted, as float32 (sampling ``pfc``)."""
        self.rows: mx.nd.NDArray | None = None
        """The sampled rows of ``weight`` the last forward used [S, D] (sparse ``pfc``): the
        step updates them in place and writes them back."""

    @property
    def update(self) -> str:
        """Which class-matrix update runs: ``full`` (no sampling), ``sparse`` or ``dense``."""
        if not self.sampling:
            return "full"
        return "sparse" if self.sparse else "dense"

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
        if self.linalg_products:
            return mx.nd.linalg.gemm2(a, b, **kwargs)
        if self.mm_dtype == self.dtype:
            return mx.nd.dot(a, b, **kwargs)
        return mx.nd.dot(a.astype(self.mm_dtype), b.astype(self.mm_dtype),
                         **kwargs).astype(self.dtype)

    def forward_backward(self, emb: mx.nd.NDArray, labels: mx.nd.NDArray,
                         grad_scale: float = 1.0, keep_logits: bool = False,
                         scores: mx.nd.NDArray | None = None
                         ) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
        """Loss of the batch and d(loss * grad_scale)/d emb.

        ``emb`` [n, D] is this rank's embeddings (any float dtype), ``labels`` [n] its global
        class ids as float64. Writes d(loss * grad_scale)/d weight into ``self.grad``.
        Returns (loss [1] in the head's dtype, gradient of ``emb`` in ``emb``'s dtype).
        Nothing is read back to the host but a sampling head's count of positives (module
        doc); in ``mp`` and ``pfc`` it talks to the other ranks through ``comm``. With
        ``keep_logits`` (tests) a copy of this shard's scaled logits [N, C] ([N, S] when
        sampling) is kept in ``self.logits``; ``scores`` (tests) [count] ranks the negatives
        of a sampling ``pfc`` instead of a uniform draw.
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
        w = self.weight
        if self.sampling:
            self.index, cols = sample_classes(cols, has, self.count, self.num_sample, scores)
            w = mx.nd.take(self.weight, self.index)
            w.attach_grad()
            if self.sparse:
                self.rows = w
        index = mx.nd.stack(self._arange(n), cols)

        norm = mx.nd.sqrt(mx.nd.sum(mx.nd.square(e), axis=1))
        e_hat = mx.nd.broadcast_div(e, mx.nd.maximum(norm, NORM_EPS).reshape((-1, 1)))
        # MXNet's fused op, forward and backward, for the [C, D] class matrix (module doc).
        with mx.autograd.record():
            w_hat = mx.nd.L2Normalization(w, mode="instance", eps=NORM_EPS ** 2)

        z = self._mm(e_hat, w_hat, transpose_b=True)                  # [n, C]: cos
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
        # d loss / d cos, times the loss scale.
        p *= s * grad_scale / n
        grad_e_hat = self._mm(p, w_hat)                               # [n, D]
        m = self._mm(p, e_hat, transpose_a=True)                      # [C, D]: d / d w_hat
        del p
        w_hat.backward(m)                                             # into w.grad
        if self.sampling:
            if self.sparse:
                self.grad = w.grad
            else:
                # arcface_torch's dense update: the whole-matrix gradient is zero off the sample.
                self.grad[:] = 0
                put_rows(self.grad, w.grad, self.index)

        radial = mx.nd.sum(grad_e_hat * e_hat, axis=1) * (norm > NORM_EPS)
        grad_e = mx.nd.broadcast_div(
            grad_e_hat - mx.nd.broadcast_mul(e_hat, radial.reshape((-1, 1))),
            mx.nd.maximum(norm, NORM_EPS).reshape((-1, 1)))
        if self.sharded:
            grad_e = comm.allreduce_sum_("head/grad_embeddings", grad_e)
            grad_e = grad_e[self.rank * local_rows:(self.rank + 1) * local_rows]
        return loss, grad_e.astype(emb.dtype, copy=False)
