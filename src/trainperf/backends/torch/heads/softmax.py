"""Cross-entropy over logits whose classes are sharded across ranks.

Each rank holds logits [N, C_local] for the same N samples (the gathered global batch). The
softmax needs the row max and the row sum of exponentials over all shards: two all-reduces of N
numbers, plus one for the target logit. The loss is the mean over the N samples, identical on
every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dist import DistContext, all_reduce_


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(fctx, logits: torch.Tensor, local_labels: torch.Tensor, ctx: DistContext
                ) -> torch.Tensor:
        n = logits.shape[0]
        row_max = logits.max(dim=1).values
        all_reduce_(row_max, ctx, dist.ReduceOp.MAX)
        probs = (logits - row_max[:, None]).exp_()
        row_sum = probs.sum(dim=1)
        all_reduce_(row_sum, ctx)
        probs.div_(row_sum[:, None])

        rows = torch.arange(n, device=logits.device)
        has = local_labels >= 0
        cols = local_labels.clamp_min(0)
        target_logit = torch.where(has, logits[rows, cols], torch.zeros_like(row_max))
        all_reduce_(target_logit, ctx)
        # log-sum-exp form: exact where the target probability underflows (no -log(1e-30) clamp).
        loss = (row_sum.log() + row_max - target_logit).mean()

        fctx.save_for_backward(probs, local_labels)
        fctx.n = n
        return loss

    @staticmethod
    def backward(fctx, grad_loss: torch.Tensor):
        probs, local_labels = fctx.saved_tensors
        rows = torch.arange(probs.shape[0], device=probs.device)
        has = local_labels >= 0
        cols = local_labels.clamp_min(0)
        grad = probs  # reuse the saved buffer: backward runs once per step
        grad.index_put_((rows, cols), grad[rows, cols] - has.to(grad.dtype))
        grad.mul_(grad_loss / fctx.n)
        return grad, None, None


def sharded_cross_entropy(logits: torch.Tensor, local_labels: torch.Tensor,
                          ctx: DistContext) -> torch.Tensor:
    """Mean cross-entropy of fp32 ``logits`` [N, C_local]; ``local_labels`` is -1 for samples
    whose class is on another rank. With ``ctx`` not distributed it is plain cross-entropy."""
    return _ShardedCrossEntropy.apply(logits, local_labels, ctx)
