"""MXNet Gluon's own training step, as a Gluon user writes it: the reference that trainperf's
MXNet worker is measured against (issue 26, native parity).

ResNet50 comes from Gluon's model zoo (``vision.resnet50_v1``) with its bottleneck blocks turned
into the v1b layout (stride on the 3x3, bias-free convolutions); the face backbone is IResNet-50
from ``gluon.nn``'s stock layers with an ArcFace head. Both are trained with
``autograd.record()``, ``loss.backward()`` and ``gluon.Trainer('sgd').step(batch_size)``, in one
of Gluon's two modes (``--mode``): ``hybrid`` (the usual one) hybridizes the network, the head
and the loss with ``static_alloc=True, static_shape=True``; ``imperative`` leaves them the plain
Gluon blocks they are built as, run operator by operator.

Imports only mxnet (and its model zoo), numpy and the standard library.

    python benchmarks/native/mxnet_native.py --case rn50|face --batch B --threads T --iters N --warmup W
        [--device cpu|cuda] [--precision fp32|bf16|fp16] [--channels-last] [--classes C]
        [--mode hybrid|imperative]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import native_cli

NAME = "native mxnet"
RN50_STAGES = ((3, 64), (4, 128), (6, 256), (3, 512))  # (blocks, bottleneck width)
MODES = ("hybrid", "imperative")
"""Gluon's modes, in trainperf's names; the first is what the reference runs by default."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = native_cli.parser(NAME, __doc__)
    a = native_cli.parse(p, argv)
    a.mode = a.mode or MODES[0]
    if a.mode not in MODES:
        p.error(f"--mode {a.mode}: Gluon trains {' or '.join(MODES)}")
    if a.channels_last:
        p.error("--channels-last: Gluon's zoo and MXNet's CPU convolution are NCHW only")
    if a.device == "cpu" and a.precision != "fp32":
        p.error(f"--precision {a.precision}: MXNet AMP training is a GPU idiom; use fp32 on cpu")
    if a.precision == "bf16":
        p.error("--precision bf16: MXNet 1.9 AMP trains bfloat16 only through oneDNN on cpu")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.threads:
        # MXNet sizes its OpenMP pools from these when the library loads (there is no setter that
        # reaches its engine's worker threads, nor a getter): set them before the import.
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
        os.environ["MXNET_OMP_MAX_THREADS"] = str(a.threads)
    import numpy as np
    import mxnet as mx
    from mxnet import autograd, gluon
    from mxnet.gluon import nn
    from mxnet.gluon.model_zoo import vision

    if a.device == "cuda":
        if mx.context.num_gpus() < 1:
            native_cli.fail(NAME, "--device cuda: this MXNet sees no GPU (a CPU-only build?)")
        ctx = mx.gpu(0)
    else:
        ctx = mx.cpu()
    amp = None
    if a.precision == "fp16":
        from mxnet.contrib import amp
        amp.init(target_dtype="float16")  # before the network is built, as its docs ask

    def resnet50_v1b(classes: int) -> tuple[gluon.HybridBlock, str]:
        """The zoo's resnet50_v1 with every BottleneckV1's three convolutions replaced in place:
        the stride leaves the first 1x1 for the 3x3 and the 1x1s lose their biases (the zoo's
        Conv2D default), which makes it torchvision's resnet50 / GluonCV's resnet50_v1b."""
        net = vision.resnet50_v1(classes=classes)
        stages = [b for b in net.features if isinstance(b, nn.HybridSequential)]
        assert len(stages) == len(RN50_STAGES)
        for index, (stage, (count, width)) in enumerate(zip(stages, RN50_STAGES)):
            assert len(stage) == count
            for i, block in enumerate(stage):
                assert isinstance(block, vision.BottleneckV1)
                stride = 2 if index > 0 and i == 0 else 1
                body = block.body
                # Same prefixes as the convolutions they replace, so parameter names stay put.
                body.register_child(nn.Conv2D(width, 1, use_bias=False, prefix=body[0].prefix),
                                    "0")
                body.register_child(nn.Conv2D(width, 3, strides=stride, padding=1,
                                              use_bias=False, in_channels=width,
                                              prefix=body[3].prefix), "3")
                body.register_child(nn.Conv2D(4 * width, 1, use_bias=False,
                                              prefix=body[6].prefix), "6")
        return net, ("gluon model_zoo.vision.resnet50_v1, each BottleneckV1's body convolutions "
                     "replaced in place: stride moved from the first 1x1 to the 3x3 and the two "
                     "1x1 convolutions made bias-free (= ResNet50 v1b / torchvision)")

    class IBasicBlock(gluon.HybridBlock):
        def __init__(self, cin: int, cout: int, stride: int, **kwargs) -> None:
            super().__init__(**kwargs)
            with self.name_scope():
                self.body = nn.HybridSequential()
                self.body.add(nn.BatchNorm(in_channels=cin),
                              nn.Conv2D(cout, 3, padding=1, use_bias=False, in_channels=cin),
                              nn.BatchNorm(in_channels=cout),
                              nn.PReLU(in_channels=cout),
                              nn.Conv2D(cout, 3, strides=stride, padding=1, use_bias=False,
                                        in_channels=cout),
                              nn.BatchNorm(in_channels=cout))
                self.shortcut = None
                if stride != 1 or cin != cout:
                    self.shortcut = nn.HybridSequential()
                    self.shortcut.add(nn.Conv2D(cout, 1, strides=stride, use_bias=False,
                                                in_channels=cin),
                                      nn.BatchNorm(in_channels=cout))

        def hybrid_forward(self, F, x):
            return self.body(x) + (self.shortcut(x) if self.shortcut is not None else x)

    def iresnet50(side: int) -> gluon.HybridBlock:
        net = nn.HybridSequential(prefix="iresnet50_")
        with net.name_scope():
            net.add(nn.Conv2D(64, 3, padding=1, use_bias=False, in_channels=3),
                    nn.BatchNorm(in_channels=64), nn.PReLU(in_channels=64))
            cin = 64
            for width, count in zip((64, 128, 256, 512), (3, 4, 14, 3)):
                for i in range(count):
                    net.add(IBasicBlock(cin, width, 2 if i == 0 else 1))
                    cin = width
            net.add(nn.BatchNorm(in_channels=512), nn.Dropout(0.4),
                    nn.Dense(512, in_units=512 * (side // 16) ** 2),  # flattens its input
                    nn.BatchNorm(in_channels=512, scale=False))  # gamma fixed at 1, untrained
        return net

    class ArcFace(gluon.HybridBlock):
        def __init__(self, classes: int, dim: int = 512, s: float = 64.0, m: float = 0.5,
                     **kwargs) -> None:
            super().__init__(**kwargs)
            self.classes, self.s, self.m = classes, s, m
            with self.name_scope():
                self.weight = self.params.get("weight", shape=(classes, dim),
                                              init=mx.init.Normal(0.01))

        def hybrid_forward(self, F, emb, labels, weight):
            cos = F.FullyConnected(F.L2Normalization(emb, mode="instance"),
                                   F.L2Normalization(weight, mode="instance"),
                                   no_bias=True, num_hidden=self.classes)
            target = F.clip(F.pick(cos, labels, axis=1), -1.0, 1.0)
            margin = F.cos(F.arccos(target) + self.m) - target
            onehot = F.one_hot(labels, self.classes)
            return (cos + F.broadcast_mul(onehot, F.expand_dims(margin, 1))) * self.s

    rn50 = a.case == "rn50"
    side, classes = native_cli.shape(a)
    mx.random.seed(0)
    np.random.seed(0)
    if rn50:
        backbone, zoo = resnet50_v1b(classes)
        head, wd = None, 1e-4
    else:
        backbone, head, wd = iresnet50(side), ArcFace(classes, prefix="arcface_"), 5e-4
        zoo = ("gluon.nn stock layers (Conv2D, BatchNorm, PReLU = fused "
               "LeakyReLU(act_type='prelu'), Dropout, Dense) + ArcFace head "
               "(L2Normalization, FullyConnected, pick/arccos/cos, one_hot)")
    backbone.initialize(mx.init.Xavier(rnd_type="gaussian", factor_type="in", magnitude=2),
                        ctx=ctx)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    blocks = [backbone, loss_fn] if head is None else [backbone, head, loss_fn]
    if head is not None:
        head.initialize(ctx=ctx)
    if a.mode == "hybrid":
        # Gluon's graph mode: each block traced once into a cached graph, its memory planned
        # once for the fixed shapes. Imperative mode is simply not calling it.
        for block in blocks:
            block.hybridize(static_alloc=True, static_shape=True)
    params = backbone.collect_params()
    if head is not None:
        params.update(head.collect_params())
    # Gluon's idiom: per-sample losses, backward() sums them, and trainer.step(batch) sets
    # rescale_grad = 1/batch, so every update is mean-loss SGD (wd added after the rescale).
    trainer = gluon.Trainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": wd})
    if amp is not None:
        amp.init_trainer(trainer)
    clip = [p for p in backbone.collect_params().values() if p.grad_req != "null"]
    rng = np.random.default_rng(0)
    images = mx.nd.array(rng.standard_normal((a.batch, 3, side, side), dtype=np.float32),
                         ctx=ctx)
    labels = mx.nd.array(rng.integers(0, classes, a.batch), ctx=ctx, dtype="int32")

    def step():
        with autograd.record():
            out = backbone(images)
            loss = loss_fn(head(out, labels) if head is not None else out, labels)
            if amp is not None:
                with amp.scale_loss(loss, trainer) as scaled:
                    autograd.backward(scaled)
        if amp is None:
            loss.backward()
        if head is None:
            trainer.step(a.batch)
            return loss
        # Gluon's clipping idiom (Trainer.update's docs): allreduce_grads(), clip, update().
        trainer.allreduce_grads()
        if amp is not None:
            amp.unscale(trainer)
        # The gradients hold the SUM over the batch until update() rescales them by 1/batch:
        # clipping the sum at 5*batch is clipping the mean-loss gradient at 5.
        # check_isfinite=False: the default reads the norm to the host every step.
        gluon.utils.clip_global_norm([p.grad(ctx) for p in clip], 5.0 * a.batch,
                                     check_isfinite=False)
        trainer.update(a.batch)
        return loss

    first = None
    for _ in range(a.warmup):
        loss = step()
        if first is None:
            first = float(loss.mean().asscalar())
    mx.nd.waitall()
    start = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
    mx.nd.waitall()  # the one sync of the window: the last step's backward and update included
    last = float(loss.mean().asscalar())
    window = time.perf_counter() - start

    def count(block) -> tuple[int, int]:
        ps = [p for name, p in block.collect_params().items()
              if not name.endswith(("running_mean", "running_var"))]
        return (sum(p.data(ctx).size for p in ps),
                sum(p.data(ctx).size for p in ps if p.grad_req != "null"))

    total, trainable = count(backbone)
    threads_env = os.environ.get("MXNET_OMP_MAX_THREADS") or os.environ.get("OMP_NUM_THREADS")
    native_cli.report(
        "mxnet", a, window, threads=a.threads or (int(threads_env) if threads_env else None),
        settings={
            "zoo": zoo,
            "mode": a.mode,
            "compile": "hybridize(static_alloc=True, static_shape=True) on the network, the "
                       "head and the loss" if a.mode == "hybrid" else
                       "none: Gluon imperative (no hybridize), each operator run as it is "
                       "called under autograd.record()",
            "layout": "NCHW",
            "optimizer": "gluon.Trainer('sgd', momentum 0.9, wd %g), loss = "
                         "SoftmaxCrossEntropyLoss per sample, loss.backward(), "
                         "trainer.step(batch) (face: allreduce_grads/clip/update(batch)); "
                         "rescale_grad 1/batch = mean-loss SGD" % wd,
            "clip": ("trainer.allreduce_grads(); gluon.utils.clip_global_norm on the "
                     "backbone's gradients at 5*batch (the summed gradient, = 5 on the mean), "
                     "check_isfinite=False; trainer.update(batch)"
                     if head is not None else "none"),
            "prelu": ("gluon nn.PReLU (fused LeakyReLU act_type='prelu'); trainperf found its "
                      "CPU gradient wrong in MXNet 1.9.1 in graph mode when the PReLU input "
                      "is an intermediate result (see trainperf's MXNet PReLU; imperative "
                      "mode is right): kept here because it is what a Gluon user writes, the "
                      "reference is about speed"
                      if head is not None else "n/a"),
            "amp": "mxnet.contrib.amp float16 (dynamic loss scale: reads an overflow flag "
                   "to the host every step)" if amp is not None else "off",
            "init": "Xavier(gaussian, in, magnitude 2); ArcFace W ~ N(0, 0.01)",
            "threads_reported": int(threads_env) if threads_env else None,
            "threads_source": "MXNET_OMP_MAX_THREADS / OMP_NUM_THREADS as MXNet reads them at "
                              "load (MXNet 1.9 has no thread-count getter; null = neither set, "
                              "MXNet's own default)",
            "sync": "mx.nd.waitall() before and after the window, then the last loss read",
            "trainable_params": trainable,
        },
        versions={"mxnet": mx.__version__, "numpy": np.__version__},
        params=total, loss_first=first if first is not None else last, loss_last=last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
