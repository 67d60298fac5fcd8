"""The OneFlow head and optimizer (``trainperf.backends.oneflow``) against the float64 oracle.

OneFlow runs in its own opt-in environment (``oneflow_python``, skipped where it is not built):
scripts run there and write ``.npz`` files, and the comparisons happen here against
``tests/oracle.py``. The sharded heads (mp, pfc) run on 2 ranks started by the backend's own
launcher (``trainperf.backends.spawn``), with a class count that does not divide evenly (37 over
2). pfc's negatives are ranked by scores the tests give (the oracle's ``pfc_sample`` rule), not
drawn, so its sample is checked column for column; its update against ``sgd_momentum_step``
row by row (sparse: the sampled rows and their own momentum; dense: the whole shard).

Tolerances: OneFlow computes in float32 from the float32 inputs the oracle casts to float64. The
loss agrees to a relative 1e-5, the logits (scaled by s = 64) to 1e-4 absolute, gradients to
1e-5 of the largest entry of the same gradient (measured: 3e-6 and below). In float64 (an
alignment run's) the head, the SGD update and the BatchNorm statistics of ``exact.py`` are held
to 1e-12 of the oracle or of numpy.

The float32 bridges: a float64 alignment run replaces three of OneFlow's kernels by
``exact.py``'s stand-ins (BatchNorm, SGD, DDP), so each stand-in is run beside the kernel it
replaces, in float32 on random inputs, and must compute what the kernel computes, state
included, within ``FP32_BRIDGE``: BatchNorm's outputs, gradients, running statistics and eval
output; SGD's weights and momentum buffers through a rate change; DDP's parameters, averaged
gradients and buffers on 2 ranks (in the 2-rank script, which already starts processes). The
kernel's own rule for the running variance is measured too: torch's, so nothing is declared.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import oracle
from framework_checks import (check_head_equals, check_sampling_rule, close_to_max, head_inputs,
                              pfc_step_inputs, sample_cases, sampled_ids_on_two_ranks,
                              sampled_oracle, shard_scores)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "combined": (1.2, 0.3, 0.1)}
SCALE = 64.0
GRAD_RTOL = 1e-5
FP32_BRIDGE = 4e-6
"""How far, as a fraction of the largest entry of the same quantity, a stand-in of ``exact.py``
may be from the OneFlow kernel it replaces when both run in float32 on random inputs: float32
rounding. Its unit roundoff is 6e-8; a bridge's quantities pass through a few dozen roundings
(BatchNorm's reductions over up to 100 values per channel and the backward's over them again,
four SGD steps compounded through the momentum). Measured over 20 draws of these inputs,
OneFlow's float32 BatchNorm is within 1.3e-6 of its rule computed in float64 and the stand-in
within 3e-7; its SGD and DDP are bitwise the stand-ins' on a CPU. Every difference of rule the
bridges are there to find is far larger: the biased running variance (1e-3 and up), a
weight decay left out (5e-5), a parameter or buffer not broadcast (1e-3 and up)."""


def of_env(python: str, *extra: Path) -> dict[str, str]:
    from trainperf.backends.oneflow.backend import library_path

    paths = [str(ROOT / "src"), str(ROOT / "tests"), *map(str, extra)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1",
               LD_LIBRARY_PATH=library_path(python), GLOG_minloglevel="2")
    env.pop("TRAINPERF_FAULT", None)
    return env


def run_of(argv: list[str], env: dict[str, str], timeout: float = 120) -> None:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


# One process: the dp head for every margin, SGD against torch's rule (the rate changes at the
# third step), and the settings the backend refuses, each with its message.
ONE_PROCESS = r"""
import sys
import numpy as np
import oneflow as flow
from trainperf.config import Workload
from trainperf.backends.oneflow import exact
from trainperf.backends.oneflow.dist import Dist
from trainperf.backends.oneflow.heads import MarginSoftmaxHead, sample_classes
from trainperf.backends.oneflow.step import check_workload

folder = sys.argv[1]
# (file suffix, dtype, straight-through): fp32 as trained, float64 as aligned, and float64 with
# the negative control's straight-through margin gradient.
KINDS = (("", flow.float32, False), ("64", flow.float64, False), ("64st", flow.float64, True))
for name in sys.argv[2:]:
    x = np.load(f"{folder}/{name}_in.npz")
    c, d = x["weight"].shape
    for suffix, dtype, straight in KINDS:
        head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), Dist(),
                                 dtype=dtype, straight_through=straight)
        head.set_weight(x["weight"])
        emb = flow.tensor(x["emb"], dtype=dtype, requires_grad=True)
        loss = head(emb, flow.tensor(x["labels"]), keep_logits=True)
        loss.backward()
        np.savez(f"{folder}/{name}_out{suffix}.npz", loss=loss.numpy(),
                 grad_emb=emb.grad.numpy(), grad_weight=head.weight.grad.numpy(),
                 logits=head.logits.numpy())

s = np.load(f"{folder}/sgd_in.npz")
w = flow.nn.Parameter(flow.tensor(s["weight"]))
opt = flow.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=5e-4)
after = []
for grad, lr in zip(s["grads"], s["lrs"]):
    opt.param_groups[0]["lr"] = float(lr)
    w.grad = flow.tensor(grad)
    opt.step()
    after.append(w.detach().numpy().copy())
np.save(f"{folder}/sgd_out.npy", np.stack(after))

w = flow.nn.Parameter(flow.tensor(s["weight"], dtype=flow.float64))
opt = exact.SGD([w], lr=0.1, momentum=0.9, weight_decay=5e-4)
after = []
for grad, lr in zip(s["grads"], s["lrs"]):
    opt.param_groups[0]["lr"] = float(lr)
    w.grad = flow.tensor(grad, dtype=flow.float64)
    opt.step()
    after.append(w.detach().numpy().copy())
np.save(f"{folder}/sgd_out64.npy", np.stack(after))

# exact.BatchNorm2d and OneFlow's own: outputs, input gradients and running statistics of two
# training-mode calls.
b = np.load(f"{folder}/bn_in.npz")
outs = {}
for kind, cls in (("exact", exact.BatchNorm2d), ("oneflow", flow.nn.BatchNorm2d)):
    bn = cls(b["x"].shape[2], eps=1e-5).to(dtype=flow.float64)
    for i, x in enumerate(b["x"], start=1):
        x = flow.tensor(x, requires_grad=True)
        y = bn(x)
        (y * flow.tensor(b["r"])).sum().backward()
        outs[f"{kind}/out{i}"] = y.detach().numpy()
        outs[f"{kind}/grad{i}"] = x.grad.numpy()
    outs[f"{kind}/mean"] = bn.running_mean.numpy()
    outs[f"{kind}/var"] = bn.running_var.numpy()
np.savez(f"{folder}/bn_out.npz", **outs)

# The float32 bridges: each stand-in of exact.py against the OneFlow kernel it replaces, on the
# same random inputs in float32 (where the kernels compute what they are asked), on the CPU
# and, where OneFlow sees one, on a GPU (cuDNN's BatchNorm, the fused SGD kernel).
# Two training-mode calls (output; input, weight and bias gradients), the running statistics
# and the call count after them, then an eval-mode call.
def batch_norm_calls(cls, a, device):
    bn = cls(a["weight"].shape[0], eps=1e-5).to(device)
    with flow.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(bn, name).copy_(flow.tensor(a[name], device=device))
    out = {}
    for i, x in enumerate(a["x"], start=1):
        bn.weight.grad = bn.bias.grad = None
        x = flow.tensor(x, device=device, requires_grad=True)
        y = bn(x)
        (y * flow.tensor(a["r"], device=device)).sum().backward()
        out.update({f"out{i}": y.detach(), f"grad_x{i}": x.grad,
                    f"grad_weight{i}": bn.weight.grad, f"grad_bias{i}": bn.bias.grad})
    out.update(running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone(),
               calls=bn.num_batches_tracked.clone())
    bn.eval()
    out["eval"] = bn(flow.tensor(a["x"][0], device=device)).detach()
    return {k: v.cpu().numpy() for k, v in out.items()}


# The momentum buffer opt holds for p (exact.SGD's by id, OneFlow's in its state).
def momentum_buffer(opt, p):
    return opt.buffers[id(p)] if isinstance(opt, exact.SGD) else opt._state[p]["momentum_buf"]


# Both weights and their momentum buffers after each step, the rate set from lrs.
def sgd_steps(opt_for, s, device):
    params = [flow.nn.Parameter(flow.tensor(s[f"w{j}"], device=device)) for j in range(2)]
    opt = opt_for(params)
    out = {}
    for i, lr in enumerate(s["lrs"]):
        opt.param_groups[0]["lr"] = float(lr)
        for j, p in enumerate(params):
            p.grad = flow.tensor(s[f"g{j}"][i], device=device)
        opt.step()
        # Copies: a CPU tensor's numpy() shares its memory, which the next step updates.
        for j, p in enumerate(params):
            out[f"{i}/w{j}"] = p.detach().cpu().numpy().copy()
            out[f"{i}/buf{j}"] = momentum_buffer(opt, p).cpu().numpy().copy()
    return out


g = np.load(f"{folder}/bridge_in.npz")
bridges = {}
for device in ["cpu"] + (["cuda"] if flow.cuda.is_available() else []):
    for dims, stand_in, native in (("1d", exact.BatchNorm1d, flow.nn.BatchNorm1d),
                                   ("2d", exact.BatchNorm2d, flow.nn.BatchNorm2d)):
        a = {k[len(dims) + 3:]: g[k] for k in g.files if k.startswith(f"bn{dims}/")}
        for kind, cls in (("exact", stand_in), ("oneflow", native)):
            for k, v in batch_norm_calls(cls, a, device).items():
                bridges[f"{device}/bn{dims}/{kind}/{k}"] = v
    sgd = {k[len("sgd/"):]: g[k] for k in g.files if k.startswith("sgd/")}
    # OneFlow's fused kernel runs on a GPU only (it falls back, with a warning, on a CPU).
    for kind, opt_for in (
            ("exact", lambda ps: exact.SGD(ps, lr=0.1, momentum=0.9, weight_decay=5e-4)),
            ("oneflow", lambda ps: flow.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=5e-4,
                                                  fused=device == "cuda"))):
        for k, v in sgd_steps(opt_for, sgd, device).items():
            bridges[f"{device}/sgd/{kind}/{k}"] = v
np.savez(f"{folder}/bridges.npz", **bridges)

# pfc: the sampling rule on given scores; at ratio 1.0 on the arcface inputs; at ratio 0.4,
# two steps with given negative scores, sparse (the head's own update) and dense (OneFlow's SGD
# on the whole shard, as step.py runs it).
s = np.load(f"{folder}/sample_in.npz")
out = {}
for i in range(int(s["cases"])):
    out[f"{i}/index"] = sample_classes(flow.tensor(s[f"{i}/labels"]), int(s[f"{i}/num_local"]),
                                       int(s[f"{i}/size"]), flow.tensor(s[f"{i}/uniform"])).numpy()
np.savez(f"{folder}/sample_out.npz", **out)

x = np.load(f"{folder}/arcface_in.npz")
c, d = x["weight"].shape
head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), Dist(), mode="pfc")
head.set_weight(x["weight"])
emb = flow.tensor(x["emb"], requires_grad=True)
loss = head(emb, flow.tensor(x["labels"]), keep_logits=True)
loss.backward()
np.savez(f"{folder}/pfc1_out.npz", loss=loss.to_local().numpy(), grad_emb=emb.grad.numpy(),
         grad_weight=head.weight.grad.to_local().numpy(), logits=head.logits.numpy(),
         update=head.update)

x = np.load(f"{folder}/pfc_in.npz")
c, d = x["weight"].shape
for update in ("sparse", "dense"):
    head = MarginSoftmaxHead(c, d, (1.0, 0.5, 0.0), 64.0, Dist(), mode="pfc", sample_ratio=0.4,
                             update=update)
    head.set_weight(x["weight"])
    opt = flow.optim.SGD([head.weight], lr=0.1, momentum=0.9, weight_decay=5e-4)
    out = {"update": head.update}
    for k in range(2):
        opt.zero_grad()
        emb = flow.tensor(x["emb"], requires_grad=True)
        loss = head(emb, flow.tensor(x[f"labels{k}"]), scores=flow.tensor(x[f"scores{k}"]))
        loss.backward()
        index = head.index.numpy()
        grad = (head.rows.grad[:len(index)] if update == "sparse"
                else head.weight.grad.to_local()[flow.tensor(index)])
        out.update({f"{k}/loss": loss.to_local().numpy(), f"{k}/grad_emb": emb.grad.numpy(),
                    f"{k}/grad": grad.numpy(), f"{k}/index": index})
        if update == "sparse":
            head.sparse_step(0.1, 0.9, 5e-4)
            out[f"{k}/momentum"] = head.momentum.numpy().copy()
        else:
            out[f"{k}/grad_whole"] = head.weight.grad.to_local().numpy().copy()
            opt.step()
        out[f"{k}/after"] = head.local_weight().detach().numpy().copy()
    np.savez(f"{folder}/pfc_{update}_out.npz", **out)

base = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=2)
refused = []
for change in ({"precision": "fp16"}, {"precision": "bf16"},
               {"backbone": "mobilefacenet_y1"},
               {"task": "classification", "backbone": "resnet50_v1b"},
               {"channels_last": True}):
    try:
        check_workload(base.replace(**change))
        refused.append("accepted")
    except ValueError as e:
        refused.append(str(e))
open(f"{folder}/refused.txt", "w").write("\n".join(refused))
"""






def bridge_inputs(rng: np.random.RandomState) -> dict[str, np.ndarray]:
    """float32 inputs of the bridges: a BatchNorm1d (batch 8) and a BatchNorm2d (4 x 5 x 5 per
    channel) with non-trivial affine values and running statistics, each channel's activations
    at its own mean (-1 to 1) and spread (0.5 to 2), two batches each; SGD's two weights, four
    steps of gradients, and the rates (dropping at the third step). Batch 8, not the 2 of the
    alignment recipe: at 2 the input gradient is a cancellation proportional to epsilon, where
    OneFlow's float32 kernel is itself 1e-2 of the largest entry from float64 (the stand-in
    3e-5), which no float32 comparison can resolve; the float64 alignment checks that case."""
    arrays = {}
    for dims, shape in (("1d", (8, 16)), ("2d", (4, 6, 5, 5))):
        c = shape[1]
        per_channel = [1, c] + [1] * (len(shape) - 2)
        spread = rng.uniform(0.5, 2.0, c).reshape(per_channel)
        centre = rng.uniform(-1.0, 1.0, c).reshape(per_channel)
        arrays.update({f"bn{dims}/weight": rng.uniform(0.5, 1.5, c),
                       f"bn{dims}/bias": rng.normal(0.0, 0.1, c),
                       f"bn{dims}/running_mean": rng.normal(0.0, 0.1, c),
                       f"bn{dims}/running_var": rng.uniform(0.5, 1.5, c),
                       f"bn{dims}/x": rng.randn(2, *shape) * spread + centre,
                       f"bn{dims}/r": rng.randn(*shape)})
    arrays.update({"sgd/w0": rng.randn(4, 3), "sgd/g0": rng.randn(4, 4, 3),
                   "sgd/w1": rng.randn(7), "sgd/g1": rng.randn(4, 7)})
    arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
    arrays["sgd/lrs"] = np.array([0.1, 0.1, 0.01, 0.01])
    return arrays


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, oneflow_python):
    folder = tmp_path_factory.mktemp("of_dp_head")
    for i, (name, margins) in enumerate(MARGINS.items()):
        np.savez(folder / f"{name}_in.npz", **head_inputs(i, 12, 8, 37), margins=margins,
                 scale=SCALE)
    rng = np.random.RandomState(5)
    np.savez(folder / "sgd_in.npz", weight=rng.randn(4, 3).astype(np.float32),
             grads=rng.randn(4, 4, 3).astype(np.float32), lrs=np.array([0.1, 0.1, 0.01, 0.01]))
    np.savez(folder / "bn_in.npz", x=rng.randn(2, 6, 5, 3, 3) * 2 + 3, r=rng.randn(6, 5, 3, 3))
    np.savez(folder / "bridge_in.npz", **bridge_inputs(np.random.RandomState(11)))
    np.savez(folder / "sample_in.npz", **sample_cases())
    np.savez(folder / "pfc_in.npz", **pfc_step_inputs())
    run_of([oneflow_python, "-c", ONE_PROCESS, str(folder), *MARGINS], of_env(oneflow_python))
    return folder


@pytest.mark.parametrize("loss", list(MARGINS))
def test_dp_head_equals_the_oracle(one_process, loss):
    x = np.load(one_process / f"{loss}_in.npz")
    got = np.load(one_process / f"{loss}_out.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE,
                                       cos_eps=oracle.FP32_COS_EPS)
    check_head_equals(got, ref)


@pytest.mark.parametrize("loss", list(MARGINS))
def test_float64_head_equals_the_oracle(one_process, loss):
    """An alignment run's head: float64 through, with the clamp at exactly 1 - 1e-6."""
    x = np.load(one_process / f"{loss}_in.npz")
    got = np.load(one_process / f"{loss}_out64.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE)
    assert got["loss"].dtype == got["grad_emb"].dtype == got["grad_weight"].dtype == np.float64
    assert float(got["loss"]) == pytest.approx(ref["loss"], rel=1e-12)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-10)
    close_to_max(got["grad_emb"], ref["grad_emb"], rtol=1e-12)
    close_to_max(got["grad_weight"], ref["grad_weight"], rtol=1e-12)


def test_straight_through_keeps_the_loss_and_changes_the_gradient(one_process):
    """The negative control's margin: ArcFace's value, the cosine's derivative."""
    true = np.load(one_process / "arcface_out64.npz")
    straight = np.load(one_process / "arcface_out64st.npz")
    assert float(straight["loss"]) == pytest.approx(float(true["loss"]), rel=1e-14)
    np.testing.assert_allclose(straight["logits"], true["logits"], rtol=1e-14, atol=1e-12)
    for grad in ("grad_emb", "grad_weight"):
        diff = np.abs(straight[grad] - true[grad]).max() / np.abs(true[grad]).max()
        assert diff > 1e-3, grad


def test_float64_sgd_is_torchs_update_through_a_rate_change(one_process):
    """``exact.SGD``: OneFlow's kernels take the rate, weight decay and momentum as float32
    attributes, which would move a float64 update by about 1e-8; this one does not."""
    s = np.load(one_process / "sgd_in.npz")
    got = np.load(one_process / "sgd_out64.npy")
    weight, buf = s["weight"].astype(np.float64), None
    for i, (grad, lr) in enumerate(zip(s["grads"], s["lrs"])):
        before = weight
        weight, buf = oracle.sgd_momentum_step(weight, grad.astype(np.float64), buf, lr, 0.9,
                                               5e-4)
        update = weight - before
        np.testing.assert_allclose(got[i] - (got[i - 1] if i else before), update, rtol=1e-12,
                                   atol=1e-12 * np.abs(update).max())


def test_float64_batch_norm_follows_torchs_rule(one_process):
    """``exact.BatchNorm2d`` normalises and differentiates as OneFlow's kernel (which differs
    only by its epsilon rounded to float32, far under 1e-11 here) and updates its running
    statistics in float64 by the kernel's rule, which is torch's (the float32 bridges below):
    mean and unbiased variance, momentum 0.1."""
    x = np.load(one_process / "bn_in.npz")["x"]
    got = np.load(one_process / "bn_out.npz")
    mean, var = np.zeros(x.shape[2]), np.ones(x.shape[2])
    for i, batch in enumerate(x, start=1):
        for kind in ("out", "grad"):
            close_to_max(got[f"exact/{kind}{i}"], got[f"oneflow/{kind}{i}"], rtol=1e-11)
        centred = batch - batch.mean(axis=(0, 2, 3), keepdims=True)
        normed = centred / np.sqrt((centred ** 2).mean(axis=(0, 2, 3), keepdims=True) + 1e-5)
        close_to_max(got[f"exact/out{i}"], normed, rtol=1e-14)
        mean = 0.9 * mean + 0.1 * batch.mean(axis=(0, 2, 3))
        var = 0.9 * var + 0.1 * batch.var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(got["exact/mean"], mean, rtol=1e-14)
    np.testing.assert_allclose(got["exact/var"], var, rtol=1e-14)
    # OneFlow's own kernel, for contrast: its float32 momentum is visible at this precision.
    assert np.abs(got["oneflow/mean"] - mean).max() > 1e-10


# ---------------------------------------------- float32 bridges: exact.py against OneFlow

BRIDGE_DEVICES = ("cpu", "cuda")


def bridge(folder: Path, device: str, what: str) -> dict[str, np.ndarray]:
    """One bridge's arrays on one device, by ``<kind>/<name>`` (kind ``exact`` or ``oneflow``);
    skips a device OneFlow did not see."""
    got = np.load(folder / "bridges.npz")
    prefix = f"{device}/{what}/"
    arrays = {k[len(prefix):]: got[k] for k in got.files if k.startswith(prefix)}
    if not arrays:
        pytest.skip(f"OneFlow sees no {device} here")
    return arrays


def stand_in_pairs(arrays: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(name, the stand-in's value, the kernel's value) for every recorded quantity."""
    names = sorted(k[len("exact/"):] for k in arrays if k.startswith("exact/"))
    assert names and names == sorted(k[len("oneflow/"):] for k in arrays
                                     if k.startswith("oneflow/"))
    return [(n, arrays[f"exact/{n}"], arrays[f"oneflow/{n}"]) for n in names]


@pytest.mark.parametrize("device", BRIDGE_DEVICES)
@pytest.mark.parametrize("dims", ("1d", "2d"))
def test_float32_batch_norm_stand_in_equals_oneflows_kernel(one_process, dims, device):
    """``exact.BatchNorm1d/2d`` (a float64 run's) against OneFlow's BatchNorm in float32 on
    random inputs: two training-mode calls (outputs, input, weight and bias gradients), the
    running statistics and the call count after them, and an eval-mode output."""
    for name, ours, theirs in stand_in_pairs(bridge(one_process, device, f"bn{dims}")):
        if name == "calls":
            assert int(ours) == int(theirs) == 2
            continue
        assert ours.dtype == theirs.dtype == np.float32, name
        close_to_max(ours, theirs, rtol=FP32_BRIDGE, what=f"bn{dims} {name}")


def running_statistics(a, dims: str, ddof: int) -> tuple[np.ndarray, np.ndarray]:
    """The running mean and variance after the bridge's two batches in float64, each moved by
    momentum 0.1 towards the batch's mean and variance (``ddof`` 1: unbiased, torch's rule;
    0: biased)."""
    mean, var = (a[f"bn{dims}/{k}"].astype(np.float64) for k in ("running_mean", "running_var"))
    axes = (0,) if dims == "1d" else (0, 2, 3)
    for x in a[f"bn{dims}/x"].astype(np.float64):
        mean = 0.9 * mean + 0.1 * x.mean(axis=axes)
        var = 0.9 * var + 0.1 * x.var(axis=axes, ddof=ddof)
    return mean, var


@pytest.mark.parametrize("device", BRIDGE_DEVICES)
@pytest.mark.parametrize("dims", ("1d", "2d"))
def test_oneflows_batch_norm_moves_its_statistics_by_torchs_rule(one_process, dims, device):
    """What OneFlow's kernel itself does to the running statistics, measured in float32: it
    moves them by momentum 0.1 towards the batch mean and the UNBIASED batch variance, as torch
    does. The stand-in follows torch's rule because the kernel does, and the backend declares
    no difference of rule (``Capabilities.rule_differences``). The biased variance's rule is
    a hundred times the bridge's bound away, and more."""
    from trainperf.backends.oneflow.backend import BACKEND

    got = bridge(one_process, device, f"bn{dims}")
    a = np.load(one_process / "bridge_in.npz")
    mean, unbiased = running_statistics(a, dims, ddof=1)
    _, biased = running_statistics(a, dims, ddof=0)
    close_to_max(got["oneflow/running_mean"], mean, rtol=FP32_BRIDGE, what="running_mean")
    close_to_max(got["oneflow/running_var"], unbiased, rtol=FP32_BRIDGE, what="running_var")
    off = np.abs(got["oneflow/running_var"] - biased).max() / np.abs(biased).max()
    assert off > 100 * FP32_BRIDGE, off
    assert BACKEND.capabilities.rule_differences == {}


@pytest.mark.parametrize("device", BRIDGE_DEVICES)
def test_float32_sgd_stand_in_equals_oneflows_kernel(one_process, device):
    """``exact.SGD`` (a float64 run's) against ``oneflow.optim.SGD`` in float32 (its fused
    multi-tensor kernel on a GPU, as the measured runs use it): two weights and their momentum
    buffers after each of four steps, with weight decay, momentum and a rate that drops at the
    third step. Leaving the weight decay out, the rule's smallest term, would move the first
    step alone by more than ten times the bound."""
    arrays = bridge(one_process, device, "sgd")
    for name, ours, theirs in stand_in_pairs(arrays):
        assert ours.dtype == theirs.dtype == np.float32, name
        close_to_max(ours, theirs, rtol=FP32_BRIDGE, what=f"sgd {name}")
    a = np.load(one_process / "bridge_in.npz")
    no_decay, _ = oracle.sgd_momentum_step(a["sgd/w0"], a["sgd/g0"][0], None, 0.1, 0.9, 0.0)
    off = np.abs(arrays["oneflow/0/w0"] - no_decay).max() / np.abs(no_decay).max()
    assert off > 10 * FP32_BRIDGE


def test_sgd_is_torchs_update_through_a_rate_change(one_process):
    """OneFlow 0.9's momentum SGD keeps torch's buffer (its docstring still describes the
    older lr-scaled form, which would differ after the rate drops)."""
    s = np.load(one_process / "sgd_in.npz")
    got = np.load(one_process / "sgd_out.npy")
    weight, buf = s["weight"], None
    for i, (grad, lr) in enumerate(zip(s["grads"], s["lrs"])):
        weight, buf = oracle.sgd_momentum_step(weight, grad, buf, lr, 0.9, 5e-4)
        np.testing.assert_allclose(got[i], weight, rtol=1e-6, atol=1e-7)


def test_unsupported_settings_are_refused_with_a_reason(one_process):
    fp16, bf16, y1, rn50, nhwc = (one_process / "refused.txt").read_text().splitlines()
    assert fp16 == ("the oneflow backend runs --precision fp32 on a CPU (OneFlow 0.9's eager "
                    "mode has no dynamic loss scaler)")
    assert bf16 == "the oneflow backend runs --precision fp32 on a CPU"
    assert y1 == rn50 == "accepted"  # OneFlow builds every family (issue 43)
    assert nhwc == ("the oneflow backend runs its backbones channels-first only: use "
                    "--memory-format auto or channels_first")


# ------------------------------------------------------------------------- pfc, one rank

def test_sampling_follows_the_oracles_rule(one_process):
    """Every positive kept, the negatives of the highest scores, sorted ascending."""
    check_sampling_rule(np.load(one_process / "sample_in.npz"),
                        np.load(one_process / "sample_out.npz"), remapped_key=None)


def test_pfc_at_ratio_one_is_the_full_softmax(one_process):
    x = np.load(one_process / "arcface_in.npz")
    got = np.load(one_process / "pfc1_out.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS["arcface"],
                                       SCALE, cos_eps=oracle.FP32_COS_EPS)
    assert str(got["update"]) == "full"
    check_head_equals(got, ref)


@pytest.mark.parametrize("update", ["sparse", "dense"])
def test_sampling_head_and_its_update(one_process, update):
    """A pfc head at ratio 0.4 of 20 classes, two steps: the sample is the oracle's, the loss
    and gradients the oracle's over the sampled classes, and the update torch's SGD, on the
    sampled rows only with momentum kept per row (sparse: the rows never sampled and their
    momentum stay as they were, bit for bit), or on the whole matrix with a gradient that is
    zero off the sample (dense, arcface_torch's)."""
    x = np.load(one_process / "pfc_in.npz")
    got = np.load(one_process / f"pfc_{update}_out.npz")
    assert str(got["update"]) == update
    weight = x["weight"].astype(np.float64)
    buf = np.zeros_like(weight)
    touched = np.zeros(len(weight), bool)
    for k in range(2):
        index, _ = oracle.pfc_sample(x[f"labels{k}"], 20, 8, x[f"scores{k}"])
        np.testing.assert_array_equal(got[f"{k}/index"], index)
        # The oracle on float32 weights, as the head holds them.
        ref = sampled_oracle(x["emb"], weight.astype(np.float32), x[f"labels{k}"], index)
        assert float(got[f"{k}/loss"]) == pytest.approx(ref["loss"], rel=1e-5)
        close_to_max(got[f"{k}/grad_emb"], ref["grad_emb"])
        close_to_max(got[f"{k}/grad"], ref["grad_weight"])
        grad = got[f"{k}/grad"].astype(np.float64)
        if update == "sparse":
            weight, buf = weight.copy(), buf.copy()
            weight[index], buf[index] = oracle.sgd_momentum_step(weight[index], grad,
                                                                 buf[index], 0.1, 0.9, 5e-4)
            touched[index] = True
            close_to_max(got[f"{k}/momentum"], buf)
            assert not got[f"{k}/momentum"][~touched].any()
        else:
            off = np.setdiff1d(np.arange(20), index)
            assert not got[f"{k}/grad_whole"][off].any()
            full = np.zeros_like(weight)
            full[index] = grad
            weight, buf = oracle.sgd_momentum_step(weight, full, buf, 0.1, 0.9, 5e-4)
        np.testing.assert_allclose(got[f"{k}/after"], weight, rtol=1e-5, atol=1e-7)
        weight = got[f"{k}/after"].astype(np.float64)
    if update == "sparse":
        assert 0 < touched.sum() < 20
        np.testing.assert_array_equal(got["1/after"][~touched], x["weight"][~touched])
    else:  # the weight decay reaches every row
        assert (got["1/after"] != x["weight"]).all(axis=1).all()


# ------------------------------------------------------------------------ mp, on 2 ranks

# Each rank: the sharded head on its half of the oracle's batch, twice (the second call must
# repeat the first: nothing of a step may carry over into the next); whole dp and mp steps;
# exact.DataParallel beside OneFlow's DDP.
MP_RANK = r"""
import sys
from trainperf.backends.oneflow.rendezvous import wait_for_rank0
wait_for_rank0()
import numpy as np
import oneflow as flow
from trainperf.backends.oneflow import exact
from trainperf.backends.oneflow.dist import dist_from_env
from trainperf.backends.oneflow.heads import MarginSoftmaxHead
from trainperf.backends.oneflow.models import build_backbone
from trainperf.backends.oneflow.step import (DDP_BUCKET_PARAMS, FaceModel, TrainStep,
                                             synthetic_batch)
from trainperf.config import Workload

folder = sys.argv[1]
dist = dist_from_env("cpu")
r = dist.rank
x = np.load(f"{folder}/head_in.npz")
c, d = x["weight"].shape
rows = x["emb"].shape[0] // dist.world_size
head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), dist, mode="mp")
head.set_weight(x["weight"])
out = {"start": head.start, "count": head.count, "world": dist.world_size,
       "sbp": str(head.weight.sbp)}
for call in (1, 2):
    emb = flow.tensor(x["emb"][r * rows:(r + 1) * rows], requires_grad=True)
    head.weight.grad = None
    loss = head(emb, flow.tensor(x["labels"][r * rows:(r + 1) * rows]), keep_logits=True)
    loss.backward()
    out.update({f"loss{call}": loss.to_local().numpy(), f"grad_emb{call}": emb.grad.numpy(),
                f"grad_weight{call}": head.weight.grad.to_local().numpy(),
                f"logits{call}": head.logits.numpy()})
np.savez(f"{folder}/head_rank{r}.npz", **out)

# pfc heads on the same halves: at ratio 1.0 (mp itself), and sampling with given negative
# scores at 0.5 (9 columns a shard) and 0.3 (5 a shard: shard 0's 6 positives exceed it, so
# rank 1's piece is padded to 6), each then taking its sparse update.
labels = flow.tensor(x["labels"][r * rows:(r + 1) * rows])
out = {}
for tag, ratio in (("pfc1", 1.0), ("pfc05", 0.5), ("pfc03", 0.3)):
    head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), dist, mode="pfc",
                             sample_ratio=ratio)
    head.set_weight(x["weight"])
    emb = flow.tensor(x["emb"][r * rows:(r + 1) * rows], requires_grad=True)
    scores = None if ratio == 1.0 else flow.tensor(x[f"scores{r}"][:head.count])
    loss = head(emb, labels, keep_logits=True, scores=scores)
    loss.backward()
    out.update({f"{tag}/loss": loss.to_local().numpy(), f"{tag}/grad_emb": emb.grad.numpy(),
                f"{tag}/logits": head.logits.numpy(), f"{tag}/update": head.update})
    if ratio == 1.0:
        out[f"{tag}/grad"] = head.weight.grad.to_local().numpy()
        continue
    index = head.index.numpy()
    out.update({f"{tag}/index": index, f"{tag}/num_sample": head.num_sample,
                f"{tag}/grad": head.rows.grad[:len(index)].numpy()})
    head.sparse_step(0.1, 0.9, 5e-4)
    out[f"{tag}/after"] = head.local_weight().detach().numpy().copy()
np.savez(f"{folder}/pfc_rank{r}.npz", **out)

# Whole steps without clipping (which would hide a wrong gradient scale): dp and mp from the
# same start on the same per-rank batches, gradients read after the reduction.
wl = Workload(backbone="iresnet_tiny", num_classes=c, batch_size=4, embedding_size=d,
              input_size=16, dropout=0.0, clip_grad_norm=None)
dp = TrainStep(wl.replace(fc="dp"), dist)
dp.head.set_weight(x["weight"])
init = {"backbone/" + k: v.numpy() for k, v in dp.backbone.state_dict().items()}
init["head/weight"] = x["weight"]
mp = TrainStep(wl.replace(fc="mp"), dist, init=init)
images, labels = synthetic_batch(wl, dist)
out = {}
for name, step in (("dp", dp), ("mp", mp)):
    loss = step.compute_gradients(images, labels)
    out[f"{name}/loss"] = (loss.to_local() if loss.is_global else loss).numpy()
    grad = step.head.weight.grad
    out[f"{name}/head"] = (grad.to_local() if grad.is_global else grad).numpy()
    for k, p in step.backbone.named_parameters():
        if p.requires_grad:
            out[f"{name}/grad/{k}"] = p.grad.numpy()
    step.apply()
np.savez(f"{folder}/step_rank{r}.npz", start=mp.head.start, **out)

# Whole pfc steps at ratio 0.5, sparse and dense: what the worker reports, and which rows of
# the shard the update moved.
out = {}
for update in ("sparse", "dense"):
    step = TrainStep(wl.replace(fc="pfc", sample_ratio=0.5, pfc_update=update), dist, init=init)
    before = step.head.local_weight().detach().numpy().copy()
    loss = step(images, labels)
    out.update({f"{update}/loss": loss.numpy(), f"{update}/ran": step.pfc_update,
                f"{update}/head": step.settings["head"], f"{update}/before": before,
                f"{update}/after": step.head.local_weight().detach().numpy().copy(),
                f"{update}/index": step.head.index.numpy(),
                f"{update}/optimizers": len(step.optimizers)})
np.savez(f"{folder}/pfc_step_rank{r}.npz", **out)

# The float32 bridge of exact.DataParallel to OneFlow's DDP: the dp model (backbone and head)
# on ranks that start apart, two forwards and backwards on each rank's own batches, with and
# without broadcast buffers. Recorded: the parameters once wrapped, then at each step the
# averaged gradients and the buffers. Copies: a CPU tensor's numpy() shares its memory.
def apart_model():
    flow.manual_seed(wl.seed)
    backbone = build_backbone("iresnet_tiny", embedding_size=d, input_size=16)
    model = FaceModel(backbone.to(dist.device), MarginSoftmaxHead(c, d, (1.0, 0.5, 0.0), 64.0,
                                                                  dist))
    with flow.no_grad():
        for p in model.parameters():
            p.add_(0.01 * r)
    return model


def wrap(model, kind, broadcast):
    if kind == "ddp":
        return flow.nn.parallel.DistributedDataParallel(
            model, broadcast_buffers=broadcast, bucket_size=DDP_BUCKET_PARAMS)
    return exact.DataParallel(model, dist, broadcast)


rng = np.random.RandomState(10 + r)
batches = [(flow.tensor(rng.randn(4, 3, 16, 16).astype(np.float32)),
            flow.tensor(rng.randint(0, c, 4))) for _ in range(2)]
out = {}
for broadcast in (0, 1):
    for kind in ("ddp", "exact"):
        model = apart_model()
        wrapped = wrap(model, kind, bool(broadcast))
        at = f"{kind}/{broadcast}"
        out.update({f"{at}/param/{k}": p.detach().numpy().copy()
                    for k, p in model.named_parameters()})
        for i, (batch_images, batch_labels) in enumerate(batches):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.zero_()  # in place: DDP's gradients are views into its buckets
            wrapped(batch_images, batch_labels).backward()
            if kind == "exact":
                wrapped.average_gradients()
            out.update({f"{at}/{i}/grad/{k}": p.grad.numpy().copy()
                        for k, p in model.named_parameters() if p.grad is not None})
            out.update({f"{at}/{i}/buffer/{k}": b.numpy().copy()
                        for k, b in model.named_buffers()})
np.savez(f"{folder}/ddp_rank{r}.npz", **out)
dist.barrier()
"""


@pytest.fixture(scope="module")
def mp_two_ranks(tmp_path_factory, oneflow_python):
    folder = tmp_path_factory.mktemp("of_mp_head")
    rng = np.random.RandomState(9)
    np.savez(folder / "head_in.npz", **head_inputs(7, 12, 8, 37), margins=MARGINS["arcface"],
             scale=SCALE, **shard_scores(rng))
    (folder / "of_mp_rank.py").write_text(MP_RANK)
    run_of([oneflow_python, "-m", "trainperf.backends.spawn", "--backend", "oneflow",
            "--nproc", "2", "--module", "of_mp_rank", "--", str(folder)],
           of_env(oneflow_python, folder))
    return folder


def test_mp_head_on_two_ranks_equals_the_full_softmax(mp_two_ranks):
    x = np.load(mp_two_ranks / "head_in.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS["arcface"],
                                       SCALE, world_size=2, cos_eps=oracle.FP32_COS_EPS)
    rows = x["emb"].shape[0] // 2
    for r in range(2):
        got = np.load(mp_two_ranks / f"head_rank{r}.npz")
        shard = ref["shards"][r]
        assert int(got["world"]) == 2 and "split(dim=0)" in str(got["sbp"])
        assert (int(got["start"]), int(got["count"])) == (shard["start"], shard["count"])
        for call in (1, 2):
            # Every rank holds the loss of the whole gathered batch.
            assert float(got[f"loss{call}"]) == pytest.approx(ref["loss"], rel=1e-5)
            np.testing.assert_allclose(got[f"logits{call}"], shard["logits"], rtol=0, atol=1e-4)
            close_to_max(got[f"grad_emb{call}"], ref["grad_emb"][r * rows:(r + 1) * rows])
            close_to_max(got[f"grad_weight{call}"], shard["grad_weight"])


def test_mp_step_sums_what_dp_averages(mp_two_ranks):
    """The same two per-rank batches through a dp and an mp step (clipping off): both give the
    gradient of the mean loss over the global batch, dp by averaging each rank's own gradient,
    mp by summing each rank's part of the global loss's. A backbone summed without the world
    size's factor, or averaged, would be half of dp's."""
    ranks = [np.load(mp_two_ranks / f"step_rank{r}.npz") for r in range(2)]
    names = [k for k in ranks[0].files if k.startswith("dp/grad/")]
    scale = max(np.abs(ranks[0][k]).max() for k in names)
    for got in ranks:
        for key in names:
            ref = ranks[0][key]  # every rank holds the same reduced gradient
            mp_key = "mp/" + key[len("dp/"):]
            np.testing.assert_allclose(got[key], ref, rtol=0, atol=1e-6 * scale, err_msg=key)
            np.testing.assert_allclose(got[mp_key], ref, rtol=0, atol=1e-5 * scale,
                                       err_msg=mp_key)
        start = int(got["start"])
        rows = got["mp/head"].shape[0]
        close_to_max(got["mp/head"], got["dp/head"][start:start + rows])
    # mp's loss is the global batch's: the mean of the ranks' own dp losses.
    dp_mean = np.mean([float(got["dp/loss"]) for got in ranks])
    for got in ranks:
        assert float(got["mp/loss"]) == pytest.approx(dp_mean, rel=1e-6)
    assert float(ranks[0]["dp/loss"]) != float(ranks[1]["dp/loss"])


def test_float32_data_parallel_equals_oneflows_ddp(mp_two_ranks):
    """``exact.DataParallel`` (a float64 run's stand-in for OneFlow's float32-only DDP) against
    DDP in float32 on 2 ranks whose parameters start 0.01 apart: rank 0's parameters on both
    once wrapped, the same averaged gradients at each of two steps, and the same buffers after
    each forward, with and without broadcast buffers. That broadcast acts: without it, rank 1's
    running statistics after the second forward are its own."""
    ranks = [np.load(mp_two_ranks / f"ddp_rank{r}.npz") for r in range(2)]
    for got in ranks:
        for key in (k for k in got.files if k.startswith("ddp/")):
            ours, theirs = got["exact/" + key[len("ddp/"):]], got[key]
            if "/param/" in key:
                # Sent from rank 0: every rank holds rank 0's.
                np.testing.assert_array_equal(theirs, ranks[0][key], err_msg=key)
            if theirs.dtype.kind != "f":
                np.testing.assert_array_equal(ours, theirs, err_msg=key)
            else:
                close_to_max(ours, theirs, rtol=FP32_BRIDGE, what=key)
    buffer = "1/buffer/backbone.bn1.running_mean"
    apart = ranks[1][f"ddp/1/{buffer}"] - ranks[1][f"ddp/0/{buffer}"]
    assert np.abs(apart).max() > 100 * FP32_BRIDGE * np.abs(ranks[1][f"ddp/1/{buffer}"]).max()


# ------------------------------------------------------------------------ pfc, on 2 ranks

def test_pfc_at_ratio_one_on_two_ranks_is_mp(mp_two_ranks):
    for r in range(2):
        mp = np.load(mp_two_ranks / f"head_rank{r}.npz")
        got = np.load(mp_two_ranks / f"pfc_rank{r}.npz")
        assert str(got["pfc1/update"]) == "full"
        for key, mp_key in (("loss", "loss1"), ("grad_emb", "grad_emb1"), ("grad", "grad_weight1"),
                            ("logits", "logits1")):
            np.testing.assert_array_equal(got[f"pfc1/{key}"], mp[mp_key], err_msg=key)


@pytest.mark.parametrize("tag,sizes", [("pfc05", (9, 9)), ("pfc03", (6, 5))])
def test_pfc_on_two_ranks_is_the_softmax_over_the_sampled_classes(mp_two_ranks, tag, sizes):
    """Each shard's sample is the oracle's (its positives all kept, at 0.3 beyond the sample);
    the loss, the embedding gradients, the logits and the sampled rows' gradients are the
    oracle's over the sampled classes of both shards; the sparse update moves the sampled rows
    by torch's first SGD step and no other row."""
    x = np.load(mp_two_ranks / "head_in.npz")
    ranks = [np.load(mp_two_ranks / f"pfc_rank{r}.npz") for r in range(2)]
    ids = sampled_ids_on_two_ranks(x, ranks, prefix=tag)
    assert tuple(len(i) for i in ids) == sizes
    ref = sampled_oracle(x["emb"], x["weight"], x["labels"], np.concatenate(ids))
    offset = 0
    for r, got in enumerate(ranks):
        n = len(ids[r])
        assert float(got[f"{tag}/loss"]) == pytest.approx(ref["loss"], rel=1e-5)
        close_to_max(got[f"{tag}/grad_emb"], ref["grad_emb"][r * 6:(r + 1) * 6])
        np.testing.assert_allclose(got[f"{tag}/logits"], ref["logits"][:, offset:offset + n],
                                   rtol=0, atol=1e-4)
        close_to_max(got[f"{tag}/grad"], ref["grad_weight"][offset:offset + n])
        start, count = oracle.shard_of(37, r, 2)
        want = x["weight"][start:start + count].astype(np.float64)
        index = got[f"{tag}/index"]
        want[index], _ = oracle.sgd_momentum_step(want[index], got[f"{tag}/grad"], None, 0.1,
                                                  0.9, 5e-4)
        np.testing.assert_allclose(got[f"{tag}/after"], want, rtol=1e-6, atol=1e-8)
        off = np.setdiff1d(np.arange(count), index)
        np.testing.assert_array_equal(got[f"{tag}/after"][off], x["weight"][start + off])
        offset += n


def test_pfc_steps_on_two_ranks_say_which_update_ran(mp_two_ranks):
    """A whole step at ratio 0.5: sparse moves only the sampled rows of each shard, by the
    head's own update (no optimizer holds the class matrix); dense moves every row (the weight
    decay), through OneFlow's SGD. ``pfc_update`` (the worker's Start field) says which."""
    for r in range(2):
        got = np.load(mp_two_ranks / f"pfc_step_rank{r}.npz")
        for update, optimizers in (("sparse", 1), ("dense", 2)):
            assert str(got[f"{update}/ran"]) == update
            assert str(got[f"{update}/head"]).endswith(f"pfc samples 0.5 of each shard, "
                                                      f"{update} update")
            assert int(got[f"{update}/optimizers"]) == optimizers
            assert np.isfinite(got[f"{update}/loss"]).all()
            moved = (got[f"{update}/after"] != got[f"{update}/before"]).any(axis=1)
            if update == "sparse":
                np.testing.assert_array_equal(np.flatnonzero(moved), got["sparse/index"])
            else:
                assert moved.all()
