"""The margin-softmax head of face workloads in Paddle, equal to torch's ``MarginSoftmaxHead``.

- ``dp``: every rank holds the whole class matrix; its gradient is averaged over ranks with the
  backbone's (``step.py``).
- ``mp``: rank r holds the balanced shard ``shard_of(C, r, W)`` of the classes (the first
  ``C % W`` ranks one more). Embeddings and labels are gathered from every rank, each rank
  computes the logits of its shard for the whole gathered batch, and the softmax runs across
  shards: the row max, the row sum of exponentials and the target logit are combined over ranks.
  The loss is the mean over the gathered batch, the same on every rank.
- ``pfc``: ``mp`` where each rank computes only on the classes it sampled this step
  (:func:`sample_classes`): every positive class of the gathered batch that lives in its shard,
  topped up with uniformly drawn negatives to ``max(1, int(sample_ratio * shard))`` columns.
  The loss is the softmax over the sampled classes of all shards. At ratio 1.0 nothing is
  sampled and it is exactly ``mp``. The ``sparse`` update (default) touches only the sampled
  rows, with momentum kept per row (PLSC, the Partial FC paper): ``d = g + wd * w; buf = m *
  buf[rows] + d; w[rows] -= lr * buf``, the other rows and their momentum untouched. ``dense``
  reproduces insightface's arcface_torch: a whole-matrix gradient (zero off the sample),
  momentum and weight decay on every row, every step.

The forward and the backward are written out by hand with Paddle operations under
``paddle.no_grad()`` (Paddle's fused ``margin_cross_entropy`` has no CPU kernel, and one code for
both devices is one thing to check), as derived in ``docs/margin_softmax_backward.md``; the
embedding gradient is handed to the backbone's graph with ``paddle.autograd.backward``.

In ``mp``/``pfc`` each rank holds a partial gradient of the one global loss for every gathered
row, so a rank's embedding gradient is the sum over ranks of the gathered gradients of its own
rows (an all-reduce of the [N, D] gradient, then this rank's slice: gloo has no
reduce-scatter), while the shard's class-matrix gradient stays local.

The head computes in its ``dtype``: float32 (throughput runs, with the class-matrix products
in half precision under AMP) or an alignment run's float64, where everything from the gathered
embeddings to the loss stays float64.

The margin is the combined cos(m1 * theta + m2) - m3 of torch's ``margin.py``: the cosine is
clamped to [-1 + 1e-6, 1 - 1e-6] (as numbers of the head's dtype) before arccos, the clamp
passing no gradient outside, bounds included (torch's clamp backward); past theta_max = (pi -
m2) / m1 the logit continues as cos(theta) - m3 - (1 + cos(theta_max)). CosFace and plain
softmax (m1 = 1, m2 = 0) are c - m3. An alignment run's negative control may ask for the
margin's gradient to pass straight through (``straight_through``: derivative 1, the forward
unchanged).

Sampling reads one number back to the host when the gathered batch has more samples than a
shard samples columns: the count of positives, which may then exceed the sample (torch's head
does the same). Nothing else in a step is read back.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import paddle

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


def check_fc(mode: str) -> None:
    """ValueError unless the backend's declaration runs head mode ``mode``."""
    require(BACKEND.head_refusal(mode))


def margin_target_logit(c: paddle.Tensor, m1: float, m2: float, m3: float
                        ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Unscaled target logit of target cosines ``c`` and its derivative d/dc (in ``c``'s
    dtype)."""
    if m1 == 1.0 and m2 == 0.0:
        return c - m3, paddle.ones_like(c)
    cc = paddle.clip(c, -1.0 + COS_EPS, 1.0 - COS_EPS)
    theta = paddle.acos(cc)
    theta_max = (math.pi - m2) / m1
    angle = m1 * theta + m2
    with_margin = paddle.cos(angle) - m3
    # d/dc cos(m1 * acos(cc) + m2) = m1 * sin(angle) / sqrt(1 - cc^2); zero where clamped.
    inside_clamp = (cc == c).astype(c.dtype)
    d_margin = m1 * paddle.sin(angle) / paddle.sqrt(1.0 - cc * cc) * inside_clamp
    beyond = c - m3 - (1.0 + math.cos(theta_max))
    inside = theta <= theta_max
    return (paddle.where(inside, with_margin, beyond),
            paddle.where(inside, d_margin, paddle.ones_like(c)))


def sample_classes(local_labels: paddle.Tensor, num_local: int, num_sample: int,
                   scores: paddle.Tensor | None = None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Pick ``num_sample`` class columns of a shard, every positive among them.

    ``local_labels`` [M] int64 holds each gathered sample's column in this shard, or -1.
    ``scores`` [num_local] in [0, 1) rank the negatives (default: drawn uniformly; tests pass
    their own). Returns the sorted column index [S] (int64) and the labels remapped into it
    (-1 kept). S is ``num_sample`` unless the positives alone are more; only then, and only
    when M > ``num_sample`` makes it possible, does counting them read back to the host.
    """
    m = int(local_labels.shape[0])
    has = local_labels >= 0
    if scores is None:
        scores = paddle.rand([num_local], dtype="float32")
    # One spare slot takes the samples of other shards, so no boolean mask is needed.
    score = paddle.concat([scores.astype("float32"), paddle.zeros([1], dtype="float32")])
    slot = paddle.where(has, local_labels, paddle.full_like(local_labels, num_local))
    score = paddle.scatter(score, slot, paddle.full([m], POSITIVE_SCORE, dtype="float32"),
                           overwrite=True)[:num_local]
    count = num_sample
    if m > num_sample:
        # Deliberate sync: the positives might not fit in the sample.
        count = max(num_sample, int((score == POSITIVE_SCORE).astype("int64").sum()))
    index = paddle.sort(paddle.topk(score, count, sorted=False)[1])
    remapped = paddle.where(has, paddle.searchsorted(index, paddle.clip(local_labels, min=0)),
                            local_labels)
    return index, remapped


def _rowdot(a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
    """Per-row dot products of two [R, D] tensors as one batched [1, D] x [D, 1] product."""
    return paddle.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape([-1])


class MarginSoftmaxHead:
    """The class matrix (this rank's shard of it), its hand-written forward and backward, and
    its SGD update. ``weight`` [count, D] is a plain tensor (no autograd), ``grad`` the last
    backward's gradient: [count, D], or in a sparse ``pfc`` step the sampled rows' [S, D]."""

    def __init__(self, num_classes: int, embedding_size: int,
                 margins: tuple[float, float, float], scale: float, comm: Comm,
                 mode: str = "dp", sample_ratio: float = 1.0, update: str = "sparse",
                 seed: int = 0, mm_dtype: str | None = None, dtype: str = "float32") -> None:
        check_fc(mode)
        if update not in PFC_UPDATES:
            raise ValueError(f"pfc update must be one of {PFC_UPDATES}, got {update!r}")
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
        self.mode = mode
        self.comm = comm
        self.margins = tuple(float(m) for m in margins)
        self.scale = float(scale)
        self.sharded = mode != "dp"
        self.rank = comm.rank
        self.start, self.count = (shard_of(num_classes, comm.rank, comm.world_size)
                                  if self.sharded else (0, num_classes))
        self.sampling = mode == "pfc" and sample_ratio < 1.0
        self.num_sample = max(1, int(sample_ratio * self.count))
        self.sparse = self.sampling and update == "sparse"
        self.dtype = dtype
        """What the class matrix, its momentum and the head's arithmetic are held in: float32,
        or an alignment run's float64."""
        self.mm_dtype = mm_dtype or dtype
        """``float16``/``bfloat16`` runs the three class-matrix products in half precision
        (AMP on a GPU); the margin and the softmax stay in ``dtype``. ``dtype`` itself: no
        cast (the default)."""
        self.straight_through = False
        """A negative control of alignment (``AlignSpec.breaks``): the margin's gradient
        passes to the cosine with derivative 1."""
        # Throughput runs: N(0, 0.01), as torch's head; dp ranks draw the same matrix (torch's
        # DDP broadcasts rank 0's), sharded ranks each their own shard. The draw must not move
        # the global generator the backbone and dropout use, so it gets its own seed and the
        # caller reseeds. ``set_weight`` overrides it.
        draw_rank = comm.rank if self.sharded else 0
        paddle.seed(seed * 1000 + 7919 * (draw_rank + 1))
        self.weight = paddle.normal(0.0, 0.01, [self.count, embedding_size]).astype(dtype)
        self.weight.stop_gradient = True
        self.grad: paddle.Tensor | None = None
        self.momentum: paddle.Tensor | None = None
        """SGD momentum buffer of the whole shard (every mode keeps one per row)."""
        self.index: paddle.Tensor | None = None
        """Shard columns sampled by the last forward (sampling ``pfc`` only)."""
        self.rows: paddle.Tensor | None = None
        """The sampled rows of ``weight`` the last forward used (sparse ``pfc``)."""
        self.logits: paddle.Tensor | None = None

    @property
    def update(self) -> str:
        """Which class-matrix update runs: ``full`` (no sampling), ``sparse`` or ``dense``."""
        if not self.sampling:
            return "full"
        return "sparse" if self.sparse else "dense"

    def set_weight(self, full_matrix: Any) -> None:
        """Load this head's rows from the whole class matrix [C, D] (a numpy array)."""
        rows = np.asarray(full_matrix)[self.start:self.start + self.count]
        if tuple(rows.shape) != tuple(self.weight.shape):
            raise ValueError(f"head weight rows {tuple(rows.shape)} do not fit the head's "
                             f"{tuple(self.weight.shape)}")
        self.weight.set_value(np.ascontiguousarray(rows, dtype=self.dtype))

    def _mm(self, a: paddle.Tensor, b: paddle.Tensor, **kwargs: bool) -> paddle.Tensor:
        if self.mm_dtype == self.dtype:
            return paddle.matmul(a, b, **kwargs)
        return paddle.matmul(a.astype(self.mm_dtype), b.astype(self.mm_dtype),
                             **kwargs).astype(self.dtype)

    @paddle.no_grad()
    def forward_backward(self, emb: paddle.Tensor, labels: paddle.Tensor,
                         grad_scale: float = 1.0, keep_logits: bool = False,
                         scores: paddle.Tensor | None = None
                         ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Loss of the batch and d(loss * grad_scale)/d emb.

        ``emb`` [n, D] is this rank's embeddings (any float dtype), ``labels`` [n] its global
        class ids (int64). Writes d(loss * grad_scale)/d weight into ``self.grad``. Returns
        (loss, a scalar tensor in the head's ``dtype``; gradient of ``emb`` in ``emb``'s dtype).
        In ``mp`` and ``pfc`` it talks to the other ranks through ``comm``. ``keep_logits``
        (tests) keeps a copy of this shard's scaled logits [N, C] in ``self.logits``; ``scores``
        (tests) ranks the negatives of a sampling ``pfc`` instead of a uniform draw.
        """
        comm = self.comm
        m1, m2, m3 = self.margins
        s = self.scale
        e = emb.detach().astype(self.dtype)
        local_rows = int(e.shape[0])
        labels = labels.astype("int64")
        if self.sharded:
            e = comm.all_gather(e)
            labels = comm.all_gather(labels)
        n = int(e.shape[0])

        local = labels - self.start
        inside = paddle.logical_and(local >= 0, local < self.count)
        local = paddle.where(inside, local, paddle.full_like(local, -1))
        w = self.weight
        if self.sampling:
            self.index, local = sample_classes(local, self.count, self.num_sample, scores)
            w = paddle.index_select(self.weight, self.index)
            if self.sparse:
                self.rows = w
        has = (local >= 0).astype(self.dtype)
        # Each sample's column; samples of other shards point at column 0 and are masked by
        # ``has`` (their column-0 entry is written back unchanged).
        cols = paddle.clip(local, min=0).unsqueeze(1)

        norm = paddle.sqrt(paddle.sum(e * e, axis=1))
        e_hat = e / paddle.clip(norm, min=NORM_EPS).unsqueeze(1)
        inv = 1.0 / paddle.clip(paddle.sqrt(paddle.sum(w * w, axis=1)), min=NORM_EPS)

        z = self._mm(e_hat, w, transpose_y=True)                       # [n, C]
        z.multiply_(inv.unsqueeze(0))                                  # cos
        target = paddle.take_along_axis(z, cols, axis=1).squeeze(1)
        value, d_value = margin_target_logit(target, m1, m2, m3)
        if self.straight_through:
            d_value = paddle.ones_like(d_value)
        value = paddle.where(has > 0, value, target)
        d_value = paddle.where(has > 0, d_value, paddle.ones_like(d_value))
        z.scale_(s)
        z.put_along_axis_(cols, (value * s).unsqueeze(1), axis=1)
        if keep_logits:
            self.logits = z.clone()

        row_max = paddle.max(z, axis=1)
        target_logit = paddle.take_along_axis(z, cols, axis=1).squeeze(1) * has
        if self.sharded:
            comm.all_reduce_max_(row_max)
        p = z
        p.subtract_(row_max.unsqueeze(1))
        p.exp_()
        row_sum = paddle.sum(p, axis=1)
        if self.sharded:
            comm.all_reduce_sum_(row_sum)
            comm.all_reduce_sum_(target_logit)
        loss = paddle.mean(paddle.log(row_sum) + row_max - target_logit)

        # d loss / d z = (softmax - onehot) / n; the target entry through the margin.
        p.divide_(row_sum.unsqueeze(1))
        p_target = paddle.take_along_axis(p, cols, axis=1).squeeze(1)
        p.put_along_axis_(cols, ((p_target - has) * d_value).unsqueeze(1), axis=1)
        # G = d loss / d cos * inv, times the loss scale: one pass over [n, C].
        p.multiply_((inv * (s * grad_scale / n)).unsqueeze(0))
        grad_e_hat = self._mm(p, w)                                    # [n, D]
        m = self._mm(p, e_hat, transpose_x=True)                       # [C, D]
        del p, z
        coef = _rowdot(m, w) * inv * inv
        m.subtract_(w * coef.unsqueeze(1))
        self.grad = m

        radial = paddle.sum(grad_e_hat * e_hat, axis=1) * (norm > NORM_EPS).astype(self.dtype)
        grad_e = (grad_e_hat - e_hat * radial.unsqueeze(1)) \
            / paddle.clip(norm, min=NORM_EPS).unsqueeze(1)
        if self.sharded:
            grad_e = comm.all_reduce_sum_(grad_e)
            grad_e = grad_e[self.rank * local_rows:(self.rank + 1) * local_rows]
        return loss, grad_e.astype(emb.dtype)

    @paddle.no_grad()
    def sgd_step(self, lr: float, momentum: float, weight_decay: float,
                 grad_factor: float = 1.0) -> None:
        """torch's SGD on the class matrix with ``self.grad * grad_factor`` (the dp mean over
        ranks, or the fp16 unscaling): ``buf = m * buf + g + wd * w; w -= lr * buf``. A sparse
        ``pfc`` head updates only the sampled rows and their momentum."""
        if self.grad is None:
            return
        if self.momentum is None:
            # Zeros make the first step's buf = g + wd * w, torch's first-step rule.
            self.momentum = paddle.zeros_like(self.weight)
        grad = self.grad if grad_factor == 1.0 else self.grad * grad_factor
        if not self.sparse:
            if self.sampling:
                # arcface_torch's dense update: the whole-matrix gradient is zero off the sample.
                full = paddle.zeros_like(self.weight)
                grad = paddle.scatter(full, self.index, grad, overwrite=True)
            grad = grad + weight_decay * self.weight
            self.momentum.scale_(momentum).add_(grad)
            self.weight.subtract_(lr * self.momentum)
            return
        rows, index = self.rows, self.index
        buf = paddle.index_select(self.momentum, index) * momentum + (grad + weight_decay * rows)
        paddle.scatter_(self.momentum, index, buf, overwrite=True)
        paddle.scatter_(self.weight, index, rows - lr * buf, overwrite=True)
