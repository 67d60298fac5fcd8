"""The torch side of strict alignment: write the shared starting point, load it in a run, and
give each step's state for the dump.

The file (layout in ``trainperf.config.AlignSpec.start``) holds torch's initial backbone, one
class matrix drawn with numpy, and one batch per rank drawn with numpy, so nothing in it depends
on which framework reads it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...config import Workload
from ..workerkit import StepState
from .backbones import workload_backbone
from .dist import DistContext
from .step import TrainStep


def write_start(workload: Workload, world_size: int, path: Path) -> int:
    """Write the starting point of ``world_size`` ranks to ``path`` (.npz); returns the
    backbone's parameter count."""
    torch.manual_seed(workload.seed)
    backbone = workload_backbone(workload)
    arrays = {f"backbone/{k}": v.detach().numpy().copy()
              for k, v in backbone.state_dict().items() if not k.endswith("num_batches_tracked")}
    rng = np.random.default_rng(workload.seed + 12345)
    if workload.task == "face":
        arrays["head/weight"] = rng.normal(
            0.0, 0.01, (workload.num_classes, workload.embedding_size)).astype(np.float32)
    side = workload.input_size
    for rank in range(world_size):
        arrays[f"images/{rank}"] = rng.standard_normal(
            (workload.batch_size, 3, side, side)).astype(np.float32)
        arrays[f"labels/{rank}"] = rng.integers(0, workload.num_classes, workload.batch_size,
                                                dtype=np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return sum(p.numel() for p in backbone.parameters())


def load_start(step: TrainStep, path: str, ctx: DistContext
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Set the step's weights from ``path``; returns this rank's batch from it."""
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    state = {k[len("backbone/"):]: torch.from_numpy(v) for k, v in arrays.items()
             if k.startswith("backbone/")}
    missing, unexpected = step.backbone.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise ValueError(f"{path} does not fit {step.workload.backbone}: missing {missing}, "
                         f"unexpected {unexpected}")
    head = step.head
    if head is not None:
        rows = arrays["head/weight"][head.class_start:head.class_start + head.num_local]
        with torch.no_grad():
            head.weight.copy_(torch.from_numpy(rows))
    dtype = next(step.backbone.parameters()).dtype
    images = torch.from_numpy(arrays[f"images/{ctx.rank}"]).to(ctx.device, dtype)
    labels = torch.from_numpy(arrays[f"labels/{ctx.rank}"]).to(ctx.device)
    if step.workload.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels


def step_state(step: TrainStep) -> StepState:
    """The step's weights and BatchNorm statistics after its last update, by torch name (the
    start file's names), with its gradient norm before clipping and its rate."""
    arrays = {f"backbone/{k}": v.detach().cpu().numpy().copy()
              for k, v in step.backbone.state_dict().items()
              if not k.endswith("num_batches_tracked")}
    if step.head is not None:
        arrays["head/weight"] = step.head.weight.detach().cpu().numpy().copy()
    norm = step.last_grad_norm
    return StepState(arrays, None if norm is None else float(norm), float(step.lr))
