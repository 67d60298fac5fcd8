"""PyTorch's own training step, as a PyTorch user writes it: the reference that trainperf's torch
worker is measured against (benchmarks/native_parity.py).

Eager mode by default, or ``--mode compile``: the forward and loss as one function under
``torch.compile`` (inductor), or ``--mode compile-cudagraphs`` (``mode="reduce-overhead"``,
CUDA only), compiled in the warm-up; torch.optim.SGD with its defaults, ``zero_grad()`` /
``backward()`` / ``step()`` eager around it, as torch's tutorials write a compiled training
step. A compiled run keeps the layout asked for (inductor's ``layout_optimization`` off
without ``--channels-last``), as trainperf's worker does (``backends/torch/modes.py`` says why).
ResNet50 comes from torchvision's model zoo (timm's where torchvision is not installed; both are
the ResNet-B layout, stride on the 3x3), or is written out in torchvision's layout from stock
layers where neither loads. The face backbone
is IResNet-50 from torch.nn's stock layers. On a GPU the native idiom adds cuDNN's autotuner,
autocast for bf16/fp16 (with a GradScaler for fp16) and, when asked, channels-last.

Imports only torch, its model zoo, numpy and the standard library.

    python benchmarks/native/torch_native.py --case rn50|face --batch B --threads T --iters N --warmup W
        [--device cpu|cuda] [--precision fp32|bf16|fp16] [--channels-last] [--classes C]
        [--mode eager|compile|compile-cudagraphs]
"""

from __future__ import annotations

import argparse
import sys
import time

import native_cli
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

NAME = "native torch"
MODES = {"eager": None, "compile": "default", "compile-cudagraphs": "reduce-overhead"}
"""trainperf's names of torch's modes, and ``torch.compile``'s ``mode`` for each."""


class Bottleneck(nn.Module):
    """torchvision's ResNet50 block: 1x1, 3x3 (the stride), 1x1, then the shortcut's add."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width * 4, 1, bias=False), nn.BatchNorm2d(width * 4))
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, width * 4, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(width * 4))
                         if stride != 1 or cin != width * 4 else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.residual(x) + self.shortcut(x))


def resnet50_layers(classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False),
                               nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, stride=2, padding=1)]
    cin = 64
    for i, (width, count) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3))):
        for j in range(count):
            layers.append(Bottleneck(cin, width, 2 if i > 0 and j == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def resnet50(classes: int) -> tuple[nn.Module, str]:
    """The model zoo's ResNet50 where one works here; else the same layout from stock layers
    (a CUDA torchvision wheel beside a CPU torch fails to load its operators)."""
    try:
        import torchvision
        return (torchvision.models.resnet50(num_classes=classes),
                f"torchvision {torchvision.__version__} models.resnet50 (stride on the 3x3)")
    except Exception:  # noqa: BLE001 - not installed, or installed for another torch
        pass
    try:
        import timm
        return (timm.create_model("resnet50", num_classes=classes),
                f"timm {timm.__version__} resnet50 (ResNet-B: stride on the 3x3)")
    except Exception:  # noqa: BLE001
        pass
    return (resnet50_layers(classes),
            "torchvision's resnet50 layout from torch.nn stock layers (no model zoo installed)")


class IBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.residual = nn.Sequential(
            nn.BatchNorm2d(cin), nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout), nn.PReLU(cout),
            nn.Conv2d(cout, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual(x) + self.shortcut(x)


def iresnet50(side: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
                               nn.PReLU(64)]
    cin = 64
    for width, count in zip((64, 128, 256, 512), (3, 4, 14, 3)):
        layers += [IBasicBlock(cin if i == 0 else width, width, 2 if i == 0 else 1)
                   for i in range(count)]
        cin = width
    embedding_bn = nn.BatchNorm1d(512)
    embedding_bn.weight.requires_grad_(False)  # gamma fixed at 1, as insightface's E block
    layers += [nn.BatchNorm2d(512), nn.Dropout(0.4), nn.Flatten(),
               nn.Linear(512 * (side // 16) ** 2, 512), embedding_bn]
    return nn.Sequential(*layers)


class ArcFace(nn.Module):
    def __init__(self, classes: int, dim: int = 512, s: float = 64.0, m: float = 0.5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(classes, dim).normal_(0, 0.01))
        self.s, self.m = s, m

    def forward(self, emb: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # under autocast the product comes back in bf16/fp16; the margin is taken in fp32
        cos = F.linear(F.normalize(emb.float()), F.normalize(self.weight)).float()
        target = cos.gather(1, labels[:, None]).clamp(-1, 1)
        cos = cos.scatter(1, labels[:, None], torch.cos(torch.acos(target) + self.m))
        return F.cross_entropy(cos * self.s, labels)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = native_cli.parser(NAME, __doc__)
    a = native_cli.parse(p, argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU")
    if a.device == "cpu" and a.precision == "fp16":
        p.error("--precision fp16 needs --device cuda (its GradScaler is a GPU idiom)")
    a.mode = a.mode or "eager"
    if a.mode not in MODES:
        p.error(f"--mode {a.mode}: torch runs {', '.join(MODES)}")
    if a.mode == "compile-cudagraphs" and a.device != "cuda":
        p.error("--mode compile-cudagraphs needs --device cuda (CUDA graphs)")
    return a


def in_mode(forward, mode: str, channels_last: bool):
    """``forward`` as ``mode`` runs it: itself, or compiled by inductor with the mode's own
    options and the layout asked for."""
    if MODES[mode] is None:
        return forward
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(MODES[mode]))
    if not channels_last:
        options["layout_optimization"] = False
    return torch.compile(forward, backend="inductor", options=options)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    rn50 = a.case == "rn50"
    side, classes = native_cli.shape(a)
    if rn50:
        backbone, zoo = resnet50(classes)
        head = None
        groups = [{"params": backbone.parameters()}]
        wd = 1e-4
    else:
        backbone, zoo = iresnet50(side), "torch.nn stock layers (Conv2d, BatchNorm2d, PReLU)"
        head = ArcFace(classes).to(device)
        groups = [{"params": [p for p in backbone.parameters() if p.requires_grad]},
                  {"params": head.parameters()}]
        wd = 5e-4
    params = sum(p.numel() for p in backbone.parameters())
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    backbone = backbone.to(device, memory_format=fmt).train()
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=wd)
    clip = [p for p in backbone.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(a.batch, 3, side, side, generator=gen).to(device, memory_format=fmt)
    labels = torch.randint(0, classes, (a.batch,), generator=gen).to(device)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    scaler = torch.amp.GradScaler(enabled=a.precision == "fp16")

    def forward(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = backbone(images)
        return F.cross_entropy(out, labels) if rn50 else head(out, labels)

    forward_loss = in_mode(forward, a.mode, a.channels_last)
    graphs = a.mode == "compile-cudagraphs"

    def step() -> torch.Tensor:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: replay over the last
        opt.zero_grad()
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = forward_loss(images, labels)
        scaler.scale(loss).backward()
        if not rn50:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(clip, 5.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    first = None
    for _ in range(a.warmup):
        loss = step()
        first = loss.item() if first is None else first
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
    last = loss.item()  # the one host sync of the window
    window = time.perf_counter() - start
    native_cli.report(
        "torch", a, window, threads=a.threads or torch.get_num_threads(),
        settings={"zoo": zoo, "compile": a.mode if MODES[a.mode] is None else
                  f"torch.compile(forward and loss, inductor, mode={MODES[a.mode]!r})",
                  "mode": a.mode,
                  "layout": "NHWC (channels_last)" if a.channels_last else "NCHW",
                  "optimizer": "torch.optim.SGD (defaults)",
                  "amp": f"autocast {a.precision}" if amp_dtype else "off",
                  "cudnn_benchmark": device.type == "cuda",
                  "threads_reported": torch.get_num_threads()},
        versions={"torch": torch.__version__, "numpy": np.__version__},
        params=params, loss_first=first if first is not None else last, loss_last=last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
