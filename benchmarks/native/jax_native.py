"""JAX's own training step, as flax's ImageNet example writes it: the reference that trainperf's
JAX worker is measured against (benchmarks/native_parity.py).

flax.linen modules in NHWC, BatchNorm statistics as a mutable collection, optax SGD with
momentum (weight decay added to the gradient first, as torch's SGD does), and one ``jax.jit``
step with the state donated. ResNet50 is the example's bottleneck layout (stride on the 3x3);
the face backbone is IResNet-50 from flax.linen's stock layers, with a per-channel PReLU
module (linen's ``nn.PReLU`` has one shared slope). ``--precision bf16`` computes in bfloat16
with float32 parameters, as the example's ``half_precision`` does.

Imports only JAX, flax, optax, numpy and the standard library.

    python benchmarks/native/jax_native.py --case rn50|face --batch B --threads T --iters N
        --warmup W [--device cpu|cuda] [--precision fp32|bf16] [--classes C] [--mode jit]

``--threads T`` sizes XLA's CPU thread pools (``PJRT_NPROC``, as trainperf's worker does), and
with one thread keeps Eigen's kernels on the calling thread. ``--mode``: ``jit``, JAX's only
training mode (the default).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import types

import native_cli

NAME = "native jax"
SINGLE_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"
POOL_SIZE_VAR = "PJRT_NPROC"
"""XLA's CPU client sizes its thread pools from this variable (one thread per core without it)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = native_cli.parser(NAME, __doc__)  # --channels-last changes nothing: flax is NHWC
    a = native_cli.parse(p, argv)
    if a.precision == "fp16":
        p.error("--precision fp16: flax's example trains in bf16 or fp32 only")
    if a.mode not in ("", "jit"):
        p.error(f"--mode {a.mode}: JAX trains in jit only")
    return a


def configure(a: argparse.Namespace) -> None:
    """What JAX reads once, when it starts its backends: set before it is imported."""
    os.environ["JAX_PLATFORMS"] = a.device
    if a.threads:
        os.environ[POOL_SIZE_VAR] = str(a.threads)
    if a.threads == 1:
        os.environ["XLA_FLAGS"] = " ".join(
            [*os.environ.get("XLA_FLAGS", "").split(), SINGLE_THREAD_FLAG])


def build(a: argparse.Namespace) -> types.SimpleNamespace:
    """The reference's jitted step and its first state, batch and keys (also timed in process
    by ``benchmarks/jax_step_ablation.py``): ``step(state, images, labels, key)`` returns
    ``(state, loss)``."""
    import flax
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    dtype = jnp.bfloat16 if a.precision == "bf16" else jnp.float32

    class Bottleneck(nn.Module):
        filters: int
        strides: int = 1

        @nn.compact
        def __call__(self, x, train: bool):
            conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype)
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                     epsilon=1e-5, dtype=dtype)
            y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
            y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(y)))
            y = norm()(conv(self.filters * 4, (1, 1))(y))
            if x.shape[-1] != self.filters * 4 or self.strides != 1:
                x = norm()(conv(self.filters * 4, (1, 1), self.strides)(x))
            return nn.relu(x + y)

    class ResNet50(nn.Module):
        classes: int

        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(64, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                        dtype=dtype)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9,
                                     epsilon=1e-5, dtype=dtype)(x))
            x = nn.max_pool(x, (3, 3), (2, 2), padding="SAME")
            for i, count in enumerate((3, 4, 6, 3)):
                for j in range(count):
                    x = Bottleneck(64 * 2 ** i, 2 if i > 0 and j == 0 else 1)(x, train)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(self.classes, dtype=dtype)(x).astype(jnp.float32)

    class PReLU(nn.Module):
        @nn.compact
        def __call__(self, x):
            slope = self.param("slope", nn.initializers.constant(0.25), (x.shape[-1],))
            return jnp.where(x > 0, x, slope.astype(x.dtype) * x)

    class IBasicBlock(nn.Module):
        filters: int
        strides: int

        @nn.compact
        def __call__(self, x, train: bool):
            conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype)
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                     epsilon=1e-5, dtype=dtype)
            y = norm()(x)
            y = PReLU()(norm()(conv(self.filters, (3, 3))(y)))
            y = norm()(conv(self.filters, (3, 3), self.strides)(y))
            if x.shape[-1] != self.filters or self.strides != 1:
                x = norm()(conv(self.filters, (1, 1), self.strides)(x))
            return x + y

    class IResNet50(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                     epsilon=1e-5, dtype=dtype)
            x = PReLU()(norm()(nn.Conv(64, (3, 3), use_bias=False, dtype=dtype)(x)))
            for width, count in zip((64, 128, 256, 512), (3, 4, 14, 3)):
                for j in range(count):
                    x = IBasicBlock(width, 2 if j == 0 else 1)(x, train)
            x = nn.Dropout(0.4, deterministic=not train)(norm()(x))
            x = nn.Dense(512, dtype=dtype)(x.reshape(x.shape[0], -1))
            # gamma fixed at 1, as insightface's E block: no scale parameter at all
            return norm(use_scale=False)(x).astype(jnp.float32)

    class ArcFace(nn.Module):
        classes: int

        @nn.compact
        def __call__(self, emb, labels):
            w = self.param("weight", nn.initializers.normal(0.01), (emb.shape[-1], self.classes))
            cos = (emb / jnp.linalg.norm(emb, axis=1, keepdims=True)) @ (
                w / jnp.linalg.norm(w, axis=0, keepdims=True))
            onehot = jax.nn.one_hot(labels, self.classes)
            target = jnp.clip(jnp.sum(cos * onehot, axis=1), -1.0, 1.0)
            cos = cos + onehot * (jnp.cos(jnp.arccos(target) + 0.5) - target)[:, None]
            return optax.softmax_cross_entropy_with_integer_labels(cos * 64.0, labels).mean()

    rn50 = a.case == "rn50"
    side, classes = native_cli.shape(a)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.standard_normal((a.batch, side, side, 3), dtype=np.float32))
    labels = jnp.asarray(rng.integers(0, classes, a.batch, dtype=np.int32))
    key = jax.random.PRNGKey(0)
    backbone = ResNet50(classes) if rn50 else IResNet50()
    variables = backbone.init({"params": key, "dropout": key}, images[:1], train=False)
    params = {"backbone": variables["params"]}
    counted = sum(x.size for x in jax.tree_util.tree_leaves(variables["params"]))
    if not rn50:
        counted += 512  # the fixed gamma that flax leaves out (use_scale=False)
        head = ArcFace(classes)
        params["head"] = head.init(key, jnp.zeros((1, 512)), labels[:1])["params"]
    sgd = optax.sgd(0.1, momentum=0.9)
    if rn50:
        tx = optax.chain(optax.add_decayed_weights(1e-4), sgd)
    else:
        tx = optax.multi_transform(
            {"backbone": optax.chain(optax.clip_by_global_norm(5.0),
                                     optax.add_decayed_weights(5e-4), sgd),
             "head": optax.chain(optax.add_decayed_weights(5e-4), sgd)},
            {"backbone": "backbone", "head": "head"})
    state = (params, variables["batch_stats"], tx.init(params))

    def loss_fn(params, stats, images, labels, key):
        out, updates = backbone.apply({"params": params["backbone"], "batch_stats": stats},
                                      images, train=True, mutable=["batch_stats"],
                                      rngs={"dropout": key})
        if rn50:
            loss = optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
        else:
            loss = head.apply({"params": params["head"]}, out, labels)
        return loss, updates["batch_stats"]

    @functools.partial(jax.jit, donate_argnums=(0,))
    def train_step(state, images, labels, key):
        params, stats, opt_state = state
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, stats, images, labels, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), stats, opt_state), loss

    return types.SimpleNamespace(
        step=train_step, state=state, images=images, labels=labels, params=counted,
        keys=jax.random.split(key, a.warmup + a.iters),
        versions={"jax": jax.__version__, "flax": flax.__version__,
                  "optax": optax.__version__, "numpy": np.__version__})


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    configure(a)
    import jax

    ref = build(a)
    rn50 = a.case == "rn50"
    train_step, state, images, labels, keys = (ref.step, ref.state, ref.images, ref.labels,
                                               ref.keys)
    first = None
    for i in range(a.warmup):
        state, loss = train_step(state, images, labels, keys[i])
        first = float(loss) if first is None else first
    jax.block_until_ready(state)
    start = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.iters):
        state, loss = train_step(state, images, labels, keys[i])
    last = float(loss)  # the one host sync of the window
    window = time.perf_counter() - start
    native_cli.report(
        "jax", a, window, threads=a.threads or os.cpu_count(),
        settings={"zoo": "flax.linen modules in the ImageNet example's layout" if rn50
                  else "flax.linen stock layers, per-channel PReLU module",
                  "compile": "jax.jit, state donated", "layout": "NHWC", "mode": "jit",
                  "optimizer": "optax.sgd(momentum) after add_decayed_weights"
                  + ("" if rn50 else ", backbone clip_by_global_norm via multi_transform"),
                  "compute_dtype": a.precision, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                  "threads_reported": ("1 (PJRT_NPROC=1, eigen single-threaded)"
                                       if a.threads == 1 else
                                       f"{a.threads} (PJRT_NPROC)" if a.threads
                                       else "XLA's default pool")},
        versions=ref.versions, params=ref.params,
        loss_first=first if first is not None else last, loss_last=last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
