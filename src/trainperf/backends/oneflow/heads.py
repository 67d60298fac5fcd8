"""The margin-softmax head of face workloads, equal to torch's ``MarginSoftmaxHead`` (dp, mp,
pfc).

The head is written once, as the single-device formula, and the SBP of its tensors decides
where it runs:

- ``dp``: the class matrix is a local parameter on every rank (averaged with the backbone's
  gradients by DDP, ``step.py``); the embeddings and labels are this rank's batch. The loss is
  the mean over this rank's samples, as torch's DDP head.
- ``mp``: the class matrix is a *global* parameter ``split(0)`` over every rank: rank r holds the
  balanced shard of rows ``shard_of(C, r, W)`` (OneFlow's balanced splitter gives the first
  ``C % W`` ranks one more row, as torch's ``shard_range``). The embeddings and labels become
  global ``split(0)`` tensors (each rank's batch is its piece) and then ``broadcast`` (an
  all-gather); the cosines ``e_hat @ w.T`` come out ``split(1)``, each rank holding the columns
  of its shard for the whole gathered batch. Row reductions over the class axis give
  ``partial_sum`` tensors, which are turned into ``broadcast`` ones explicitly (all-reduces of N
  numbers: the target cosine and the sum of exponentials); the row max is the max of the
  shards' maxima (an all-gather of N numbers per rank). The loss is the mean over the gathered
  global batch, the same on every rank.

Per step, with e the embeddings, w the class rows, s the scale, y the labels::

    e_hat = e / max(|e|, 1e-12)            w_hat_j = w_j / max(|w_j|, 1e-12)
    cos   = e_hat @ w_hat.T                (F.normalize's copy of the class matrix: scaling
                                            the [N, C] product by 1 / |w_j| instead saves that
                                            copy, but OneFlow's backward of it took 1,270 ms a
                                            step against 340 ms, 85,742 x 512 on 2 CPU threads,
                                            and held the face step at 0.92 of OneFlow's own)
    t_i   = cos[i, y_i]                    (a masked row sum: the one-hot of y against the
                                            shard's class ids)
    z     = s * cos, with z[i, y_i] = s * margin(t_i)
    loss  = mean_i(log sum_j exp(z_ij - max_i) + max_i - z[i, y_i])

OneFlow's autograd gives the backward, boxing included: the gradient of the gathered normalised
embeddings is a ``partial_sum`` (each shard's part), summed over ranks (an all-reduce of [N, D],
as torch's and MXNet's heads do) and sliced back to each rank's rows; the shard's class-matrix
gradient stays on its rank. The two row-sum conversions pass ``grad_sbp=broadcast``: the
gradient of a sum of per-rank parts is the same full gradient on every rank. No [N, C] tensor
moves between ranks, forward or backward (checked by printing each tensor's and each gradient's
SBP while writing this).

``pfc`` (Partial FC) is ``mp`` where each rank computes only on the columns it sampled this
step (:func:`sample_classes`, written with tensor operations: OneFlow 0.9's own sampling op
cannot run this rule, see there): every positive class of the gathered batch that lives in its
shard, topped up with uniformly drawn negatives to ``max(1, int(sample_ratio * shard))``
columns, or more where the positives alone are more. The loss is the softmax over the sampled
classes of all shards. At ratio 1.0 nothing is sampled and it is ``mp`` itself. The sampled rows
are gathered from the shard and made a global ``split(0)`` matrix, and the step above runs on it
unchanged, the sampled classes' ids standing in for the shard's. A global ``split(0)`` tensor
holds balanced pieces only, so where ranks sample different numbers of rows (uneven shards, or
positives beyond the sample) every rank's piece is padded to the largest with copies of its
first row whose exponentials are multiplied by 0 (no share of the sum, no gradient); every rank
works the sizes out alike from the gathered labels, as SPMD global operations require.

The ``sparse`` update (default) touches only the sampled rows, with momentum kept per row (the
Partial FC paper, PLSC): the sampled rows are a fresh leaf of each step, cut from the shard's
autograd, so no gradient the size of the shard is formed, and the head's ``sparse_step``
applies ``d = g + wd * w; buf = m * buf[rows] + d; w[rows] -= lr * buf``, the other rows and
their momentum untouched. ``dense`` reproduces insightface's arcface_torch: the rows
are gathered with autograd, so the shard's gradient is the whole [count, D] matrix, zero off the
sample, and OneFlow's SGD applies momentum and weight decay to every row (``step.py``).

Sampling reads the gathered labels back to the host when the gathered batch has more samples
than some rank samples columns: its positives might then exceed the sample, and every rank must
know every rank's sample size. Nothing else in a step is read back.

The margin is the combined cos(m1 * theta + m2) - m3 of torch's ``margin.py``: the target cosine
is clamped to [-1 + 1e-6, 1 - 1e-6] before arccos (the clamp passes no gradient outside), and
past theta_max = (pi - m2) / m1 the logit continues as cos(theta) - m3 - (1 + cos(theta_max)).
CosFace and plain softmax (m1 = 1, m2 = 0) are c - m3. The head runs in fp32 whatever the
precision, or in float64 where the embeddings and the class matrix are (an alignment run's).

In graph mode (``graph_step.py``) the same head runs inside an ``nn.Graph``: ``dp``'s class
matrix is a global ``broadcast`` tensor there, its batch ``split(0)``; a sharded head is told so
(``in_graph``), for the two things a graph needs done differently; each sample's loss is returned
(``per_sample``).

``straight_through`` (an alignment run's negative control only, ``AlignSpec.breaks``): the
target logit keeps the margin's value, but its gradient reaches the cosine unchanged
(derivative 1), as insightface's arcface_torch computes it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import oneflow.nn as nn
import oneflow.nn.functional as F

import oneflow as flow

from ..base import require
from ..layouts import shard_of
from .backend import BACKEND
from .dist import Dist

COS_EPS = 1e-6
NORM_EPS = 1e-12
FC_MODES = ("dp", "mp", "pfc")
PFC_UPDATES = ("sparse", "dense")
POSITIVE_SCORE = 2.0
"""Above every uniform [0, 1) score of a negative, so the top scores hold every positive."""


def check_fc(mode: str) -> None:
    """ValueError unless the backend's declaration runs head mode ``mode``."""
    require(BACKEND.head_refusal(mode))


def sample_classes(local_labels: flow.Tensor, num_local: int, size: int,
                   scores: flow.Tensor) -> flow.Tensor:
    """The ``size`` columns of a shard of ``num_local`` to compute on, sorted ascending ([size]
    int64, local tensors): every positive (a column that ``local_labels`` [M] names; -1 is a
    sample of another shard), then the negatives of the highest ``scores`` [num_local] in
    [0, 1). ``size`` must cover the positives (:meth:`MarginSoftmaxHead.sample_sizes`).

    Written with OneFlow's tensor operations rather than OneFlow 0.9's own
    ``nn.DistributedPariticalFCSample``: that op has no CPU kernel (``Cannot find the kernel``
    on a CPU tensor, measured here), and its CUDA kernel (read in OneFlow's source, not run
    here) assumes shards of one size and keeps at most its ``num_sample`` columns, dropping
    positives beyond them: it cannot follow the rule of the other backends and the oracle.
    """
    # A spare last slot takes the samples of other shards: no boolean indexing, no sync.
    slot = flow.where(local_labels >= 0, local_labels,
                      flow.full_like(local_labels, num_local))
    spare = flow.zeros(1, dtype=flow.float32, device=scores.device)
    score = flow.cat([scores.to(flow.float32), spare])
    score = flow.scatter(score, 0, slot, POSITIVE_SCORE)[:num_local]
    return flow.sort(flow.topk(score, size)[1])[0]


def at_least_fp32(t: flow.Tensor) -> flow.Tensor:
    """``t`` in fp32, or as it is when it is wider (float64, an alignment run's)."""
    return t if t.dtype == flow.float64 else t.float()


def margin_target_logit(c: flow.Tensor, m1: float, m2: float, m3: float,
                        straight_through: bool = False) -> flow.Tensor:
    """Unscaled target logit of target cosines ``c`` (any shape); ``straight_through``: its
    gradient is passed to ``c`` as it is (a negative control, module docstring)."""
    if m1 == 1.0 and m2 == 0.0:
        return c - m3
    theta = flow.acos(flow.clamp(c, -1.0 + COS_EPS, 1.0 - COS_EPS))
    theta_max = (math.pi - m2) / m1
    with_margin = flow.cos(theta * m1 + m2) - m3
    beyond = c - (m3 + 1.0 + math.cos(theta_max))
    logit = flow.where(theta <= theta_max, with_margin, beyond)
    if straight_through:
        # The value of the margin, the derivative of the identity.
        return c + (logit - c).detach()
    return logit


class MarginSoftmaxHead(nn.Module):
    """The class matrix (``weight``: local [C, D] in dp, global ``split(0)`` in mp and pfc) and
    the loss of a batch against it."""

    def __init__(self, num_classes: int, embedding_size: int,
                 margins: tuple[float, float, float], scale: float, dist: Dist,
                 mode: str = "dp", seed: int = 0, dtype: flow.dtype = flow.float32,
                 straight_through: bool = False, sample_ratio: float = 1.0,
                 update: str = "sparse") -> None:
        super().__init__()
        check_fc(mode)
        if update not in PFC_UPDATES:
            raise ValueError(f"pfc update must be one of {PFC_UPDATES}, got {update!r}")
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in (0, 1], got {sample_ratio}")
        if sample_ratio < 1.0 and mode != "pfc":
            raise ValueError(f"sample_ratio {sample_ratio} needs mode 'pfc', not {mode!r}")
        self.mode = mode
        self.straight_through = straight_through
        self.dist = dist
        self.margins = tuple(float(m) for m in margins)
        self.scale = float(scale)
        self.sharded = mode != "dp"
        self.num_classes = num_classes
        self.start, self.count = (shard_of(num_classes, dist.rank, dist.world_size)
                                  if self.sharded else (0, num_classes))
        self.sampling = mode == "pfc" and sample_ratio < 1.0
        self.shards = [shard_of(num_classes, r, dist.world_size)
                       for r in range(dist.world_size)] if self.sharded else [(0, num_classes)]
        """Every rank's (start, count): each rank works out every rank's sample size."""
        self.num_samples = [max(1, int(sample_ratio * count)) for _, count in self.shards]
        """Every rank's sample size where its positives fit in it."""
        self.num_sample = self.num_samples[dist.rank if self.sharded else 0]
        self.sparse = self.sampling and update == "sparse"
        # N(0, 0.01) as torch's head. dp ranks draw the same matrix (DDP broadcasts rank 0's
        # anyway); mp draws one logical matrix, each rank generating its own rows.
        gen = flow.Generator(device=dist.device_type)
        gen.manual_seed(seed * 1000 + 7919)
        shape = (num_classes, embedding_size)
        if self.sharded:
            weight = flow.normal(0.0, 0.01, shape, generator=gen, placement=dist.placement,
                                 sbp=flow.sbp.split(0), dtype=dtype)
            classes = flow.arange(num_classes, placement=dist.placement, sbp=flow.sbp.split(0))
        else:
            weight = flow.normal(0.0, 0.01, shape, generator=gen, device=dist.device,
                                 dtype=dtype)
            classes = flow.arange(num_classes, device=dist.device)
        self.weight = nn.Parameter(weight)
        # Each column's class id: the one-hot of the labels is a comparison against it, which
        # needs no index arithmetic on the shard's offset.
        self.register_buffer("classes", classes.unsqueeze(0), persistent=False)
        # Its own stream, different on every rank: the draws of the negatives must not move
        # the generator that the backbone's dropout uses.
        self.sampler = flow.Generator(device=dist.device_type)
        self.sampler.manual_seed(seed * 1000 + 104729 * (dist.rank + 1))
        self.index: flow.Tensor | None = None
        """This shard's columns sampled by the last forward (sampling pfc), ascending."""
        self.rows: flow.Tensor | None = None
        """The last forward's sampled rows of the shard, padded (sparse pfc): a leaf whose
        ``grad`` the backward fills; :meth:`sparse_step` reads it."""
        self.momentum: flow.Tensor | None = None
        """The sparse update's momentum, one row per row of the shard (local)."""
        self.in_graph = False
        """A sharded head inside an ``nn.Graph`` (``graph_step.py``), set by the graph step.
        Two things then differ, both measured on 2 ranks against the eager step:

        - the log-sum-exp is shifted by the logits' bound, the scale ``s``, not by each row's
          max: the max of split(1) logits over their split axis cannot read each rank's shard
          there (``to_local`` is not allowed in a graph), and OneFlow's own reduction would
          move the [N, C] logits between ranks. Every logit is at most ``s`` (a cosine, or the
          margin's target logit, times ``s``), so no exponential overflows; the sum underflows
          only where every cosine of a row is below ``1 - 103 / s`` (-0.6 at s = 64).
        - the gathered embeddings' gradient is made ``split(0)`` (each rank's rows of the
          summed gradient) as it leaves the head: left to itself, a graph hands the backbone's
          last BatchNorm a gradient of another SBP, and its backward then mixes the ranks'
          batches (the backbone's updates 2% to 12% off the eager step's; with ``split(0)``
          within 4e-6)."""

    @property
    def update(self) -> str:
        """Which class-matrix update runs: ``full`` (no sampling), ``sparse`` or ``dense``."""
        if not self.sampling:
            return "full"
        return "sparse" if self.sparse else "dense"

    def set_weight(self, full_matrix: Any) -> None:
        """Load the whole class matrix [C, D] (a numpy array, the same on every rank); a
        sharded head keeps its rows (slicing a broadcast tensor to split(0) moves nothing)."""
        if tuple(full_matrix.shape) != tuple(self.weight.shape):
            raise ValueError(f"head weight {tuple(full_matrix.shape)} does not fit the head's "
                             f"{tuple(self.weight.shape)}")
        value = flow.tensor(full_matrix, dtype=self.weight.dtype)
        if self.sharded:
            value = value.to_global(placement=self.dist.placement, sbp=flow.sbp.broadcast)
            value = value.to_global(sbp=flow.sbp.split(0))
        else:
            value = value.to(self.dist.device)
        with flow.no_grad():
            self.weight.copy_(value)

    def local_weight(self) -> flow.Tensor:
        """This rank's rows of the class matrix (a view, no copy)."""
        return self.weight.to_local() if self.sharded else self.weight

    def sample_sizes(self, labels: flow.Tensor) -> list[int]:
        """How many columns each rank samples for the gathered ``labels`` (a global
        ``broadcast`` [N]): its ``num_sample``, or its count of distinct positives where that is
        more. Only where N exceeds some rank's ``num_sample`` can that happen, and only then are
        the labels read back."""
        if labels.shape[0] <= min(self.num_samples):
            return list(self.num_samples)
        # Deliberate sync: every rank needs every shard's positives to size the pieces alike.
        ids = np.unique(labels.to_local().numpy())
        return [max(n, int(np.searchsorted(ids, start + count) - np.searchsorted(ids, start)))
                for n, (start, count) in zip(self.num_samples, self.shards)]

    def _sampled_columns(self, labels: flow.Tensor, scores: flow.Tensor | None
                         ) -> tuple[flow.Tensor, flow.Tensor, flow.Tensor | None]:
        """(the sampled rows of every shard as a global ``split(0)`` matrix, their class ids as
        a global [1, S] ``split(1)`` row, and where ranks' pieces are padded a [1, S] float
        ``split(1)`` mask of the real columns, else None) for the gathered ``labels``."""
        dist = self.dist
        sizes = self.sample_sizes(labels)
        size, padded = sizes[dist.rank], max(sizes)
        local = labels.to_local() - self.start
        local = flow.where((local >= 0) & (local < self.count), local,
                           flow.full_like(local, -1))
        if scores is None:
            scores = flow.rand(self.count, generator=self.sampler, device=dist.device)
        self.index = index = sample_classes(local, self.count, size, scores)
        ids = index + self.start
        if padded > size:
            # Padding repeats column 0's row; its id -1 is no label's.
            index = flow.cat([index, flow.zeros(padded - size, dtype=index.dtype,
                                                device=index.device)])
            ids = flow.cat([ids, flow.full((padded - size,), -1, dtype=ids.dtype,
                                           device=ids.device)])
        if self.sparse:
            # A leaf of its own: the backward stops at the sampled rows.
            self.rows = flow.index_select(self.local_weight().detach(), 0, index)
            self.rows.requires_grad_()
            rows = self.rows
        else:
            rows = flow.index_select(self.local_weight(), 0, index)
        mask = None
        if padded > min(sizes):
            mask = self._split(ids.unsqueeze(0) >= 0, 1).to(rows.dtype)
        return self._split(rows, 0), self._split(ids.unsqueeze(0), 1), mask

    def _split(self, local: flow.Tensor, dim: int) -> flow.Tensor:
        """Every rank's ``local`` (of one shape on every rank) as the pieces of one global
        tensor split along ``dim``."""
        return local.to_global(placement=self.dist.placement, sbp=flow.sbp.split(dim),
                               check_meta=False)

    def _to_broadcast(self, x: flow.Tensor) -> flow.Tensor:
        """A ``partial_sum`` or ``split`` global tensor made whole on every rank; its gradient
        stays ``broadcast`` (see the module docstring)."""
        return x.to_global(sbp=flow.sbp.broadcast, grad_sbp=flow.sbp.broadcast)

    def _gather(self, local: flow.Tensor) -> flow.Tensor:
        """Every rank's rows of ``local`` in rank order, as a global ``broadcast`` tensor (its
        gradient: this rank's rows of the summed gradients)."""
        if self.in_graph:
            # Already global split(0) there; the gradient's SBP must be said (``in_graph``).
            return local.to_global(sbp=flow.sbp.broadcast, grad_sbp=flow.sbp.split(0))
        return self._split(local, 0).to_global(sbp=flow.sbp.broadcast)

    def _row_max(self, logits: flow.Tensor) -> flow.Tensor:
        """max_j logits[i, j] over every shard, without gradient (the log-sum-exp does not
        depend on the shift; a padded column's logit is a real cosine's, so it only shifts)."""
        if not self.sharded:
            return flow.amax(logits.detach(), dim=1)
        local = flow.amax(logits.detach().to_local(), dim=1)
        per_rank = self._split(local.unsqueeze(0), 0)
        return flow.amax(per_rank.to_global(sbp=flow.sbp.broadcast), dim=0)

    def forward(self, emb: flow.Tensor, labels: flow.Tensor, keep_logits: bool = False,
                scores: flow.Tensor | None = None, per_sample: bool = False) -> flow.Tensor:
        """Mean loss of the batch: this rank's (dp) or the gathered global batch's (mp, pfc; a
        global ``broadcast`` scalar). ``emb`` [n, D] is this rank's embeddings, ``labels`` [n]
        its class ids (int64). With ``keep_logits`` (tests) this rank's scaled logits [N,
        count] (its sampled columns' [N, S] in a sampling pfc) are kept in ``self.logits``;
        ``scores`` (tests) [count] ranks this shard's negatives instead of a uniform draw;
        ``per_sample``: each sample's loss, not their mean (graph mode, ``graph_step.py``,
        whose dp batch is one global ``split(0)`` tensor: the mean of this rank's part is the
        loss an eager run records)."""
        m1, m2, m3 = self.margins
        s = self.scale
        e = at_least_fp32(emb)
        if self.sharded:
            e = self._gather(e)
            labels = self._gather(labels)
        e_hat = F.normalize(e, p=2.0, dim=1, eps=NORM_EPS)
        w, classes, real = self.weight, self.classes, None
        if self.sampling:
            w, classes, real = self._sampled_columns(labels, scores)
        cos = F.linear(e_hat, F.normalize(w, p=2.0, dim=1, eps=NORM_EPS))  # [N, C]
        onehot = classes == labels.unsqueeze(1)                           # [N, C] bool
        target = (cos * onehot.to(cos.dtype)).sum(dim=1)                  # [N]
        if self.sharded:
            target = self._to_broadcast(target)
        value = margin_target_logit(target, m1, m2, m3, self.straight_through) * s
        # The value expanded to the logits' shape: with an [N, 1] operand OneFlow would gather
        # the split(1) logits whole on every rank to pick them.
        logits = flow.where(onehot, value.unsqueeze(1).expand(*cos.shape), cos * s)
        if keep_logits:
            kept = logits.to_local() if self.sharded else logits
            if self.sampling:
                kept = kept[:, :self.index.shape[0]]
            self.logits = kept.detach().clone()
        if self.in_graph:
            row_max: flow.Tensor | float = s
            exp = flow.exp(logits - s)
        else:
            row_max = self._row_max(logits)
            exp = flow.exp(logits - row_max.unsqueeze(1))
        if real is not None:
            exp = exp * real
        row_sum = exp.sum(dim=1)
        if self.sharded:
            row_sum = self._to_broadcast(row_sum)
        # The log-sum-exp form: exact where the target probability underflows.
        losses = flow.log(row_sum) + row_max - value
        return losses if per_sample else losses.mean()

    def sparse_step(self, lr: float, momentum: float, weight_decay: float) -> None:
        """torch's SGD on the rows the last forward sampled, with their own momentum (sparse
        pfc): ``buf = m * buf + g + wd * w; w -= lr * buf`` on those rows only. A row's first
        update finds its momentum zero, which makes it torch's first step (``buf = d``). In the
        weight's dtype, scalars included (float64 in an alignment run)."""
        if self.rows is None or self.rows.grad is None:
            return
        with flow.no_grad():
            size = self.index.shape[0]
            rows, grad = self.rows.detach()[:size], self.rows.grad[:size]
            weight = self.local_weight()
            if self.momentum is None:
                self.momentum = flow.zeros_like(weight.detach())
            buf = flow.index_select(self.momentum, 0, self.index) * momentum \
                + (grad + rows * weight_decay)
            self.momentum[self.index] = buf
            weight[self.index] = rows - buf * lr
            self.rows = None
