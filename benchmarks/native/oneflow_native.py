"""OneFlow's own training step, as a OneFlow user writes it: the reference that trainperf's oneflow
worker is measured against (benchmarks/native_parity.py).

``--mode eager`` (the default, and what an empty ``--mode`` runs): eager mode
(``oneflow.nn.Module``), ``flow.optim.SGD``, then ``loss.backward()``, ``opt.step()``,
``opt.zero_grad()``. ``--mode graph`` runs the step as an ``oneflow.nn.Graph``, OneFlow's
documented static-graph training path as its model zoo and oneflow_face write it:
``add_optimizer`` + ``loss.backward()`` inside ``build``, with ``allow_fuse_add_to_output`` and
``allow_fuse_model_update_ops`` on; there the face backbone's gradient clipping is the optimizer
param group's ``clip_grad_max_norm`` / ``clip_grad_norm_type`` (the graph's own clip), in eager
it is ``flow.nn.utils.clip_grad_norm_``. ``--graph`` is the older spelling of ``--mode graph``.

ResNet50 comes from flowvision, OneFlow's model zoo (a separate package, which
trainperf.parity.ZOOS installs); its Bottleneck is torchvision's, stride on the 3x3
(v1.5 == v1b), so it is used unchanged.
The face backbone is IResNet-50 built from oneflow.nn's stock layers.

Imports only oneflow, flowvision, numpy and the standard library.

    python benchmarks/native/oneflow_native.py --case rn50|face --batch B --threads T --iters N --warmup W
        [--device cpu|cuda] [--precision fp32|bf16|fp16] [--channels-last] [--classes C]
        [--mode eager|graph]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import sys
import tempfile
import time
from typing import NoReturn

import native_cli

NAME = "native oneflow"
MODES = ("eager", "graph")


def fail(msg: str) -> NoReturn:
    native_cli.fail(NAME, msg)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = native_cli.parser(NAME, __doc__)
    p.add_argument("--graph", action="store_true", help="the same as --mode graph")
    a = native_cli.parse(p, argv)
    if a.graph and a.mode not in ("", "graph"):
        fail(f"--graph runs --mode graph, not --mode {a.mode}")
    a.mode = a.mode or ("graph" if a.graph else "eager")
    if a.mode not in MODES:
        fail(f"--mode {a.mode}: OneFlow runs {', '.join(MODES)}")
    a.graph = a.mode == "graph"
    if a.channels_last:
        fail("--channels-last: OneFlow 0.9 has no channels-last memory format for training")
    if a.device == "cpu" and a.precision != "fp32":
        fail(f"--precision {a.precision} needs --device cuda (OneFlow 0.9 disables CPU autocast)")
    if a.precision == "fp16" and not a.graph:
        fail("--precision fp16 needs --mode graph (OneFlow 0.9's GradScaler only works in "
             "nn.Graph)")
    return a


def resnet50(flow, classes: int):
    try:
        import flowvision
        from flowvision.models import resnet50 as zoo_resnet50
    except ImportError as e:
        fail(f"the model zoo is not importable ({e}); benchmarks/native_parity.py installs it "
             "(trainperf.parity.ZOOS)")
    net = zoo_resnet50(pretrained=False, num_classes=classes)
    block = net.layer2[0]
    if block.conv2.stride != (2, 2) or block.conv1.stride != (1, 1):
        fail("flowvision's Bottleneck does not put the stride on the 3x3 (expected v1b)")
    return net, (f"flowvision {flowvision.__version__} models.resnet50(num_classes={classes}), "
                 "unchanged (torchvision-style Bottleneck: stride on the 3x3, v1b)")


def iresnet50(flow, side: int):
    nn = flow.nn

    class IBasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.main = nn.Sequential(
                nn.BatchNorm2d(cin, eps=1e-5, momentum=0.1),
                nn.Conv2d(cin, cout, 3, stride=1, padding=1, bias=False),
                nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1),
                nn.PReLU(cout),
                nn.Conv2d(cout, cout, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1))
            if stride != 1 or cin != cout:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                           nn.BatchNorm2d(cout, eps=1e-5, momentum=0.1))
            else:
                self.short = nn.Identity()

        def forward(self, x):
            return self.main(x) + self.short(x)

    stages = []
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 14), (512, 3)):
        for i in range(blocks):
            stages.append(IBasicBlock(cin, width, 2 if i == 0 else 1))
            cin = width
    feat = side // 16
    emb_bn = nn.BatchNorm1d(512, eps=1e-5, momentum=0.1)
    emb_bn.weight.requires_grad_(False)  # gamma fixed at 1, beta trained (insightface's "E")
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False),
        nn.BatchNorm2d(64, eps=1e-5, momentum=0.1),
        nn.PReLU(64),
        *stages,
        nn.BatchNorm2d(512, eps=1e-5, momentum=0.1),
        nn.Dropout(0.4),
        nn.Flatten(),
        nn.Linear(512 * feat * feat, 512),
        emb_bn)


def arcface_head(flow, classes: int, dim: int = 512, s: float = 64.0, m: float = 0.5):
    nn, F = flow.nn, flow.nn.functional

    class ArcFace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(flow.randn(classes, dim) * 0.01)

        def forward(self, emb, labels):
            cos = F.linear(F.normalize(emb, dim=1), F.normalize(self.weight, dim=1))
            idx = labels.unsqueeze(1)
            target = flow.clamp(flow.gather(cos, 1, idx), -1.0, 1.0)
            # flow.scatter, not Tensor.scatter: 0.9's method passes reduce=None and fails
            logits = flow.scatter(cos, 1, idx, flow.cos(flow.acos(target) + m))
            return F.cross_entropy(logits * s, labels)

    return ArcFace()


def set_threads(flow, threads: int) -> tuple[int | None, str]:
    """flow.set_num_threads(T). OneFlow 0.9 has no getter; its only report is a warning that its
    C++ side prints to stdout when T is not below the logical core count ("... will be set to the
    maximum number of logical cores N"). Catch that line (stdout must end with the JSON) and
    return (the count it says it uses, what it said)."""
    if not threads:
        return None, "flow.set_num_threads not called (OneFlow's default)"
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            flow.set_num_threads(threads)
        finally:
            ctypes.CDLL(None).fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        said = " ".join(tmp.read().decode(errors="replace").split())
    match = re.search(r"logical cores\s+(\d+)", said)
    if match:
        return int(match.group(1)), f"flow.set_num_threads({threads}) said: {said}"
    return threads, f"flow.set_num_threads({threads}) accepted silently (no getter in 0.9)"


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    import numpy as np
    import oneflow as flow

    # "set_num_threads must be called before running eager": first thing after import.
    threads_reported, threads_said = set_threads(flow, a.threads)
    if a.device == "cuda" and not flow.cuda.is_available():
        fail("--device cuda: oneflow sees no GPU")
    F = flow.nn.functional
    device = flow.device(a.device)
    flow.manual_seed(0)
    rn50 = a.case == "rn50"
    side, classes = native_cli.shape(a)

    if rn50:
        backbone, zoo = resnet50(flow, classes)
        head = None
        wd = 1e-4
    else:
        backbone = iresnet50(flow, side)
        zoo = ("oneflow.nn stock layers (Conv2d, BatchNorm2d, PReLU(C), Dropout, Linear, "
               "BatchNorm1d with weight.requires_grad=False) + ArcFace head (composed ops)")
        head = arcface_head(flow, classes)
        wd = 5e-4
    params = sum(p.numel() for p in backbone.parameters())
    backbone = backbone.to(device).train()
    trained = [p for p in backbone.parameters() if p.requires_grad]
    clip_group = {}
    if head is not None:
        head = head.to(device).train()
        if a.graph:  # nn.Graph clips through the optimizer's param-group config
            clip_group = {"clip_grad_max_norm": 5.0, "clip_grad_norm_type": 2.0}
    groups = [{"params": trained, **clip_group}]
    if head is not None:
        groups.append({"params": list(head.parameters())})
    opt = flow.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=wd)

    rng = np.random.default_rng(0)
    images = flow.tensor(rng.standard_normal((a.batch, 3, side, side), dtype=np.float32),
                         device=device)
    labels = flow.tensor(rng.integers(0, classes, a.batch, dtype=np.int64), device=device)
    amp_dtype = {"bf16": flow.bfloat16, "fp16": flow.float16}.get(a.precision)

    def forward_loss(model, hd, x, y):
        out = model(x)
        if hd is None:
            return F.cross_entropy(out, y)
        return hd(out.float(), y)

    if a.graph:
        class TrainStep(flow.nn.Graph):
            def __init__(self) -> None:
                super().__init__()
                self.backbone = backbone
                if head is not None:
                    self.head = head
                # What OneFlow's own training graphs (its model zoo, oneflow_face) switch on.
                self.config.allow_fuse_add_to_output(True)
                self.config.allow_fuse_model_update_ops(True)
                self.add_optimizer(opt)
                if amp_dtype is not None:
                    self.config.enable_amp(True, dtype=amp_dtype)
                    if amp_dtype == flow.float16:
                        self.set_grad_scaler(flow.amp.GradScaler(
                            init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                            growth_interval=2000))

            def build(self, x, y):
                loss = forward_loss(self.backbone, self.head if head is not None else None, x, y)
                loss.backward()
                return loss

        graph = TrainStep()

        def step():
            return graph(images, labels)

        compile_desc = ("oneflow.nn.Graph (add_optimizer, loss.backward() in build, "
                        "allow_fuse_add_to_output, allow_fuse_model_update_ops; compiled on the "
                        "first warm-up step)")
    else:
        def step():
            with (flow.autocast(a.device, dtype=amp_dtype) if amp_dtype is not None
                  else contextlib.nullcontext()):
                loss = forward_loss(backbone, head, images, labels)
            loss.backward()
            if head is not None:
                flow.nn.utils.clip_grad_norm_(trained, 5.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        compile_desc = "eager (oneflow.nn.Module)"

    first = None
    loss = None
    for _ in range(a.warmup):
        loss = step()
        if first is None:
            first = loss.item()
    if loss is not None:
        loss.item()  # sync before the window
    start = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
    last = loss.item()  # the one host sync of the window
    window = time.perf_counter() - start
    clip_desc = None
    if head is not None:
        clip_desc = ("optimizer param group clip_grad_max_norm=5.0, clip_grad_norm_type=2.0 "
                     "(backbone group only)" if a.graph
                     else "flow.nn.utils.clip_grad_norm_(backbone params, 5.0)")
    native_cli.report(
        "oneflow", a, window,
        settings={
            "zoo": zoo, "mode": a.mode, "compile": compile_desc, "layout": "NCHW",
            "optimizer": f"flow.optim.SGD(lr=0.1, momentum=0.9, weight_decay={wd})",
            "clip": clip_desc,
            "amp": ("nn.Graph config.enable_amp" if a.graph else "flow.autocast")
            + f" {a.precision}" if amp_dtype is not None else "off",
            "threads_reported": threads_reported,
            "threads_api": threads_said,
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
            "trainable_params": sum(p.numel() for p in trained),
        },
        versions={"oneflow": flow.__version__, "numpy": np.__version__,
                  **({"flowvision": sys.modules["flowvision"].__version__}
                     if "flowvision" in sys.modules else {})},
        params=params, loss_first=first if first is not None else last, loss_last=last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
