"""Synthetic data: random images and labels made on the device once, never zeros."""

from __future__ import annotations

import torch

from ...config import Workload
from .dist import DistContext


def synthetic_batch(workload: Workload, ctx: DistContext) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch per rank, seeded by (seed, rank) so ranks see different samples."""
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(workload.seed * 1000 + ctx.rank + 1)
    side = workload.input_size
    images = torch.randn((workload.batch_size, 3, side, side), generator=gen, device=ctx.device)
    labels = torch.randint(0, workload.num_classes, (workload.batch_size,), generator=gen,
                           device=ctx.device)
    if workload.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels
