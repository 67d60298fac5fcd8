"""The margin-softmax head of face workloads, equal to torch's ``MarginSoftmaxHead`` (dp, mp).

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

    e_hat = e / max(|e|, 1e-12)            inv_j = 1 / max(|w_j|, 1e-12)
    cos   = (e_hat @ w.T) * inv            (no normalised copy of the class matrix)
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

The margin is the combined cos(m1 * theta + m2) - m3 of torch's ``margin.py``: the target cosine
is clamped to [-1 + 1e-6, 1 - 1e-6] before arccos (the clamp passes no gradient outside), and
past theta_max = (pi - m2) / m1 the logit continues as cos(theta) - m3 - (1 + cos(theta_max)).
CosFace and plain softmax (m1 = 1, m2 = 0) are c - m3. The head runs in fp32 whatever the
precision, or in float64 where the embeddings and the class matrix are (an alignment run's).

``straight_through`` (an alignment run's negative control only, ``AlignSpec.breaks``): the
target logit keeps the margin's value, but its gradient reaches the cosine unchanged
(derivative 1), as insightface's arcface_torch computes it.
"""

from __future__ import annotations

import math
from typing import Any

import oneflow.nn as nn
import oneflow.nn.functional as F

import oneflow as flow

from ..base import require
from ..layouts import shard_of
from .backend import BACKEND
from .dist import Dist

COS_EPS = 1e-6
NORM_EPS = 1e-12
FC_MODES = ("dp", "mp")


def check_fc(mode: str) -> None:
    """ValueError unless the backend's declaration runs head mode ``mode``."""
    require(BACKEND.head_refusal(mode))


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
    """The class matrix (``weight``: local [C, D] in dp, global ``split(0)`` in mp) and the loss
    of a batch against it."""

    def __init__(self, num_classes: int, embedding_size: int,
                 margins: tuple[float, float, float], scale: float, dist: Dist,
                 mode: str = "dp", seed: int = 0, dtype: flow.dtype = flow.float32,
                 straight_through: bool = False) -> None:
        super().__init__()
        check_fc(mode)
        self.mode = mode
        self.straight_through = straight_through
        self.dist = dist
        self.margins = tuple(float(m) for m in margins)
        self.scale = float(scale)
        self.sharded = mode == "mp"
        self.num_classes = num_classes
        self.start, self.count = (shard_of(num_classes, dist.rank, dist.world_size)
                                  if self.sharded else (0, num_classes))
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

    def _to_broadcast(self, x: flow.Tensor) -> flow.Tensor:
        """A ``partial_sum`` or ``split`` global tensor made whole on every rank; its gradient
        stays ``broadcast`` (see the module docstring)."""
        return x.to_global(sbp=flow.sbp.broadcast, grad_sbp=flow.sbp.broadcast)

    def _gather(self, local: flow.Tensor) -> flow.Tensor:
        """Every rank's rows of ``local`` in rank order, as a global ``broadcast`` tensor (its
        gradient: this rank's rows of the summed gradients)."""
        piece = local.to_global(placement=self.dist.placement, sbp=flow.sbp.split(0),
                                check_meta=False)
        return piece.to_global(sbp=flow.sbp.broadcast)

    def _row_max(self, logits: flow.Tensor) -> flow.Tensor:
        """max_j logits[i, j] over every shard, without gradient (the log-sum-exp does not
        depend on the shift)."""
        if not self.sharded:
            return flow.amax(logits.detach(), dim=1)
        local = flow.amax(logits.detach().to_local(), dim=1)
        per_rank = local.unsqueeze(0).to_global(placement=self.dist.placement,
                                                sbp=flow.sbp.split(0), check_meta=False)
        return flow.amax(per_rank.to_global(sbp=flow.sbp.broadcast), dim=0)

    def forward(self, emb: flow.Tensor, labels: flow.Tensor,
                keep_logits: bool = False) -> flow.Tensor:
        """Mean loss of the batch: this rank's (dp) or the gathered global batch's (mp, a global
        ``broadcast`` scalar). ``emb`` [n, D] is this rank's embeddings, ``labels`` [n] its
        class ids (int64). With ``keep_logits`` (tests) this rank's scaled logits [N, count]
        are kept in ``self.logits``."""
        m1, m2, m3 = self.margins
        s = self.scale
        e = at_least_fp32(emb)
        if self.sharded:
            e = self._gather(e)
            labels = self._gather(labels)
        e_hat = F.normalize(e, p=2.0, dim=1, eps=NORM_EPS)
        w = self.weight
        inv = 1.0 / flow.clamp(flow.linalg.vector_norm(w, dim=1), min=NORM_EPS)
        cos = F.linear(e_hat, w) * inv.unsqueeze(0)                       # [N, C]
        onehot = self.classes == labels.unsqueeze(1)                      # [N, C] bool
        target = (cos * onehot.to(cos.dtype)).sum(dim=1)                  # [N]
        if self.sharded:
            target = self._to_broadcast(target)
        value = margin_target_logit(target, m1, m2, m3, self.straight_through) * s
        # The value expanded to the logits' shape: with an [N, 1] operand OneFlow would gather
        # the split(1) logits whole on every rank to pick them.
        logits = flow.where(onehot, value.unsqueeze(1).expand(*cos.shape), cos * s)
        if keep_logits:
            self.logits = (logits.to_local() if self.sharded else logits).detach().clone()
        row_max = self._row_max(logits)
        row_sum = flow.exp(logits - row_max.unsqueeze(1)).sum(dim=1)
        if self.sharded:
            row_sum = self._to_broadcast(row_sum)
        # The log-sum-exp form: exact where the target probability underflows.
        return (flow.log(row_sum) + row_max - value).mean()
