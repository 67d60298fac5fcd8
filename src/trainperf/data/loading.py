"""What a real-data feed is set by, on either side of it (standard library only): the per-channel
mean and deviation each task's uint8 images are normalised by on the device, and how many
loader processes a rank gets by default."""

from __future__ import annotations

import os

FACE_MEAN, FACE_STD = (127.5,) * 3, (128.0,) * 3  # insightface: (x - 127.5) / 128
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def mean_std(task: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The per-channel (RGB) mean and deviation a task's uint8 images are normalised by."""
    return (FACE_MEAN, FACE_STD) if task == "face" else (IMAGENET_MEAN, IMAGENET_STD)


def default_workers(local_ranks: int, cpus: int | None = None) -> int:
    """The host's cores per rank less one (the training process keeps a core), 1 to 8."""
    per_rank = (cpus or len(os.sched_getaffinity(0)) or 1) // max(1, local_ranks)
    return max(1, min(8, per_rank - 1))
