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


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or as it is when it is wider (float64, an alignment run's)."""
    return t if t.dtype == torch.float64 else t.float()


def margin_target_logit(cos_t: torch.Tensor, m1: float, m2: float, m3: float) -> torch.Tensor:
    """Unscaled target logit for target cosines ``cos_t`` (any shape, computed in fp32 or
    wider).

    Where m1 * theta + m2 would pass pi, cos() would turn back up and reward a worse angle; there
    the logit continues as cos(theta) - m3 - (1 + cos(theta_max)), theta_max = (pi - m2) / m1,
    which meets the margin curve at theta_max and keeps falling as theta grows.
    """
    c = at_least_fp32(cos_t)
    if m1 == 1.0 and m2 == 0.0:
        return c - m3  # CosFace and plain softmax need no angle
    theta = torch.acos(c.clamp(-1.0 + COS_EPS, 1.0 - COS_EPS))
    theta_max = (math.pi - m2) / m1
    with_margin = torch.cos(m1 * theta + m2) - m3
    beyond = c - m3 - (1.0 + math.cos(theta_max))
    return torch.where(theta <= theta_max, with_margin, beyond)


def apply_margin_(cos: torch.Tensor, local_labels: torch.Tensor, m1: float, m2: float, m3: float,
                  scale: float, straight_through: bool = False) -> torch.Tensor:
    """Scaled logits from cosines [N, C]; ``local_labels[i]`` is the column of sample i's class in
    this shard, or -1 when its class lives elsewhere. Returns fp32 logits (float64 from float64
    cosines); an fp32 or float64 ``cos`` is modified in place (the class-matrix product does not
    keep its output for backward, and a copy of an [N, C] tensor is the largest allocation of
    the head)."""
    logits = at_least_fp32(cos)
    rows = torch.arange(logits.shape[0], device=logits.device)
    has = local_labels >= 0
    cols = local_labels.clamp_min(0)
    target = logits[rows, cols]
    margined = margin_target_logit(target, m1, m2, m3)
    if straight_through:
        # arcface_torch's gradient: the margin's value, but the cosine's derivative (1). Only
        # an alignment run's negative control asks for it (AlignSpec.breaks).
        margined = target + (margined - target).detach()
    new_target = torch.where(has, margined, target)
    logits.index_put_((rows, cols), new_target)
    return logits.mul_(scale)
