"""The margin-softmax head of face workloads in TensorFlow, equal to torch's ``MarginSoftmaxHead``
in its ``dp`` mode: every rank holds the whole class matrix, and its gradient is averaged over
ranks with the backbone's (``step.py``). ``mp`` and ``pfc`` are not implemented (``check_fc``).

The forward is torch's, written with TensorFlow ops, and the backward is TensorFlow's automatic
differentiation of it (the same derivatives torch's autograd and its hand-written normalised
linear take)::

    e_hat = e / max(|e|, 1e-12)              inv_j = 1 / max(|w_j|, 1e-12)
    cos   = (e_hat @ w.T) * inv              [N, C], the class matrix never normalised in a copy
    z     = s * cos, the target entry s * margin(cos_target), in float32 (or float64)
    loss  = mean_i cross_entropy(z_i, y_i)

The margin is the combined cos(m1 * theta + m2) - m3 of torch's ``margin.py``: the cosine is
clamped to [-1 + 1e-6, 1 - 1e-6] before arccos (``tf.clip_by_value`` passes the gradient inside
the bounds, bounds included, and none outside, as torch's clamp), the gradient is arccos' true
one, and past theta_max = (pi - m2) / m1 the logit continues as cos(theta) - m3 - (1 +
cos(theta_max)). CosFace and plain softmax (m1 = 1, m2 = 0) are c - m3, unclamped. A strict
alignment run's negative control (``straight_through``) keeps the margin's value but gives the
cosine its gradient unchanged (derivative 1), as insightface's arcface_torch does.

Precision: the class matrix is held in ``dtype``, float32, or float64 in a strict alignment run.
The class-matrix product runs in the step's compute dtype (float16 under mixed precision, as
torch's autocast runs it; else ``dtype``), the norms, the margin and the softmax in ``dtype``:
float32 at least, float64 kept as it is.
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from ..base import require
from .backend import BACKEND

COS_EPS = 1e-6
NORM_EPS = 1e-12
FC_MODES = ("dp",)


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


class MarginSoftmaxHead:
    """The whole class matrix ``weight`` [C, D] (``dtype``, torch's layout: one row per class)
    and the loss of a batch against it. ``straight_through``: the negative control's margin
    gradient (module doc), for strict alignment runs only."""

    def __init__(self, num_classes: int, embedding_size: int,
                 margins: tuple[float, float, float], scale: float, mode: str = "dp",
                 seed: int = 0, compute_dtype: tf.DType | None = None,
                 dtype: tf.DType = tf.float32, straight_through: bool = False) -> None:
        check_fc(mode)
        self.mode = mode
        self.margins = tuple(float(m) for m in margins)
        self.scale = float(scale)
        self.dtype = tf.as_dtype(dtype)
        self.compute_dtype = compute_dtype or self.dtype
        self.straight_through = straight_through
        # N(0, 0.01) as torch's head; the same matrix on every rank (torch's DDP broadcasts
        # rank 0's). ``set_weight`` overrides it.
        rng = np.random.RandomState(seed * 1000 + 7919)
        self.weight = tf.Variable(
            rng.normal(0.0, 0.01, (num_classes, embedding_size)).astype(
                self.dtype.as_numpy_dtype), name="head.weight")

    def set_weight(self, full_matrix: np.ndarray) -> None:
        """Load the whole class matrix [C, D] (a numpy array)."""
        if tuple(full_matrix.shape) != tuple(self.weight.shape):
            raise ValueError(f"head weight {tuple(full_matrix.shape)} does not fit the head's "
                             f"{tuple(self.weight.shape)}")
        self.weight.assign(np.asarray(full_matrix, dtype=self.dtype.as_numpy_dtype))

    def logits(self, emb: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        """Scaled logits [N, C] in ``dtype`` of embeddings [N, D] and class ids [N] (int)."""
        m1, m2, m3 = self.margins
        e = tf.cast(emb, self.dtype)
        e_hat = e / tf.maximum(tf.norm(e, axis=1, keepdims=True), NORM_EPS)
        w = self.weight
        inv = 1.0 / tf.maximum(tf.norm(w, axis=1), NORM_EPS)
        cd = self.compute_dtype
        cos = tf.matmul(tf.cast(e_hat, cd), tf.cast(w, cd), transpose_b=True)
        cos = tf.cast(cos, self.dtype) * inv[None, :]
        labels = tf.cast(labels, tf.int32)
        index = tf.stack([tf.range(tf.shape(labels)[0], dtype=tf.int32), labels], axis=1)
        target = tf.gather_nd(cos, index)
        margined = margin_target_logit(target, m1, m2, m3)
        if self.straight_through:
            # The margin's value with the cosine's gradient: the rule broken on purpose.
            margined = target + tf.stop_gradient(margined - target)
        cos = tf.tensor_scatter_nd_update(cos, index, margined)
        return cos * self.scale

    def __call__(self, emb: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        """Mean cross-entropy of the batch (a scalar in ``dtype``)."""
        logits = self.logits(emb, labels)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            tf.cast(labels, tf.int32), logits))
