"""What a float64 alignment run (``trainperf.config.AlignSpec``) computes itself instead of
OneFlow's kernels, and why.

OneFlow 0.9's kernels run in float64 where their tensors are float64, but BatchNorm's and
SGD's take their hyperparameters as 32-bit ``Float`` attributes (their signatures in
``oneflow._C``), so the numbers they apply are not the ones asked for:

- ``normalization`` (BatchNorm) takes ``momentum`` and ``epsilon`` as floats. 0.1 becomes
  0.100000001490, and each running statistic's update moves by 1.5e-8 of itself, and by more
  where the statistic is large against its update (2.4e-7 measured on a running mean). 1e-5
  becomes 9.99999975e-6, 2.5e-8 less, which shows where the batch has two samples: the
  embedding BatchNorm1d then normalises two values per feature to nearly +-1, and its gradient
  is proportional to epsilon (d/dx of d / sqrt(d^2 + eps) is eps / (d^2 + eps)^1.5), so every
  gradient above it moves by 2.5e-8 (measured: the gradient norm of iresnet100 at batch 2
  by 1.1e-8, its updates by up to 5.8e-7 at the second step). :class:`BatchNorm1d` and
  :class:`BatchNorm2d` write training-mode BatchNorm with tensor operations (OneFlow's
  autograd gives the backward), with the kernel's rule for the running statistics: each moves
  by momentum 0.1 towards the batch mean and the UNBIASED batch variance. That rule is
  torch's too (measured in float32: the kernel's running variance is within 2e-7 of the
  unbiased rule's, and 5e-3 to 7e-2 away from the biased one's), so the backend declares no
  difference of rule.
- ``sgd_update`` and ``momentum_update`` (``oneflow.optim.SGD``, fused or not) take the rate,
  the weight decay and the momentum as floats: 0.1, 5e-4 and 0.9 each lose about 1e-8 of
  themselves, and every update moves by 1.5e-8 to 5e-8 (measured against numpy).
  :class:`SGD` is the kernels' rule written with tensor operations, in the parameters' dtype;
  it is torch's (the weight decay added to the gradient before the momentum, the buffer not
  scaled by the rate). The fused CUDA kernel that GPU runs use (``multi_tensor_momentum_
  update``) reads the same in OneFlow's source; the bridge tests below measure it where
  OneFlow sees a GPU, and the CPU kernel everywhere.

And one module refuses float64 outright: ``nn.parallel.DistributedDataParallel`` asserts that
every parameter is float32 (its gradient buckets are float32 arrays). :class:`DataParallel` does
what it does for a run on several ranks, in the gradients' own dtype: rank 0's parameters sent
to every rank when the module is wrapped; each gradient times 1 / world size, summed over
ranks, after the backward; with ``broadcast_buffers``, rank 0's buffers sent to every rank
before each forward.

Only float64 alignment runs use these (``TrainStep``'s ``dtype``); throughput runs and float32
alignment runs keep OneFlow's kernels. Each stand-in is bridged to the kernel it replaces by a
float32 test on random inputs, where the kernel computes what it is asked
(``tests/test_oneflow_heads.py``): BatchNorm's outputs, gradients, running statistics and eval
output, SGD's weights and momentum buffers through a rate change, and on 2 ranks DDP's
parameters, averaged gradients and broadcast buffers.
"""

from __future__ import annotations

from typing import Iterable

import oneflow as flow
import oneflow.nn as nn

from .dist import Dist


class _ExactBatchNorm:
    """Training-mode BatchNorm in the input's dtype, epsilon and momentum included, by OneFlow's
    kernel's rule: the batch mean and biased variance normalise, the unbiased variance goes into
    the running one. Eval mode is OneFlow's own kernel."""

    def forward(self, x: flow.Tensor) -> flow.Tensor:
        if not self.training:
            return super().forward(x)
        dims = [d for d in range(x.ndim) if d != 1]
        per_channel = [1, x.shape[1]] + [1] * (x.ndim - 2)
        count = x.numel() // x.shape[1]
        mean = x.mean(dim=dims, keepdim=True)
        centred = x - mean
        squares = (centred * centred).sum(dim=dims, keepdim=True)
        out = centred / flow.sqrt(squares / count + self.eps)
        out = out * self.weight.reshape(per_channel) + self.bias.reshape(per_channel)
        with flow.no_grad():
            m = self.momentum
            self.running_mean.copy_(self.running_mean * (1.0 - m) + mean.reshape(-1) * m)
            self.running_var.copy_(self.running_var * (1.0 - m)
                                   + squares.reshape(-1) / (count - 1) * m)
            self.num_batches_tracked.add_(1)
        return out


class BatchNorm1d(_ExactBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` computed in its input's dtype throughout."""


class BatchNorm2d(_ExactBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` computed in its input's dtype throughout."""


class SGD(flow.optim.SGD):
    """OneFlow's SGD with momentum and weight decay (no dampening, no Nesterov), which is
    torch's, in the parameters' own dtype: ``d = g + wd * w``; ``buf = d`` at the first step,
    ``m * buf + d`` after; ``w -= lr * buf``. Only ``step`` differs from OneFlow's: the rate is
    still set through ``param_groups``, and ``zero_grad`` is OneFlow's."""

    def __init__(self, params: Iterable[flow.Tensor], lr: float, momentum: float,
                 weight_decay: float) -> None:
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.buffers: dict[int, flow.Tensor] = {}
        """Momentum buffers by parameter id, in the parameter's dtype and placement."""

    def step(self, closure: None = None) -> None:
        with flow.no_grad():
            for group in self.param_groups:
                lr, m, wd = group["lr"], group["momentum"], group["weight_decay"]
                for p in group.parameters:
                    if p.grad is not None:
                        p.copy_(p - self._direction(p, m, wd) * lr)

    def _direction(self, p: flow.Tensor, m: float, wd: float) -> flow.Tensor:
        """What the rate multiplies: the decayed gradient, through the momentum buffer."""
        d = p.grad + p * wd if wd else p.grad
        if not m:
            return d
        buf = self.buffers.get(id(p))
        buf = d.clone() if buf is None else buf * m + d
        self.buffers[id(p)] = buf
        return buf


class DataParallel(nn.Module):
    """``module`` run on every rank with OneFlow DDP's arithmetic in any dtype: rank 0's
    parameters sent to every rank when wrapped (as DDP's ``broadcast_parameters``), and after
    each backward, :meth:`average_gradients`."""

    def __init__(self, module: nn.Module, dist: Dist, broadcast_buffers: bool) -> None:
        super().__init__()
        self.module = module
        self.dist = dist
        self.broadcast_buffers = broadcast_buffers
        self._broadcast_parameters()

    def _broadcast_parameters(self) -> None:
        """Every parameter made rank 0's, as DDP does when it wraps a module. An alignment run's
        ranks load one start file, so it changes nothing there; it is here so that what this
        wrapper computes is DDP's wherever the ranks start."""
        with flow.no_grad():
            for p in self.module.parameters():
                requires_grad = p.requires_grad
                flow.comm.broadcast(p, 0)
                # OneFlow 0.9's DDP notes that the broadcast can drop requires_grad, and
                # restores it so: done the same way here.
                p.requires_grad_(requires_grad)

    def forward(self, *args: flow.Tensor) -> flow.Tensor:
        if self.broadcast_buffers:
            with flow.no_grad():
                for buffer in self.module.buffers():
                    flow.comm.broadcast(buffer, 0)
        return self.module(*args)

    def average_gradients(self) -> None:
        """Every gradient replaced by its mean over ranks (DDP's order: scaled, then summed)."""
        factor = 1.0 / self.dist.world_size
        with flow.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.copy_(self._sum_over_ranks(p.grad * factor))

    def _sum_over_ranks(self, local: flow.Tensor) -> flow.Tensor:
        """Each rank's ``local`` as one part of a sum, made whole on every rank (an
        all-reduce)."""
        parts = local.to_global(placement=self.dist.placement, sbp=flow.sbp.partial_sum)
        return parts.to_global(sbp=flow.sbp.broadcast).to_local()
