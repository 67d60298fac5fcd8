"""The fused normalised linear against the plain composition, in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainperf.backends.torch.heads.normalized_linear import normalized_linear


def test_gradcheck_float64():
    torch.manual_seed(0)
    emb = F.normalize(torch.randn(5, 7, dtype=torch.float64)).requires_grad_(True)
    weight = torch.randn(11, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(normalized_linear, (emb, weight))


def test_equals_normalize_then_linear():
    torch.manual_seed(1)
    emb = F.normalize(torch.randn(6, 16, dtype=torch.float64))
    weight = torch.randn(40, 16, dtype=torch.float64) * 0.01  # init scale of the class matrix
    a_e, a_w = emb.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    b_e, b_w = emb.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    grad = torch.randn(6, 40, dtype=torch.float64)
    ours = normalized_linear(a_e, a_w)
    ref = F.linear(b_e, F.normalize(b_w))
    ours.backward(grad)
    ref.backward(grad)
    assert torch.allclose(ours, ref, rtol=1e-12, atol=1e-14)
    assert torch.allclose(a_e.grad, b_e.grad, rtol=1e-10)
    assert torch.allclose(a_w.grad, b_w.grad, rtol=1e-10)


def test_autocast_computes_in_low_precision_and_returns_fp32_gradients():
    emb = F.normalize(torch.randn(4, 8)).requires_grad_(True)
    weight = torch.randn(10, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cos = normalized_linear(emb, weight)
    assert cos.dtype == torch.bfloat16
    cos.float().sum().backward()
    assert weight.grad.dtype == torch.float32 and emb.grad.dtype == torch.float32
    ref = F.linear(emb.detach(), F.normalize(weight.detach()))
    assert torch.allclose(cos.float(), ref, atol=2e-2)
