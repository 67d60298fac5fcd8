"""The stand-ins of a float64 Paddle alignment run (``backends.paddle.alignment``) compute what
the Paddle kernels they replace compute, so that alignment checks the code a throughput run
times.

For each stand-in, on random inputs:

- in float32, the native kernel, set up as a throughput run sets it up, and the stand-in give
  the same outputs, every gradient and the state they move (running statistics, momentum
  buffers) to float32 rounding: :data:`FLOAT32_BOUND`;
- in float64, the native kernel is off the exact rule by more than :data:`NATIVE_OFF` (the
  32-bit number it holds, which is why the stand-in exists), and the stand-in is exact to
  float64 rounding: :data:`FLOAT64_BOUND`.

Errors are the largest difference over the largest entry of the reference array. A moved state
is compared by its move (after minus before), not by its value, so that a small update cannot
hide behind the value it moves. The Paddle side runs in the Paddle environment on inputs made
here; the exact rule (numpy, float64) is computed here.
"""

from __future__ import annotations

import numpy as np
import pytest

from framework_checks import close_to_max
from test_paddle_heads import pd_env, run_pd

FLOAT32_BOUND = 64 * 2.0 ** -24
"""64 units of float32 rounding (3.8e-6): both sides round every operation in float32, and sum
reductions of up to a few hundred terms in other orders, where the rounding of a sum of n terms
grows like sqrt(n) units; a different rule (a biased variance for an unbiased one, a missing
decay term, another rate) is 1e-4 or more on these inputs."""
FLOAT64_BOUND = 64 * 2.0 ** -53
"""The same 64 units of rounding in float64 (7.1e-15)."""
NATIVE_OFF = 1e-9
"""What a 32-bit constant does to a float64 kernel: 0.9, 1e-5 or 1/49 held as a float32 is
off by 1e-8 to 1e-7 of itself, far over float64 rounding and over alignment's 1e-8."""

STEPS = 4
RATES = (0.1, 0.1, 0.01, 0.01)
"""The optimizer's rate per step: it changes once, as at a boundary of the schedule."""
MU, DECAY = 0.9, 5e-4
PARAM_SHAPES = ((16, 8), (8,), (4, 3, 3, 3))
BN_SHAPES = {"bn2d": (4, 6, 7, 7), "bn1d": (8, 16)}
"""BatchNorm2D over 196 values a channel, BatchNorm1D over 8 (an embedding's, one value a
sample)."""
BN_ITERATIONS = 2
BN_MOMENTUM, BN_EPS = 0.9, 1e-5

PADDLE_SIDE = r"""
import sys
import numpy as np
import paddle
import paddle.nn as nn
from trainperf.backends.paddle import alignment, models, step

work = sys.argv[1]
x = np.load(f"{work}/inputs.npz")
STEPS, SHAPES, RATES = int(x["steps"]), int(x["shapes"]), x["rates"]


def momentum(dtype, make, velocity):
    # The backbone's optimizer as the step drives it: the rate set, a step, the gradients
    # cleared; every step's move of each parameter from its start and its velocity.
    params = [paddle.create_parameter(
        list(x[f"w{i}"].shape), dtype,
        default_initializer=nn.initializer.Assign(x[f"w{i}"].astype(dtype)))
        for i in range(SHAPES)]
    opt = make(params, float(RATES[0]), float(x["mu"]), float(x["decay"]))
    out = {}
    for k in range(STEPS):
        for i, p in enumerate(params):
            (p * paddle.to_tensor(x[f"g{k}_{i}"].astype(dtype))).sum().backward()
        opt.set_lr(float(RATES[k]))
        opt.step()
        opt.clear_grad(set_to_zero=False)
        for i, p in enumerate(params):
            out[f"momentum/move{i}/{k}"] = p.numpy().astype("float64") - x[f"w{i}"]
            out[f"momentum/velocity{i}/{k}"] = velocity(opt, i, p).numpy()
    return out


def native_velocity(opt, i, p):
    return opt._accumulators[opt._velocity_acc_str][p.name]


def exact_velocity(opt, i, p):
    return opt.velocity[i]


def single_tensor(params, lr, mu, decay):
    # The multi-tensor op a throughput run uses refuses float64: the same op per tensor.
    return paddle.optimizer.Momentum(learning_rate=lr, momentum=mu, parameters=params,
                                     weight_decay=decay)


def batch_norm(case, dtype, exact):
    # A BatchNorm as the backbones build it, from random statistics and parameters, through
    # training-mode forwards and backwards.
    channels = x[f"{case}/weight"].shape[0]
    layer = models._bn2d(channels) if case == "bn2d" else models._bn1d(channels)
    for name, t in (("weight", layer.weight), ("bias", layer.bias), ("mean", layer._mean),
                    ("var", layer._variance)):
        t.set_value(x[f"{case}/{name}"].astype(dtype))
    if exact:
        alignment.use_exact_kernels(layer)
    layer.train()
    out = {}
    k = 0
    while f"{case}/x{k}" in x.files:
        before = {"mean": layer._mean.numpy(), "var": layer._variance.numpy()}
        inp = paddle.to_tensor(x[f"{case}/x{k}"].astype(dtype), stop_gradient=False)
        y = layer(inp)
        y.backward(paddle.to_tensor(x[f"{case}/dy{k}"].astype(dtype)))
        out.update({f"{case}/y/{k}": y.numpy(), f"{case}/dx/{k}": inp.grad.numpy(),
                    f"{case}/dweight/{k}": layer.weight.grad.numpy(),
                    f"{case}/dbias/{k}": layer.bias.grad.numpy(),
                    f"{case}/move_mean/{k}": layer._mean.numpy() - before["mean"],
                    f"{case}/move_var/{k}": layer._variance.numpy() - before["var"]})
        layer.clear_gradients()
        k += 1
    return out


def pool(dtype, exact):
    # The global pool of ResNet as models builds it: forward and backward.
    layer = nn.AdaptiveAvgPool2D(1)
    if exact:
        alignment.use_exact_kernels(layer)
    inp = paddle.to_tensor(x["pool/x"].astype(dtype), stop_gradient=False)
    y = layer(inp)
    y.backward(paddle.to_tensor(x["pool/dy"].astype(dtype)))
    return {"pool/y": y.numpy(), "pool/dx": inp.grad.numpy()}


cases = {"float32": ("bn2d", "bn1d"), "float64": ("bn2d", "bn1d", "pair")}
for dtype in ("float32", "float64"):
    paddle.set_default_dtype(dtype)
    native_opt = step.native_optimizer if dtype == "float32" else single_tensor
    for kind, exact in (("native", False), ("stand_in", True)):
        out = momentum(dtype, alignment.ExactMomentum, exact_velocity) if exact else \
            momentum(dtype, native_opt, native_velocity)
        for case in cases[dtype]:
            out.update(batch_norm(case, dtype, exact))
        out.update(pool(dtype, exact))
        np.savez(f"{work}/{dtype}.{kind}.npz", **out)
"""


def _inputs() -> dict[str, np.ndarray]:
    """Well-scaled random inputs, each held in float32 (a float64 run holds them exactly)."""
    rng = np.random.default_rng(20240611)

    def normal(shape, mean=0.0, std=1.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32).astype(np.float64)

    def uniform(shape, low, high):
        return rng.uniform(low, high, shape).astype(np.float32).astype(np.float64)

    x = {"steps": np.array(STEPS), "shapes": np.array(len(PARAM_SHAPES)),
         "rates": np.array(RATES), "mu": np.array(MU), "decay": np.array(DECAY)}
    for i, shape in enumerate(PARAM_SHAPES):
        x[f"w{i}"] = normal(shape)
        for k in range(STEPS):
            x[f"g{k}_{i}"] = normal(shape)
    for case, shape in BN_SHAPES.items():
        x.update(_bn_inputs(normal, uniform, case, shape, BN_ITERATIONS, 0.5, 2.0))
    # Two samples of small spread: epsilon decides the output (a batch-2 embedding's). Centred
    # on 0, as a mean far from 0 beside a small spread would cancel digits in x - mean.
    x.update(_bn_inputs(normal, uniform, "pair", (2, 4), 1, 0.0, 1e-3))
    x["pool/x"] = normal((4, 6, 7, 7), 0.5, 2.0)
    x["pool/dy"] = normal((4, 6, 1, 1))
    return x


def _bn_inputs(normal, uniform, case: str, shape: tuple, iterations: int, centre: float,
               spread: float) -> dict[str, np.ndarray]:
    channels = shape[1]
    x = {f"{case}/weight": uniform(channels, 0.5, 1.5), f"{case}/bias": normal(channels, 0, 0.1),
         f"{case}/mean": normal(channels, 0, 0.1), f"{case}/var": uniform(channels, 0.5, 1.5)}
    for k in range(iterations):
        x[f"{case}/x{k}"] = normal(shape, centre, spread)
        x[f"{case}/dy{k}"] = normal(shape)
    return x


@pytest.fixture(scope="module")
def sides(tmp_path_factory, paddle_python):
    work = tmp_path_factory.mktemp("pd_stand_ins")
    x = _inputs()
    np.savez(work / "inputs.npz", **x)
    run_pd(paddle_python, ["-c", PADDLE_SIDE, str(work)], pd_env())
    got = {f"{dtype}.{kind}": dict(np.load(work / f"{dtype}.{kind}.npz"))
           for dtype in ("float32", "float64") for kind in ("native", "stand_in")}
    return x, got


def _error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _same_in_float32(sides, prefix: str) -> list[str]:
    """Every float32 array under ``prefix``: the stand-in's equals the native kernel's to
    float32 rounding. Returns the names compared."""
    _, got = sides
    native, stand_in = got["float32.native"], got["float32.stand_in"]
    names = sorted(k for k in native if k.startswith(prefix))
    assert names and names == sorted(k for k in stand_in if k.startswith(prefix))
    for name in names:
        assert native[name].dtype == stand_in[name].dtype
        close_to_max(stand_in[name], native[name], FLOAT32_BOUND, what=name)
    return names


# ------------------------------------------------------------------------------ momentum

def _exact_momentum(x: dict) -> dict[str, np.ndarray]:
    """Paddle's momentum op in float64 with exact numbers: ``v = mu * v + (g + decay * w)``
    from ``v = 0``, ``w -= lr * v``; each step's move from the start and velocity."""
    out = {}
    w = [x[f"w{i}"].copy() for i in range(len(PARAM_SHAPES))]
    v = [np.zeros_like(a) for a in w]
    for k, lr in enumerate(RATES):
        for i in range(len(w)):
            v[i] = MU * v[i] + (x[f"g{k}_{i}"] + DECAY * w[i])
            w[i] = w[i] - lr * v[i]
            out[f"momentum/move{i}/{k}"] = w[i] - x[f"w{i}"]
            out[f"momentum/velocity{i}/{k}"] = v[i]
    return out


def test_exact_momentum_is_paddles_optimizer_in_float32(sides):
    """The throughput run's optimizer (multi-tensor momentum op, decay in the op) and
    ``ExactMomentum``, four steps with weight decay and a change of rate: every parameter's
    move and every velocity alike."""
    names = _same_in_float32(sides, "momentum/")
    assert len(names) == 2 * len(PARAM_SHAPES) * STEPS


def test_exact_momentum_holds_its_numbers_in_float64(sides):
    x, got = sides
    exact = _exact_momentum(x)
    native = max(_error(got["float64.native"][k], v) for k, v in exact.items())
    assert native > NATIVE_OFF, native  # momentum and decay held as float32 by the op
    for name, want in exact.items():
        close_to_max(got["float64.stand_in"][name], want, FLOAT64_BOUND, what=name)


# ----------------------------------------------------------------------------- BatchNorm

def _exact_batch_norm(x: dict, case: str) -> dict[str, np.ndarray]:
    """Paddle's training-mode BatchNorm forward and running statistics in float64: the biased
    batch variance, epsilon 1e-5 and momentum 0.9 exactly."""
    out = {}
    mean, var = x[f"{case}/mean"], x[f"{case}/var"]
    k = 0
    while f"{case}/x{k}" in x:
        v = x[f"{case}/x{k}"]
        axes = (0,) + tuple(range(2, v.ndim))
        shape = (1, -1) + (1,) * (v.ndim - 2)
        m, s = v.mean(axis=axes), v.var(axis=axes)
        out[f"{case}/y/{k}"] = ((v - m.reshape(shape)) / np.sqrt(s + BN_EPS).reshape(shape)
                                * x[f"{case}/weight"].reshape(shape)
                                + x[f"{case}/bias"].reshape(shape))
        new_mean = mean * BN_MOMENTUM + m * (1.0 - BN_MOMENTUM)
        new_var = var * BN_MOMENTUM + s * (1.0 - BN_MOMENTUM)
        out[f"{case}/move_mean/{k}"], out[f"{case}/move_var/{k}"] = new_mean - mean, new_var - var
        mean, var = new_mean, new_var
        k += 1
    return out


@pytest.mark.parametrize("case", list(BN_SHAPES))
def test_exact_batch_norm_is_paddles_kernel_in_float32(sides, case):
    """A BatchNorm of the backbones and ``ExactBatchNorm``, two training iterations: output,
    input, weight and bias gradients and both running statistics' moves alike (the running
    variance's by Paddle's own rule, the biased batch variance)."""
    names = _same_in_float32(sides, f"{case}/")
    assert len(names) == 6 * BN_ITERATIONS


@pytest.mark.parametrize("case", [*BN_SHAPES, "pair"])
def test_exact_batch_norm_holds_its_numbers_in_float64(sides, case):
    """In float64 the native kernel's running-statistics moves are off by its float32
    momentum, and over two samples of small spread its output by its float32 epsilon; the
    stand-in is exact (its gradients are torch's to rounding: ``test_paddle_models.py``)."""
    x, got = sides
    exact = _exact_batch_norm(x, case)
    native = {k: _error(got["float64.native"][k], v) for k, v in exact.items()}
    if case == "pair":
        assert native[f"{case}/y/0"] > NATIVE_OFF, native
    else:
        assert min(v for k, v in native.items() if "/move_" in k) > NATIVE_OFF, native
    for name, want in exact.items():
        close_to_max(got["float64.stand_in"][name], want, FLOAT64_BOUND, what=name)


def test_the_float32_bound_tells_paddles_running_variance_from_torchs(sides):
    """The bound is tight enough to see a rule: torch's unbiased variance in the running
    variance's move would be off Paddle's kernel by far more than float32 rounding."""
    x, got = sides
    case, k = "bn1d", 0
    v = x[f"{case}/x{k}"]
    unbiased_move = (1.0 - BN_MOMENTUM) * (v.var(axis=0, ddof=1) - x[f"{case}/var"])
    assert _error(unbiased_move, got["float32.native"][f"{case}/move_var/{k}"]) \
        > 100 * FLOAT32_BOUND


# ------------------------------------------------------------------------------ the pool

def test_exact_global_pool_is_paddles_pool_in_float32(sides):
    """``AdaptiveAvgPool2D(1)`` and the mean over the map: output and input gradient."""
    assert _same_in_float32(sides, "pool/") == ["pool/dx", "pool/y"]


def test_exact_global_pool_holds_its_numbers_in_float64(sides):
    """The native pool's backward scales by 1/49 held as a float32; the mean's is exact."""
    x, got = sides
    exact = {"pool/y": x["pool/x"].mean(axis=(2, 3), keepdims=True),
             "pool/dx": np.broadcast_to(x["pool/dy"] / 49.0, x["pool/x"].shape)}
    assert _error(got["float64.native"]["pool/dx"], exact["pool/dx"]) > NATIVE_OFF
    for name, want in exact.items():
        close_to_max(got["float64.stand_in"][name], want, FLOAT64_BOUND, what=name)
