"""Dynamic fp16 loss scaling whose skip decision is one decision for every rank and optimizer.

Why not ``torch.amp.GradScaler``: it decides by itself, on each rank and for each optimizer,
whether a gradient overflowed. In ``mp`` and ``pfc`` every rank holds a different shard of the
class matrix, so one rank can find an inf in its shard's gradient and skip a step that the
others take: the replicated backbone and the loss scales then drift apart. And with a sparse
Partial FC head a rank can even step its backbone optimizer and skip the sampled rows' one.

Here, as Megatron-style trainers do, the step unscales every gradient any of its optimizers will
apply, reduces one found-inf flag with MAX over the run's process group, and every rank then
steps all its optimizers or none and updates its scale from that same flag, so the scales stay
equal. The policy is GradScaler's (``backends.scaling``), run by the same fused device ops,
so the scale and the flag never leave the device; the only host read-back is the skip decision
itself.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from .. import scaling
from .dist import DistContext, all_reduce_


class DynamicLossScaler:
    """Use once per step, in this order: ``scale_loss`` -> backward -> ``unscale_and_check_``
    -> ``should_step`` (then step every optimizer, or none) -> ``update``."""

    def __init__(self, ctx: DistContext, init_scale: float = scaling.INIT,
                 growth_factor: float = scaling.GROWTH, backoff_factor: float = scaling.BACKOFF,
                 growth_interval: int = scaling.INTERVAL) -> None:
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval > 0):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval > 0")
        self.ctx = ctx
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        device = ctx.device
        # One-element tensors: the shape the fused amp ops take.
        self._scale = torch.full((1,), float(init_scale), dtype=torch.float32, device=device)
        self._clean_steps = torch.zeros(1, dtype=torch.int32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self._checked = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale.squeeze(0)

    def unscale_and_check_(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Divide every gradient of ``optimizers`` by the scale in place and agree, over the
        group, on whether any gradient of any rank is inf or NaN."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    grad = p.grad
                    if grad is None:
                        continue
                    if grad.is_sparse:
                        raise ValueError("DynamicLossScaler does not unscale sparse gradients")
                    if grad.device != self._scale.device:
                        raise ValueError(f"a gradient on {grad.device}, the loss scale on "
                                         f"{self._scale.device}: one device per rank expected")
                    by_dtype.setdefault(grad.dtype, []).append(grad)
        self._found_inf.zero_()
        inv_scale = self._scale.double().reciprocal().float()
        # The fused op wants one dtype per call; it only ever sets found_inf, never clears it.
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self._found_inf, inv_scale)
        all_reduce_(self._found_inf, self.ctx, dist.ReduceOp.MAX)
        self._checked = True

    def should_step(self) -> bool:
        """Whether no rank found an overflow this step; the same answer on every rank."""
        assert self._checked, "unscale_and_check_ must run before should_step"
        # Deliberate sync, the one per fp16 step: skipping is host control flow (which optimizer
        # calls run), so the agreed flag has to reach the host. GradScaler.step reads it too.
        return not bool(self._found_inf.item())

    def update(self) -> None:
        """Grow or back off the scale from this step's agreed flag (on the device)."""
        assert self._checked, "unscale_and_check_ must run before update"
        torch._amp_update_scale_(self._scale, self._clean_steps, self._found_inf,
                                 self.growth_factor, self.backoff_factor, self.growth_interval)
        self._checked = False

    def current_scale(self) -> float:
        """The scale the next step will use. Reads it back to the host: call it off the clock."""
        return float(self._scale.item())
