"""The torch head against the framework-neutral float64 oracle in oracle.py.

Torch computes in float32, the oracle in float64 on the same (float32-representable) inputs, so
the tolerances below are float32 rounding, stated where they are used:

- margin values: 2e-6 absolute (|value| <= 2, a few float32 ulps through acos and cos);
- margin derivative: relative 1e-5 + 3e-8 / (1 - |c|). Near |c| = 1 torch's acos backward
  forms 1 - c*c in float32, whose rounding (~6e-8) is relatively large against 2 * (1 - |c|);
- head loss: 1e-5 relative; logits (scale 64): 1e-4 absolute;
- head gradients: each row (a sample's or a class's) within 1e-4 of its own norm or 1e-5 of the
  largest row's norm (see assert_rows_close: nearly-solved samples have tiny, cancelling rows);
- SGD: run in float64 on both sides, 1e-12.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import oracle
from dist_util import run_ranks
from trainperf.backends.torch.dist import DistContext, all_gather
from trainperf.backends.layouts import shard_of as torch_shard_of
from trainperf.backends.torch.heads import MarginSoftmaxHead
from trainperf.backends.torch.heads.fc import sample_classes
from trainperf.backends.torch.heads.margin import apply_margin_
from trainperf.backends.torch.heads.margin import margin_target_logit as torch_margin
from trainperf.backends.torch.heads.normalized_linear import normalized_linear

MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "softmax": (1.0, 0.0, 0.0),
           "combined": (0.9, 0.4, 0.15), "sphere": (1.35, 0.0, 0.0),
           "no_turn": (0.9, 0.2, 0.1)}  # theta_max > pi: the clamp at -1 is in the margin branch
SCALE = 64.0
EMB = 16
NUM_CLASSES = 103  # odd: two shards of 52 and 51
BATCH = 4  # per rank

LOSS_RTOL = 1e-5
LOGIT_ATOL = 1e-4
GRAD_ROW_RTOL = 1e-4
GRAD_ROW_FLOOR = 1e-5


def assert_rows_close(actual, expected, rtol: float = GRAD_ROW_RTOL,
                      floor: float = GRAD_ROW_FLOOR) -> None:
    """Every row's error within ``rtol`` of its own norm, or within ``floor`` of the largest
    row's norm: a nearly-solved sample's gradient is (p_y - 1) with p_y ~ 1, which float32 has
    only to ~6e-8 absolute, so tiny rows carry large relative errors however exact the code."""
    a = actual.detach().double().numpy() if isinstance(actual, torch.Tensor) else actual
    b = np.asarray(expected, dtype=np.float64)
    assert a.shape == b.shape
    err = np.linalg.norm(a - b, axis=1)
    norm = np.linalg.norm(b, axis=1)
    bound = rtol * norm + floor * norm.max()
    assert (err <= bound).all(), f"rows {np.flatnonzero(err > bound)}: err {err.max():.3g}"


def as64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def make_problem(n: int, num_classes: int = NUM_CLASSES, seed: int = 0):
    """float32 weight [C, D] (N(0, 0.01) as the head initialises it), embeddings [n, D] and
    labels [n]. Samples 0 and 1 lie near their class (cos ~ 0.96, the ArcFace factor ~ 3), sample
    2 opposite it (cos ~ -0.96, past ArcFace's theta_max), the rest at random (cos ~ 0)."""
    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((num_classes, EMB)) * 0.01).astype(np.float32)
    labels = rng.integers(0, num_classes, n)
    emb = rng.standard_normal((n, EMB))
    w_hat = weight / np.linalg.norm(weight, axis=1, keepdims=True)
    noise = rng.standard_normal((3, EMB)) * 0.3 / math.sqrt(EMB)
    emb[0:2] = w_hat[labels[0:2]] + noise[0:2]
    emb[2] = -w_hat[labels[2]] + noise[2]
    return torch.from_numpy(weight), torch.from_numpy(emb.astype(np.float32)), \
        torch.from_numpy(labels)


def torch_logits(emb, weight, local_labels, margins):
    with torch.no_grad():
        cos = normalized_linear(F.normalize(emb), weight)
        return apply_margin_(cos, local_labels, *margins, SCALE)


def test_shard_of_matches_torch():
    for total in (0, 1, 7, 103, 1000):
        for world in (1, 2, 3, 4, 8):
            split = [oracle.shard_of(total, r, world) for r in range(world)]
            assert split == [torch_shard_of(total, r, world) for r in range(world)]
            assert sum(c for _, c in split) == total


@pytest.mark.parametrize("name", MARGINS)
def test_margin_matches_oracle(name):
    m = MARGINS[name]
    near = [1.0, 1 - 1e-7, 1 - 5e-7, 1 - 2e-6, 1 - 1e-5, 1 - 1e-4, 1 - 1e-3]
    grid = np.concatenate([np.linspace(-0.999, 0.999, 401), near, [-x for x in near]])
    c = torch.tensor(grid, dtype=torch.float32, requires_grad=True)
    out = torch_margin(c, *m)
    out.sum().backward()
    c64 = as64(c)  # the float32 inputs exactly
    # The float32 clamp bound: in the band |c| > 1 - 1e-6 the value is the one at the bound.
    values, deriv = oracle.margin_target_logit(c64, *m, cos_eps=oracle.FP32_COS_EPS)
    np.testing.assert_allclose(as64(out), values, rtol=0, atol=2e-6)
    # The derivative jumps where the margin curve meets the straight continuation.
    cos_switch = math.cos((math.pi - m[1]) / m[0]) if (math.pi - m[1]) / m[0] < math.pi else -2.0
    keep = np.abs(c64 - cos_switch) > 1e-4
    tol = np.abs(deriv) * (1e-5 + 3e-8 / np.maximum(1 - np.abs(c64), 1e-12)) + 1e-6
    err = np.abs(as64(c.grad) - deriv)
    assert (err[keep] <= tol[keep]).all(), (c64[keep][err[keep] > tol[keep]], err[keep].max())
    if m[:2] != (1.0, 0.0):
        # In the clamped band the logit is flat: torch passes no gradient there.
        band = np.abs(c64) > 1 - oracle.FP32_COS_EPS
        assert band.sum() >= 4
        eps = oracle.FP32_COS_EPS
        theta = np.arccos(np.clip(c64, -1 + eps, 1 - eps))
        margin_branch = band & (theta <= (math.pi - m[1]) / m[0])
        assert (deriv[margin_branch] == 0).all() and (as64(c.grad)[margin_branch] == 0).all()
    # The default (float64) bound differs only inside that band.
    v64, d64 = oracle.margin_target_logit(c64, *m)
    outside = np.abs(c64) < 1 - 2e-6
    np.testing.assert_array_equal(v64[outside], values[outside])
    np.testing.assert_array_equal(d64[outside], deriv[outside])


def test_margin_derivative_is_finite_difference():
    """The oracle's analytic derivative against its own central differences (float64)."""
    c = np.linspace(-0.99, 0.99, 199)
    for m in MARGINS.values():
        h = 1e-6
        up, _ = oracle.margin_target_logit(c + h, *m)
        down, _ = oracle.margin_target_logit(c - h, *m)
        _, deriv = oracle.margin_target_logit(c, *m)
        theta_max = (math.pi - m[1]) / m[0]
        keep = np.abs(np.arccos(c) - theta_max) > 1e-3
        np.testing.assert_allclose(deriv[keep], ((up - down) / (2 * h))[keep], rtol=1e-6,
                                   atol=1e-7)


def test_head_gradients_are_finite_difference():
    """The oracle's analytic gradients against central differences of its own loss."""
    weight, emb, labels = make_problem(5, num_classes=7, seed=4)
    w, e = as64(weight) * 50, as64(emb)  # weight rows of norm ~2: the radial term matters
    for m in (MARGINS["arcface"], MARGINS["combined"]):
        res = oracle.head_forward_backward(e, w, labels.numpy(), m, 8.0)
        for x, grad in ((e, res["grad_emb"]), (w, res["grad_weight"])):
            numeric = np.zeros_like(x)
            for idx in np.ndindex(*x.shape):
                saved = x[idx]
                x[idx] = saved + 1e-6
                up = oracle.head_forward_backward(e, w, labels.numpy(), m, 8.0)["loss"]
                x[idx] = saved - 1e-6
                down = oracle.head_forward_backward(e, w, labels.numpy(), m, 8.0)["loss"]
                x[idx] = saved
                numeric[idx] = (up - down) / 2e-6
            np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", ["arcface", "cosface"])
def test_dp_head_matches_oracle(name):
    margins = MARGINS[name]
    weight, emb, labels = make_problem(2 * BATCH)
    head = MarginSoftmaxHead(NUM_CLASSES, EMB, margins, SCALE, DistContext(), mode="dp")
    head.weight.data.copy_(weight)
    emb_t = emb.clone().requires_grad_(True)
    loss = head(emb_t, labels)
    loss.backward()
    ref = oracle.head_forward_backward(as64(emb), as64(weight), labels.numpy(), margins, SCALE)
    assert float(loss.detach()) == pytest.approx(ref["loss"], rel=LOSS_RTOL)
    np.testing.assert_allclose(as64(torch_logits(emb, weight, labels, margins)), ref["logits"],
                               rtol=0, atol=LOGIT_ATOL)
    assert_rows_close(emb_t.grad, ref["grad_emb"])
    assert_rows_close(head.weight.grad, ref["grad_weight"])
    if name == "arcface":  # the problem reaches both branches of the margin
        cos = ref["logits"][np.arange(3), labels.numpy()[:3]] / SCALE
        assert cos[0] > 0.5 and cos[2] < math.cos(math.pi - 0.5)


def mp_rank(ctx: DistContext, problem):
    """One rank of an mp head, for each margin: loss, own-row embedding gradient, shard weight
    gradient, and the shard's logits (recomputed from the head's pieces without gradient)."""
    weight, emb, labels = problem
    out = {}
    for name in ("arcface", "cosface"):
        margins = MARGINS[name]
        head = MarginSoftmaxHead(weight.shape[0], EMB, margins, SCALE, ctx, mode="mp")
        head.weight.data.copy_(weight[head.class_start:head.class_start + head.num_local])
        rows = slice(ctx.rank * BATCH, (ctx.rank + 1) * BATCH)
        local_emb = emb[rows].clone().requires_grad_(True)
        loss = head(local_emb, labels[rows])
        loss.backward()
        gathered = all_gather(emb[rows].contiguous(), ctx)
        local = labels - head.class_start
        local = torch.where((local >= 0) & (local < head.num_local), local, -1)
        out[name] = dict(loss=loss.detach(), emb_grad=local_emb.grad, weight_grad=head.weight.grad,
                         start=head.class_start, count=head.num_local, local_labels=local,
                         logits=torch_logits(gathered, head.weight.detach(), local, margins))
    return out


def test_mp_two_ranks_match_oracle_shards():
    world = 2
    problem = make_problem(world * BATCH, seed=1)
    weight, emb, labels = problem
    results = run_ranks(mp_rank, world, problem)
    for name in ("arcface", "cosface"):
        ref = oracle.head_forward_backward(as64(emb), as64(weight), labels.numpy(), MARGINS[name],
                                           SCALE, world_size=world)
        assert [s["count"] for s in ref["shards"]] == [52, 51]
        for r, per_rank in enumerate(results):
            res, shard = per_rank[name], ref["shards"][r]
            assert (res["start"], res["count"]) == (shard["start"], shard["count"])
            np.testing.assert_array_equal(res["local_labels"].numpy(), shard["local_labels"])
            assert float(res["loss"]) == pytest.approx(ref["loss"], rel=LOSS_RTOL)
            np.testing.assert_allclose(as64(res["logits"]), shard["logits"], rtol=0,
                                       atol=LOGIT_ATOL)
            assert_rows_close(res["weight_grad"], shard["grad_weight"])
            own = ref["grad_emb"][r * BATCH:(r + 1) * BATCH]
            assert_rows_close(res["emb_grad"], own)
        # Both shards hold positives, and some samples' classes are elsewhere for each.
        for shard in ref["shards"]:
            assert 0 < (shard["local_labels"] >= 0).sum() < world * BATCH


class FixedRand:
    """Stands in for torch.rand inside sample_classes: returns the given scores for the shard's
    columns (plus the spare slot that takes other shards' samples) and records the call."""

    def __init__(self, scores: np.ndarray):
        self.scores = scores
        self.calls = []

    def __call__(self, *size, **kwargs):
        self.calls.append(size)
        assert size == (self.scores.shape[0] + 1,), size
        return torch.from_numpy(np.append(self.scores, np.float32(0.5)))


def distinct_scores(num_local: int, rng) -> np.ndarray:
    """Distinct float32 scores in [0, 1): a random permutation of k / num_local."""
    return (rng.permutation(num_local) / num_local).astype(np.float32)


PFC_CASES = {
    # (num_local, num_sample, local labels)
    "negatives_drawn": (60, 10, [3, -1, 17, 3, -1, 42, -1, 0]),
    "fewer_samples_than_slots": (40, 12, [5, -1, 39]),
    "positives_outnumber_slots": (50, 4, [1, 9, -1, 12, 30, 9, 44, 2, -1, 49]),
    "positives_equal_slots": (30, 3, [7, -1, 8, 29, -1, 7]),
    "no_positives": (20, 5, [-1, -1, -1, -1, -1, -1, -1]),
    "all_columns": (6, 6, [0, 5, -1, 2]),
}


@pytest.mark.parametrize("case", PFC_CASES)
def test_sample_classes_matches_oracle(case, monkeypatch):
    num_local, num_sample, labels = PFC_CASES[case]
    rng = np.random.default_rng(len(case))
    scores = distinct_scores(num_local, rng)
    fake = FixedRand(scores)
    monkeypatch.setattr(torch, "rand", fake)
    index, remapped = sample_classes(torch.tensor(labels), num_local, num_sample)
    assert len(fake.calls) == 1
    ref_index, ref_remapped = oracle.pfc_sample(labels, num_local, num_sample,
                                                scores.astype(np.float64))
    np.testing.assert_array_equal(index.numpy(), ref_index)
    np.testing.assert_array_equal(remapped.numpy(), ref_remapped)
    positives = {y for y in labels if y >= 0}
    assert len(ref_index) == max(num_sample, len(positives))
    assert positives <= set(ref_index.tolist())
    negatives = [j for j in ref_index.tolist() if j not in positives]
    if negatives:  # the best-scoring negatives, none better left out
        left_out = [j for j in range(num_local) if j not in set(ref_index.tolist())]
        assert not left_out or min(scores[negatives]) > max(scores[left_out])


def test_pfc_head_matches_oracle_on_sampled_classes(monkeypatch):
    """A single-process Partial FC head at ratio 0.1: the sampled columns are pfc_sample's, and
    loss and gradients are the oracle's head on those classes with the remapped labels."""
    num_classes, n, margins = 200, 2 * BATCH, MARGINS["arcface"]
    weight, emb, labels = make_problem(n, num_classes=num_classes, seed=2)
    scores = distinct_scores(num_classes, np.random.default_rng(5))
    monkeypatch.setattr(torch, "rand", FixedRand(scores))
    head = MarginSoftmaxHead(num_classes, EMB, margins, SCALE, DistContext(), mode="pfc",
                             sample_ratio=0.1)
    head.weight.data.copy_(weight)
    emb_t = emb.clone().requires_grad_(True)
    loss = head(emb_t, labels)
    loss.backward()
    index, remapped = oracle.pfc_sample(labels.numpy(), num_classes, head.num_sample,
                                        scores.astype(np.float64))
    np.testing.assert_array_equal(head.index.numpy(), index)
    ref = oracle.head_forward_backward(as64(emb), as64(weight)[index], remapped, margins, SCALE)
    assert float(loss.detach()) == pytest.approx(ref["loss"], rel=LOSS_RTOL)
    assert_rows_close(emb_t.grad, ref["grad_emb"])
    assert_rows_close(head.rows.grad, ref["grad_weight"])


def test_sgd_step_matches_oracle():
    rng = np.random.default_rng(7)
    w0 = rng.standard_normal((5, 3))
    grads = [rng.standard_normal((5, 3)) for _ in range(3)]
    lr, momentum, wd = 0.1, 0.9, 5e-4
    param = torch.nn.Parameter(torch.from_numpy(w0.copy()))
    opt = torch.optim.SGD([param], lr=lr, momentum=momentum, weight_decay=wd)
    w, buf = w0, None
    for g in grads:  # the first step starts the momentum; the later ones use it
        param.grad = torch.from_numpy(g.copy())
        opt.step()
        w, buf = oracle.sgd_momentum_step(w, g, buf, lr, momentum, wd)
        np.testing.assert_allclose(param.detach().numpy(), w, rtol=0, atol=1e-12)
        np.testing.assert_allclose(opt.state[param]["momentum_buffer"].numpy(), buf, rtol=0,
                                   atol=1e-12)
    # A zero buffer is the same as none.
    a = oracle.sgd_momentum_step(w0, grads[0], None, lr, momentum, wd)
    b = oracle.sgd_momentum_step(w0, grads[0], np.zeros_like(w0), lr, momentum, wd)
    np.testing.assert_array_equal(a[0], b[0])
