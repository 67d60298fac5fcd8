"""Checks every framework backend's tests share (main environment: torch and numpy)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import oracle


def randomise_norm_layers(model: nn.Module) -> None:
    """BN and PReLU values away from torch's initial ones (gammas 1, or 0 in ResNet v1b, betas
    0), so that a layout or mapping mix-up in a converted model cannot hide behind them."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.weight.requires_grad:
                    m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
            elif isinstance(m, nn.PReLU):
                m.weight.uniform_(0.1, 0.4)


def check_recorded_sgd_steps(got, count: int, backbone: int, rates, clip: float | None) -> None:
    """A backend recorded, for step i and trainable array j, ``{i}/{j}/before``, ``grad`` and
    ``after``: each step must equal torch's SGD (oracle.sgd_momentum_step, momentum 0.9, weight
    decay 5e-4) at ``rates[i]`` on those gradients, the first ``backbone`` arrays clipped to
    the global norm ``clip`` (the head's never), and the clipping must have acted."""
    bufs: list = [None] * count
    coefs = []
    for i, lr in enumerate(rates):
        grads = [got[f"{i}/{j}/grad"].astype(np.float64) for j in range(count)]
        if clip is not None:
            norm = np.sqrt(sum(float((g * g).sum()) for g in grads[:backbone]))
            coefs.append(min(clip / (norm + 1e-6), 1.0))
            grads = [g * coefs[-1] for g in grads[:backbone]] + grads[backbone:]
        for j in range(count):
            want, bufs[j] = oracle.sgd_momentum_step(got[f"{i}/{j}/before"], grads[j], bufs[j],
                                                     lr, 0.9, 5e-4)
            np.testing.assert_allclose(got[f"{i}/{j}/after"], want, rtol=1e-5,
                                       atol=1e-6 * max(np.abs(want).max(), 1.0),
                                       err_msg=f"step {i} array {j}")
    if clip is not None:
        assert max(coefs) < 1.0  # clipping acted


def close_to_max(got, want, rtol: float = 1e-5, what: str = "") -> None:
    """Same shape, and every entry within ``rtol`` of the largest entry of ``want``."""
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, what
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= rtol, f"{what}: max error {err:.3g} of the largest entry"


def head_inputs(seed: int, n: int, d: int, c: int) -> dict[str, np.ndarray]:
    """Embeddings, an unnormalised class matrix and labels, with one target at cos = 1 (the
    clamped band), one at cos = -1 (past theta_max) and one class shared by two samples."""
    rng = np.random.RandomState(seed)
    emb = rng.randn(n, d).astype(np.float32)
    weight = (rng.randn(c, d) * 0.05).astype(np.float32)
    labels = rng.choice(c, size=n, replace=False)
    labels[3] = labels[2]
    weight[labels[0]] = emb[0] * 0.03
    weight[labels[1]] = -emb[1] * 0.04
    return {"emb": emb, "weight": weight, "labels": labels.astype(np.int64)}
