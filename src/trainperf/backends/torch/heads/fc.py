"""The classification head of face workloads in its three modes.

- ``dp``: every rank holds the whole class matrix; its gradient is averaged with the backbone's.
- ``mp``: rank r holds a balanced shard of the classes; embeddings and labels are gathered from
  every rank and the softmax runs across shards.
- ``pfc``: ``mp`` where each rank computes only on the classes it sampled this step: every
  positive class of the global batch that lives in its shard, topped up with random negatives
  to ``sample_ratio`` of the shard. At ratio 1.0 nothing is sampled and it is exactly ``mp``.

With a ``sparse`` update only the sampled rows are normalised, multiplied and updated, with
momentum kept per row (as the Partial FC paper and PLSC do); a ``dense`` update reproduces
arcface_torch: a whole-matrix gradient, momentum and weight decay every step.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..dist import DistContext, all_gather, all_gather_with_grad, shard_range
from .margin import apply_margin_
from .normalized_linear import normalized_linear
from .softmax import sharded_cross_entropy


def sample_classes(local_labels: torch.Tensor, num_local: int, num_sample: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``num_sample`` class columns of a shard, every positive among them.

    ``local_labels`` holds each gathered sample's column in this shard, or -1. Returns the sorted
    column index [S] and the labels remapped into it (-1 kept). S is ``num_sample`` unless the
    positives alone are more; only then does the count cost a device-to-host sync.
    """
    device = local_labels.device
    has = local_labels >= 0
    # One spare slot takes the samples of other shards, so no boolean mask (and no sync) is
    # needed. Positives score 2 and so always beat the uniform [0, 1) scores of the negatives.
    score = torch.rand(num_local + 1, device=device)
    score.index_fill_(0, torch.where(has, local_labels, num_local), 2.0)
    score = score[:num_local]
    count = num_sample
    if local_labels.numel() > num_sample:
        # More samples than slots: the positives might not fit. Deliberate sync to count them.
        count = max(num_sample, int((score == 2.0).sum()))
    index = torch.topk(score, count, sorted=False).indices.sort().values
    remapped = torch.where(has, torch.searchsorted(index, local_labels.clamp_min(0)), local_labels)
    return index, remapped


class MarginSoftmaxHead(nn.Module):
    def __init__(self, num_classes: int, embedding_size: int, margins: tuple[float, float, float],
                 scale: float, ctx: DistContext, mode: str = "dp", sample_ratio: float = 1.0,
                 update: str = "sparse", generator: torch.Generator | None = None) -> None:
        super().__init__()
        if mode not in ("dp", "mp", "pfc"):
            raise ValueError(f"unknown fc mode {mode!r}")
        self.mode = mode
        self.ctx = ctx
        self.margins = margins
        self.scale = scale
        self.sharded = mode != "dp"
        self.class_start, self.num_local = (
            shard_range(num_classes, ctx) if self.sharded else (0, num_classes)
        )
        self.sampling = mode == "pfc" and sample_ratio < 1.0
        self.num_sample = max(1, int(sample_ratio * self.num_local))
        self.sparse = self.sampling and update == "sparse"
        # Drawn where it will live: millions of classes drawn on the host take minutes, and a
        # capacity search draws them for every probe.
        where = generator.device if generator is not None else ctx.device
        weight = torch.empty(self.num_local, embedding_size, device=where)
        weight.normal_(0.0, 0.01, generator=generator)
        if self.sparse:
            # The optimizer never sees the full matrix: SampledRowsSGD writes the rows back.
            self.register_buffer("weight", weight)
            self.register_buffer("momentum_rows", torch.zeros_like(weight))
            self.rows = nn.Parameter(torch.empty(0, embedding_size))
        else:
            self.weight = nn.Parameter(weight)
        self.index: torch.Tensor | None = None
        """Shard columns sampled by the last forward (pfc below ratio 1 only)."""
        self.straight_through = False
        """Pass the margin's gradient straight through (an alignment control only)."""

    @property
    def update(self) -> str:
        if not self.sampling:
            return "full"
        return "sparse" if self.sparse else "dense"

    def _select(self, embeddings: torch.Tensor, labels: torch.Tensor):
        if self.sharded:
            embeddings = all_gather_with_grad(embeddings, self.ctx)
            labels = all_gather(labels, self.ctx)
        local = labels - self.class_start
        local = torch.where((local >= 0) & (local < self.num_local), local, -1)
        if not self.sampling or not self.training:
            # Evaluation (eval mode) scores every class of the shard: the loss of the model,
            # not of one step's sample.
            return embeddings, local, self.weight
        index, local = sample_classes(local, self.num_local, self.num_sample)
        self.index = index
        if not self.sparse:
            return embeddings, local, self.weight.index_select(0, index)
        rows = self.rows.data
        if rows.shape[0] == index.numel():
            torch.index_select(self.weight, 0, index, out=rows)  # reuse: no fresh pages
        else:
            self.rows.data = self.weight.index_select(0, index)
        self.rows.grad = None
        return embeddings, local, self.rows

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        embeddings, local_labels, weight = self._select(embeddings, labels)
        cos = normalized_linear(F.normalize(embeddings), weight)
        logits = apply_margin_(cos, local_labels, *self.margins, self.scale,
                               self.straight_through)
        return sharded_cross_entropy(logits, local_labels, self.ctx if self.sharded else
                                     DistContext(device=self.ctx.device))


class SampledRowsSGD(torch.optim.Optimizer):
    """SGD with momentum and weight decay on the rows a sparse Partial FC head sampled this step.

    Its one parameter is ``head.rows`` so that loss scaling (loss_scale.py) unscales and checks
    it like any other; ``step`` writes the updated rows and their momentum back into the shard.
    Rows not sampled keep their weights and momentum untouched until they are sampled again.
    """

    def __init__(self, head: MarginSoftmaxHead, lr: float, momentum: float, weight_decay: float
                 ) -> None:
        if not head.sparse:
            raise ValueError("SampledRowsSGD needs a sparse Partial FC head")
        super().__init__([head.rows], dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.head = head

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - Optimizer API
        group = self.param_groups[0]
        head = self.head
        rows = head.rows
        if rows.grad is None or head.index is None:
            return None
        index = head.index
        grad = rows.grad.add_(rows, alpha=group["weight_decay"])  # the step owns this grad
        buf = head.momentum_rows.index_select(0, index).mul_(group["momentum"]).add_(grad)
        head.momentum_rows.index_copy_(0, index, buf)
        head.weight.index_copy_(0, index, rows.sub_(buf, alpha=group["lr"]))
        return None
