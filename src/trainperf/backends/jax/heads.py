"""The margin-softmax head of face workloads in JAX, equal to torch's ``MarginSoftmaxHead``.

The functions that compute run inside the training step's ``jax.shard_map`` over the mesh axis
of ranks (``dist.AXIS``); gradients come from JAX's autodiff through them, collectives included.

- ``dp``: every rank holds the whole class matrix (replicated); the loss is the mean over the
  rank's own batch and the step averages every gradient over ranks.
- ``mp``: rank r holds the rows ``shard_of(C, r, W)`` of the class matrix (torch's balanced
  shards), padded to ``ceil(C / W)`` rows so that every rank's block has one shape (the padded
  columns are masked out of the softmax and never move). Embeddings and labels are all-gathered,
  each rank computes the logits of its shard for the whole gathered batch, and the softmax runs
  across shards: the row max (``pmax``), the row sum of exponentials and the target logit
  (``psum``). The loss is the mean over the gathered batch, the same on every rank. Autodiff
  transposes the all-gather into a reduce-scatter, so each rank's embedding gradient is the sum
  over ranks of the partial gradients of its own rows, and the psums into broadcasts, so a
  shard's class-matrix gradient stays local.
- ``pfc``: ``mp`` where each rank computes only on the classes it samples per step: every
  positive of the gathered batch that lives in its shard (score 2), topped up with the best of
  uniform [0, 1) scores to ``max(1, int(sample_ratio * count))`` columns (``oracle.pfc_sample``'s
  rule). Shapes must be static, so the positives must fit the sample without growing it (as
  torch grows it): the step refuses a global batch larger than the sample. Uneven shards sample
  the larger shard's count and mask the surplus column on the ranks whose sample is one
  smaller. At ``sample_ratio`` 1.0 it is exactly ``mp``.

Per step, with e the embeddings, w the class rows, s the scale (as torch)::

    e_hat = e / max(|e|, 1e-12)      cos = (e_hat @ w.T) / max(|w_j|, 1e-12)
    z = s * cos, the target entry s * margin(cos_target) (fp32)
    loss = mean_i(log sum_j exp(z_ij - max_i) + max_i - z_i,target)

The margin is the combined cos(m1 * theta + m2) - m3 of torch's ``margin.py``: the cosine is
clamped to [-1 + 1e-6, 1 - 1e-6] (in float32, as torch) before arccos, and the clamp passes no
gradient outside its band but does at its bounds (torch's clamp backward); past theta_max =
(pi - m2) / m1 the logit continues as cos(theta) - m3 - (1 + cos(theta_max)). CosFace and plain
softmax (m1 = 1, m2 = 0) are c - m3. The row max is a constant to autodiff (it cancels in the
loss), so its ``pmax`` needs no gradient. Under bf16 / fp16 the class-matrix product runs in
that dtype (as torch's autocast head) and everything after it in fp32; in a float64 alignment
run everything, the product included, runs in float64 (nothing is lifted "to fp32" from
float64, as torch's ``at_least_fp32``).

``straight_through`` (an alignment run's negative control only, ``AlignSpec.breaks``): the
margin's value in the forward, but the cosine's derivative (1) in the backward, as insightface's
arcface_torch computes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

import jax

from ..layouts import shard_of
from .dist import AXIS, Layout
from .models import at_least_fp32

COS_EPS = 1e-6
NORM_EPS = 1e-12
FC_MODES = ("dp", "mp", "pfc")


def margin_target_logit(c: jax.Array, m1: float, m2: float, m3: float) -> jax.Array:
    """Unscaled target logit of fp32 (or float64) target cosines ``c`` (any shape)."""
    if m1 == 1.0 and m2 == 0.0:
        return c - m3
    lo, hi = -1.0 + COS_EPS, 1.0 - COS_EPS
    in_band = (c >= lo) & (c <= hi)
    # Outside the band the clamped value is a constant: no gradient, as torch's clamp.
    cc = jnp.where(in_band, c, jnp.clip(jax.lax.stop_gradient(c), lo, hi))
    theta = jnp.arccos(cc)
    theta_max = (math.pi - m2) / m1
    with_margin = jnp.cos(m1 * theta + m2) - m3
    beyond = c - m3 - (1.0 + math.cos(theta_max))
    return jnp.where(theta <= theta_max, with_margin, beyond)


def _row_norm(x: jax.Array) -> jax.Array:
    """max(|row|, 1e-12); below the clamp its gradient is zero, as torch's clamp_min."""
    return jnp.sqrt(jnp.maximum(jnp.sum(jnp.square(x), axis=1), NORM_EPS ** 2))


def margin_softmax_loss(emb: jax.Array, local_labels: jax.Array, weight: jax.Array, *,
                        margins: tuple[float, float, float], scale: float,
                        axis: str | None = None, valid: jax.Array | None = None,
                        mm_dtype: Any = jnp.float32, straight_through: bool = False,
                        return_logits: bool = False) -> Any:
    """Mean margin-softmax cross-entropy of the batch ``emb`` [N, D] against the class rows
    ``weight`` [K, D]. ``local_labels`` [N]: each sample's row in ``weight``, or -1 when its
    class lives on another rank. ``axis``: the mesh axis the classes are sharded over (the max,
    the sum and the target are combined over it), None for one whole class matrix. ``valid``
    [K] masks padded / surplus rows out of the softmax. ``straight_through``: the margin's
    gradient passed to the cosine unchanged (module docstring). With ``return_logits`` (tests),
    returns (loss, this shard's scaled logits [N, K]).

    The arithmetic after the product runs in fp32, or in float64 when the embeddings are
    float64 (an alignment run's)."""
    m1, m2, m3 = margins
    e = at_least_fp32(emb)
    e_hat = e / _row_norm(e)[:, None]
    cos = jnp.dot(e_hat.astype(mm_dtype), weight.astype(mm_dtype).T).astype(e.dtype)
    cos = cos * (1.0 / _row_norm(at_least_fp32(weight)))[None, :]
    has = local_labels >= 0
    col = jnp.maximum(local_labels, 0)
    target_cos = jnp.take_along_axis(cos, col[:, None], axis=1)[:, 0]
    margined = margin_target_logit(target_cos, m1, m2, m3)
    if straight_through:
        # The margin's value, the cosine's derivative: a rule broken on purpose.
        margined = target_cos + jax.lax.stop_gradient(margined - target_cos)
    target = jnp.where(has, margined, target_cos)
    onehot = (jnp.arange(weight.shape[0])[None, :] == col[:, None]) & has[:, None]
    z = scale * jnp.where(onehot, target[:, None], cos)
    if valid is not None:
        z = jnp.where(valid[None, :], z, -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(z, axis=1))
    target_logit = jnp.where(has, scale * target, 0.0)
    if axis is not None:
        row_max = jax.lax.pmax(row_max, axis)
    row_sum = jnp.sum(jnp.exp(z - row_max[:, None]), axis=1)
    if axis is not None:
        row_sum = jax.lax.psum(row_sum, axis)
        target_logit = jax.lax.psum(target_logit, axis)
    loss = jnp.mean(jnp.log(row_sum) + row_max - target_logit)
    return (loss, z) if return_logits else loss


class Selection(NamedTuple):
    """What a rank's head uses this step, decided before the differentiated part."""

    local_labels: jax.Array
    """[N] each (gathered) sample's row in the rows used, or -1."""
    index: jax.Array | None
    """pfc: [S] the sampled shard rows, ascending; None: every row."""
    valid: jax.Array | None
    """[rows used] False for padded or surplus rows; None when all are real."""


def sample_classes(local_labels: jax.Array, count: jax.Array, num_sample: jax.Array,
                   max_sample: int, uniform: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Partial FC sample of one shard (``oracle.pfc_sample``'s rule, static shapes).

    ``local_labels`` [N]: columns in the shard or -1; ``count``: real rows of the shard (the
    block may be padded past it); ``num_sample`` (<= ``max_sample``): how many to keep;
    ``uniform`` [rows of the block] scores in [0, 1). Positives score 2, padded rows -1; the
    ``max_sample`` best are taken and the worst ``max_sample - num_sample`` of them marked
    invalid. Returns (index [max_sample] ascending, labels remapped into it (-1 kept), valid
    [max_sample]). The caller guarantees that the positives fit in ``num_sample``."""
    rows = uniform.shape[0]
    has = local_labels >= 0
    score = jnp.where(jnp.arange(rows) < count, uniform, -1.0)
    score = score.at[jnp.where(has, local_labels, rows)].set(2.0, mode="drop")
    _, best = jax.lax.top_k(score, max_sample)        # best first
    keep = jnp.arange(max_sample) < num_sample
    order = jnp.argsort(best)
    index, valid = best[order], keep[order]
    remapped = jnp.where(has, jnp.searchsorted(index, jnp.maximum(local_labels, 0)), -1)
    return index, remapped.astype(local_labels.dtype), valid


@dataclass(frozen=True)
class MarginSoftmaxHead:
    """The head's static description; its class rows live in the step's state."""

    num_classes: int
    embedding_size: int
    margins: tuple[float, float, float]
    scale: float
    world_size: int = 1
    mode: str = "dp"
    sample_ratio: float = 1.0
    update_rule: str = "sparse"
    """pfc below ratio 1: ``sparse`` (sampled rows only, momentum per row) or ``dense``."""
    mm_dtype: Any = jnp.float32
    """The class-matrix product's dtype (the run's compute dtype)."""
    dtype: Any = jnp.float32
    """What the class rows are held in (float64 in a float64 alignment run)."""
    straight_through: bool = False
    """The margin's gradient passed straight through (an alignment control only)."""

    def __post_init__(self) -> None:
        if self.mode not in FC_MODES:
            raise ValueError(f"unknown fc mode {self.mode!r}")
        if self.update_rule not in ("sparse", "dense"):
            raise ValueError(f"pfc update must be sparse or dense, got {self.update_rule!r}")

    @property
    def sharded(self) -> bool:
        return self.mode != "dp"

    @property
    def sampling(self) -> bool:
        return self.mode == "pfc" and self.sample_ratio < 1.0

    @property
    def update(self) -> str:
        """``full``, ``sparse`` or ``dense``: which class-matrix update runs."""
        return self.update_rule if self.sampling else "full"

    @property
    def block_rows(self) -> int:
        """Rows of each rank's block of the class matrix (the largest shard's count)."""
        return -(-self.num_classes // self.world_size) if self.sharded else self.num_classes

    @property
    def padded(self) -> bool:
        return self.sharded and self.num_classes % self.world_size != 0

    def num_sample(self, rank: int) -> int:
        """torch's sample size of ``rank``'s shard."""
        return max(1, int(self.sample_ratio * shard_of(self.num_classes, rank,
                                                       self.world_size)[1]))

    @property
    def max_sample(self) -> int:
        return max(self.num_sample(r) for r in range(self.world_size))

    def check_batch(self, global_batch: int) -> None:
        """pfc's static sample must hold every positive (see the module docstring)."""
        if self.sampling:
            smallest = min(self.num_sample(r) for r in range(self.world_size))
            if global_batch > smallest:
                raise ValueError(
                    f"the jax pfc head samples a static {smallest} classes per shard, fewer "
                    f"than the {global_batch} samples of the global batch whose positives it "
                    f"must hold; raise --sample-ratio or lower the batch")

    # ------------------------------------------------------------------ class rows

    def _pad(self, rows: np.ndarray | jax.Array) -> Any:
        extra = self.block_rows - rows.shape[0]
        return jnp.pad(rows, ((0, extra), (0, 0))) if extra else rows

    def init_weight(self, layout: Layout, seed: int) -> jax.Array:
        """N(0, 0.01) class rows drawn on the device: ``dp`` ranks all hold rank 0's draw, a
        sharded head's ranks each their own shard (torch's seeds; not torch's numbers)."""
        def draw(rank: int, count: int) -> jax.Array:
            key = jax.random.key(seed * 1000 + 7919 * (rank + 1), impl="rbg")
            return 0.01 * jax.random.normal(key, (count, self.embedding_size), jnp.float32)

        if not self.sharded:
            return layout.replicated(draw(0, self.num_classes))
        return layout.per_rank(lambda r: self._pad(
            draw(r, shard_of(self.num_classes, r, self.world_size)[1])))

    def weight_from_matrix(self, layout: Layout, matrix: np.ndarray) -> jax.Array:
        """The head's rows from the whole class matrix [C, D] (alignment), in ``dtype``."""
        matrix = np.asarray(matrix, dtype=self.dtype)
        if matrix.shape != (self.num_classes, self.embedding_size):
            raise ValueError(f"head/weight has shape {matrix.shape}, expected "
                             f"{(self.num_classes, self.embedding_size)}")
        if not self.sharded:
            return layout.replicated(matrix)

        def rows(rank: int) -> jax.Array:
            start, count = shard_of(self.num_classes, rank, self.world_size)
            return self._pad(jnp.asarray(matrix[start:start + count]))
        return layout.per_rank(rows)

    # --------------------------------------------------- inside the step's shard_map

    def _shard(self) -> tuple[jax.Array, jax.Array]:
        """(start, count) of this rank's shard, as device scalars."""
        rank = jax.lax.axis_index(AXIS)
        base, rem = divmod(self.num_classes, self.world_size)
        return rank * base + jnp.minimum(rank, rem), base + (rank < rem).astype(jnp.int32)

    def select(self, labels: jax.Array, key: jax.Array | None = None) -> Selection:
        """This rank's labels in its rows (labels gathered over ranks when sharded) and, for
        pfc, this step's sample (``key``: this rank's random key for the step)."""
        if not self.sharded:
            return Selection(labels, None, None)
        labels = jax.lax.all_gather(labels, AXIS, tiled=True)
        start, count = self._shard()
        local = labels - start
        local = jnp.where((local >= 0) & (local < count), local, -1)
        if not self.sampling:
            valid = (jnp.arange(self.block_rows) < count) if self.padded else None
            return Selection(local, None, valid)
        rank = jax.lax.axis_index(AXIS)
        sizes = jnp.asarray([self.num_sample(r) for r in range(self.world_size)], jnp.int32)
        # In the rows' dtype: a float64 run holds no float32 value at all.
        uniform = jax.random.uniform(key, (self.block_rows,), self.dtype)
        index, remapped, valid = sample_classes(local, count, sizes[rank], self.max_sample,
                                                uniform)
        return Selection(remapped, index, None if self._all_sizes_equal else valid)

    @property
    def _all_sizes_equal(self) -> bool:
        return len({self.num_sample(r) for r in range(self.world_size)}) == 1

    def loss(self, emb: jax.Array, selection: Selection, rows: jax.Array) -> jax.Array:
        """The loss of this rank's embeddings [B, D] against ``rows`` (the class rows the
        selection names: the whole block, or the sampled ones)."""
        if self.sharded:
            emb = jax.lax.all_gather(emb, AXIS, tiled=True)
        return margin_softmax_loss(emb, selection.local_labels, rows, margins=self.margins,
                                   scale=self.scale, axis=AXIS if self.sharded else None,
                                   valid=selection.valid, mm_dtype=self.mm_dtype,
                                   straight_through=self.straight_through)
