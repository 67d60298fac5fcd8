"""Face verification of a torch backbone on insightface's ``.bin`` sets (read by
``trainperf.data.binset``, scored by ``trainperf.verify``).

As insightface evaluates: each image's embedding plus its horizontal flip's, in eval mode
(BatchNorm running statistics, no dropout), in fp32 whatever the training precision, so the
accuracy is the model's and not the evaluation's arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from ... import verify
from ...data.binset import VerificationSet, read_bin
from ...data.pipeline import FACE_MEAN, FACE_STD


@torch.no_grad()
def embed(backbone: nn.Module, images: np.ndarray, device: torch.device, batch_size: int = 64
          ) -> np.ndarray:
    """[N, D] float32: the embedding of each uint8 HWC RGB image plus its flip's."""
    was_training = backbone.training
    backbone.eval()
    mean = torch.tensor(FACE_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(FACE_STD, device=device).view(1, 3, 1, 1)
    out = []
    try:
        for i in range(0, len(images), batch_size):
            x = torch.from_numpy(images[i:i + batch_size]).to(device)
            x = x.permute(0, 3, 1, 2).float().sub_(mean).div_(std).contiguous()
            e = backbone(x).float() + backbone(torch.flip(x, dims=[3])).float()
            out.append(e.cpu().numpy())
    finally:
        backbone.train(was_training)
    return np.concatenate(out) if out else np.empty((0, 0), np.float32)


def evaluate_sets(backbone: nn.Module, sets: list[VerificationSet],
                  device: torch.device, batch_size: int = 64, far: float = 1e-3
                  ) -> dict[str, dict]:
    """Each set's 10-fold verification figures, by set name."""
    return {s.name: verify.evaluate(embed(backbone, s.images, device, batch_size), s.issame,
                                    far_target=far)
            for s in sets}


def verify_checkpoint(path: str, val_paths: list[str], device_kind: str = "auto",
                      batch_size: int = 64, far: float = 1e-3) -> tuple[str, dict[str, dict]]:
    """The checkpoint folder used and each set's figures for its backbone."""
    from ...config import Workload
    from .backbones import workload_backbone
    from .checkpoint import CheckpointError, read_backbone, read_manifest, resolve
    from .dist import resolve_device

    where = resolve(path)
    workload = Workload.from_dict(read_manifest(where)["workload"])
    if workload.task != "face":
        raise CheckpointError(f"{where} holds a {workload.task} model: verification sets are "
                              "for face embeddings")
    sets = [read_bin(p, size=workload.input_size) for p in val_paths]
    device = resolve_device(device_kind)
    backbone = workload_backbone(workload)
    backbone.load_state_dict(read_backbone(where, "cpu")["model"])
    backbone.to(device)
    return str(where), evaluate_sets(backbone, sets, device, batch_size, far)
