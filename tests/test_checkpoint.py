"""Checkpoints: a save on 2 ranks resumes on 1 and on 4 with the same model, and a save that
dies half-way leaves the last good checkpoint."""

from __future__ import annotations

import pytest
import torch

from dist_util import run_ranks
from trainperf.backends.torch import checkpoint
from trainperf.backends.torch.dist import DistContext, all_gather
from trainperf.backends.torch.step import TrainStep
from trainperf.config import Workload

# 37 classes: uneven shards on 2 and on 4 ranks, so rows move between files on load.
WORKLOAD = Workload(backbone="iresnet_tiny", num_classes=37, batch_size=4, embedding_size=16,
                    input_size=16, fc="pfc", sample_ratio=0.5, dropout=0.0)
GLOBAL_BATCH = 8


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=gen),
            torch.randint(0, WORKLOAD.num_classes, (GLOBAL_BATCH,), generator=gen))


def my_rows(ctx: DistContext, images: torch.Tensor, labels: torch.Tensor):
    per = GLOBAL_BATCH // ctx.world_size
    return images[ctx.rank * per:(ctx.rank + 1) * per], labels[ctx.rank * per:(ctx.rank + 1) * per]


def eval_loss(step: TrainStep, ctx: DistContext) -> float:
    """The loss of the whole model on the global batch: eval mode (running BatchNorm
    statistics, every class), so it depends on the weights alone, not on how many ranks."""
    step.model.eval()
    with torch.no_grad():
        loss = step.forward_loss(*my_rows(ctx, *global_batch()))
    step.model.train()
    return float(loss)


def full_state(step: TrainStep, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The class matrix and its row momentum over all ranks, in class order, and the
    backbone's momentum."""
    head = step.head
    pad = WORKLOAD.num_classes // ctx.world_size + 1  # all_gather wants equal shapes

    def gather(t: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(pad, t.shape[1])
        padded[:t.shape[0]] = t
        counts = all_gather(torch.tensor([t.shape[0]]), ctx).tolist()
        parts = all_gather(padded, ctx).split(pad)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    momentum = {n: s["momentum_buffer"].clone() for n, p in step.backbone.named_parameters()
                for s in [step.optimizers[0].state.get(p, {})] if "momentum_buffer" in s}
    return {"weight": gather(head.weight), "momentum_rows": gather(head.momentum_rows),
            **{f"backbone_momentum/{k}": v for k, v in momentum.items()}}


def train_and_save(ctx: DistContext, root: str) -> dict:
    torch.manual_seed(0)
    step = TrainStep(WORKLOAD, ctx)
    images, labels = global_batch()
    for i in range(3):
        torch.manual_seed(100 + i * 10 + ctx.rank)  # the sampler's draws
        step(*my_rows(ctx, images + 0.1 * i, labels))
    checkpoint.save(root, step, ctx, {"step": step.step_index, "samples": 24})
    state = full_state(step, ctx)
    # Loaded back on the same ranks: the loss every world size must give. (Ranks keep their
    # own BatchNorm running statistics while training and a checkpoint holds rank 0's, so the
    # loaded model, not the one still running, is the reference.)
    fresh = TrainStep(WORKLOAD, ctx)
    checkpoint.load(checkpoint.step_dirs(root)[-1], fresh, ctx)
    return {"loss": eval_loss(fresh, ctx), **state}


def load_and_check(ctx: DistContext, root: str, again: str) -> dict:
    step = TrainStep(WORKLOAD, ctx)
    progress = checkpoint.load(checkpoint.step_dirs(root)[-1], step, ctx)
    out = {"loss": eval_loss(step, ctx), "progress": progress, "step_index": step.step_index,
           **full_state(step, ctx)}
    checkpoint.save(again, step, ctx, progress)
    return out


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt2"))
    return root, run_ranks(train_and_save, 2, root)


@pytest.mark.parametrize("world", [1, 4])
def test_two_rank_checkpoint_resumes_on_other_world_sizes(saved_on_two, world, tmp_path):
    root, saved = saved_on_two
    if world == 1:
        loaded = [load_and_check(DistContext(), root, str(tmp_path))]
    else:
        loaded = run_ranks(load_and_check, world, root, str(tmp_path))
    for rank in loaded:
        assert rank["loss"] == pytest.approx(saved[0]["loss"], rel=1e-6)
        assert rank["progress"] == {"step": 3, "samples": 24}
        assert rank["step_index"] == 3  # the learning-rate schedule goes on from step 3
    state = loaded[0]
    for key, value in saved[0].items():
        if key != "loss":
            assert torch.equal(state[key], value), key
    assert state["momentum_rows"].abs().sum() > 0  # sampled rows did get momentum
    # Saved again from the new world size: the same class matrix, file by file content.
    manifest = checkpoint.read_manifest(checkpoint.step_dirs(tmp_path)[-1])
    assert manifest["world_size"] == world
    assert [c["end"] - c["first"] for c in manifest["classes"]] == (
        [37] if world == 1 else [10, 9, 9, 9])


def test_loss_scale_and_mode_change_round_trip(tmp_path):
    ctx = DistContext()
    fp16 = WORKLOAD.replace(precision="fp16", fc="mp", sample_ratio=1.0)
    step = TrainStep(fp16, ctx)
    step.scaler._scale.fill_(1024.0)
    step.scaler._clean_steps.fill_(7)
    with torch.no_grad():
        step.head.weight.normal_()
    step.optimizers[0].state[step.head.weight]["momentum_buffer"] = torch.ones(37, 16)
    checkpoint.save(tmp_path, step, ctx, {"step": 9})
    # Back as sparse Partial FC: the head's SGD momentum becomes its per-row momentum.
    other = TrainStep(WORKLOAD.replace(precision="fp16"), ctx)
    checkpoint.load(checkpoint.resolve(tmp_path), other, ctx)
    assert other.scaler.current_scale() == 1024.0 and int(other.scaler._clean_steps) == 7
    assert torch.equal(other.head.weight, step.head.weight)
    assert torch.equal(other.head.momentum_rows, torch.ones(37, 16))


def test_a_save_that_dies_leaves_the_last_good_checkpoint(tmp_path, monkeypatch):
    ctx = DistContext()
    step = TrainStep(WORKLOAD, ctx)
    good = checkpoint.save(tmp_path, step, ctx, {"step": 1})
    real_save = torch.save

    def dies_on_backbone(obj, path, *args, **kwargs):
        if str(path).endswith("backbone.pt"):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", dies_on_backbone)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, step, ctx, {"step": 2})
    monkeypatch.undo()
    assert checkpoint.step_dirs(tmp_path) == [good]
    assert (tmp_path / "step-00000002.partial").exists()  # ignored, cleared by the next save
    assert checkpoint.resolve(tmp_path) == good
    checkpoint.save(tmp_path, step, ctx, {"step": 2})
    checkpoint.save(tmp_path, step, ctx, {"step": 3}, keep=2)
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step-00000002", "step-00000003"]
    assert not (tmp_path / "step-00000002.partial").exists()


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    ctx = DistContext()
    checkpoint.save(tmp_path, TrainStep(WORKLOAD, ctx), ctx, {"step": 1})
    other = TrainStep(WORKLOAD.replace(num_classes=40), ctx)
    with pytest.raises(checkpoint.CheckpointError, match="num_classes 37 here 40"):
        checkpoint.load(checkpoint.resolve(tmp_path), other, ctx)
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint"):
        checkpoint.resolve(tmp_path / "nothing")
