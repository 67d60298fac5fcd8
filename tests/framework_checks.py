"""Checks every framework backend's tests share (main environment: torch and numpy)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import oracle


def randomise_norm_layers(model: nn.Module) -> None:
    """BN and PReLU values away from torch's initial ones (gammas 1, or 0 in ResNet v1b, betas
    0), so that a layout or mapping mix-up in a converted model cannot hide behind them."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                if m.weight.requires_grad:
                    m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
            elif isinstance(m, nn.PReLU):
                m.weight.uniform_(0.1, 0.4)


def check_recorded_sgd_steps(got, count: int, backbone: int, rates, clip: float | None) -> None:
    """A backend recorded, for step i and trainable array j, ``{i}/{j}/before``, ``grad`` and
    ``after``: each step must equal torch's SGD (oracle.sgd_momentum_step, momentum 0.9, weight
    decay 5e-4) at ``rates[i]`` on those gradients, the first ``backbone`` arrays clipped to
    the global norm ``clip`` (the head's never), and the clipping must have acted."""
    bufs: list = [None] * count
    coefs = []
    for i, lr in enumerate(rates):
        grads = [got[f"{i}/{j}/grad"].astype(np.float64) for j in range(count)]
        if clip is not None:
            norm = np.sqrt(sum(float((g * g).sum()) for g in grads[:backbone]))
            coefs.append(min(clip / (norm + 1e-6), 1.0))
            grads = [g * coefs[-1] for g in grads[:backbone]] + grads[backbone:]
        for j in range(count):
            want, bufs[j] = oracle.sgd_momentum_step(got[f"{i}/{j}/before"], grads[j], bufs[j],
                                                     lr, 0.9, 5e-4)
            np.testing.assert_allclose(got[f"{i}/{j}/after"], want, rtol=1e-5,
                                       atol=1e-6 * max(np.abs(want).max(), 1.0),
                                       err_msg=f"step {i} array {j}")
    if clip is not None:
        assert max(coefs) < 1.0  # clipping acted


def close_to_max(got, want, rtol: float = 1e-5, what: str = "") -> None:
    """Same shape, and every entry within ``rtol`` of the largest entry of ``want``."""
    want = np.asarray(want, dtype=np.float64)
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, what
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= rtol, f"{what}: max error {err:.3g} of the largest entry"


def head_inputs(seed: int, n: int, d: int, c: int) -> dict[str, np.ndarray]:
    """Embeddings, an unnormalised class matrix and labels, with one target at cos = 1 (the
    clamped band), one at cos = -1 (past theta_max) and one class shared by two samples."""
    rng = np.random.RandomState(seed)
    emb = rng.randn(n, d).astype(np.float32)
    weight = (rng.randn(c, d) * 0.05).astype(np.float32)
    labels = rng.choice(c, size=n, replace=False)
    labels[3] = labels[2]
    weight[labels[0]] = emb[0] * 0.03
    weight[labels[1]] = -emb[1] * 0.04
    return {"emb": emb, "weight": weight, "labels": labels.astype(np.int64)}


def sample_cases(label_dtype=np.int64) -> dict[str, np.ndarray]:
    """Partial FC sampling cases for a backend's ``sample_classes`` (to save with ``np.savez``):
    shards whose positives are fewer than, more than, and as many as the sample; samples of other
    shards (-1) and repeated positives. ``size`` is what the head samples: the oracle's count,
    ``max(num_sample, positives)``; ``uniform`` ranks the negatives instead of a random draw."""
    rng = np.random.RandomState(3)
    cases = [(np.array([4, -1, 9, 4, -1, 0]), 12, 5),
             (np.array([1, 7, 3, 11, 5, -1, 9, 2]), 12, 3),     # 7 positives > 3 sampled
             (np.array([-1, -1, -1]), 6, 2),                     # no positive here
             (np.array([2, 0, 1, 2]), 4, 3)]                     # positives fill the sample
    out: dict[str, np.ndarray] = {"cases": np.array(len(cases))}
    for i, (labels, num_local, num_sample) in enumerate(cases):
        positives = len(np.unique(labels[labels >= 0]))
        out.update({f"{i}/labels": labels.astype(label_dtype),
                    f"{i}/num_local": np.array(num_local),
                    f"{i}/num_sample": np.array(num_sample),
                    f"{i}/size": np.array(max(num_sample, positives)),
                    f"{i}/uniform": rng.permutation(num_local).astype(np.float32) / num_local})
    return out


def sampled_oracle(emb, weight, labels, ids, margins=(1.0, 0.5, 0.0), scale: float = 64.0):
    """The oracle's head over the classes ``ids`` only (global ids, ascending within each shard,
    shards in rank order): what a sampling pfc head computes, with a float32 backend's clamp."""
    position = {int(c): i for i, c in enumerate(ids)}
    remapped = np.array([position[int(y)] for y in labels])
    return oracle.head_forward_backward(emb, weight[ids], remapped, margins, scale,
                                        cos_eps=oracle.FP32_COS_EPS)


def check_sampling_rule(cases, got, remapped_key: str | None = "remapped") -> None:
    """A backend's ``sample_classes`` on ``sample_cases``: each case's sample is the oracle's
    (every positive kept, negatives by score, sorted), and under ``remapped_key`` each label's
    column in the sample (-1 outside the shard); all positives kept where they outnumber the
    sample."""
    for i in range(int(cases["cases"])):
        index, remapped = oracle.pfc_sample(cases[f"{i}/labels"], cases[f"{i}/num_local"],
                                            cases[f"{i}/num_sample"], cases[f"{i}/uniform"])
        np.testing.assert_array_equal(got[f"{i}/index"], index, err_msg=f"case {i}")
        if remapped_key:
            np.testing.assert_array_equal(got[f"{i}/{remapped_key}"], remapped,
                                          err_msg=f"case {i}")
    assert len(got["1/index"]) == 7  # the positives outnumber the sample: all kept


def sampled_ids_on_two_ranks(inputs, ranks, prefix: str = "pfc", classes: int = 37
                             ) -> list[np.ndarray]:
    """Each of two ranks' pfc samples (``{prefix}/index``, drawn on the scores ``scores<r>``
    of ``inputs``) checked against the oracle's rule; the global class ids of each."""
    ids = []
    for r, got in enumerate(ranks):
        start, count = oracle.shard_of(classes, r, 2)
        local = oracle.local_labels_of(inputs["labels"], start, count)
        index, _ = oracle.pfc_sample(local, count, int(got[f"{prefix}/num_sample"]),
                                     inputs[f"scores{r}"][:count])
        np.testing.assert_array_equal(got[f"{prefix}/index"], index)
        ids.append(start + index)
    return ids


def check_mp_on_two_ranks(inputs, ranks, margins, scale: float, rows: int = 6) -> None:
    """Two ranks' ``mp`` heads on 37 classes against the oracle: each rank's shard logits and
    class-matrix gradient are the oracle's columns and rows, its embedding gradient the
    oracle's rows of its own ``rows`` samples, the loss the global one, in both of two calls;
    and pfc at ratio 1.0 (``pfc1/``) is mp exactly."""
    ref = oracle.head_forward_backward(inputs["emb"], inputs["weight"], inputs["labels"],
                                       margins, scale, world_size=2,
                                       cos_eps=oracle.FP32_COS_EPS)
    assert [int(g["mp/count"]) for g in ranks] == [19, 18]  # uneven shards
    for r, got in enumerate(ranks):
        shard = ref["shards"][r]
        assert int(got["mp/start"]) == shard["start"]
        for call in (1, 2):
            assert abs(float(got[f"mp/loss{call}"]) - ref["loss"]) <= 1e-5 * abs(ref["loss"])
            np.testing.assert_allclose(got[f"mp/logits{call}"], shard["logits"], rtol=0,
                                       atol=1e-4)
            close_to_max(got[f"mp/grad_weight{call}"], shard["grad_weight"])
            close_to_max(got[f"mp/grad_emb{call}"], ref["grad_emb"][r * rows:(r + 1) * rows])
        for key in ("loss", "grad_emb", "grad_weight", "logits"):
            np.testing.assert_array_equal(got[f"pfc1/{key}1"], got[f"mp/{key}1"])


def check_head_equals(got, ref) -> None:
    """A float32 head's loss, logits and both gradients (``got``) against the oracle's
    (``ref``, ``oracle.head_forward_backward``'s)."""
    assert abs(float(got["loss"]) - ref["loss"]) <= 1e-5 * abs(ref["loss"])
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-4)
    close_to_max(got["grad_emb"], ref["grad_emb"], what="grad_emb")
    close_to_max(got["grad_weight"], ref["grad_weight"], what="grad_weight")


def shard_scores(rng: np.random.RandomState, shard: int = 19) -> dict[str, np.ndarray]:
    """Negatives' scores for two ranks' pfc samples (``scores0``, ``scores1``), drawn from
    ``rng``, one per column of a shard of ``shard`` columns (37 classes over 2 ranks: 19 and 18,
    the second reading its first 18)."""
    return {f"scores{r}": (rng.permutation(shard) / shard).astype(np.float32) for r in range(2)}


def pfc_step_inputs() -> dict[str, np.ndarray]:
    """Two pfc steps on one rank of 20 classes (``pfc_in.npz``): the embeddings and class
    matrix, each step's labels (``labels0``, ``labels1``) and each step's negatives' scores."""
    x = head_inputs(11, 6, 8, 20)
    rng = np.random.RandomState(5)
    return {"emb": x["emb"], "weight": x["weight"], "labels0": x["labels"],
            "labels1": rng.choice(20, size=6, replace=False).astype(np.int64),
            "scores0": (rng.permutation(20) / 20).astype(np.float32),
            "scores1": (rng.permutation(20) / 20).astype(np.float32)}
