"""Combined margin: the target logit becomes s * (cos(m1 * theta + m2) - m3).

ArcFace is (1, 0.5, 0), CosFace (1, 0, 0.4), plain softmax (1, 0, 0). The margin is applied to the
one target logit per sample, in fp32 whatever the training precision, and the gradient is the
true derivative (insightface's arcface_torch passes it straight through instead).
"""

from __future__ import annotations

import math

import torch

# acos' derivative is infinite at +-1; clamping keeps every gradient finite. At 1 - 1e-6 the
# ArcFace factor sin(theta + m2) / sin(theta) is about 340, large but finite.
COS_EPS = 1e-6


def margin_target_logit(cos_t: torch.Tensor, m1: float, m2: float, m3: float) -> torch.Tensor:
    """Unscaled target logit for target cosines ``cos_t`` (any shape, computed in fp32).

    Where m1 * theta + m2 would pass pi, cos() would turn back up and reward a worse angle; there
    the logit continues as cos(theta) - m3 - (1 + cos(theta_max)), theta_max = (pi - m2) / m1,
    which meets the margin curve at theta_max and keeps falling as theta grows.
    """
    c = cos_t.float()
    if m1 == 1.0 and m2 == 0.0:
        return c - m3  # CosFace and plain softmax need no angle
    theta = torch.acos(c.clamp(-1.0 + COS_EPS, 1.0 - COS_EPS))
    theta_max = (math.pi - m2) / m1
    with_margin = torch.cos(m1 * theta + m2) - m3
    beyond = c - m3 - (1.0 + math.cos(theta_max))
    return torch.where(theta <= theta_max, with_margin, beyond)


def apply_margin_(cos: torch.Tensor, local_labels: torch.Tensor, m1: float, m2: float, m3: float,
                  scale: float) -> torch.Tensor:
    """Scaled logits from cosines [N, C]; ``local_labels[i]`` is the column of sample i's class in
    this shard, or -1 when its class lives elsewhere. Returns fp32 logits; an fp32 ``cos`` is
    modified in place (the class-matrix product does not keep its output for backward, and a
    copy of an [N, C] tensor is the largest allocation of the head)."""
    logits = cos.float()
    rows = torch.arange(logits.shape[0], device=logits.device)
    has = local_labels >= 0
    cols = local_labels.clamp_min(0)
    target = logits[rows, cols]
    new_target = torch.where(has, margin_target_logit(target, m1, m2, m3), target)
    logits.index_put_((rows, cols), new_target)
    return logits.mul_(scale)
