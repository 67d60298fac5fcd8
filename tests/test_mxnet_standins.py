"""The float64 stand-ins of the MXNet backend compute what the native kernels they replace
compute (``step.py``'s and ``alignment.py``'s module docs).

A float64 alignment run cannot use four of MXNet's kernels as they are: the fused momentum SGD
(``preloaded_multi_sgd_mom_update``; ``sgd_mom_update`` alike) takes its rates, decays and
momentum as float32, ``multi_sum_sq`` returns float32, ``clip`` takes its bounds as C floats, and
BatchNorm holds its momentum as a C float. It runs stand-ins made of MXNet's elementwise
operations instead, while throughput runs keep the native kernels. These tests run both in
float32, on random inputs, where the native kernels are exact to float32, and require the same
outputs, gradients and state (momentum buffers, running statistics) within float32 rounding;
and they check in float64 that the stand-ins keep the native rule with double constants.

Bounds, and why they are float32 rounding (one rounding is at most 2**-24 = 6e-8 relative):

- SGD: each step starts both sides from the native side's weights, momentum buffers and
  gradients (three steps of TrainStep with weight decay, clipping and a change of rate; four of
  one array against ``sgd_mom_update``). The momentum buffers within 1e-6 of their largest
  entry: each side rounds the six products and sums of ``m * mom - lr * wd * w - lr * rescale *
  g`` once, in another grouping (the fused kernel takes ``lr * coef`` and ``wd / coef``, the
  stand-in ``coef * rescale``), 12 roundings of the largest term at most, 7e-7. The weights
  within the buffers' difference plus one rounding of ``w + mom`` (one float32 ulp of ``w``).
  Where clipping acts the update is linear in ``max_norm / norm``, so the two norms' measured
  difference comes on top.
- The gradient norm: MXNet's CPU ``multi_sum_sq`` adds an array's float32 squares one after
  another in a float32 (bit for bit numpy's float32 ``cumsum``, checked), whose rounding grows
  with the array's length: up to ``(n - 1) * 2**-24`` of the sum (Higham's bound for recursive
  summation), 1e-5 seen on a gradient of 36864 values. The stand-in's ``sum`` is the exact sum
  of the same squares to 4 roundings. So the two are held to the native sum's own bound, and
  the stand-in to 4 roundings of the exact sum.
- The clamp: identical values, gradients and inside-the-clamp mask (``maximum``/``minimum``
  and ``clip`` compare with the same float32 bound and round nothing).
- BatchNorm: outputs and every gradient identical (the momentum does not enter a training-mode
  pass); the running statistics within 1e-6 of the array's largest entry after three steps:
  the native kernel's (1 - 0.9f) = 0.10000002 is 2.4e-7 off the stand-in's float32 0.1, plus
  one rounding per product and sum each step.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SGD_RTOL = 1e-6
BN_RTOL = 1e-6
ROUNDING = 2.0 ** -24
"""One float32 rounding, relative."""
FLOAT64_RTOL = 1e-13
"""float64 stand-ins against numpy's float64 arithmetic: rounding only (a few 1e-16 per
operation, summed over at most 10**3 values)."""

MXNET_SIDE = r"""
import sys
import mxnet as mx
import numpy as np
from mxnet import autograd
from mxnet.gluon import nn
from trainperf.config import Workload
from trainperf.backends.mxnet import models
from trainperf.backends.mxnet.alignment import MXNetRunningStatistics
from trainperf.backends.mxnet.comm import Comm
from trainperf.backends.mxnet.heads import _clamp
from trainperf.backends.mxnet.step import TrainStep, global_norm, momentum_sgd, synthetic_batch

folder = sys.argv[1]
out = {}

# ---- the update: TrainStep's fused (native) path and its float64 path, both in float32. Before
# every step the stand-in's weights, momentum buffers and gradients are set to the native
# side's, so each step starts from one state; clipped (a tiny norm, so it acts) and unclipped,
# the rate x0.1 from step 1 (each side rescales its momentum there), a weight decay that shows.
CASES = {
    "clipped": dict(clip_grad_norm=0.05, weight_decay=0.01),
    "unclipped": dict(clip_grad_norm=None, weight_decay=0.01),
}

def state(step):  # weights (backbone, head), momentum buffers, gradients
    weights = [p.data() for p in step.params] + [h.weight for h in step.heads]
    moms = [m for ms in step._bb_mom for m in ms] + step._head_mom
    grads = [p.grad() for p in step.params] + [h.grad for h in step.heads]
    return weights, moms, grads

for (case, change), kernel in [(c, k) for c in CASES.items() for k in ("per_array", "multi")]:
    case = case if kernel == "per_array" else f"{case}-multi"
    wl = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=4, embedding_size=8,
                  input_size=16, dropout=0.0, lr_steps=(1,), lr_scales=(0.1,), **change)
    native, standin = TrainStep(wl, Comm()), TrainStep(wl, Comm())
    native.update_kernel = kernel  # a CPU's kernel, and a GPU's run here on the CPU
    standin.fused = False
    for step in (native, standin):
        step.keep_grad_norm = True  # the norm even where nothing clips
    batch = [synthetic_batch(wl, 0, mx.cpu())]
    for i in range(3):
        losses = native.compute_gradients(batch)
        for a, b in zip(sum(state(native), []), sum(state(standin), [])):
            a.copyto(b)
        for j, w in enumerate(state(native)[0]):
            out[f"{case}/{i}/before/{j}"] = w.asnumpy()
        for name, step in (("native", native), ("standin", standin)):
            step.apply(losses)
            weights, moms, _ = state(step)
            for j, (w, m) in enumerate(zip(weights, moms)):
                out[f"{case}/{name}/{i}/weights/{j}"] = w.asnumpy()
                out[f"{case}/{name}/{i}/mom/{j}"] = m.asnumpy()
            out[f"{case}/{name}/{i}/norm"] = step.last_grad_norm.asnumpy()
            out[f"{case}/{name}/{i}/lr"] = step.last_lr
    out[f"{case}/moms"] = len(state(native)[1])
    out[f"{case}/longest"] = max(g.size for g in state(native)[2][:len(native.params)])

# ---- one array against sgd_mom_update: four steps from the native side's state, the rate x0.1
# from step 2 (each side's momentum rescaled by the step's rule before it).
rs = np.random.RandomState(11)
shape = (37, 19)
w = mx.nd.array(rs.normal(0, 0.5, shape), dtype="float32")
mom = mx.nd.zeros(shape, dtype="float32")
last = None
for i, lr in enumerate((0.1, 0.1, 0.01, 0.01)):
    g = mx.nd.array(rs.normal(0, 2.0, shape), dtype="float32")
    if last is not None and lr != last:
        mom *= lr / last
    last = lr
    w2, mom2 = w.copy(), mom.copy()
    out[f"single/{i}/before/0"] = w.asnumpy()
    mx.nd.sgd_mom_update(w, g, mom, lr=lr, momentum=0.9, wd=0.01, rescale_grad=0.5, out=w)
    momentum_sgd([w2], [g], [mom2], 0.9, lr, 0.01, 0.5)
    for name, (weights, moms) in (("native", (w, mom)), ("standin", (w2, mom2))):
        out[f"single/{name}/{i}/weights/0"] = weights.asnumpy()
        out[f"single/{name}/{i}/mom/0"] = moms.asnumpy()

# ---- the norm: 50 arrays (two fused calls), 1 to 40000 values, scales 1e-3 to 1e2; each
# array's sum of squares alone too.
rs = np.random.RandomState(21)
host = [rs.normal(0, 10.0 ** rs.uniform(-3, 2), rs.randint(1, 40000)).astype(np.float32)
        for _ in range(50)]
for j, h in enumerate(host):
    out[f"norm/array/{j}"] = h
for dtype in ("float32", "float64"):
    grads = [mx.nd.array(h, dtype=dtype) for h in host]
    for fused in (True, False):
        norm = global_norm(grads, 0.25, fused)
        out[f"norm/{dtype}/{fused}"] = norm.asnumpy().astype(np.float64)
        out[f"norm/{dtype}/{fused}/dtype"] = np.dtype(norm.dtype).name
    out[f"norm/{dtype}/sums/native"] = np.concatenate(
        [mx.nd.multi_sum_sq(g, num_arrays=1).asnumpy() for g in grads])
    out[f"norm/{dtype}/sums/standin"] = np.concatenate(
        [mx.nd.sum(mx.nd.square(g)).asnumpy() for g in grads])

# ---- the clamp: random cosines, the bounds and their float32 neighbours.
low, high = -1.0 + 1e-6, 1.0 - 1e-6
rs = np.random.RandomState(31)
edges = np.array([low, high], dtype=np.float32)
values = np.concatenate([rs.uniform(-1.2, 1.2, 4000), edges,
                         np.nextafter(edges, np.float32(2)), np.nextafter(edges, np.float32(-2)),
                         [-1.0, 1.0]]).astype(np.float32)
out["clamp/x"] = values
for dtype in ("float32", "float64"):
    for name, fn in (("native", lambda x: mx.nd.clip(x, low, high)),
                     ("standin", lambda x: _clamp(x, low, high))):
        x = mx.nd.array(values, dtype=dtype)
        x.attach_grad()
        with autograd.record():
            y = fn(x)
        y.backward(mx.nd.array(np.linspace(1, 2, values.size), dtype=dtype))
        out[f"clamp/{dtype}/{name}"] = y.asnumpy()
        out[f"clamp/{dtype}/{name}/grad"] = x.grad.asnumpy()
        out[f"clamp/{dtype}/{name}/same"] = (y == x).asnumpy()

# ---- BatchNorm's running statistics: the same network natively and with the stand-in, three
# training passes each on the same random batches. iresnet_tiny: 4-d BatchNorms of 8 to 64
# channels (oneDNN's kernel in float32) and a fixed-gamma one on [N, 8] (MXNet's own kernel);
# a small network: a 4-d BatchNorm of 6 channels and two on [N, 5] (MXNet's own kernel, the
# one float64 runs), one without a scale.
def bn(channels, **kw):
    return nn.BatchNorm(axis=1, momentum=models.BN_MOMENTUM, epsilon=models.BN_EPS,
                        in_channels=channels, **kw)

def small():
    net = nn.HybridSequential()
    net.add(nn.Conv2D(6, 3, padding=1, in_channels=3, use_bias=False), bn(6),
            nn.Activation("relu"), nn.Dense(5, in_units=6 * 36), bn(5), bn(5, scale=False))
    return net

NETS = {
    "iresnet": (lambda: models.build_backbone("iresnet_tiny", embedding_size=8, input_size=16),
                (4, 3, 16, 16), 8),
    "small": (small, (4, 3, 6, 6), 5),
}

def build(make, dtype, standin):
    mx.random.seed(3)
    net = make()
    net.initialize()
    rs = np.random.RandomState(1)  # statistics, shifts and scales away from their start
    for name, p in sorted(net.collect_params().items()):
        shape = p.data().shape
        if name.endswith("running_var"):
            p.set_data(rs.uniform(0.5, 2.0, shape))
        elif name.endswith(("running_mean", "beta")):
            p.set_data(rs.normal(0, 0.5, shape))
        elif name.endswith("gamma") and p.grad_req != "null":
            p.set_data(rs.uniform(0.5, 1.5, shape))
    net.cast(dtype)
    stats = MXNetRunningStatistics(net) if standin else None
    net.hybridize(static_alloc=True, static_shape=True)
    return net, stats

for kind, (make, shape, width) in NETS.items():
    for name in ("native", "standin"):
        net, stats = build(make, "float32", name == "standin")
        rs = np.random.RandomState(5)
        for i in range(3):
            x = mx.nd.array(rs.normal(0.3, 1.5, shape), dtype="float32")
            x.attach_grad()
            r = mx.nd.array(rs.normal(size=(shape[0], width)), dtype="float32")
            with autograd.record():
                y = net(x)
                objective = (y * r).sum()
            objective.backward()
            if stats is not None:
                stats.update()
            mx.nd.waitall()  # the native op writes the running arrays unordered (alignment.py)
            key = f"bn/{kind}/{name}/{i}"
            out[f"{key}/out"], out[f"{key}/x_grad"] = y.asnumpy(), x.grad.asnumpy()
            for torch_name, p in models.torch_names(net).items():
                if p.grad_req != "null":
                    out[f"{key}/grad/{torch_name}"] = p.grad().asnumpy()
                if torch_name.endswith(("running_mean", "running_var")):
                    out[f"{key}/state/{torch_name}"] = p.data().asnumpy()

# ---- BatchNorm in float64, one layer on its input (4-d and 2-d): the stand-in's running
# arrays, and the native op's, after two passes, against numpy's MXNet rule with a double
# momentum and the biased batch variance.
for kind, shape in (("4d", (4, 5, 3, 3)), ("2d", (6, 5))):
    rs = np.random.RandomState(41)
    start_mean, start_var = rs.normal(0, 0.5, 5), rs.uniform(0.5, 2.0, 5)
    xs = [rs.normal(0.3, 1.5, shape) for _ in range(2)]
    out[f"bn64/{kind}/start"] = np.stack([start_mean, start_var])
    out[f"bn64/{kind}/x"] = np.stack(xs)
    for name in ("native", "standin"):
        layer = bn(5)
        layer.initialize()
        layer.cast("float64")
        layer.running_mean.set_data(mx.nd.array(start_mean, dtype="float64"))
        layer.running_var.set_data(mx.nd.array(start_var, dtype="float64"))
        stats = MXNetRunningStatistics(layer) if name == "standin" else None
        layer.hybridize()
        for x in xs:
            data = mx.nd.array(x, dtype="float64")
            with autograd.record():
                y = layer(data)
            y.backward()
            if stats is not None:
                stats.update()
            mx.nd.waitall()
        out[f"bn64/{kind}/{name}"] = np.stack([layer.running_mean.data().asnumpy(),
                                              layer.running_var.data().asnumpy()])
        out[f"bn64/{kind}/{name}/dtype"] = np.dtype(layer.running_var.data().dtype).name

np.savez(f"{folder}/standins.npz", **out)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mxnet_python):
    folder = tmp_path_factory.mktemp("mx_standins")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop("TRAINPERF_FAULT", None)
    proc = subprocess.run([mxnet_python, "-c", MXNET_SIDE, str(folder)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return np.load(folder / "standins.npz")


def relative_to_largest(got, want) -> float:
    """The largest difference of ``got`` from ``want``, over ``want``'s largest entry."""
    want = np.asarray(want, dtype=np.float64)
    scale = np.abs(want).max()
    assert scale > 0
    return float(np.abs(np.asarray(got, dtype=np.float64) - want).max() / scale)


def close_after_update(runs, prefix: str, i: int, extra: float = 0.0) -> int:
    """Step ``i`` of ``prefix`` (both sides from one state): each of the stand-in's momentum
    buffers within ``SGD_RTOL + extra`` of the native one's largest entry, and each weight
    within its buffer's difference plus one float32 rounding of ``w + mom`` on each side (at
    most one ulp of the weight, 2**-23 of it). Returns how many arrays it compared."""
    count = sum(1 for k in runs.files if k.startswith(f"{prefix}/native/{i}/mom/"))
    assert count
    for j in range(count):
        native, standin = (runs[f"{prefix}/{side}/{i}/mom/{j}"].astype(np.float64)
                           for side in ("native", "standin"))
        err = relative_to_largest(standin, native)
        assert err <= SGD_RTOL + extra, f"{prefix} step {i} momentum {j}: {err:.2e}"
        gap = np.abs(standin - native)
        native_w, standin_w = (runs[f"{prefix}/{side}/{i}/weights/{j}"].astype(np.float64)
                               for side in ("native", "standin"))
        assert not np.array_equal(native_w, runs[f"{prefix}/{i}/before/{j}"])  # it moved
        np.testing.assert_array_less(np.abs(standin_w - native_w),
                                     gap + 2 * ROUNDING * np.abs(native_w) + 1e-45,
                                     err_msg=f"{prefix} step {i} weight {j}")
    return count


@pytest.mark.parametrize("case", ["clipped", "unclipped", "clipped-multi", "unclipped-multi"])
def test_update_stand_in_is_the_fused_update(runs, case):
    """Each of three steps of TrainStep's float64-path update (``momentum_sgd``, and
    ``global_norm`` without ``multi_sum_sq``) equals the native path in float32 (a CPU's
    ``sgd_mom_update`` per array with the gradients scaled in place, and, ``-multi``, a GPU's
    fused ``preloaded_multi_sgd_mom_update``) from the same weights, momentum and gradients:
    every momentum buffer and
    weight, the gradient norm before clipping and the rate, across the rate change (where each
    side rescales its momentum) with weight decay, clipping acting or off. A clipped update is
    linear in ``max_norm / norm``, so there the two norms' own difference (the native sum's
    rounding, ``test_norm_stand_in_is_multi_sum_sq``) comes on top of the update's bound."""
    for i in range(3):
        native = float(runs[f"{case}/native/{i}/norm"][0])
        standin = float(runs[f"{case}/standin/{i}/norm"][0])
        norm_gap = abs(standin - native) / native
        bound = sequential_sum_bound(int(runs[f"{case}/longest"])) / 2 + 4 * ROUNDING
        assert norm_gap <= bound, f"step {i}: the norms differ by {norm_gap:.2e}"
        compared = close_after_update(runs, case, i,
                                      norm_gap if case.startswith("clipped") else 0.0)
        assert compared == int(runs[f"{case}/moms"]) > 20
        assert float(runs[f"{case}/standin/{i}/lr"]) == float(runs[f"{case}/native/{i}/lr"])
    rates = [float(runs[f"{case}/native/{i}/lr"]) for i in range(3)]
    assert rates == pytest.approx([0.1, 0.01, 0.01], rel=1e-15)
    if case.startswith("clipped"):  # the tiny norm clips every step
        assert all(float(runs[f"{case}/native/{i}/norm"][0]) > 0.05 for i in range(3))


def test_update_stand_in_is_sgd_mom_update(runs):
    """``momentum_sgd`` on one array equals MXNet's ``sgd_mom_update`` (weight decay, a
    gradient rescale, the rate x0.1 at step 2 with the momentum rescaled), each of four steps
    from the native side's weights and momentum."""
    for i in range(4):
        close_after_update(runs, "single", i)


def sequential_sum_bound(n: int) -> float:
    """How far, relative to the exact sum, adding ``n`` nonnegative float32 numbers one after
    another in float32 may land: Higham's ``(n - 1) * 2**-24 / (1 - (n - 1) * 2**-24)``
    (*Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 4.4), which ``n * 2**-24``
    covers for the lengths here (under 10**5)."""
    return n * ROUNDING


def test_norm_stand_in_is_multi_sum_sq(runs):
    """What ``multi_sum_sq`` computes on a CPU is each array's float32 squares added one after
    another in float32, bit for bit (its kernel: ``float sum; sum += x * x``). The stand-in's
    sum of squares is the exact sum of the same float32 squares to a few roundings, so the two
    differ by the native kernel's own summation rounding, which grows with the array's length:
    ``sequential_sum_bound``, per array and (halved by the root) for the norm. In float64 the
    stand-in is numpy's norm to rounding; ``multi_sum_sq`` is not (its sums are float32)."""
    arrays = [runs[f"norm/array/{j}"] for j in range(50)]
    native, standin = runs["norm/float32/sums/native"], runs["norm/float32/sums/standin"]
    for j, h in enumerate(arrays):
        squares = h * h  # float32, rounded as the kernel rounds them
        assert native[j] == np.cumsum(squares, dtype=np.float32)[-1], j
        exact = float(squares.astype(np.float64).sum())
        assert abs(float(standin[j]) - exact) <= 4 * ROUNDING * exact, j
        assert abs(float(standin[j]) - float(native[j])) <= sequential_sum_bound(h.size) * exact
    longest = max(h.size for h in arrays)
    fused, mine = float(runs["norm/float32/True"][0]), float(runs["norm/float32/False"][0])
    assert mine == pytest.approx(fused, rel=sequential_sum_bound(longest) / 2 + 4 * ROUNDING)
    host = np.sqrt(sum(float((h.astype(np.float64) ** 2).sum()) for h in arrays)) * 0.25
    assert mine == pytest.approx(host, rel=4 * ROUNDING)
    assert str(runs["norm/float64/False/dtype"]) == "float64"
    assert float(runs["norm/float64/False"][0]) == pytest.approx(host, rel=FLOAT64_RTOL)
    # Why float64 needs the stand-in: the fused kernel's sums come back in float32.
    assert abs(float(runs["norm/float64/True"][0]) - host) / host > 1e-9


def test_clamp_stand_in_is_clip(runs):
    """``maximum``/``minimum`` give ``clip``'s values, its gradient and the head's "inside the
    clamp" mask exactly in float32 (the bounds and their neighbours included); in float64 they
    clamp at the double bounds, where ``clip`` moves them to float32's."""
    for suffix in ("", "/grad", "/same"):
        np.testing.assert_array_equal(runs[f"clamp/float32/standin{suffix}"],
                                      runs[f"clamp/float32/native{suffix}"], err_msg=suffix)
    x = runs["clamp/x"].astype(np.float64)
    low, high = -1.0 + 1e-6, 1.0 - 1e-6
    np.testing.assert_array_equal(runs["clamp/float64/standin"], np.clip(x, low, high))
    assert not np.array_equal(runs["clamp/float64/native"], np.clip(x, low, high))


@pytest.mark.parametrize("kind", ["iresnet", "small"])
def test_running_statistics_stand_in_is_mxnets_batch_norm(runs, kind):
    """Three training passes with ``MXNetRunningStatistics`` leave what MXNet's own BatchNorm
    leaves in float32 (4-d inputs through oneDNN's and MXNet's kernels, [N, C] inputs, fixed and
    free gamma): the same outputs, input gradient and parameter gradients, and the running
    means and variances within float32 rounding."""
    prefix = f"bn/{kind}/native/"
    keys = sorted(k[len(prefix):] for k in runs.files if k.startswith(prefix))
    states = [k for k in keys if "/state/" in k]
    assert len(states) == 3 * 2 * (19 if kind == "iresnet" else 3)
    for key in keys:
        native, standin = runs[prefix + key], runs[f"bn/{kind}/standin/{key}"]
        if "/state/" in key:
            err = relative_to_largest(standin, native)
            assert err <= BN_RTOL, f"{key}: {err:.2e}"
        else:
            np.testing.assert_array_equal(standin, native, err_msg=key)


@pytest.mark.parametrize("kind", ["4d", "2d"])
def test_running_statistics_stand_in_keeps_mxnets_rule_exactly_in_float64(runs, kind):
    """In float64 the stand-in is MXNet's rule, ``0.9 * running + (1 - 0.9) * batch`` with the
    biased batch variance, to rounding; MXNet's own op is not (its momentum is 0.9f), by the
    2.4e-7 that makes the stand-in necessary. torch's unbiased rule is another by far."""
    start, xs = runs[f"bn64/{kind}/start"], runs[f"bn64/{kind}/x"]
    axes = (0, 2, 3) if kind == "4d" else (0,)
    mean, var = start[0].copy(), start[1].copy()
    torch_var = start[1].copy()
    for x in xs:
        n = x.size // x.shape[1]
        mean = mean * 0.9 + x.mean(axis=axes) * (1 - 0.9)
        var = var * 0.9 + x.var(axis=axes) * (1 - 0.9)
        torch_var = torch_var * 0.9 + x.var(axis=axes) * n / (n - 1) * 0.1
    want = np.stack([mean, var])
    assert str(runs[f"bn64/{kind}/standin/dtype"]) == "float64"
    np.testing.assert_allclose(runs[f"bn64/{kind}/standin"], want, rtol=FLOAT64_RTOL, atol=0)
    moved = runs[f"bn64/{kind}/native"] - start
    assert np.abs(moved / (want - start) - 1).max() > 1e-7
    assert np.abs(runs[f"bn64/{kind}/standin"][1] - torch_var).max() > 1e-3
