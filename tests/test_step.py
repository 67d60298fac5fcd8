"""The training step: data-parallel and model-parallel steps equal one big single-process step,
and the loss falls in every head mode and precision the CPU runs."""

from __future__ import annotations

import pytest
import torch

from dist_util import run_ranks
from trainperf.backends.torch.data import synthetic_batch
from trainperf.backends.torch.dist import DistContext
from trainperf.backends.torch.step import TrainStep
from trainperf.config import Workload
from trainperf.recipes import RECIPES, get_recipe

BATCH = 4
WORLD = 2


def tiny(**changes) -> Workload:
    return get_recipe("tiny-arcface").workload.replace(num_classes=50, **changes)


def global_batch(workload: Workload, world: int):
    gen = torch.Generator().manual_seed(42)
    images = torch.randn(world * BATCH, 3, 112, 112, generator=gen)
    labels = torch.randint(0, workload.num_classes, (world * BATCH,), generator=gen)
    return images, labels


def prepared(step: TrainStep) -> TrainStep:
    # Per-rank BatchNorm statistics differ from whole-batch ones by design (no SyncBN, as in
    # InsightFace); eval-mode BN makes the comparison about gradients and updates only.
    step.model.eval()
    # Shards are initialised per rank; give every layout the same class matrix.
    full = torch.randn(step.workload.num_classes, step.workload.embedding_size,
                       generator=torch.Generator().manual_seed(5)) * 0.01
    head = step.head
    head.weight.data.copy_(full[head.class_start:head.class_start + head.num_local])
    return step


def ranks_train(ctx: DistContext, workload: Workload, steps: int):
    step = prepared(TrainStep(workload.replace(batch_size=BATCH), ctx))
    images, labels = global_batch(workload, ctx.world_size)
    sl = slice(ctx.rank * BATCH, (ctx.rank + 1) * BATCH)
    losses = [step(images[sl], labels[sl]) for _ in range(steps)]
    return dict(losses=torch.stack(losses), params=[p.detach().clone() for p in
                                                    step.backbone.parameters()])


def single_train(workload: Workload, steps: int):
    step = prepared(TrainStep(workload.replace(batch_size=WORLD * BATCH), DistContext()))
    images, labels = global_batch(workload, WORLD)
    losses = [step(images, labels) for _ in range(steps)]
    return dict(losses=torch.stack(losses), params=[p.detach().clone() for p in
                                                    step.backbone.parameters()])


@pytest.mark.parametrize("fc", ["dp", "mp"])
def test_parallel_step_equals_single_process_big_batch(fc):
    """dp: N ranks x batch B == one process x batch N*B. mp: the same for the backbone, since its
    gradients are summed partials of one global loss (the head is checked in test_heads_*)."""
    workload = tiny(fc=fc)
    results = run_ranks(ranks_train, WORLD, workload, 2)
    ref = single_train(workload.replace(fc="dp"), 2)
    for res in results:
        if fc == "mp":  # the sharded loss is the global mean on every rank
            assert torch.allclose(res["losses"], ref["losses"], rtol=1e-5)
        for p, q in zip(res["params"], ref["params"]):
            assert torch.allclose(p, q, rtol=1e-4, atol=1e-6)
    if fc == "dp":  # each rank's loss is its own half; their mean is the big batch's loss
        mean = (results[0]["losses"] + results[1]["losses"]) / 2
        assert torch.allclose(mean, ref["losses"], rtol=1e-5)


def cpu_precisions() -> list[str]:
    out = ["fp32"]
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            with torch.autocast("cpu", dtype=dtype):
                torch.nn.functional.linear(torch.randn(2, 2), torch.randn(2, 2))
            out.append(name)
        except RuntimeError:
            pass
    return out


HEADS = [("dp", 1.0, "sparse"), ("mp", 1.0, "sparse"), ("pfc", 0.2, "sparse"),
         ("pfc", 0.2, "dense")]
# Half precision through the plain head and the sampling one with its own update; mp on one
# rank and the dense update run the same autocast and loss-scaling code as those two (fp16 is
# emulated on a CPU: these cases took 10-30 s each).
LOSS_FALLS = [(*head, p) for p in cpu_precisions() for head in HEADS
              if p == "fp32" or head in (HEADS[0], HEADS[2])]


@pytest.mark.parametrize("fc,ratio,update,precision", LOSS_FALLS)
def test_loss_falls(fc, ratio, update, precision):
    torch.manual_seed(0)
    workload = get_recipe("tiny-arcface").workload.replace(
        fc=fc, sample_ratio=ratio, pfc_update=update, precision=precision, num_classes=200)
    ctx = DistContext()
    step = TrainStep(workload, ctx)
    images, labels = synthetic_batch(workload, ctx)  # one fixed batch: learnable by memorising
    losses = torch.stack([step(images, labels) for _ in range(20)])
    assert torch.isfinite(losses).all()
    # fp16 skips its first steps while the loss scale backs off from 2**16.
    assert losses[-3:].mean() < 0.5 * losses[0]
    assert step.pfc_update == ("full" if ratio == 1.0 else update)


def test_classification_step_learns():
    torch.manual_seed(0)
    workload = Workload(backbone="resnet_v1b_tiny", task="classification", num_classes=10,
                        batch_size=8, input_size=64, loss="softmax", clip_grad_norm=None)
    step = TrainStep(workload, DistContext())
    images, labels = synthetic_batch(workload, DistContext())
    losses = torch.stack([step(images, labels) for _ in range(25)])
    assert losses[-3:].mean() < 0.5 * losses[0]


def test_synthetic_data_is_random_and_per_rank():
    workload = tiny()
    a_img, a_lab = synthetic_batch(workload, DistContext(rank=0))
    b_img, _ = synthetic_batch(workload, DistContext(rank=1))
    again, _ = synthetic_batch(workload, DistContext(rank=0))
    assert a_img.std() > 0.5 and not torch.equal(a_img, b_img) and torch.equal(a_img, again)
    assert a_lab.min() >= 0 and a_lab.max() < workload.num_classes


def test_lr_schedule_by_steps():
    w = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=2, lr=0.1,
                 lr_steps=(10, 20), lr_scales=(0.1, 0.01))
    assert [w.lr_at(s) for s in (0, 9, 10, 19, 20, 99)] == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


def test_recipes_are_valid_and_use_their_backbones():
    from trainperf.backends.torch.backbones import get_spec
    for recipe in RECIPES.values():
        assert get_spec(recipe.workload.backbone).task == recipe.workload.task


def test_workload_rejects_bad_settings():
    with pytest.raises(ValueError, match="--fc"):
        tiny(fc="zz")
    with pytest.raises(ValueError, match="sample-ratio"):
        tiny(fc="mp", sample_ratio=0.5)
    with pytest.raises(ValueError, match="precision"):
        tiny(precision="fp8")
