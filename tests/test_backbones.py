"""Backbones: tiny variants run; published sizes have the published parameters and FLOPs."""

from __future__ import annotations

import pytest
import torch

from trainperf.backends.torch.backbones import backbone_names, build_backbone, get_spec
from trainperf.backends.torch.flops import backbone_profile, train_flops_per_sample

# name, input side, extra kwargs, published params (M), published forward GFLOPs (2 per MAC)
PUBLISHED = [
    ("iresnet100", 112, {}, 65.2, 24.2),
    ("iresnet50", 112, {}, 43.6, 12.6),
    ("mobilefacenet", 112, {}, 2.06, 0.88),
    ("mobilefacenet_y1", 112, {}, 1.0, 0.44),
    ("resnet50_v1b", 224, {"num_classes": 1000}, 25.6, 8.2),
]
TINY = ["iresnet_tiny", "mobilefacenet_tiny", "resnet_v1b_tiny"]


@pytest.mark.parametrize("name,side,kwargs,params_m,gflops", PUBLISHED)
def test_published_sizes(name, side, kwargs, params_m, gflops):
    params, flops = backbone_profile(name, side, **kwargs)
    assert params / 1e6 == pytest.approx(params_m, rel=0.01)
    assert sum(flops.values()) / 1e9 == pytest.approx(gflops, rel=0.01)
    # The only matrix products of these backbones are their last fully connected layers.
    assert 0 < flops["matmul"] < 0.05 * flops["conv"]


def test_every_family_has_a_tiny_variant():
    families = {"iresnet", "mobilefacenet", "resnet"}
    assert {f for f in families for n in TINY if n.startswith(f)} == families
    assert set(TINY) <= set(backbone_names())


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward(name):
    torch.manual_seed(0)
    spec = get_spec(name)
    side = 112 if spec.task == "face" else 64
    model = build_backbone(name, embedding_size=32, num_classes=10, input_size=side)
    x = torch.randn(4, 3, side, side)
    out = model(x)
    assert out.shape == (4, 32 if spec.task == "face" else 10)
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_meta_profile_equals_real_forward_shapes():
    """The meta-device count is the count of a real model (same layers, same shapes)."""
    params_meta, _ = backbone_profile("iresnet_tiny", 112, embedding_size=64)
    real = build_backbone("iresnet_tiny", embedding_size=64, input_size=112)
    assert params_meta == sum(p.numel() for p in real.parameters())


def test_iresnet_rejects_bad_input_size():
    with pytest.raises(ValueError, match="divisible by 16"):
        build_backbone("iresnet_tiny", input_size=100)


def test_train_flops_rule():
    # 3x forward for backbone and head; head forward is 2 * emb * classes per sample, a matmul.
    assert train_flops_per_sample({"conv": 10, "matmul": 1}, 4, 5) == {
        "conv": 30, "matmul": 3 * (1 + 2 * 4 * 5)}
