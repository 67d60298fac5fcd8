"""The distributed layout of one run, and collectives that are no-ops in a single process.

A DistContext is built once per process and passed in explicitly; nothing here reads a global
process group, so tests can run any piece with ``group=None``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..base import COLLECTIVE_TIMEOUT_ENV, own_gpu_ordinal
from ..layouts import shard_of

# Newer torch renames all_gather_into_tensor; keep working on both (the package asks torch>=2.4).
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None
    """None in a single process: every collective below is then the identity."""

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    @property
    def backend(self) -> str | None:
        return dist.get_backend(self.group) if self.distributed else None


def resolve_device(kind: str, local_rank: int = 0) -> torch.device:
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but torch sees no GPU "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}, "
                             f"torch {torch.__version__}, CUDA build {torch.version.cuda})")
        return torch.device("cuda", own_gpu_ordinal(local_rank, torch.cuda.device_count(),
                                                    "torch"))
    return torch.device("cpu")


def init_from_env(device_kind: str) -> DistContext:
    """Join the process group described by the environment (``MASTER_ADDR``, ``RANK``...: what
    the launcher sets, as ``torch.distributed.run`` would)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_kind, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        return DistContext(device=device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # A peer that vanishes without closing its connections (a dead node, a cut link) fails
    # the collective after this long instead of torch's default of 10 to 30 minutes.
    timeout = timedelta(seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "1800")))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return DistContext(rank, world_size, local_rank, device, dist.group.WORLD)


def all_reduce_(t: torch.Tensor, ctx: DistContext, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
                ) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(t, op=op, group=ctx.group)
    return t


def all_gather(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every rank along dim 0, rank order (no gradient)."""
    if not ctx.distributed:
        return t
    out = torch.empty((ctx.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _gather_single(out, t.contiguous(), group=ctx.group)
    return out


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(fctx, t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
        fctx.ctx = ctx
        fctx.rows = t.shape[0]
        return all_gather(t, ctx)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        ctx: DistContext = fctx.ctx
        rows = fctx.rows
        grad = grad.contiguous()
        # Every rank holds a partial gradient of the same global loss for all gathered rows;
        # the true gradient of this rank's rows is the sum of those partials.
        if ctx.backend == "nccl":
            out = torch.empty((rows, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad[ctx.rank * rows:(ctx.rank + 1) * rows], None


def all_gather_with_grad(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """all_gather whose backward sends each rank the summed gradient of its own rows."""
    if not ctx.distributed:
        return t
    return _AllGatherWithGrad.apply(t, ctx)


def shard_range(total: int, ctx: DistContext) -> tuple[int, int]:
    """(start, count) of this rank's balanced shard; the first ``total % world`` ranks take one
    more."""
    return shard_of(total, ctx.rank, ctx.world_size)
