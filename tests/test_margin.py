"""The combined margin against a float64 reference written here, including theta near 0 and pi."""

from __future__ import annotations

import math

import pytest
import torch

from trainperf.backends.torch.heads.margin import apply_margin_, margin_target_logit

CASES = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "softmax": (1.0, 0.0, 0.0),
         "combined": (0.9, 0.4, 0.15)}


def reference(c: float, m1: float, m2: float, m3: float) -> float:
    """Float64 by hand: the margin curve up to theta_max, then the straight continuation."""
    theta = math.acos(c)
    theta_max = (math.pi - m2) / m1
    if theta <= theta_max:
        return math.cos(m1 * theta + m2) - m3
    return c - m3 - (1.0 + math.cos(theta_max))


def reference_grad(c: float, m1: float, m2: float, m3: float) -> float:
    theta = math.acos(c)
    if m1 == 1.0 and m2 == 0.0:
        return 1.0
    if theta > (math.pi - m2) / m1:
        return 1.0
    return m1 * math.sin(m1 * theta + m2) / math.sin(theta)


@pytest.mark.parametrize("name", CASES)
def test_values_and_gradients_match_float64(name):
    m = CASES[name]
    grid = torch.linspace(-0.999, 0.999, 401, dtype=torch.float64)
    c = grid.float().requires_grad_(True)
    out = margin_target_logit(c, *m)
    out.sum().backward()
    for ci, oi, gi in zip(c.detach().double().tolist(), out.detach().tolist(), c.grad.tolist()):
        assert oi == pytest.approx(reference(ci, *m), abs=2e-6)
        assert gi == pytest.approx(reference_grad(ci, *m), rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("name", CASES)
def test_safe_at_theta_zero_and_pi(name):
    m = CASES[name]
    c = torch.tensor([1.0, 1.0 - 1e-9, -1.0, -1.0 + 1e-9, 0.999999], requires_grad=True)
    out = margin_target_logit(c, *m)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(c.grad).all()


@pytest.mark.parametrize("name", ["arcface", "combined"])
def test_monotone_decreasing_in_angle(name):
    """Past theta_max the logit keeps falling: a worse angle is never rewarded."""
    m = CASES[name]
    theta = torch.linspace(0.0, math.pi, 2001, dtype=torch.float64)
    out = margin_target_logit(torch.cos(theta), *m).double()
    assert (out[1:] - out[:-1] <= 1e-6).all()


def test_apply_margin_changes_only_target_columns():
    torch.manual_seed(0)
    cos = torch.rand(5, 7) * 2 - 1
    labels = torch.tensor([0, 3, -1, 6, 2])
    logits = apply_margin_(cos.clone(), labels, *CASES["arcface"], 64.0)
    expected = cos * 64.0
    for i, y in enumerate(labels.tolist()):
        if y >= 0:
            expected[i, y] = 64.0 * reference(float(cos[i, y]), *CASES["arcface"])
    assert torch.allclose(logits, expected, atol=1e-4)
    assert logits.dtype == torch.float32


def test_apply_margin_half_input_gives_fp32():
    cos = (torch.rand(4, 5) * 2 - 1).half()
    logits = apply_margin_(cos, torch.tensor([1, 2, 3, 4]), *CASES["cosface"], 64.0)
    assert logits.dtype == torch.float32
