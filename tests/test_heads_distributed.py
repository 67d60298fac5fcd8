"""mp and pfc heads on several gloo ranks against one process computing the full softmax."""

from __future__ import annotations

import pytest
import torch

from dist_util import run_ranks
from trainperf.backends.layouts import shard_of
from trainperf.backends.torch.dist import DistContext
from trainperf.backends.torch.heads import MarginSoftmaxHead, SampledRowsSGD

NUM_CLASSES = 103  # not divisible by 2 or 4: exercises the uneven shards
EMB = 16
BATCH = 6
MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4)}


def make_problem(world_size: int, labels_in_one_shard: bool, seed: int = 0,
                 num_classes: int = NUM_CLASSES):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_classes, EMB, generator=gen) * 0.01
    emb = torch.randn(world_size * BATCH, EMB, generator=gen)
    if labels_in_one_shard:
        start, count = shard_of(num_classes, world_size - 1, world_size)
        labels = torch.randint(start, start + count, (world_size * BATCH,), generator=gen)
    else:
        labels = torch.randint(0, num_classes, (world_size * BATCH,), generator=gen)
    return weight, emb, labels


def sharded_rank(ctx: DistContext, mode: str, ratio: float, update: str, margins, problem):
    weight, emb, labels = problem
    torch.manual_seed(1234 + ctx.rank)  # the sampler's draws
    head = MarginSoftmaxHead(weight.shape[0], EMB, margins, 64.0, ctx, mode=mode,
                             sample_ratio=ratio, update=update)
    head.weight.data.copy_(weight[head.class_start:head.class_start + head.num_local])
    local_emb = emb[ctx.rank * BATCH:(ctx.rank + 1) * BATCH].clone().requires_grad_(True)
    local_labels = labels[ctx.rank * BATCH:(ctx.rank + 1) * BATCH]
    loss = head(local_emb, local_labels)
    loss.backward()
    w_grad = head.rows.grad if head.sparse else head.weight.grad
    return dict(loss=loss.detach(), emb_grad=local_emb.grad, weight_grad=w_grad,
                start=head.class_start, count=head.num_local, num_sample=head.num_sample,
                index=head.index)


def full_softmax(weight, emb, labels, margins):
    """One process, all classes: the reference."""
    head = MarginSoftmaxHead(weight.shape[0], EMB, margins, 64.0, DistContext(), mode="dp")
    head.weight.data.copy_(weight)
    emb = emb.clone().requires_grad_(True)
    loss = head(emb, labels)
    loss.backward()
    return loss.detach(), emb.grad, head.weight.grad


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def worst_row_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest relative error of any one row (class or sample), each against its own norm."""
    assert a.shape == b.shape
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).max())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("loss_name", ["arcface", "cosface"])
@pytest.mark.parametrize("one_shard", [False, True])
@pytest.mark.parametrize("mode", ["mp", "pfc"])
def test_sharded_equals_full_softmax(world_size, loss_name, one_shard, mode):
    margins = MARGINS[loss_name]
    problem = make_problem(world_size, one_shard)
    results = run_ranks(sharded_rank, world_size, mode, 1.0, "sparse", margins, problem)
    ref_loss, ref_emb_grad, ref_w_grad = full_softmax(*problem, margins)
    for r, res in enumerate(results):
        assert rel_err(res["loss"], ref_loss) < 1e-5
        assert worst_row_rel_err(res["emb_grad"], ref_emb_grad[r * BATCH:(r + 1) * BATCH]) < 1e-5
        shard = ref_w_grad[res["start"]:res["start"] + res["count"]]
        assert worst_row_rel_err(res["weight_grad"], shard) < 1e-5
    counts = [res["count"] for res in results]
    assert sum(counts) == NUM_CLASSES and max(counts) - min(counts) <= 1
    assert counts == sorted(counts, reverse=True)  # the first ranks take the remainder


@pytest.mark.parametrize("update", ["sparse", "dense"])
def test_partial_fc_samples_and_matches_restricted_softmax(update):
    """Enough classes that each shard's sampled slots (50) hold far more than its positives
    (at most 12), so random negatives are drawn and enter the softmax."""
    world_size, margins = 2, MARGINS["arcface"]
    weight, emb, labels = make_problem(world_size, False, seed=3, num_classes=1001)
    results = run_ranks(sharded_rank, world_size, "pfc", 0.1, update, margins,
                        (weight, emb, labels))
    sampled_global = []
    for res in results:
        index = res["index"]
        assert index.numel() == res["num_sample"] == int(0.1 * res["count"])
        in_shard = labels[(labels >= res["start"]) & (labels < res["start"] + res["count"])]
        positives = set((in_shard - res["start"]).tolist())
        assert positives <= set(index.tolist()), "a positive class was not sampled"
        assert len(set(index.tolist())) == index.numel()
        negatives = set(index.tolist()) - positives
        assert len(negatives) >= res["num_sample"] - world_size * BATCH > 0
        sampled_global.append(index + res["start"])
    classes = torch.cat(sampled_global)
    # Full softmax restricted to the sampled classes, labels renumbered into that set.
    remap = {int(c): i for i, c in enumerate(classes)}
    sub_labels = torch.tensor([remap[int(y)] for y in labels])
    ref_loss, ref_emb_grad, ref_w_grad = full_softmax(weight[classes], emb, sub_labels, margins)
    offset = 0
    for r, res in enumerate(results):
        n = res["index"].numel()
        assert rel_err(res["loss"], ref_loss) < 1e-5
        assert worst_row_rel_err(res["emb_grad"], ref_emb_grad[r * BATCH:(r + 1) * BATCH]) < 1e-5
        w_grad = res["weight_grad"]
        if update == "dense":  # a gradient over the whole shard, zero off the sampled rows
            assert w_grad.shape[0] == res["count"]
            mask = torch.ones(res["count"], dtype=torch.bool)
            mask[res["index"]] = False
            assert torch.count_nonzero(w_grad[mask]) == 0
            w_grad = w_grad[res["index"]]
        assert worst_row_rel_err(w_grad, ref_w_grad[offset:offset + n]) < 1e-5
        offset += n


def test_many_positives_all_kept():
    """More positives in a shard than sampling slots: all of them are kept, nothing else."""
    torch.manual_seed(0)
    head = MarginSoftmaxHead(200, EMB, MARGINS["arcface"], 64.0, DistContext(), mode="pfc",
                             sample_ratio=0.05)  # 10 slots
    labels = torch.arange(0, 40, 2)  # 20 distinct positives
    head(torch.randn(20, EMB), labels)
    assert head.index.tolist() == labels.tolist()


def test_sparse_update_touches_only_sampled_rows():
    torch.manual_seed(0)
    head = MarginSoftmaxHead(500, EMB, MARGINS["arcface"], 64.0, DistContext(), mode="pfc",
                             sample_ratio=0.1)
    opt = SampledRowsSGD(head, lr=0.1, momentum=0.9, weight_decay=5e-4)
    before = head.weight.clone()
    momentum_seen = torch.zeros_like(before)
    for _ in range(3):
        labels = torch.randint(0, 500, (8,))
        opt.zero_grad()
        head(torch.randn(8, EMB), labels).backward()
        index, rows, grad = head.index, head.rows.detach().clone(), head.rows.grad.clone()
        snapshot = head.weight.clone()
        opt.step()
        untouched = torch.ones(500, dtype=torch.bool)
        untouched[index] = False
        assert torch.equal(head.weight[untouched], snapshot[untouched])
        # torch.optim.SGD's rule, applied per sampled row with that row's own momentum.
        momentum_seen[index] = 0.9 * momentum_seen[index] + grad + 5e-4 * rows
        assert torch.allclose(head.weight[index], rows - 0.1 * momentum_seen[index], atol=1e-7)
        assert torch.allclose(head.momentum_rows, momentum_seen, atol=1e-7)
    assert not torch.equal(before, head.weight)
