"""Native PaddlePaddle reference training step (trainperf issue 26).

A plain PaddlePaddle dygraph training loop, written from Paddle's own documentation
and model zoo, used to check trainperf's paddle worker:

    python benchmarks/native/paddle_native.py --case rn50|face --batch B --threads T \
        --iters N --warmup W [--device cpu|cuda] [--precision fp32|bf16|fp16] \
        [--channels-last] [--classes C] [--mode dygraph|static]

--mode: ``dygraph`` (the default) runs the loop eagerly; ``static`` wraps the network in
``paddle.jit.to_static(model, full_graph=True)``, the dygraph-to-static training idiom of
Paddle's model zoo (PaddleClas's ``Global.to_static``): the network's forward, and the backward
Paddle derives from it, run as static programs; the loss, its head and the optimizer stay in
dygraph.

The last line of stdout is one JSON object, the form benchmarks/native_parity.py reads.
Imports only paddle, numpy and the standard library.
"""

import os
import sys
import time

import native_cli

NAME = "native paddle"
MODES = ("dygraph", "static")


def _fail(msg):
    native_cli.fail(NAME, msg)


def parse_args(argv=None):
    p = native_cli.parser(NAME, __doc__)
    a = native_cli.parse(p, argv)
    a.mode = a.mode or "dygraph"
    if a.mode not in MODES:
        _fail("--mode %s: paddle runs %s" % (a.mode, ", ".join(MODES)))
    if a.threads < 1:
        _fail("--threads must be >= 1")
    a.classes = native_cli.shape(a)[1]
    if a.device == "cpu" and a.precision != "fp32":
        _fail("--precision %s is only supported with --device cuda (paddle.amp); use fp32 on cpu"
              % a.precision)
    if a.channels_last and a.case == "rn50":
        _fail("--channels-last: paddle.vision.models.resnet50 has no data_format option (NCHW only)")
    return a


args = parse_args()

import warnings  # noqa: E402

# import-time / per-layer notices that are not about this run
warnings.filterwarnings("ignore", message="No ccache found")
warnings.filterwarnings("ignore", message="When training, we now always track")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.nn as nn  # noqa: E402
import paddle.nn.functional as F  # noqa: E402


# ---------------------------------------------------------------- models

def count_params(layer):
    """(all parameters, trainable ones), BN running mean/variance excluded.

    Paddle stores BN running statistics as non-trainable parameters named _mean and
    _variance, so they are filtered out by name.
    """
    total = trainable = 0
    for name, p in layer.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("_mean", "_variance"):
            continue
        n = int(np.prod(p.shape))
        total += n
        if not p.stop_gradient:
            trainable += n
    return total, trainable


def build_rn50(classes):
    model = paddle.vision.models.resnet50(num_classes=classes)
    # Paddle's zoo BottleneckBlock already strides its 3x3 (conv2): v1b / "v1.5".
    blk = model.layer2[0]
    assert tuple(blk.conv2._stride) == (2, 2) and tuple(blk.conv1._stride) == (1, 1), \
        "unexpected paddle.vision BottleneckBlock layout"
    return model


class IBasicBlock(nn.Layer):
    """insightface/PLSC IBasicBlock: BN-conv3x3-BN-PReLU-conv3x3(stride)-BN + shortcut."""

    def __init__(self, cin, cout, stride, data_format):
        super().__init__()
        df = data_format
        self.bn1 = nn.BatchNorm2D(cin, momentum=0.9, epsilon=1e-5, data_format=df)
        self.conv1 = nn.Conv2D(cin, cout, 3, stride=1, padding=1, bias_attr=False,
                               data_format=df)
        self.bn2 = nn.BatchNorm2D(cout, momentum=0.9, epsilon=1e-5, data_format=df)
        self.prelu = nn.PReLU(num_parameters=cout, init=0.25, data_format=df)
        self.conv2 = nn.Conv2D(cout, cout, 3, stride=stride, padding=1, bias_attr=False,
                               data_format=df)
        self.bn3 = nn.BatchNorm2D(cout, momentum=0.9, epsilon=1e-5, data_format=df)
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2D(cin, cout, 1, stride=stride, bias_attr=False, data_format=df),
                nn.BatchNorm2D(cout, momentum=0.9, epsilon=1e-5, data_format=df),
            )
        else:
            self.downsample = None

    def forward(self, x):
        out = self.bn1(x)
        out = self.conv1(out)
        out = self.bn2(out)
        out = self.prelu(out)
        out = self.conv2(out)
        out = self.bn3(out)
        shortcut = x if self.downsample is None else self.downsample(x)
        return out + shortcut


class IResNet50(nn.Layer):
    """IResNet-50 backbone (insightface / PLSC "ResNet50"), 112x112 -> 512-d embedding."""

    def __init__(self, data_format="NCHW", emb=512, image=112):
        super().__init__()
        df = data_format
        self.conv1 = nn.Conv2D(3, 64, 3, stride=1, padding=1, bias_attr=False, data_format=df)
        self.bn1 = nn.BatchNorm2D(64, momentum=0.9, epsilon=1e-5, data_format=df)
        self.prelu = nn.PReLU(num_parameters=64, init=0.25, data_format=df)
        stages = []
        cin = 64
        for cout, n in zip((64, 128, 256, 512), (3, 4, 14, 3)):
            blocks = [IBasicBlock(cin, cout, 2, df)]
            blocks += [IBasicBlock(cout, cout, 1, df) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        # output block "E"
        self.bn2 = nn.BatchNorm2D(512, momentum=0.9, epsilon=1e-5, data_format=df)
        self.dropout = nn.Dropout(p=0.4)
        side = image // 16
        self.fc = nn.Linear(512 * side * side, emb)
        # gamma fixed at 1 and not trained; beta trained
        self.features = nn.BatchNorm1D(
            emb, momentum=0.9, epsilon=1e-5,
            weight_attr=paddle.ParamAttr(initializer=nn.initializer.Constant(1.0),
                                         trainable=False))

    def forward(self, x):
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = self.bn2(x)
        x = self.dropout(x)
        x = paddle.flatten(x, start_axis=1)
        x = self.fc(x)
        return self.features(x)


class ArcFaceHead(nn.Layer):
    """Class centres W (emb x classes, Paddle's Linear layout) + ArcFace margin loss.

    W is created with ParamAttr(need_clip=False): the optimizer's ClipGradByGlobalNorm
    then leaves W out of both the global norm and the scaling (only the backbone is
    clipped), with a single optimizer.
    """

    def __init__(self, emb, classes, fused, s=64.0, m=0.5):
        super().__init__()
        self.weight = self.create_parameter(
            shape=[emb, classes],
            attr=paddle.ParamAttr(initializer=nn.initializer.Normal(0.0, 0.01),
                                  need_clip=False))
        self.classes, self.s, self.m, self.fused = classes, s, m, fused

    def forward(self, emb, label):
        cos = paddle.matmul(F.normalize(emb, axis=1), F.normalize(self.weight, axis=0))
        if self.fused:
            # GPU-only fused kernel (cos(m1*theta + m2) - m3, times s, softmax CE)
            return F.margin_cross_entropy(cos, label, margin1=1.0, margin2=self.m,
                                          margin3=0.0, scale=self.s, reduction="mean")
        # composed ArcFace (margin_cross_entropy has no CPU kernel): margin on the
        # label column only
        target = paddle.take_along_axis(cos, label.unsqueeze(1), axis=1)
        theta = paddle.acos(paddle.clip(target, -1.0, 1.0))
        delta = paddle.cos(theta + self.m) - target
        onehot = F.one_hot(label, self.classes).astype(cos.dtype)
        logits = (cos + onehot * delta) * self.s
        return F.cross_entropy(logits, label, reduction="mean")


# ---------------------------------------------------------------- main

def main(a):
    if a.device == "cuda":
        if not paddle.is_compiled_with_cuda():
            _fail("--device cuda: this paddle %s build has no CUDA" % paddle.__version__)
        place = paddle.set_device("gpu")
    else:
        place = paddle.set_device("cpu")
        # CPU math library threads (MKL/OpenBLAS + OpenMP), Paddle's own setter
        paddle.base.core.set_num_threads(a.threads)
    paddle.seed(0)
    np.random.seed(0)

    layout = "NHWC" if a.channels_last else "NCHW"
    if a.case == "rn50":
        size, lr, wd = native_cli.shape(a)[0], 0.1, 1e-4
        model = build_rn50(a.classes)
        net = model
        params, trainable = count_params(model)
        head = None
        opt = paddle.optimizer.Momentum(learning_rate=lr, momentum=0.9,
                                        parameters=model.parameters(), weight_decay=wd)
        zoo = ("paddle.vision.models.resnet50(num_classes=%d), unchanged: its BottleneckBlock "
               "already puts the stride on the 3x3 (conv2), i.e. v1b/v1.5" % a.classes)
    else:
        size, lr, wd = 112, 0.1, 5e-4
        model = IResNet50(data_format=layout, image=size)
        params, trainable = count_params(model)
        fused = a.device == "cuda"
        head = ArcFaceHead(512, a.classes, fused=fused)
        net = model
        opt = paddle.optimizer.Momentum(
            learning_rate=lr, momentum=0.9,
            parameters=list(model.parameters()) + list(head.parameters()),
            weight_decay=wd, grad_clip=nn.ClipGradByGlobalNorm(clip_norm=5.0))
        zoo = ("IResNet-50 from paddle.nn stock layers (Conv2D, BatchNorm2D, PReLU(num_parameters=C), "
               "Dropout, Linear, BatchNorm1D with ParamAttr(trainable=False) gamma) + ArcFace head: "
               + ("F.margin_cross_entropy (fused, GPU)" if fused else
                  "F.normalize + matmul, acos/cos margin on the label column, F.cross_entropy "
                  "(margin_cross_entropy is GPU-only)"))
    sys.stderr.write("paddle.py: params %d (trainable %d)%s\n" % (
        params, trainable,
        "" if head is None else ", head W %d" % int(np.prod(head.weight.shape))))

    if a.mode == "static":
        net = paddle.jit.to_static(model, full_graph=True)
    model.train()

    shape = [a.batch, size, size, 3] if a.channels_last else [a.batch, 3, size, size]
    images = paddle.randn(shape, dtype="float32")
    labels = paddle.randint(0, a.classes, [a.batch], dtype="int64")

    amp = a.precision != "fp32"
    amp_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(a.precision)
    scaler = paddle.amp.GradScaler(init_loss_scaling=2.0 ** 15) if a.precision == "fp16" else None

    def step():
        if amp:
            with paddle.amp.auto_cast(enable=True, level="O1", dtype=amp_dtype):
                out = net(images)
                loss = F.cross_entropy(out, labels) if head is None else head(out, labels)
        else:
            out = net(images)
            loss = F.cross_entropy(out, labels) if head is None else head(out, labels)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.clear_grad()
        return loss

    first = None
    loss = None
    for _ in range(a.warmup):
        loss = step()
        if first is None:
            first = loss
    if loss is not None:
        float(loss)  # synchronise: loss value to host
    t0 = time.perf_counter()
    for _ in range(a.iters):
        loss = step()
        if first is None:
            first = loss
    loss_last = float(loss)  # synchronise once
    window = time.perf_counter() - t0
    loss_first = float(first)

    if a.mode == "static":
        compile_s = ("paddle.jit.to_static(model, full_graph=True) (forward and its backward as "
                     "static programs), loss/optimizer dygraph")
    else:
        compile_s = "dygraph (eager, no to_static)"
    settings = {
        "zoo": zoo,
        "mode": a.mode,
        "compile": compile_s,
        "layout": layout,
        "optimizer": "paddle.optimizer.Momentum(learning_rate=%g, momentum=0.9, weight_decay=%g)"
                     " [float weight_decay == L2Decay, fused into the momentum kernel]" % (lr, wd),
        "step": "loss.backward(); opt.step(); opt.clear_grad()  [clear_grad default set_to_zero=True]"
                if scaler is None else
                "scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.clear_grad()",
        "threads_reported": {
            "set_num_threads": a.threads if a.device == "cpu" else None,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "note": "paddle.base.core.set_num_threads(T) has no getter; OMP_NUM_THREADS as paddle "
                    "left it (paddle forces it to 1 when the caller does not set it)",
        },
        "FLAGS_use_mkldnn": bool(paddle.get_flags(["FLAGS_use_mkldnn"])["FLAGS_use_mkldnn"]),
        "place": str(place),
    }
    if a.case == "face":
        settings["grad_clip"] = ("ClipGradByGlobalNorm(5.0) on one Momentum optimizer; head W has "
                                 "ParamAttr(need_clip=False) so only the backbone is clipped")
        settings["params_trainable"] = trainable
        settings["head_params"] = int(np.prod(head.weight.shape))
    if amp:
        settings["amp"] = "paddle.amp.auto_cast(level='O1', dtype='%s')%s" % (
            amp_dtype, " + GradScaler" if scaler is not None else "")

    native_cli.report("paddle", a, window, settings=settings,
                      versions={"paddle": paddle.__version__, "numpy": np.__version__},
                      params=params, loss_first=loss_first, loss_last=loss_last)


if __name__ == "__main__":
    main(args)
