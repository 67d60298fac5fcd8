"""Checkpoints that any number of ranks can resume from.

A checkpoint is a folder ``step-00001200/`` under the run's checkpoint folder:

- ``manifest.json``: the format, the workload, the training progress (step, samples, training
  seconds, the accuracy curve so far) and the class-matrix files with the class range each
  holds.
- ``backbone.pt``: rank 0's backbone (parameters and BatchNorm buffers), its SGD momentum by
  parameter name, and the fp16 loss scale.
- ``classes-<first>-<end>.pt``: the rows ``[first, end)`` of the class matrix and their
  momentum, one file per rank that held them.

The class matrix is described by class ranges, not by ranks, so a run on any number of ranks
takes from each file the rows of its own shard (files are memory-mapped: a rank reads only its
rows). Momentum is per row in every head mode (SGD's buffer for ``dp``/``mp``/dense ``pfc``,
``momentum_rows`` for sparse ``pfc``), so a checkpoint moves between modes too.

Writes are atomic: every rank writes into ``step-N.partial/`` and rank 0 renames it once all
files are complete, then deletes the oldest complete checkpoints beyond ``keep``. A run killed
while saving leaves the previous checkpoint as it was, and its partial folder is ignored.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...config import Workload
from ..layouts import shard_of
from .dist import DistContext
from .step import TrainStep

FORMAT = "trainperf.checkpoint/v1"
PREFIX = "step-"
# What must match for a checkpoint's tensors to fit the model (the rest, such as the head
# mode, precision or batch size, may change on resume).
SHAPE_FIELDS = ("task", "backbone", "num_classes", "embedding_size", "output_block",
                "input_size")


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or made for another model."""


def step_dirs(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and not p.name.endswith(".partial") and (p / "manifest.json").exists()]
    return sorted(found, key=lambda p: p.name)


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint folder; or the newest one under a folder of checkpoints, or under the one
    run of a ``trainperf train`` output folder."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return path
    found = step_dirs(path) or step_dirs(path / "checkpoints")
    if not found:
        runs = sorted(p for p in path.glob("runs/*/checkpoints") if step_dirs(p))
        if len(runs) > 1:
            raise CheckpointError(f"{path} holds checkpoints of {len(runs)} runs; name one: "
                                  + ", ".join(str(p) for p in runs))
        found = step_dirs(runs[0]) if runs else []
    if not found:
        raise CheckpointError(f"{path}: no checkpoint (a folder with manifest.json, or one "
                              "holding step-N folders)")
    return found[-1]


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    where = Path(path) / "manifest.json"
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{where}: cannot read ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a {FORMAT} manifest")
    return manifest


def _barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier(group=ctx.group)


def _head_momentum(step: TrainStep) -> torch.Tensor | None:
    head = step.head
    if head.sparse:
        return head.momentum_rows
    state = step.optimizers[0].state.get(head.weight, {})
    return state.get("momentum_buffer")


def save(root: str | os.PathLike, step: TrainStep, ctx: DistContext, progress: dict[str, Any],
         keep: int = 2) -> Path:
    """Write the checkpoint of ``progress["step"]`` (every rank calls this); its folder."""
    root = Path(root)
    final = root / f"{PREFIX}{progress['step']:08d}"
    partial = final.with_name(final.name + ".partial")
    if ctx.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a run killed while saving
        partial.mkdir(parents=True)
    _barrier(ctx)
    head = step.head
    shards = []
    if head is not None:
        classes = step.workload.num_classes
        shards = ([shard_of(classes, r, ctx.world_size) for r in range(ctx.world_size)]
                  if head.sharded else [(0, classes)])
        first, count = head.class_start, head.num_local
        if head.sharded or ctx.rank == 0:
            momentum = _head_momentum(step)
            torch.save({"weight": head.weight.detach().float().cpu(),
                        "momentum": None if momentum is None else momentum.float().cpu()},
                       partial / f"classes-{first}-{first + count}.pt")
    if ctx.rank == 0:
        names = {p: n for n, p in step.backbone.named_parameters()}
        momentum = {names[p]: s["momentum_buffer"].cpu()
                    for p, s in step.optimizers[0].state.items()
                    if p in names and s.get("momentum_buffer") is not None}
        scaler = step.scaler
        torch.save({"model": {k: v.cpu() for k, v in step.backbone.state_dict().items()},
                    "momentum": momentum,
                    "loss_scale": None if scaler is None else {
                        "scale": scaler._scale.cpu(), "clean_steps": scaler._clean_steps.cpu()}},
                   partial / "backbone.pt")
    _barrier(ctx)
    if ctx.rank == 0:
        manifest = {"format": FORMAT, "workload": step.workload.to_dict(),
                    "world_size": ctx.world_size, "fc": step.workload.fc,
                    "classes": [{"file": f"classes-{a}-{a + n}.pt", "first": a, "end": a + n}
                                for a, n in shards],
                    "progress": progress}
        (partial / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)  # the same step saved by an earlier attempt
        os.replace(partial, final)
        for old in step_dirs(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(ctx)
    return final


def read_backbone(path: Path, device) -> dict[str, Any]:
    """``backbone.pt`` of the checkpoint at ``path``: its ``model``, ``momentum`` and
    ``loss_scale``."""
    try:
        return torch.load(path / "backbone.pt", map_location=device, weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"{path / 'backbone.pt'}: cannot read ({exc})") from None


def check_fits(manifest: dict[str, Any], workload: Workload, where: Path) -> None:
    saved = manifest.get("workload", {})
    now = workload.to_dict()
    differ = [k for k in SHAPE_FIELDS if saved.get(k) != now.get(k)]
    if differ:
        raise CheckpointError(f"{where} was made for another model: "
                              + ", ".join(f"{k} {saved.get(k)!r} here {now.get(k)!r}"
                                          for k in differ))


def _load_rows(path: Path, manifest: dict[str, Any], first: int, count: int, device
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [first, first + count) of the class matrix and their momentum (None if the
    checkpoint has none yet), gathered from whichever files hold them."""
    end = first + count
    weight = momentum = None
    covered = 0
    for entry in manifest["classes"]:
        lo, hi = max(first, entry["first"]), min(end, entry["end"])
        if lo >= hi:
            continue
        part = torch.load(path / entry["file"], map_location="cpu", mmap=True,
                          weights_only=True)
        rows = slice(lo - entry["first"], hi - entry["first"])
        if weight is None:
            weight = torch.empty(count, part["weight"].shape[1])
        weight[lo - first:hi - first] = part["weight"][rows]
        if part["momentum"] is not None:
            if momentum is None:
                momentum = torch.zeros_like(weight)
            momentum[lo - first:hi - first] = part["momentum"][rows]
        covered += hi - lo
    if covered != count:
        raise CheckpointError(f"{path}: its class files cover {covered} of the rows "
                              f"[{first}, {end})")
    return weight.to(device), None if momentum is None else momentum.to(device)


@torch.no_grad()
def load(path: str | os.PathLike, step: TrainStep, ctx: DistContext) -> dict[str, Any]:
    """Put the checkpoint's state into ``step`` (this rank's shard of the class matrix); the
    saved training progress."""
    path = Path(path)
    manifest = read_manifest(path)
    check_fits(manifest, step.workload, path)
    saved = read_backbone(path, ctx.device)
    step.backbone.load_state_dict(saved["model"])
    main = step.optimizers[0]
    for name, param in step.backbone.named_parameters():
        if name in saved["momentum"]:
            main.state[param]["momentum_buffer"] = saved["momentum"][name].to(param).clone()
    if step.scaler is not None and saved["loss_scale"] is not None:
        step.scaler._scale.copy_(saved["loss_scale"]["scale"])
        step.scaler._clean_steps.copy_(saved["loss_scale"]["clean_steps"])
    head = step.head
    if head is not None:
        weight, momentum = _load_rows(path, manifest, head.class_start, head.num_local,
                                      ctx.device)
        head.weight.copy_(weight)
        if momentum is not None:
            if head.sparse:
                head.momentum_rows.copy_(momentum)
            else:
                main.state[head.weight]["momentum_buffer"] = momentum
    progress = dict(manifest["progress"])
    step.step_index = progress["step"]  # the learning-rate schedule goes on from there
    return progress
