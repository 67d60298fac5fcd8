"""Native TensorFlow/Keras reference training step (trainperf issue 26).

Written the way a Keras 3 user on TensorFlow would write a custom training
loop: a functional ``keras.Model`` in the default NHWC (channels_last) layout,
a ``tf.function`` train step with ``tf.GradientTape`` and a
``keras.optimizers.SGD``.  It imports only TensorFlow/Keras, numpy and the
standard library.

    python benchmarks/native/tf_native.py --case rn50|face --batch B --threads T \
        --iters N --warmup W [--device cpu|cuda] [--precision fp32|bf16|fp16] \
        [--channels-last] [--classes C] [--onednn] [--mode function|xla] [--inter-op K]

Modes, trainperf's names for TensorFlow's: ``function`` (the default) traces the step into a
graph, ``tf.function(jit_compile=False)``; ``xla`` compiles the whole step with XLA,
``tf.function(jit_compile=True)`` (``--xla`` is its older spelling).

The last line of stdout is one JSON object (see the contract).
"""

import os
import sys
import time

import native_cli

RN50_PARAMS = 25_557_032
FACE_PARAMS = 43_590_848
FACE_TRAINABLE = 43_590_336


NAME = "native tf"
MODES = {"function": False, "xla": True}
"""trainperf's names of TensorFlow's modes, and ``tf.function``'s ``jit_compile`` for each."""


def fail(message):
    native_cli.fail(NAME, message)


def parse_args(argv):
    p = native_cli.parser(NAME, __doc__)  # --channels-last changes nothing: Keras is NHWC
    p.add_argument("--onednn", action="store_true",
                   help="turn TensorFlow's oneDNN custom ops on (off by default: "
                        "TF_ENABLE_ONEDNN_OPTS=0)")
    p.add_argument("--xla", action="store_true", help="--mode xla, in its older spelling")
    p.add_argument("--inter-op", type=int, default=1,
                   help="inter-op threads (default 1: ops run one after another, "
                        "each on all --threads intra-op threads)")
    a = native_cli.parse(p, argv)
    for name in ("threads", "warmup", "inter_op"):
        if getattr(a, name) < 1:
            fail("--%s must be >= 1, got %d" % (name.replace("_", "-"), getattr(a, name)))
    a.classes = native_cli.shape(a)[1]
    if a.xla and a.mode not in ("", "xla"):
        fail("--xla is --mode xla; it cannot go with --mode %s" % a.mode)
    a.mode = a.mode or ("xla" if a.xla else "function")
    if a.mode not in MODES:
        fail("--mode %s: tf runs %s" % (a.mode, ", ".join(MODES)))
    a.xla = MODES[a.mode]
    if a.precision == "fp16":
        fail("--precision fp16 is not supported by this reference (needs a GPU and "
             "loss scaling; TensorFlow CPU has no fast fp16); use fp32 or bf16")
    return a


# ----------------------------------------------------------------------------
# models (built from keras.layers, functional API, NHWC)
# ----------------------------------------------------------------------------

def resnet50_v1b(keras, classes, side=224):
    """ResNet50 v1b in the style of keras.applications.resnet.ResNet50.

    Differences from keras.applications.ResNet50 (which is v1): the stride of a
    downsampling block is on the 3x3 convolution, not on the first 1x1, and the
    convolutions carry no bias (every conv is followed by BN), as in
    torchvision's resnet50.
    """
    L = keras.layers

    def bn(name):
        # keras.applications' epsilon; momentum 0.9 == torch's 0.1
        return L.BatchNormalization(axis=3, epsilon=1.001e-5, momentum=0.9, name=name)

    def block(x, filters, stride, shortcut_conv, name):
        if shortcut_conv:
            sc = L.Conv2D(4 * filters, 1, strides=stride, use_bias=False,
                          name=name + "_0_conv")(x)
            sc = bn(name + "_0_bn")(sc)
        else:
            sc = x
        y = L.Conv2D(filters, 1, use_bias=False, name=name + "_1_conv")(x)
        y = bn(name + "_1_bn")(y)
        y = L.Activation("relu", name=name + "_1_relu")(y)
        y = L.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                     name=name + "_2_conv")(y)
        y = bn(name + "_2_bn")(y)
        y = L.Activation("relu", name=name + "_2_relu")(y)
        y = L.Conv2D(4 * filters, 1, use_bias=False, name=name + "_3_conv")(y)
        y = bn(name + "_3_bn")(y)
        y = L.Add(name=name + "_add")([sc, y])
        return L.Activation("relu", name=name + "_out")(y)

    def stack(x, filters, blocks, stride, name):
        x = block(x, filters, stride, True, name + "_block1")
        for i in range(2, blocks + 1):
            x = block(x, filters, 1, False, name + "_block%d" % i)
        return x

    inp = keras.Input(shape=(side, side, 3), name="input")
    x = L.ZeroPadding2D(padding=3, name="conv1_pad")(inp)
    x = L.Conv2D(64, 7, strides=2, use_bias=False, name="conv1_conv")(x)
    x = bn("conv1_bn")(x)
    x = L.Activation("relu", name="conv1_relu")(x)
    x = L.ZeroPadding2D(padding=1, name="pool1_pad")(x)
    x = L.MaxPooling2D(3, strides=2, name="pool1_pool")(x)
    x = stack(x, 64, 3, 1, "conv2")
    x = stack(x, 128, 4, 2, "conv3")
    x = stack(x, 256, 6, 2, "conv4")
    x = stack(x, 512, 3, 2, "conv5")
    x = L.GlobalAveragePooling2D(name="avg_pool")(x)
    # logits; the softmax lives in the loss (from_logits)
    out = L.Dense(classes, name="predictions", dtype="float32")(x)
    return keras.Model(inp, out, name="resnet50_v1b")


def iresnet50(keras):
    """insightface IResNet-50 backbone (112x112 -> 512-d embedding)."""
    L = keras.layers
    const = keras.initializers.Constant

    def bn(name, **kw):
        return L.BatchNormalization(axis=-1, momentum=0.9, epsilon=1e-5, name=name, **kw)

    def prelu(name):
        return L.PReLU(alpha_initializer=const(0.25), shared_axes=[1, 2], name=name)

    def block(x, cin, cout, stride, name):
        y = bn(name + "_bn1")(x)
        y = L.Conv2D(cout, 3, padding="same", use_bias=False, name=name + "_conv1")(y)
        y = bn(name + "_bn2")(y)
        y = prelu(name + "_prelu")(y)
        y = L.Conv2D(cout, 3, strides=stride, padding="same", use_bias=False,
                     name=name + "_conv2")(y)
        y = bn(name + "_bn3")(y)
        if stride != 1 or cin != cout:
            sc = L.Conv2D(cout, 1, strides=stride, use_bias=False, name=name + "_down_conv")(x)
            sc = bn(name + "_down_bn")(sc)
        else:
            sc = x
        return L.Add(name=name + "_add")([y, sc])

    inp = keras.Input(shape=(112, 112, 3), name="input")
    x = L.Conv2D(64, 3, padding="same", use_bias=False, name="conv1")(inp)
    x = bn("bn1")(x)
    x = prelu("prelu")(x)
    cin = 64
    for s, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 14, 3)), 1):
        for b in range(blocks):
            x = block(x, cin, width, 2 if b == 0 else 1, "layer%d_%d" % (s, b))
            cin = width
    x = bn("bn2")(x)
    x = L.Dropout(0.4, name="dropout")(x)
    x = L.Flatten(name="flatten")(x)
    x = L.Dense(512, name="fc")(x)
    # fixed gamma (== 1, not trained), trained beta
    emb = bn("features", scale=False, dtype="float32")(x)
    return keras.Model(inp, emb, name="iresnet50")


def make_arcface(keras, tf):
    class ArcFace(keras.layers.Layer):
        """ArcFace (additive angular margin) logits: s * cos(theta + m) on the label."""

        def __init__(self, classes, s=64.0, m=0.5, **kw):
            super().__init__(dtype="float32", **kw)
            self.classes, self.s, self.m = classes, s, m

        def build(self, input_shape):
            # Dense-style layout (in_features, classes)
            self.w = self.add_weight(
                shape=(int(input_shape[-1]), self.classes), name="weight",
                initializer=keras.initializers.RandomNormal(stddev=0.01), trainable=True)

        def call(self, emb, labels):
            emb = tf.math.l2_normalize(emb, axis=1)
            w = tf.math.l2_normalize(self.w, axis=0)
            cos = tf.matmul(emb, w)  # (B, classes)
            idx = tf.stack([tf.range(tf.shape(labels)[0], dtype=labels.dtype), labels], axis=1)
            target = tf.gather_nd(cos, idx)
            theta = tf.math.acos(tf.clip_by_value(target, -1.0, 1.0))
            cos = tf.tensor_scatter_nd_update(cos, idx, tf.math.cos(theta + self.m))
            return cos * self.s

    return ArcFace


# ----------------------------------------------------------------------------

def count(variables):
    return int(sum(int(v.shape.num_elements()) for v in variables))


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)

    # Must happen before tensorflow is imported.
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if a.onednn else "0"
    os.environ["KERAS_BACKEND"] = "tensorflow"
    # Quiet TensorFlow's C++ INFO/WARNING start-up lines (errors still show),
    # so that a refusal stays one line on stderr; the caller may override it.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    import numpy as np
    import tensorflow as tf
    import keras

    # Threads: before any op runs.
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(a.inter_op)

    if a.device == "cuda":
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            fail("--device cuda: this TensorFlow build sees no GPU (tensorflow-cpu)")
        dev = "/GPU:0"
    else:
        tf.config.set_visible_devices([], "GPU")
        dev = "/CPU:0"

    if a.precision == "bf16":
        keras.mixed_precision.set_global_policy("mixed_bfloat16")

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    size = native_cli.shape(a)[0]
    wd = 1e-4 if a.case == "rn50" else 5e-4

    with tf.device(dev):
        x = tf.constant(rng.standard_normal((a.batch, size, size, 3), dtype=np.float32))
        y = tf.constant(rng.integers(0, a.classes, size=(a.batch,)), dtype=tf.int32)

        # Plain SGD with momentum; weight decay is added to the gradient in the
        # step (L2, coupled through momentum, as torch.optim.SGD does) rather
        # than SGD(weight_decay=...), which in Keras 3 is decoupled
        # (variable -= lr * wd * variable before the momentum update).
        opt = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)

        if a.case == "rn50":
            model = resnet50_v1b(keras, a.classes, size)
            variables = model.trainable_variables
            params = count(variables)
            params_check = RN50_PARAMS if a.classes == 1000 else None
            trainable = params
            opt.build(variables)

            def step_fn(x, y):
                with tf.GradientTape() as tape:
                    logits = model(x, training=True)
                    loss = tf.reduce_mean(
                        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
                grads = tape.gradient(loss, variables)
                grads = [g + wd * v for g, v in zip(grads, variables)]
                opt.apply_gradients(zip(grads, variables))
                return loss
        else:
            backbone = iresnet50(keras)
            head = make_arcface(keras, tf)(a.classes, name="arcface")
            head.build((None, 512))
            bb_vars = backbone.trainable_variables
            head_vars = head.trainable_variables
            variables = bb_vars + head_vars
            trainable = count(bb_vars)
            # + the fixed gammas of BatchNormalization(scale=False) (implicitly 1)
            fixed_gamma = sum(int(l.beta.shape[0]) for l in backbone.layers
                              if isinstance(l, keras.layers.BatchNormalization) and not l.scale)
            params = trainable + fixed_gamma
            params_check = FACE_PARAMS
            if trainable != FACE_TRAINABLE:
                sys.stderr.write("native tf: warning: backbone trainable %d != %d\n"
                                 % (trainable, FACE_TRAINABLE))
            opt.build(variables)
            nb = len(bb_vars)

            def step_fn(x, y):
                with tf.GradientTape() as tape:
                    emb = backbone(x, training=True)
                    logits = head(emb, y)
                    loss = tf.reduce_mean(
                        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
                grads = tape.gradient(loss, variables)
                bb_grads, _ = tf.clip_by_global_norm(grads[:nb], 5.0)
                grads = list(bb_grads) + list(grads[nb:])
                grads = [g + wd * v for g, v in zip(grads, variables)]
                opt.apply_gradients(zip(grads, variables))
                return loss

        if params_check is not None and params != params_check:
            sys.stderr.write("native tf: warning: params %d != expected %d\n" % (params, params_check))

        step = tf.function(step_fn, jit_compile=a.xla)

        loss_first = None
        loss = None
        for _ in range(a.warmup):
            loss = step(x, y)
            if loss_first is None:
                loss_first = float(loss.numpy())
        float(loss.numpy())  # sync

        t0 = time.perf_counter()
        for _ in range(a.iters):
            loss = step(x, y)
        loss_last = float(loss.numpy())  # sync
        window = time.perf_counter() - t0

    native_cli.report(
        "tf", a, window,
        settings={
            "zoo": ("ResNet50 v1b built from keras.layers in keras.applications.ResNet50's "
                    "functional style (keras.applications.ResNet50 is v1 with the stride on the "
                    "first 1x1 and conv biases, not configurable): stride moved to the 3x3 "
                    "(padding='same'), use_bias=False on convs, BN eps 1.001e-5 momentum 0.9"
                    if a.case == "rn50" else
                    "IResNet-50 (insightface) from keras.layers: Conv2D(padding='same', no bias), "
                    "BatchNormalization(momentum=0.9, eps=1e-5), PReLU(shared_axes=[1,2], 0.25), "
                    "Dropout(0.4), Flatten, Dense(512), BatchNormalization(scale=False); ArcFace "
                    "head as a keras Layer (l2_normalize, matmul, gather_nd/acos/cos, "
                    "tensor_scatter_nd_update, s=64 m=0.5), W (512, classes)"),
            "compile": "tf.function(jit_compile=%s) with tf.GradientTape" % a.xla,
            "layout": "NHWC",
            "optimizer": ("keras.optimizers.SGD(learning_rate=0.1, momentum=0.9) with L2 "
                          "wd=%g added to the gradient in the step (torch-style coupled decay; "
                          "not SGD(weight_decay=), which Keras 3 applies decoupled)" % wd),
            "clip": ("tf.clip_by_global_norm(backbone grads, 5.0) before L2 and update"
                     if a.case == "face" else None),
            "loss": "tf.nn.sparse_softmax_cross_entropy_with_logits, mean",
            "onednn": bool(a.onednn),
            "TF_ENABLE_ONEDNN_OPTS": os.environ["TF_ENABLE_ONEDNN_OPTS"],
            "mode": a.mode,
            "xla": bool(a.xla),
            "TF_CPP_MIN_LOG_LEVEL": os.environ["TF_CPP_MIN_LOG_LEVEL"],
            "mixed_precision_policy": keras.mixed_precision.global_policy().name,
            "threads_reported": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op_threads_reported": tf.config.threading.get_inter_op_parallelism_threads(),
            "channels_last_flag": bool(a.channels_last),
            "classes": a.classes,
            "trainable_params": trainable,
            "keras_count_params": (model.count_params() if a.case == "rn50"
                                   else backbone.count_params()),
        },
        versions={"tensorflow": tf.__version__, "keras": keras.__version__,
                  "numpy": np.__version__},
        params=params, loss_first=loss_first, loss_last=loss_last)


if __name__ == "__main__":
    main()
