"""Where a run's batches come from: synthetic tensors made on the device once (never zeros), or
a RecordIO dataset through the input pipeline (``trainperf.data.pipeline``)."""

from __future__ import annotations

import os

import torch

from ...config import DataSpec, Workload
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


def real_feed(data: DataSpec, workload: Workload, ctx: DistContext, start: int = 0):
    """The rank's feed of real batches and its description, ``start`` samples into the rank's
    stream. ``TRAINPERF_DATA_TRACE`` (tests) names a folder where each rank writes the samples
    it was fed."""
    from ...data.pipeline import open_feed

    trace_dir = os.environ.get("TRAINPERF_DATA_TRACE")
    return open_feed(
        data.prefix, task=workload.task, size=workload.input_size,
        num_classes=workload.num_classes, batch_size=workload.batch_size, rank=ctx.rank,
        world=ctx.world_size, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        seed=workload.seed, device=ctx.device, decoder=data.decoder,
        workers=data.loader_workers, prefetch_batches=data.prefetch_batches,
        channels_last=workload.channels_last, start=start,
        trace=os.path.join(trace_dir, f"w{ctx.world_size}_rank{ctx.rank}.txt") if trace_dir else None)
