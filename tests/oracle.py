"""A framework-neutral float64 oracle of the margin-softmax classification head.

Every backend's head (torch here, MXNet and others elsewhere) is checked against these functions,
so this file imports only numpy and the standard library and uses no numpy API newer than 1.23:
the MXNet environment imports it too, without torch.

Conventions, shared by all functions:

- All arithmetic is float64. Inputs are converted with ``np.asarray(x, dtype=np.float64)``; a
  backend computing in float32 is compared after casting its float32 inputs to float64, so both
  sides see the same numbers and only the arithmetic differs.
- Embeddings are ``[N, D]`` (the global batch, every rank's rows in rank order), the class matrix
  is ``[C, D]`` (one row per class, unnormalised), labels are ``[N]`` integers in ``[0, C)``.
- Normalisation is ``x / max(|x|, 1e-12)`` per row (torch's ``F.normalize``).
- The combined margin (m1, m2, m3) turns the target cosine into ``cos(m1 * theta + m2) - m3``:
  ArcFace is (1, 0.5, 0), CosFace (1, 0, 0.4), plain softmax (1, 0, 0). ``scale`` multiplies all
  logits, the margin one included.
- The loss is the mean over the N samples of the cross-entropy of the scaled logits.
- Class shards are balanced: rank r of W holds ``shard_of(C, r, W)``; "local labels" are a
  sample's column within a shard, or -1 when its class lives in another shard.
"""

from __future__ import annotations

import math

import numpy as np

COS_EPS = 1e-6
"""The margin clamps cosines to [-1 + COS_EPS, 1 - COS_EPS] before arccos."""

FP32_COS_EPS = 1.0 - float(np.float32(1.0 - COS_EPS))
"""The clamp a float32 backend really applies: 1 - 1e-6 rounds to 1 - 1.0133e-6 in float32
(-1 + 1e-6 likewise, symmetrically). Pass it as ``cos_eps`` to match a float32 backend exactly in
the clamped band |cos| > 1 - 1e-6; elsewhere the two bounds give identical results."""

NORM_EPS = 1e-12
"""Row norms below this are replaced by it (as torch's F.normalize)."""


def shard_of(total, rank, world_size):
    """``(start, count)`` of rank ``rank``'s balanced shard of ``total`` items over ``world_size``
    ranks: every rank gets ``total // world_size``, and the first ``total % world_size`` ranks one
    more, so shards are contiguous, in rank order, and differ in size by at most one."""
    total, rank, world_size = int(total), int(rank), int(world_size)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size}")
    base, rem = divmod(total, world_size)
    count = base + (1 if rank < rem else 0)
    start = rank * base + min(rank, rem)
    return start, count


def margin_target_logit(cos_t, m1, m2, m3, cos_eps=COS_EPS):
    """Unscaled target logit of target cosines ``cos_t`` (any shape) and its derivative.

    Returns ``(values, dvalue_dcos)``, float64 arrays of the shape of ``cos_t``.

    - m1 == 1 and m2 == 0 (CosFace, plain softmax): ``value = c - m3``, derivative 1, no clamp.
    - otherwise, with ``cc = clip(c, -1 + cos_eps, 1 - cos_eps)``, ``theta = arccos(cc)`` and
      ``theta_max = (pi - m2) / m1``:

      * ``theta <= theta_max``: ``value = cos(m1 * theta + m2) - m3`` and
        ``d value / dc = m1 * sin(m1 * theta + m2) / sqrt(1 - cc**2)`` where
        ``-1 + cos_eps <= c <= 1 - cos_eps``, and 0 outside (the clamp passes no gradient, as in
        torch's clamp backward, whose mask includes the bounds);
      * ``theta > theta_max`` (only reachable when theta_max < pi): the straight continuation
        ``value = c - m3 - (1 + cos(theta_max))``, derivative 1, unclamped ``c``. It meets the
        margin curve at theta_max and keeps falling as theta grows.
    """
    c = np.asarray(cos_t, dtype=np.float64)
    m1, m2, m3 = float(m1), float(m2), float(m3)
    if m1 == 1.0 and m2 == 0.0:
        return c - m3, np.ones_like(c)
    if not 0.0 < cos_eps < 1.0:
        raise ValueError(f"cos_eps {cos_eps} must lie in (0, 1): arccos' slope is infinite at +-1")
    lo, hi = -1.0 + cos_eps, 1.0 - cos_eps
    cc = np.clip(c, lo, hi)
    theta = np.arccos(cc)
    theta_max = (math.pi - m2) / m1
    with_margin = np.cos(m1 * theta + m2) - m3
    d_margin = m1 * np.sin(m1 * theta + m2) / np.sqrt(1.0 - cc * cc)
    d_margin = np.where((c >= lo) & (c <= hi), d_margin, 0.0)
    beyond = c - m3 - (1.0 + math.cos(theta_max))
    inside = theta <= theta_max
    return np.where(inside, with_margin, beyond), np.where(inside, d_margin, 1.0)


def _normalize(x):
    """Rows of ``x`` divided by ``max(|row|, NORM_EPS)``; returns (normalised, clamped norms)."""
    norm = np.maximum(np.sqrt(np.sum(x * x, axis=1)), NORM_EPS)
    return x / norm[:, None], norm


def _normalize_backward(grad_hat, x_hat, norm):
    """d loss / d x from d loss / d x_hat for x_hat = x / n:
    ``(g - (g . x_hat) x_hat) / n`` per row; ``g / NORM_EPS`` where the norm was clamped."""
    radial = np.sum(grad_hat * x_hat, axis=1)
    clamped = norm <= NORM_EPS
    radial = np.where(clamped, 0.0, radial)
    return (grad_hat - radial[:, None] * x_hat) / norm[:, None]


def local_labels_of(labels, start, count):
    """Each label's column in the shard ``[start, start + count)``, or -1 outside it."""
    labels = np.asarray(labels).astype(np.int64)
    local = labels - start
    return np.where((local >= 0) & (local < count), local, -1)


def head_forward_backward(emb, weight, labels, margins, scale, world_size=1, cos_eps=COS_EPS):
    """Loss, logits and analytic gradients of the margin-softmax head on the global batch.

    ``emb`` [N, D], ``weight`` [C, D], ``labels`` [N] in [0, C), ``margins`` (m1, m2, m3).

    Forward::

        e_hat = normalize(emb), w_hat = normalize(weight), cos = e_hat @ w_hat.T      [N, C]
        z = scale * cos, except z[i, y_i] = scale * margin_target_logit(cos[i, y_i])
        loss = mean_i (logsumexp_j z[i, j] - z[i, y_i])

    Backward (``p = softmax(z)`` per row, ``onehot[i, y_i] = 1``)::

        G = d loss / d z = (p - onehot) / N
        H = d loss / d cos = scale * G, with the target entry times d margin / d cos
        d loss / d e_hat = H @ w_hat,  d loss / d w_hat = H.T @ e_hat
        d loss / d x = (g - (g . x_hat) x_hat) / |x| per row, for x = emb and x = weight

    ``shards`` splits the class axis as a sharded (mp) head over ``world_size`` ranks would: for
    rank r with ``(start, count) = shard_of(C, r, world_size)`` it holds ``logits[:, start:start +
    count]``, ``grad_weight[start:start + count]`` and the local labels (each sample's column in
    that shard, -1 when its class is elsewhere). Every rank of a sharded head sees the whole
    gathered batch, so its loss is ``loss`` and its embedding gradient for its own rows
    ``[r * N / W, (r + 1) * N / W)`` is the matching slice of ``grad_emb``.

    Returns a dict: ``loss`` (float), ``logits`` [N, C], ``grad_emb`` [N, D], ``grad_weight``
    [C, D], ``shards`` (list of dicts with ``start``, ``count``, ``logits``, ``grad_weight``,
    ``local_labels``).
    """
    emb = np.asarray(emb, dtype=np.float64)
    weight = np.asarray(weight, dtype=np.float64)
    labels = np.asarray(labels).astype(np.int64)
    n, num_classes = emb.shape[0], weight.shape[0]
    if emb.ndim != 2 or weight.ndim != 2 or emb.shape[1] != weight.shape[1]:
        raise ValueError(f"emb {emb.shape} and weight {weight.shape} do not match")
    if labels.shape != (n,) or labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError("labels must be [N] integers in [0, C)")
    m1, m2, m3 = margins
    scale = float(scale)

    e_hat, e_norm = _normalize(emb)
    w_hat, w_norm = _normalize(weight)
    cos = e_hat @ w_hat.T
    rows = np.arange(n)
    target, d_target = margin_target_logit(cos[rows, labels], m1, m2, m3, cos_eps)
    logits = scale * cos
    logits[rows, labels] = scale * target

    row_max = logits.max(axis=1)
    shifted = np.exp(logits - row_max[:, None])
    row_sum = shifted.sum(axis=1)
    loss = float(np.mean(np.log(row_sum) + row_max - logits[rows, labels]))

    grad_logits = shifted / row_sum[:, None]
    grad_logits[rows, labels] -= 1.0
    grad_logits /= n
    grad_cos = scale * grad_logits
    grad_cos[rows, labels] *= d_target
    grad_emb = _normalize_backward(grad_cos @ w_hat, e_hat, e_norm)
    grad_weight = _normalize_backward(grad_cos.T @ e_hat, w_hat, w_norm)

    shards = []
    for rank in range(int(world_size)):
        start, count = shard_of(num_classes, rank, world_size)
        shards.append(dict(start=start, count=count,
                           logits=logits[:, start:start + count].copy(),
                           grad_weight=grad_weight[start:start + count].copy(),
                           local_labels=local_labels_of(labels, start, count)))
    return dict(loss=loss, logits=logits, grad_emb=grad_emb, grad_weight=grad_weight,
                shards=shards)


def pfc_sample(local_labels, num_local, num_sample, uniform):
    """The Partial FC class sample of one shard, deterministic given the negatives' scores.

    ``local_labels`` [M]: each gathered sample's column in this shard, or -1. ``uniform``
    [num_local]: one score in [0, 1) per column, which a backend draws at random and the caller
    supplies here (they should be distinct, or the cut among negatives is ambiguous).

    Rule: every positive column (one that some local label names) scores 2, the others their
    uniform score; the ``count = max(num_sample, number of distinct positives)`` best-scoring
    columns are kept, i.e. all positives, then negatives by descending score. Returns
    ``(index, remapped)``: ``index`` [count] the kept columns sorted ascending (int64), and
    ``remapped`` [M] each label's position in ``index``, -1 kept as -1.
    """
    labels = np.asarray(local_labels).astype(np.int64).reshape(-1)
    num_local, num_sample = int(num_local), int(num_sample)
    score = np.array(uniform, dtype=np.float64).reshape(-1)
    if score.shape[0] != num_local:
        raise ValueError(f"uniform has {score.shape[0]} scores for {num_local} columns")
    if score.size and not (score.min() >= 0.0 and score.max() < 1.0):
        raise ValueError("uniform scores must lie in [0, 1)")
    if not 1 <= num_sample <= num_local:
        raise ValueError(f"num_sample {num_sample} not in [1, {num_local}]")
    if labels.size and (labels.min() < -1 or labels.max() >= num_local):
        raise ValueError("local labels must lie in [-1, num_local)")
    positives = np.unique(labels[labels >= 0])
    score[positives] = 2.0
    count = max(num_sample, positives.size)
    order = np.argsort(-score, kind="stable")
    index = np.sort(order[:count]).astype(np.int64)
    remapped = np.where(labels >= 0, np.searchsorted(index, np.maximum(labels, 0)), -1)
    return index, remapped.astype(np.int64)


def sgd_momentum_step(weight, grad, buf, lr, momentum, wd):
    """One step of SGD with momentum and weight decay, as every backend's update must equal.

    torch.optim.SGD (dampening 0, no Nesterov)::

        d = grad + wd * weight
        buf = momentum * buf + d          (buf None, the first step: buf = d)
        weight = weight - lr * buf

    MXNet's form ``mom = momentum * mom - lr * d; weight += mom`` is the same update with
    ``mom = -lr * buf`` while lr stays constant. Returns ``(new_weight, new_buf)`` in float64;
    the inputs are not modified.
    """
    weight = np.asarray(weight, dtype=np.float64)
    grad = np.asarray(grad, dtype=np.float64)
    d = grad + float(wd) * weight
    if buf is None:
        new_buf = d
    else:
        new_buf = float(momentum) * np.asarray(buf, dtype=np.float64) + d
    return weight - float(lr) * new_buf, new_buf
