"""The Paddle head and training step (``trainperf.backends.paddle``) against the float64 oracle.

Paddle runs in its own environment (``paddle_python``): each fixture runs a script there that
writes ``.npz`` files, and the comparisons happen here, against ``tests/oracle.py``. The 2-rank
checks start two ranks through the backend's own launcher (``trainperf.backends.spawn``, gloo),
as a run does.

Tolerances: Paddle computes in float32 from the same float32 inputs the oracle casts to float64.
The loss agrees to a relative 1e-5; the logits (scaled by s = 64) to 1e-4 absolute; gradients
to 1e-5 of the largest entry of the same gradient. The clamp of the margin is compared with
``oracle.FP32_COS_EPS``, the bound a float32 backend really applies. A float64 head (an
alignment run's) agrees with the oracle to 1e-12.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import oracle
from framework_checks import (check_head_equals, check_mp_on_two_ranks, check_recorded_sgd_steps,
                              check_sampling_rule, close_to_max, head_inputs, pfc_step_inputs,
                              sample_cases, sampled_ids_on_two_ranks, sampled_oracle, shard_scores)

ROOT = Path(__file__).resolve().parents[1]
MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "combined": (1.2, 0.3, 0.1)}
SCALE = 64.0
GRAD_RTOL = 1e-5


def pd_env(*extra: Path) -> dict[str, str]:
    paths = [str(ROOT / "src"), *map(str, extra)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    env.pop("TRAINPERF_FAULT", None)
    return env


def run_pd(python: str, argv: list[str], env: dict[str, str], timeout: float = 180) -> None:
    proc = subprocess.run([python, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-5000:]}"




# --------------------------------------------------------------------------- one process

ONE_PROCESS = r"""
import contextlib, sys
import numpy as np
import paddle
from trainperf.config import Workload
from trainperf.backends.paddle import step as step_module
from trainperf.backends.paddle.comm import Comm
from trainperf.backends.paddle.heads import MarginSoftmaxHead, sample_classes
from trainperf.backends.paddle.step import TrainStep, synthetic_batch

folder = sys.argv[1]
T = paddle.to_tensor

# (1) dp heads on the oracle's inputs.
for name in ("arcface", "cosface", "combined"):
    x = np.load(f"{folder}/{name}_in.npz")
    c, d = x["weight"].shape
    head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), Comm())
    head.set_weight(x["weight"])
    loss, grad = head.forward_backward(T(x["emb"]), T(x["labels"]), keep_logits=True)
    np.savez(f"{folder}/{name}_out.npz", loss=loss.numpy(), grad_emb=grad.numpy(),
             grad_weight=head.grad.numpy(), logits=head.logits.numpy())

# (1b) the same heads in float64 (an alignment run's), exact and with the margin's gradient
# passed straight through (a negative control's break).
for name in ("arcface", "combined"):
    x = np.load(f"{folder}/{name}_in.npz")
    c, d = x["weight"].shape
    out = {}
    for tag, through in (("exact", False), ("through", True)):
        head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), Comm(),
                                 dtype="float64")
        head.straight_through = through
        head.set_weight(x["weight"])
        loss, grad = head.forward_backward(T(x["emb"].astype(np.float64)), T(x["labels"]),
                                           keep_logits=True)
        out.update({f"{tag}/loss": loss.numpy(), f"{tag}/grad_emb": grad.numpy(),
                    f"{tag}/grad_weight": head.grad.numpy(), f"{tag}/logits": head.logits.numpy(),
                    f"{tag}/weight": head.weight.numpy()})
    np.savez(f"{folder}/{name}_f64_out.npz", **out)

# (2) the sampling rule.
s = np.load(f"{folder}/sample_in.npz")
out = {}
for i in range(int(s["cases"])):
    index, remapped = sample_classes(T(s[f"{i}/labels"]), int(s[f"{i}/num_local"]),
                                     int(s[f"{i}/num_sample"]), T(s[f"{i}/uniform"]))
    out[f"{i}/index"], out[f"{i}/remapped"] = index.numpy(), remapped.numpy()
np.savez(f"{folder}/sample_out.npz", **out)

# (3) a sampling pfc head, one rank, two steps with given negative scores: sparse and dense.
x = np.load(f"{folder}/pfc_in.npz")
c, d = x["weight"].shape
for update in ("sparse", "dense"):
    head = MarginSoftmaxHead(c, d, (1.0, 0.5, 0.0), 64.0, Comm(), mode="pfc", sample_ratio=0.4,
                             update=update)
    head.set_weight(x["weight"])
    out = {"update": head.update}
    for k in range(2):
        loss, grad = head.forward_backward(T(x["emb"]), T(x[f"labels{k}"]),
                                           scores=T(x[f"scores{k}"]))
        out.update({f"{k}/loss": loss.numpy(), f"{k}/grad_emb": grad.numpy(),
                    f"{k}/grad": head.grad.numpy(), f"{k}/index": head.index.numpy()})
        head.sgd_step(0.1, 0.9, 5e-4)
        out[f"{k}/after"] = head.weight.numpy()
    np.savez(f"{folder}/pfc_{update}_out.npz", **out)

# (4) three updates of the step, the raw gradients before each.
cases = {
    # A tiny clip norm so clipping acts on every step; the rate drops after step 1.
    "face": Workload(backbone="iresnet_tiny", num_classes=10, batch_size=4, embedding_size=8,
                     input_size=16, dropout=0.0, clip_grad_norm=0.05, lr_steps=(1,),
                     lr_scales=(0.1,)),
    "classification": Workload(backbone="resnet_v1b_tiny", task="classification",
                               num_classes=10, batch_size=4, input_size=16, lr=0.05,
                               clip_grad_norm=None, lr_steps=(2,), lr_scales=(0.2,)),
}
for name, wl in cases.items():
    step = TrainStep(wl, Comm())
    images, labels = synthetic_batch(wl, 0)
    def values(kind):
        if kind == "data":
            return [p.numpy() for p in step.params] + ([step.head.weight.numpy()]
                                                       if step.head else [])
        return [p.grad.numpy() for p in step.params] + ([step.head.grad.numpy()]
                                                        if step.head else [])
    out = {"backbone_count": len(step.params)}
    for i in range(3):
        before = values("data")
        step.compute_gradients(images, labels)
        grads = values("grad")
        step.apply()
        after = values("data")
        for j, (b, g, a) in enumerate(zip(before, grads, after)):
            out[f"{i}/{j}/before"], out[f"{i}/{j}/grad"], out[f"{i}/{j}/after"] = b, g, a
    out["arrays"] = len(before)
    held = step(images, labels)
    out["held_loss_keeps_graph"] = held.grad_fn is not None or not held.stop_gradient
    np.savez(f"{folder}/{name}.npz", **out)

# (5) what the backend refuses, and the message.
refused = []
base = dict(backbone="iresnet_tiny", num_classes=10, batch_size=4, embedding_size=8,
            input_size=16)
for change in ({"precision": "fp16"}, {"precision": "bf16"}):
    try:
        TrainStep(Workload(**base, **change), Comm())
        refused.append("accepted")
    except ValueError as exc:
        refused.append(str(exc))
with open(f"{folder}/refused.txt", "w") as f:
    f.write("\n".join(refused))

# (6) fp16's loss-scaling bookkeeping on CPU, where the backend refuses fp16: autocast off and
# the head's products in fp32, so only the scaling, the overflow check and the skip remain.
step_module.check_precision = lambda precision, device_type: None
TrainStep._autocast = lambda self: contextlib.nullcontext()
scaled = {}
for precision in ("fp32", "fp16"):
    wl = Workload(**base, precision=precision, dropout=0.0)
    step = TrainStep(wl, Comm())
    step.head.mm_dtype = "float32"
    images, labels = synthetic_batch(wl, 0)
    losses = []
    for i in range(5):
        loss = step.compute_gradients(images, labels)
        if precision == "fp16" and i == 2:  # an overflow in one gradient, checked again
            paddle.assign(paddle.full_like(step.params[3].grad, float("inf")),
                          output=step.params[3].grad)
            step._bad = step._overflow()
        step.apply()
        losses.append(float(loss))
    scaled[precision] = losses
    scaled[precision + "_scale"] = -1.0 if step.loss_scale is None else step.loss_scale
    scaled[precision + "_skipped"] = np.array(step.skipped_steps, dtype=np.int64)
np.savez(f"{folder}/loss_scaling.npz", **scaled)
"""




@pytest.fixture(scope="module")
def one_process(tmp_path_factory, paddle_python):
    folder = tmp_path_factory.mktemp("pd_heads")
    for i, (name, margins) in enumerate(MARGINS.items()):
        np.savez(folder / f"{name}_in.npz", **head_inputs(i, 12, 8, 37), margins=margins,
                 scale=SCALE)
    np.savez(folder / "sample_in.npz", **sample_cases())
    np.savez(folder / "pfc_in.npz", **pfc_step_inputs())
    run_pd(paddle_python, ["-c", ONE_PROCESS, str(folder)], pd_env())
    return folder


@pytest.mark.parametrize("loss", list(MARGINS))
def test_dp_head_equals_the_oracle(one_process, loss):
    x = np.load(one_process / f"{loss}_in.npz")
    got = np.load(one_process / f"{loss}_out.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE,
                                       cos_eps=oracle.FP32_COS_EPS)
    check_head_equals(got, ref)


@pytest.mark.parametrize("loss", ["arcface", "combined"])
def test_float64_head_equals_the_oracle_and_breaks_only_the_margins_slope(one_process, loss):
    """A float64 head (an alignment run's) holds and returns float64 and equals the float64
    oracle to rounding, the clamp at the oracle's own bound. Passing the margin's gradient
    straight through leaves the forward alone and changes only the target classes' rows."""
    x = np.load(one_process / f"{loss}_in.npz")
    got = np.load(one_process / f"{loss}_f64_out.npz")
    assert {got[k].dtype for k in got.files} == {np.dtype(np.float64)}
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE)
    assert float(got["exact/loss"]) == pytest.approx(ref["loss"], rel=1e-12)
    close_to_max(got["exact/logits"], ref["logits"], rtol=1e-12)
    close_to_max(got["exact/grad_emb"], ref["grad_emb"], rtol=1e-12)
    close_to_max(got["exact/grad_weight"], ref["grad_weight"], rtol=1e-12)

    assert float(got["through/loss"]) == float(got["exact/loss"])
    np.testing.assert_array_equal(got["through/logits"], got["exact/logits"])
    targets = np.unique(x["labels"])
    others = np.setdiff1d(np.arange(len(x["weight"])), targets)
    np.testing.assert_array_equal(got["through/grad_weight"][others],
                                  got["exact/grad_weight"][others])
    assert not np.allclose(got["through/grad_weight"][targets],
                           got["exact/grad_weight"][targets], rtol=1e-3, atol=0)


def test_sampling_follows_the_oracles_rule(one_process):
    """Every positive kept, negatives by score, sorted; labels remapped into the sample."""
    check_sampling_rule(np.load(one_process / "sample_in.npz"),
                        np.load(one_process / "sample_out.npz"))


@pytest.mark.parametrize("update", ["sparse", "dense"])
def test_sampling_head_and_its_update(one_process, update):
    """A pfc head at ratio 0.4 of 20 classes: the sample is the oracle's, the loss and gradients
    are the oracle's over the sampled classes, and the update is torch's SGD: on the sampled
    rows only with momentum kept per row (sparse), or on the whole matrix with a gradient that
    is zero off the sample (dense, arcface_torch's)."""
    x = np.load(one_process / "pfc_in.npz")
    got = np.load(one_process / f"pfc_{update}_out.npz")
    assert str(got["update"]) == update
    weight = x["weight"].astype(np.float64)
    buf = np.zeros_like(weight)
    touched = np.zeros(len(weight), bool)
    for k in range(2):
        local = x[f"labels{k}"]
        index, _ = oracle.pfc_sample(local, 20, 8, x[f"scores{k}"])
        np.testing.assert_array_equal(got[f"{k}/index"], index)
        # The oracle on float32 weights, as the head holds them.
        ref = sampled_oracle(x["emb"], weight.astype(np.float32), local, index, (1.0, 0.5, 0.0))
        assert float(got[f"{k}/loss"]) == pytest.approx(ref["loss"], rel=1e-5)
        close_to_max(got[f"{k}/grad_emb"], ref["grad_emb"])
        close_to_max(got[f"{k}/grad"], ref["grad_weight"])
        grad = got[f"{k}/grad"].astype(np.float64)
        if update == "sparse":
            rows, buf[index] = oracle.sgd_momentum_step(weight[index], grad, buf[index],
                                                        0.1, 0.9, 5e-4)
            weight = weight.copy()
            weight[index] = rows
            touched[index] = True
        else:
            full = np.zeros_like(weight)
            full[index] = grad
            weight, buf = oracle.sgd_momentum_step(weight, full, buf, 0.1, 0.9, 5e-4)
        np.testing.assert_allclose(got[f"{k}/after"], weight, rtol=1e-5, atol=1e-7)
        weight = got[f"{k}/after"].astype(np.float64)
    if update == "sparse":  # rows never sampled are bit for bit the initial ones
        np.testing.assert_array_equal(got["1/after"][~touched], x["weight"][~touched])


@pytest.mark.parametrize("case,clip,rates", [
    ("face", 0.05, (0.1, 0.01, 0.01)),
    ("classification", None, (0.05, 0.05, 0.01)),
])
def test_update_is_torch_sgd_with_clipping_and_rate_changes(one_process, case, clip, rates):
    """Three steps of the update equal torch's SGD (oracle.sgd_momentum_step) on the step's own
    gradients, with the backbone's global-norm clipping (not the head's) and a change of
    rate."""
    got = np.load(one_process / f"{case}.npz")
    check_recorded_sgd_steps(got, int(got["arrays"]), int(got["backbone_count"]), rates, clip)


@pytest.mark.parametrize("case", ["face", "classification"])
def test_the_step_hands_back_its_loss_without_the_graph(one_process, case):
    # The measured loop holds every step's loss until the window ends.
    assert not np.load(one_process / f"{case}.npz")["held_loss_keeps_graph"]


def test_half_precision_on_cpu_is_refused(one_process):
    fp16, bf16 = (one_process / "refused.txt").read_text().splitlines()
    for precision, line in (("fp16", fp16), ("bf16", bf16)):
        assert line == (f"the paddle backend runs --precision fp32 on a CPU; {precision} needs "
                        "a GPU (Paddle's CPU build has no half-precision matrix products)")


def test_fp16_loss_scaling_scales_checks_and_skips(one_process):
    """Without an overflow the scaled step trains exactly as fp32 (the scale is a power of
    two); an overflow skips that step's update (the next loss repeats it) and halves the
    scale from 2**16."""
    got = np.load(one_process / "loss_scaling.npz")
    fp32, fp16 = list(got["fp32"]), list(got["fp16"])
    np.testing.assert_allclose(fp16[:3], fp32[:3], rtol=1e-6)
    assert fp16[3] == fp16[2]
    np.testing.assert_allclose(fp16[4], fp32[3], rtol=1e-5)
    assert float(got["fp16_scale"]) == 2.0 ** 15
    assert list(got["fp16_skipped"]) == [2]


# ------------------------------------------------------------------ two ranks, gloo

# Each rank: (1) the mp head on the oracle's inputs, twice (nothing may carry over between
# calls), and pfc at ratio 1.0 (no sampling: mp itself); (2) pfc at ratio 0.5 with given
# negative scores; (3) a dp and an mp TrainStep's reduced gradients, beside the same gradients
# computed in this process alone by one-process steps from the same weights.
RANK = r"""
import sys
import numpy as np
import paddle
from trainperf.config import Workload
from trainperf.backends.paddle import models
from trainperf.backends.paddle.comm import Comm, comm_from_env
from trainperf.backends.paddle.heads import MarginSoftmaxHead
from trainperf.backends.paddle.step import TrainStep, synthetic_batch

folder = sys.argv[1]
comm = comm_from_env("cpu")
r = comm.rank
T = paddle.to_tensor
x = np.load(f"{folder}/head_in.npz")
c, d = x["weight"].shape
rows = x["emb"].shape[0] // comm.world_size
emb, labels = T(x["emb"][r * rows:(r + 1) * rows]), T(x["labels"][r * rows:(r + 1) * rows])
out = {}
for tag, kwargs in (("mp", {"mode": "mp"}), ("pfc1", {"mode": "pfc", "sample_ratio": 1.0})):
    head = MarginSoftmaxHead(c, d, (1.0, 0.5, 0.0), 64.0, comm, **kwargs)
    head.set_weight(x["weight"])
    out[f"{tag}/start"], out[f"{tag}/count"] = head.start, head.count
    for call in (1, 2):
        loss, grad = head.forward_backward(emb, labels, keep_logits=True)
        out.update({f"{tag}/loss{call}": loss.numpy(), f"{tag}/grad_emb{call}": grad.numpy(),
                    f"{tag}/grad_weight{call}": head.grad.numpy(),
                    f"{tag}/logits{call}": head.logits.numpy()})
head = MarginSoftmaxHead(c, d, (1.0, 0.5, 0.0), 64.0, comm, mode="pfc", sample_ratio=0.5)
head.set_weight(x["weight"])
loss, grad = head.forward_backward(emb, labels, scores=T(x[f"scores{r}"][:head.count]))
out.update({"pfc/loss": loss.numpy(), "pfc/grad_emb": grad.numpy(), "pfc/grad": head.grad.numpy(),
            "pfc/index": head.index.numpy(), "pfc/num_sample": head.num_sample})

for fc in ("dp", "mp"):
    wl = Workload(backbone="iresnet_tiny", num_classes=37, batch_size=4, embedding_size=8,
                  input_size=16, dropout=0.0, fc=fc, clip_grad_norm=None)
    step = TrainStep(wl, comm)
    names = models.torch_names(step.net)
    init = {"backbone/" + k: v for k, v in models.torch_state(step.net).items()}
    init["head/weight"] = x["step_head"]
    step.head.set_weight(x["step_head"])
    batches = [synthetic_batch(wl, k) for k in range(2)]
    loss = step.compute_gradients(*batches[r])
    out[f"{fc}/loss"] = loss.numpy()
    out[f"{fc}/head_grad"] = step.head.grad.numpy()
    out[f"{fc}/start"] = step.head.start
    trained = {id(p) for p in step.params}  # not BN statistics, not the fixed gamma
    for k, (p, t) in names.items():
        if id(p) in trained:
            out[f"{fc}/grad/{k}"] = p.grad.numpy().T if t else p.grad.numpy()
    # The reference, in this process alone, from the same weights and both ranks' batches.
    ref = TrainStep(wl.replace(fc="dp"), Comm(), init=init)
    ref_names = {k: v for k, v in models.torch_names(ref.net).items()
                 if any(v[0] is p for p in ref.params)}
    if fc == "dp":  # each rank's own gradient; the test averages them
        for k in range(2):
            out[f"dp/ref{k}/loss"] = ref.compute_gradients(*batches[k]).numpy()
            out[f"dp/ref{k}/head_grad"] = ref.head.grad.numpy()
            for n, (p, t) in ref_names.items():
                out[f"dp/ref{k}/grad/{n}"] = p.grad.numpy().T if t else p.grad.numpy()
            ref.opt.clear_grad(set_to_zero=False)
    else:  # one softmax over both halves, each half through the backbone on its own
        halves = [ref.net(images) for images, _ in batches]
        both = paddle.concat(halves)
        loss, grad = ref.head.forward_backward(both, paddle.concat([y for _, y in batches]))
        paddle.autograd.backward(halves, [grad[:4], grad[4:]])
        out["mp/ref/loss"] = loss.numpy()
        out["mp/ref/head_grad"] = ref.head.grad.numpy()
        for n, (p, t) in ref_names.items():
            out[f"mp/ref/grad/{n}"] = p.grad.numpy().T if t else p.grad.numpy()
    step.apply()
    for k, v in models.torch_state(step.net).items():
        out[f"{fc}/before/{k}"], out[f"{fc}/after/{k}"] = init["backbone/" + k], v
    out[f"{fc}/later"] = np.array([float(step(*batches[r])) for _ in range(2)])
np.savez(f"{folder}/rank{r}.npz", **out)
comm.barrier()
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, paddle_python):
    folder = tmp_path_factory.mktemp("pd_two_ranks")
    x = head_inputs(7, 12, 8, 37)
    rng = np.random.RandomState(9)
    (folder / "paddle_rank_check.py").write_text(RANK)
    np.savez(folder / "head_in.npz", **x,
             **shard_scores(rng),
             step_head=(rng.randn(37, 8) * 0.01).astype(np.float32))
    run_pd(paddle_python, ["-m", "trainperf.backends.spawn", "--backend", "paddle", "--nproc",
                           "2", "--module", "paddle_rank_check", "--", str(folder)],
           pd_env(folder))
    return folder, [dict(np.load(folder / f"rank{r}.npz")) for r in range(2)]


def test_mp_head_on_two_ranks_equals_the_full_softmax(two_ranks):
    """Each rank's shard logits and class-matrix gradient are the oracle's columns and rows,
    its embedding gradient the oracle's rows of its own samples, the loss the global one; a
    second call repeats the first; pfc at ratio 1.0 is mp exactly."""
    folder, ranks = two_ranks
    check_mp_on_two_ranks(np.load(folder / "head_in.npz"), ranks, MARGINS["arcface"], SCALE)


def test_pfc_on_two_ranks_is_the_softmax_over_the_sampled_classes(two_ranks):
    folder, ranks = two_ranks
    x = np.load(folder / "head_in.npz")
    ids = sampled_ids_on_two_ranks(x, ranks)
    ref = sampled_oracle(x["emb"], x["weight"], x["labels"], np.concatenate(ids),
                         MARGINS["arcface"])
    offset = 0
    for r, got in enumerate(ranks):
        assert float(got["pfc/loss"]) == pytest.approx(ref["loss"], rel=1e-5)
        close_to_max(got["pfc/grad_emb"], ref["grad_emb"][r * 6:(r + 1) * 6])
        rows = len(ids[r])
        close_to_max(got["pfc/grad"], ref["grad_weight"][offset:offset + rows])
        offset += rows


def _backbone_grads(got: dict, prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v.astype(np.float64) for k, v in got.items()
            if k.startswith(prefix)}


def _close_grads(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want) and len(want) > 10
    largest = max(np.abs(v).max() for v in want.values())
    for k, v in want.items():
        err = np.abs(got[k] - v).max() / largest
        assert err <= 1e-4, f"{k}: {err:.3g} of the largest backbone gradient"


def test_dp_step_averages_and_mp_step_sums_over_ranks(two_ranks):
    """After the all-reduce every rank holds the sum of the ranks' own gradients. dp: the
    update applies their mean (first step: w - lr * (mean + wd * w)), the same on both ranks.
    mp: the loss and backbone gradient of one process running the full softmax on both ranks'
    embeddings (the partials summed and applied as a sum), the shard's class-matrix gradient
    its rows of the full one; later mp steps give both ranks the same loss."""
    _, ranks = two_ranks
    refs = [_backbone_grads(ranks[0], f"dp/ref{k}/grad/") for k in range(2)]
    total = {k: refs[0][k] + refs[1][k] for k in refs[0]}
    for r, got in enumerate(ranks):
        _close_grads(_backbone_grads(got, "dp/grad/"), total)
        assert float(got["dp/loss"]) == pytest.approx(float(got[f"dp/ref{r}/loss"]), rel=1e-5)
        close_to_max(got["dp/head_grad"], got["dp/ref0/head_grad"] + got["dp/ref1/head_grad"],
                     rtol=1e-4)
        for fc, grads in (("dp", {k: v / 2 for k, v in total.items()}),
                          ("mp", _backbone_grads(got, "mp/ref/grad/"))):
            moved = {k: got[f"{fc}/after/{k}"] - got[f"{fc}/before/{k}"] for k in grads}
            want = {k: -0.1 * (g + 5e-4 * got[f"{fc}/before/{k}"]) for k, g in grads.items()}
            _close_grads(moved, want)
        _close_grads(_backbone_grads(got, "mp/grad/"), _backbone_grads(got, "mp/ref/grad/"))
        assert float(got["mp/loss"]) == pytest.approx(float(got["mp/ref/loss"]), rel=1e-5)
        start = int(got["mp/start"])
        close_to_max(got["mp/head_grad"],
                     got["mp/ref/head_grad"][start:start + len(got["mp/head_grad"])], rtol=1e-4)
    for fc in ("dp", "mp"):
        for k in refs[0]:
            np.testing.assert_array_equal(ranks[0][f"{fc}/after/{k}"], ranks[1][f"{fc}/after/{k}"])
    np.testing.assert_array_equal(ranks[0]["mp/later"], ranks[1]["mp/later"])
