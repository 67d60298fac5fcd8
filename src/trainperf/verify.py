"""insightface's 10-fold face verification protocol, without any deep-learning framework, on the
``.bin`` sets that ``trainperf.data.binset`` reads.

Evaluation follows insightface's ``verification.py``: L2-normalised embeddings, squared
Euclidean distance per pair, thresholds 0, 0.01, ..., 3.99, K contiguous folds; accuracy at the
threshold chosen on the other folds, and TAR at the threshold where the other folds' FAR
reaches a target (1e-3 by default).
"""

from __future__ import annotations

from typing import Any

import numpy as np

THRESHOLDS = np.arange(0, 4, 0.01)
"""insightface's grid; squared distances of unit vectors lie in [0, 4]."""


class _Counts:
    """Per-threshold, per-fold counts of accepted pairs (distance < threshold), split into
    same and different pairs, so that any fold's or training set's rates are a subtraction."""

    def __init__(self, dist: np.ndarray, issame: np.ndarray, fold_of: np.ndarray,
                 folds: int) -> None:
        onehot = np.zeros((len(dist), folds))
        onehot[np.arange(len(dist)), fold_of] = 1.0
        accept = (dist[None, :] < THRESHOLDS[:, None]).astype(np.float64)  # [T, N]
        # float matmul is exact for counts this small and far faster than integer matmul
        self.true_accepts = (accept * issame) @ onehot  # [T, K]
        self.false_accepts = (accept * ~issame) @ onehot
        self.same = issame.astype(np.float64) @ onehot  # [K]
        self.diff = (~issame).astype(np.float64) @ onehot


def _ratio(num: np.ndarray | float, den: float) -> np.ndarray | float:
    # insightface's convention: a rate over no pairs is 0
    return num / den if den else num * 0.0


def _threshold_at_far(far: np.ndarray, target: float) -> float:
    """The threshold where the (non-decreasing) training FAR curve reaches ``target``.

    insightface interpolates with scipy's ``interp1d(far, thresholds, kind="slinear")``. FAR is
    a step function of the threshold, so it repeats values, and scipy >= 1.9 refuses those
    (insightface issue #2152); older scipy built a linear B-spline with repeated knots, which
    interpolates between the last threshold of the lower FAR value and the first of the higher,
    and at a repeated value equal to the target gives the last threshold with it. This is that
    rule, written out.
    """
    lo = int(np.searchsorted(far, target, side="right")) - 1  # last threshold with FAR <= target
    if far[lo] == target:  # also where the target is the curve's top, with no step after it
        return float(THRESHOLDS[lo])
    hi = lo + 1  # exists: the caller checked max(far) >= target
    share = (target - far[lo]) / (far[hi] - far[lo])
    return float(THRESHOLDS[lo] + share * (THRESHOLDS[hi] - THRESHOLDS[lo]))


def _fold_index(pairs: int, folds: int) -> np.ndarray:
    # contiguous, the first pairs % folds folds one pair longer: sklearn's KFold(shuffle=False)
    sizes = np.full(folds, pairs // folds)
    sizes[:pairs % folds] += 1
    return np.repeat(np.arange(folds), sizes)


def _check(embeddings: Any, issame: Any, folds: int, far_target: float
           ) -> tuple[np.ndarray, np.ndarray]:
    emb = np.asarray(embeddings, dtype=np.float64)
    same = np.asarray(issame)
    if same.ndim != 1 or same.dtype != bool:
        raise ValueError(f"issame must be a 1-D bool array, got {same.dtype} of shape "
                         f"{same.shape}")
    if emb.ndim != 2 or emb.shape[0] != 2 * len(same) or emb.shape[1] < 1:
        raise ValueError(f"embeddings must be [2N, D] = [{2 * len(same)}, D] for "
                         f"{len(same)} pairs, got shape {emb.shape}")
    if not np.isfinite(emb).all():
        raise ValueError("embeddings hold NaN or infinite values")
    if folds < 2:
        raise ValueError(f"folds must be at least 2, got {folds}")
    if len(same) < folds:
        raise ValueError(f"{len(same)} pairs cannot fill {folds} folds")
    if same.all() or not same.any():
        raise ValueError("issame must hold both same and different pairs")
    if not 0 < far_target <= 1:
        raise ValueError(f"far_target must be in (0, 1], got {far_target}")
    return emb, same


def evaluate(embeddings: np.ndarray, issame: np.ndarray, folds: int = 10,
             far_target: float = 1e-3) -> dict:
    """insightface's verification protocol over ``embeddings`` [2N, D] (each row already the
    sum of an image's and its mirror image's embedding) and ``issame`` [N].

    Returns ``pairs``, ``folds``, ``accuracy`` and ``accuracy_std`` (over folds, as fractions),
    ``best_thresholds`` (per fold), ``tar``, ``tar_std`` and ``far`` (test-fold means at the
    threshold where the training folds' FAR is ``far_target``) and ``far_target``.
    """
    emb, same = _check(embeddings, issame, folds, far_target)
    norm = np.linalg.norm(emb, axis=1, keepdims=True)
    emb = emb / np.where(norm > 0, norm, 1.0)  # a zero row stays zero, as sklearn's normalize
    dist = ((emb[0::2] - emb[1::2]) ** 2).sum(1)
    fold_of = _fold_index(len(same), folds)
    counts = _Counts(dist, same, fold_of, folds)
    size = np.bincount(fold_of, minlength=folds).astype(np.float64)
    correct = counts.true_accepts + (counts.diff - counts.false_accepts)  # [T, K]
    total_correct, total_diff = correct.sum(1), counts.diff.sum()
    total_fa = counts.false_accepts.sum(1)
    accuracy, best, tar, far = [], [], [], []
    for k in range(folds):
        test = fold_of == k
        train_acc = (total_correct - correct[:, k]) / (len(same) - size[k])
        at = int(np.argmax(train_acc))  # ties: the lowest threshold
        best.append(float(THRESHOLDS[at]))
        accuracy.append(correct[at, k] / size[k])

        train_far = _ratio(total_fa - counts.false_accepts[:, k],
                           total_diff - counts.diff[k])
        threshold = (_threshold_at_far(train_far, far_target)
                     if train_far.max() >= far_target else 0.0)
        accept = dist[test] < threshold
        tar.append(_ratio(float((accept & same[test]).sum()), counts.same[k]))
        far.append(_ratio(float((accept & ~same[test]).sum()), counts.diff[k]))
    return {"pairs": len(same), "folds": folds,
            "accuracy": float(np.mean(accuracy)), "accuracy_std": float(np.std(accuracy)),
            "best_thresholds": best, "tar": float(np.mean(tar)), "tar_std": float(np.std(tar)),
            "far": float(np.mean(far)), "far_target": far_target}


def format_table(results: dict[str, dict]) -> str:
    """A markdown table of ``evaluate`` results by set name: accuracy and TAR in percent."""
    targets = {r["far_target"] for r in results.values()}
    one_target = len(targets) == 1
    tar_head = f"TAR @ FAR={targets.pop():g}" if one_target else "TAR @ FAR"
    lines = [f"| set | pairs | accuracy (%) | {tar_head} (%) |", "|---|---:|---:|---:|"]
    for name, r in results.items():
        tar = f"{100 * r['tar']:.2f} ± {100 * r['tar_std']:.2f}"
        if not one_target:
            tar += f" @ {r['far_target']:g}"
        lines.append(f"| {name} | {r['pairs']} | {100 * r['accuracy']:.2f} ± "
                     f"{100 * r['accuracy_std']:.2f} | {tar} |")
    return "\n".join(lines)
