"""Mixed precision with sharded heads: every rank and every optimizer takes one skip decision.

In mp and pfc each rank holds its own shard of the class matrix, so only the agreed fp16
overflow check keeps the replicated backbone, the loss scale and the skipped steps equal on all
ranks; an overflow injected on one rank's shard must make every rank skip that step.
"""

from __future__ import annotations

import pytest
import torch

from dist_util import run_ranks
from test_step import cpu_precisions
from trainperf.backends.torch.data import synthetic_batch
from trainperf.backends.torch.dist import DistContext
from trainperf.backends.torch.loss_scale import DynamicLossScaler
from trainperf.backends.torch.step import TrainStep
from trainperf.config import Workload
from trainperf.recipes import get_recipe

WORLD = 2
STEPS = 14
OVERFLOW_STEP = 9  # after fp16 has backed off from 2**16 to a scale it can keep
OVERFLOW_RANK = 1
AMP_PRECISIONS = [p for p in ("fp16", "bf16") if p in cpu_precisions()]
FP16 = pytest.mark.skipif("fp16" not in AMP_PRECISIONS,
                          reason="fp16 autocast does not run on this CPU build of torch")


def small(fc: str, precision: str) -> Workload:
    # A 32-pixel batch of 4 keeps a 2-rank run to a few seconds on two cores.
    return get_recipe("tiny-arcface").workload.replace(
        fc=fc, sample_ratio=0.2 if fc == "pfc" else 1.0, pfc_update="sparse",
        precision=precision, num_classes=40, batch_size=4, input_size=32)


def head_grad_param(step: TrainStep) -> torch.nn.Parameter:
    # The Parameter object stays the same across steps even though sparse pfc swaps its .data.
    head = step.head
    return head.rows if head.sparse else head.weight


def head_shard(step: TrainStep) -> list[torch.Tensor]:
    head = step.head
    return [head.weight, head.momentum_rows] if head.sparse else [head.weight]


def snapshot(step: TrainStep) -> dict:
    return dict(backbone=[p.detach().clone() for p in step.backbone.parameters()],
                shard=[t.detach().clone() for t in head_shard(step)])


def grads_finite(step: TrainStep) -> bool:
    return all(p.grad is None or bool(torch.isfinite(p.grad).all())
               for opt in step.optimizers for group in opt.param_groups for p in group["params"])


def inject_overflow(step: TrainStep, at_step: int) -> None:
    """From inside backward, make this rank's head gradient inf at ``at_step`` only."""
    def to_inf(grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, float("inf")) if step.step_index == at_step else grad
    head_grad_param(step).register_hook(to_inf)


def train(ctx: DistContext, workload: Workload, steps: int, overflow_step: int | None = None):
    """Train on this rank's fixed batch; optionally overflow rank OVERFLOW_RANK's head gradient
    at ``overflow_step`` and record the state around it."""
    step = TrainStep(workload, ctx)
    images, labels = synthetic_batch(workload, ctx)
    if overflow_step is not None and ctx.rank == OVERFLOW_RANK:
        inject_overflow(step, overflow_step)
    losses, scales, around = [], [], {}
    for i in range(steps):
        if i == overflow_step:
            around["before"] = snapshot(step)
        losses.append(step(images, labels))
        scales.append(step.loss_scale)  # a sync per step: fine outside a measured window
        if i == overflow_step:
            around["after"] = snapshot(step)
            around["grads_finite"] = grads_finite(step)
    return dict(losses=torch.stack(losses), scales=scales, skipped=list(step.skipped_steps),
                final=snapshot(step), around=around)


def assert_same_tensors(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def assert_ranks_agree(results: list[dict], same_loss: bool = True) -> None:
    # Bitwise: each rank applies the same all-reduced backbone gradient with the same optimizer,
    # and the sharded loss is built from the same all-reduced row statistics on every rank.
    first = results[0]
    for other in results[1:]:
        if same_loss:
            assert torch.equal(other["losses"], first["losses"])
        assert other["scales"] == first["scales"]
        assert other["skipped"] == first["skipped"]
        assert_same_tensors(other["final"]["backbone"], first["final"]["backbone"])


LOCKSTEP_CASES = [(fc, p) for p in AMP_PRECISIONS for fc in ("mp", "pfc")]
if "fp16" in AMP_PRECISIONS:
    LOCKSTEP_CASES.append(("dp", "fp16"))  # one code path: the flag's all-reduce runs in dp too


@pytest.mark.parametrize("fc,precision", LOCKSTEP_CASES)
def test_ranks_train_in_lockstep(fc, precision):
    results = run_ranks(train, WORLD, small(fc, precision), STEPS)
    # dp: each rank's loss is the mean over its own batch only.
    assert_ranks_agree(results, same_loss=fc != "dp")
    res = results[0]
    losses = res["losses"]
    assert torch.isfinite(losses).all()
    assert losses[-3:].mean() < 0.5 * losses[0]
    if precision == "fp16":
        assert res["skipped"], "fp16 backs off from 2**16 with a few skipped steps"
    else:
        assert res["skipped"] == [] and res["scales"] == [None] * STEPS


@FP16
@pytest.mark.parametrize("fc", ["mp", "pfc"])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(fc):
    k = OVERFLOW_STEP
    results = run_ranks(train, WORLD, small(fc, "fp16"), STEPS, k)
    assert_ranks_agree(results)
    for rank, res in enumerate(results):
        around = res["around"]
        # Only the injected rank saw an inf: the others skip because they agreed to.
        assert around["grads_finite"] == (rank != OVERFLOW_RANK)
        assert k in res["skipped"] and k - 1 not in res["skipped"]
        assert res["scales"][k] == res["scales"][k - 1] / 2
        assert_same_tensors(around["after"]["backbone"], around["before"]["backbone"])
        assert_same_tensors(around["after"]["shard"], around["before"]["shard"])
        # Training goes on: the following steps are taken and move the backbone.
        assert not any(s > k for s in res["skipped"])
        assert any(not torch.equal(a, b) for a, b in
                   zip(res["final"]["backbone"], around["after"]["backbone"]))
        assert res["losses"][-1] < 0.5 * res["losses"][0]


@pytest.fixture
def one_thread():
    # Tensors this small gain nothing from a second thread, and on a busy two-core machine
    # its spin-waits make each step tens of times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@FP16
@pytest.mark.usefixtures("one_thread")
def test_overflow_in_sampled_rows_skips_the_backbone_optimizer_too():
    """One process, sparse pfc: an inf in the rows' optimizer stops the backbone's as well."""
    k = 8  # a step this run takes when nothing is injected (fp16 backs off over steps 0-7)
    step = TrainStep(small("pfc", "fp16"), DistContext())
    images, labels = synthetic_batch(step.workload, DistContext())
    inject_overflow(step, k)
    for _ in range(k):
        step(images, labels)
    before = snapshot(step)
    scale = step.loss_scale
    step(images, labels)
    after = snapshot(step)
    # The backbone's own gradients were finite: only the rows' inf can have stopped its step.
    assert all(bool(torch.isfinite(p.grad).all()) for p in step.clip_params)
    assert k in step.skipped_steps and step.loss_scale == scale / 2
    assert_same_tensors(after["backbone"], before["backbone"])
    assert_same_tensors(after["shard"], before["shard"])


def scaled_backward(scaler: DynamicLossScaler, param: torch.nn.Parameter) -> None:
    param.grad = None
    scaler.scale_loss((3.0 * param).sum()).backward()


def test_scaler_grows_after_clean_interval_and_backs_off_on_overflow():
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = DynamicLossScaler(DistContext(), init_scale=8.0, growth_interval=3)
    assert scaler.current_scale() == 8.0

    def clean_step() -> None:
        scaled_backward(scaler, param)
        scaler.unscale_and_check_([opt])
        assert torch.equal(param.grad, torch.full((4,), 3.0))  # unscaled exactly
        assert scaler.should_step()
        opt.step()
        scaler.update()

    for _ in range(2):
        clean_step()
    assert scaler.current_scale() == 8.0
    clean_step()
    assert scaler.current_scale() == 16.0  # x2 after growth_interval clean steps

    scaled_backward(scaler, param)
    param.grad[1] = float("inf")
    scaler.unscale_and_check_([opt])
    assert not scaler.should_step()
    scaler.update()
    assert scaler.current_scale() == 8.0  # x0.5 on overflow
    for _ in range(2):  # the overflow restarted the clean-step count
        clean_step()
    assert scaler.current_scale() == 8.0
    clean_step()
    assert scaler.current_scale() == 16.0


def test_scaler_check_spans_every_optimizer():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opts = [torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)]
    scaler = DynamicLossScaler(DistContext())
    scaler.scale_loss((a * b).sum()).backward()
    b.grad[0] = float("nan")
    scaler.unscale_and_check_(opts)
    assert not scaler.should_step()
    assert torch.equal(a.grad, torch.ones(2))  # the clean optimizer's gradient is unscaled too
    scaler.update()
    assert scaler.current_scale() == 2.0 ** 15
