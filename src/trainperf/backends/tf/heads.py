"""The margin-softmax head of face workloads in TensorFlow, equal to torch's ``MarginSoftmaxHead``.

- ``dp``: every rank holds the whole class matrix; its gradient is averaged over ranks with the
  backbone's (``step.py``).
- ``mp``: rank r holds the balanced shard ``shard_of(C, r, W)`` of the classes (the first
  ``C % W`` ranks one row more). Embeddings and labels are all-gathered over ranks, each rank
  computes the logits of its shard for the whole gathered batch, and the softmax runs across
  shards: the row max (an all-gather of each shard's, then their max: the strategy's all-reduce
  has SUM and MEAN only), the row sum of exponentials and the target logit (one all-reduce SUM
  of both). The loss is the mean over the gathered batch, the same on every rank.
- ``pfc``: ``mp`` where each rank computes only on the classes it samples this step
  (:func:`sample_classes`): every positive of the gathered batch that lives in its shard, topped
  up with uniformly drawn negatives (a ``tf.random.Generator`` per rank) to ``max(1,
  int(sample_ratio * shard))`` columns, all positives kept when they are more. Only the sampled
  rows are gathered, normalised and multiplied. At ratio 1.0 nothing is sampled: it is ``mp``.
  The sample's size is a tensor, so growing it to hold every positive needs no read-back. The
  update of the sampled rows, ``sparse`` (per row) or ``dense`` (arcface_torch's), is the
  step's (``step.py``).

Gradients are TensorFlow's automatic differentiation, collectives included, under the
strategy's convention that the objective is the SUM over replicas of what each differentiates:
the gradient of an all-reduce SUM is the all-reduce SUM of the gradients, that of an all-gather
the all-reduce SUM of the gradients sliced to this rank's rows (``ReplicaContext.all_gather``'s
own gradient). The sharded loss is one number that every rank holds, so each rank
differentiates its share of it, ``loss / W`` (:meth:`MarginSoftmaxHead.replica_objective`):
the shard's class-matrix gradient is then that of the global loss (it stays local), and each
rank's embedding gradient the sum over ranks of the partial gradients of its own rows, whose
backbone gradients ``step.py`` sums over ranks. The row max is a constant to autodiff (it
cancels in the loss), so its gather passes no gradient.

The forward is torch's, written with TensorFlow ops::

    e_hat = e / max(|e|, 1e-12)              inv_j = 1 / max(|w_j|, 1e-12)
    cos   = (e_hat @ w.T) * inv              [N, C], the class rows never normalised in a copy
    z     = s * cos, the target entry s * margin(cos_target), in float32 (or float64)
    loss  = mean_i (log sum_j exp(z_ij - max_i) + max_i - z_i,target)

The margin is the combined cos(m1 * theta + m2) - m3 of torch's ``margin.py``: the cosine is
clamped to [-1 + 1e-6, 1 - 1e-6] before arccos (``tf.clip_by_value`` passes the gradient inside
the bounds, bounds included, and none outside, as torch's clamp), the gradient is arccos' true
one, and past theta_max = (pi - m2) / m1 the logit continues as cos(theta) - m3 - (1 +
cos(theta_max)). CosFace and plain softmax (m1 = 1, m2 = 0) are c - m3, unclamped. A strict
alignment run's negative control (``straight_through``) keeps the margin's value but gives the
cosine its gradient unchanged (derivative 1), as insightface's arcface_torch does.

Precision: the class matrix is held in ``dtype``, float32, or float64 in a strict alignment run.
The class-matrix product runs in the step's compute dtype (float16 under mixed precision, as
torch's autocast runs it; else ``dtype``), the norms, the margin, the softmax and the gathers in
``dtype``: float32 at least, float64 kept as it is.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import tensorflow as tf

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


def margin_target_logit(c: tf.Tensor, m1: float, m2: float, m3: float) -> tf.Tensor:
    """Unscaled target logit of target cosines ``c`` (float32 or float64), in their dtype."""
    if m1 == 1.0 and m2 == 0.0:
        return c - m3
    theta = tf.acos(tf.clip_by_value(c, -1.0 + COS_EPS, 1.0 - COS_EPS))
    theta_max = (math.pi - m2) / m1
    with_margin = tf.cos(m1 * theta + m2) - m3
    beyond = c - m3 - (1.0 + math.cos(theta_max))
    return tf.where(theta <= theta_max, with_margin, beyond)


def sample_classes(local_labels: tf.Tensor, num_local: int, num_sample: int,
                   scores: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Pick ``num_sample`` class columns of a shard, every positive among them
    (``oracle.pfc_sample``'s rule).

    ``local_labels`` [M] int32 holds each gathered sample's column in this shard, or -1;
    ``scores`` [num_local] in [0, 1) rank the negatives. Returns the ascending column index [S]
    and the labels remapped into it (-1 kept), both int32. S is ``num_sample`` unless the
    positives alone are more: then all of them, a size computed on the device."""
    has = local_labels >= 0
    # One spare slot takes the samples of other shards, so no boolean mask is needed.
    slot = tf.where(has, local_labels, num_local)
    score = tf.concat([tf.cast(scores, tf.float32), tf.zeros([1], tf.float32)], axis=0)
    score = tf.tensor_scatter_nd_update(
        score, slot[:, None], tf.fill(tf.shape(slot), POSITIVE_SCORE))[:num_local]
    positives = tf.reduce_sum(tf.cast(score == POSITIVE_SCORE, tf.int32))
    count = tf.maximum(num_sample, positives)
    index = tf.sort(tf.math.top_k(score, count, sorted=False).indices)
    remapped = tf.where(has, tf.searchsorted(index, tf.maximum(local_labels, 0)), -1)
    return index, remapped


class Selection(NamedTuple):
    """What a rank's head uses this step, decided before (and outside) the differentiated
    part."""

    local: tf.Tensor
    """[N] int32: each (gathered, when sharded) sample's row in the rows used, or -1."""
    index: tf.Tensor | None
    """Sampling pfc: [S] the sampled rows of the shard, ascending; None: every row."""


class MarginSoftmaxHead:
    """The class matrix ``weight`` (``dtype``, torch's layout, one row per class: all ``C``
    rows in ``dp``, this rank's shard in ``mp``/``pfc``) and the loss of a batch against it.

    ``comm``: the ranks the classes are sharded over (None: one process). ``sample_ratio`` and
    ``update``: pfc's sample and which update the step runs (``sparse``: the sampled rows and
    their momentum only; ``dense``: arcface_torch's whole-matrix SGD). ``straight_through``:
    the negative control's margin gradient (module doc), for strict alignment runs only.
    ``gather_by_sum``: gather over ranks with ``Comm.all_gather_by_sum``, the form XLA
    compiles (``--mode xla``), instead of the strategy's all-gather; the same values."""

    def __init__(self, num_classes: int, embedding_size: int,
                 margins: tuple[float, float, float], scale: float, comm: Comm | None = None,
                 mode: str = "dp", sample_ratio: float = 1.0, update: str = "sparse",
                 seed: int = 0, compute_dtype: tf.DType | None = None,
                 dtype: tf.DType = tf.float32, straight_through: bool = False,
                 gather_by_sum: bool = False) -> None:
        check_fc(mode)
        if update not in PFC_UPDATES:
            raise ValueError(f"pfc update must be one of {', '.join(PFC_UPDATES)}, got "
                             f"{update!r}")
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
        self.mode = mode
        self.comm = comm
        self.margins = tuple(float(m) for m in margins)
        self.scale = float(scale)
        self.dtype = tf.as_dtype(dtype)
        self.compute_dtype = compute_dtype or self.dtype
        self.straight_through = straight_through
        self.gather_by_sum = gather_by_sum
        self.sharded = mode != "dp"
        self.matrix_shape = (int(num_classes), int(embedding_size))
        """The whole class matrix's, of which this rank holds rows ``start`` on (``count``)."""
        self.rank, self.world_size = (comm.rank, comm.world_size) if comm else (0, 1)
        self.start, self.count = (shard_of(num_classes, self.rank, self.world_size)
                                  if self.sharded else (0, num_classes))
        self.sampling = mode == "pfc" and sample_ratio < 1.0
        self.num_sample = max(1, int(sample_ratio * self.count))
        self.sparse = self.sampling and update == "sparse"
        # N(0, 0.01) as torch's head: dp ranks draw the same matrix (torch's DDP broadcasts
        # rank 0's), sharded ranks each their own shard. ``set_weight`` overrides it.
        draw_rank = self.rank if self.sharded else 0
        rng = np.random.RandomState(seed * 1000 + 7919 * (draw_rank + 1))
        self.weight = tf.Variable(
            rng.normal(0.0, 0.01, (self.count, embedding_size)).astype(
                self.dtype.as_numpy_dtype), name="head.weight")
        self.generator: tf.random.Generator | None = None
        if self.sampling:
            # Each rank its own stream: the shards sample independently, as torch's ranks do.
            self.generator = tf.random.Generator.from_seed(seed * 1000 + 104729 *
                                                           (self.rank + 1))

    @property
    def update(self) -> str:
        """Which class-matrix update the step runs: ``full`` (no sampling), ``sparse`` or
        ``dense``."""
        if not self.sampling:
            return "full"
        return "sparse" if self.sparse else "dense"

    def set_weight(self, full_matrix: np.ndarray) -> None:
        """Load this head's rows from the whole class matrix [C, D] (a numpy array)."""
        full_matrix = np.asarray(full_matrix)
        if full_matrix.shape != self.matrix_shape:
            raise ValueError(f"head weight {tuple(full_matrix.shape)} does not fit the head's "
                             f"class matrix {self.matrix_shape}")
        rows = full_matrix[self.start:self.start + self.count]
        self.weight.assign(np.asarray(rows, dtype=self.dtype.as_numpy_dtype))

    # ------------------------------------------------------------- inside the replica context

    def _gather(self, value: tf.Tensor) -> tf.Tensor:
        if self.comm is None or not self.comm.distributed:
            return value
        if self.gather_by_sum:
            return self.comm.all_gather_by_sum(value)
        return self.comm.all_gather(value)

    def _sum(self, values: list[tf.Tensor]) -> list[tf.Tensor]:
        if self.comm is None or not self.comm.distributed:
            return list(values)
        return self.comm.all_reduce_sum(values)

    def select(self, labels: tf.Tensor, scores: tf.Tensor | None = None) -> Selection:
        """This rank's labels in its rows (gathered over ranks when sharded) and, for a
        sampling pfc, this step's sample. ``scores`` [count] in [0, 1) (tests) rank the
        negatives instead of a uniform draw."""
        labels = tf.cast(labels, tf.int32)
        if not self.sharded:
            return Selection(labels, None)
        labels = self._gather(labels)
        local = labels - self.start
        local = tf.where((local >= 0) & (local < self.count), local, -1)
        if not self.sampling:
            return Selection(local, None)
        if scores is None:
            scores = self.generator.uniform([self.count], dtype=tf.float32)
        index, local = sample_classes(local, self.count, self.num_sample, scores)
        return Selection(local, index)

    def rows(self, selection: Selection) -> tf.Tensor | tf.Variable:
        """The class rows the selection uses: the variable itself, or its sampled rows (a
        gather, whose gradient is the rows' and nothing of the rest)."""
        if selection.index is None:
            return self.weight
        return tf.gather(self.weight, selection.index)

    def logits_and_loss(self, emb: tf.Tensor, selection: Selection,
                        rows: tf.Tensor | tf.Variable) -> tuple[tf.Tensor, tf.Tensor]:
        """This rank's scaled logits [N, rows] (``dtype``) and the loss, a scalar in
        ``dtype``: the mean over the batch (the gathered one when sharded, the same on every
        rank). ``emb`` [n, D] is this rank's embeddings."""
        m1, m2, m3 = self.margins
        e = tf.cast(emb, self.dtype)
        if self.sharded:
            e = self._gather(e)
        e_hat = e / tf.maximum(tf.norm(e, axis=1, keepdims=True), NORM_EPS)
        inv = 1.0 / tf.maximum(tf.norm(rows, axis=1), NORM_EPS)
        cd = self.compute_dtype
        cos = tf.matmul(tf.cast(e_hat, cd), tf.cast(rows, cd), transpose_b=True)
        cos = tf.cast(cos, self.dtype) * inv[None, :]
        local = selection.local
        # Samples of other shards point at column 0 and keep its cosine there (masked below).
        index = tf.stack([tf.range(tf.shape(local)[0], dtype=tf.int32),
                          tf.maximum(local, 0)], axis=1)
        target = tf.gather_nd(cos, index)
        margined = margin_target_logit(target, m1, m2, m3)
        if self.straight_through:
            # The margin's value with the cosine's gradient: the rule broken on purpose.
            margined = target + tf.stop_gradient(margined - target)
        if not self.sharded:
            z = tf.tensor_scatter_nd_update(cos, index, margined) * self.scale
            return z, tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(local, z))
        has = local >= 0
        z = tf.tensor_scatter_nd_update(cos, index, tf.where(has, margined, target)) * self.scale
        target_logit = tf.where(has, margined * self.scale, tf.zeros_like(margined))
        # The row max cancels in the loss: a constant to autodiff, gathered without a gradient.
        row_max = tf.stop_gradient(tf.reduce_max(
            self._gather(tf.stop_gradient(tf.reduce_max(z, axis=1))[None, :]), axis=0))
        row_sum = tf.reduce_sum(tf.exp(z - row_max[:, None]), axis=1)
        row_sum, target_logit = self._sum([row_sum, target_logit])
        return z, tf.reduce_mean(tf.math.log(row_sum) + row_max - target_logit)

    def replica_objective(self, loss: tf.Tensor) -> tf.Tensor:
        """What this rank differentiates (module doc): the loss of its own batch in ``dp``,
        whose gradients the step averages; its share ``loss / W`` of the one sharded loss."""
        return loss / self.world_size if self.sharded else loss

    def __call__(self, emb: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        """The loss of the batch (a scalar in ``dtype``), this step's sample drawn."""
        selection = self.select(labels)
        return self.logits_and_loss(emb, selection, self.rows(selection))[1]
