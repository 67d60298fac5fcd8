"""Parameter and FLOP counts of a backbone, computed on the meta device (nothing is run).

A multiply-add counts as 2 FLOPs. InsightFace publishes multiply-adds under the name "GFLOPs",
so its tables show half of what we print. Only convolutions and fully connected layers are
counted: BN, activations and additions add well under 1% for these networks, and published
figures leave them out too. Grouped and depthwise convolutions are counted per group here, which
torch's FlopCounterMode gets wrong in the backward pass (it multiplies by the group count).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .backbones import build_backbone


def count_params(model: nn.Module) -> int:
    """All parameters, trainable or not (published counts include fixed BN gammas)."""
    return sum(p.numel() for p in model.parameters())


def forward_flops(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, int]:
    """FLOPs of one forward pass for one sample of ``input_shape`` (C, H, W), by the engine that
    runs them: ``conv`` (cuDNN) and ``matmul`` (cuBLAS). In fp32 each runs in TF32 or in full
    fp32 as its own flag says (``tf32_cudnn``, ``tf32_matmul``), at peaks 7x apart, so MFU needs
    them apart."""
    total = {"conv": 0, "matmul": 0}

    def on_conv(mod: nn.Conv2d, _inp, out: torch.Tensor) -> None:
        kh, kw = mod.kernel_size
        macs_per_output = (mod.in_channels // mod.groups) * kh * kw
        total["conv"] += 2 * out[0].numel() * macs_per_output

    def on_linear(mod: nn.Linear, _inp, out: torch.Tensor) -> None:
        total["matmul"] += 2 * mod.in_features * out[0].numel()

    handles = []
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            handles.append(mod.register_forward_hook(on_conv))
        elif isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_hook(on_linear))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.empty((1, *input_shape), device="meta"))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return total


def backbone_profile(name: str, input_size: int, **kwargs) -> tuple[int, dict[str, int]]:
    """(parameters, forward FLOPs per sample by engine) of a registered backbone, built on the
    meta device."""
    with torch.device("meta"):
        model = build_backbone(name, input_size=input_size, **kwargs)
    return count_params(model), forward_flops(model, (3, input_size, input_size))


def head_flops_per_sample(embedding_size: int, classes_computed: int) -> int:
    """Forward FLOPs of the class-matrix product for one sample over the classes it touches."""
    return 2 * embedding_size * classes_computed


def train_flops_per_sample(backbone_forward_flops: dict[str, int], embedding_size: int,
                           classes_computed: int) -> dict[str, int]:
    """Forward + backward FLOPs per sample by engine: backward costs two forwards (grad of
    inputs and of weights), the standard 3x rule used for model-FLOPs utilisation. The class
    matrix product is a matmul."""
    head = head_flops_per_sample(embedding_size, classes_computed)
    return {"conv": 3 * backbone_forward_flops["conv"],
            "matmul": 3 * (backbone_forward_flops["matmul"] + head)}
