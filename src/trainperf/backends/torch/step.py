"""The training step that trainperf measures: backbone, head, loss, backward, clip, SGD.

This module owns precision, the optimizers and the execution mode (``modes.py``): in a compiled
mode, ``torch.compile`` wraps the module that DDP wraps (or would wrap on several ranks), DDP
included, as torch's guide to DDP with ``torch.compile`` writes it, so that TorchDynamo's DDP
optimizer splits the graph at the gradient buckets and the all-reduce still overlaps the
backward. In ``dp`` that is backbone and head as one graph; in ``mp`` and ``pfc`` the backbone
alone: their head's collectives (the embeddings gathered, the sharded softmax's all-reduces)
are custom autograd functions around ``torch.distributed`` calls that run eagerly on their
own, and Partial FC's sampling counts its positives on the host and swaps the sampled rows'
storage every step. The head stays eager there. The optimizers and clipping stay eager in
every mode, as a ``torch.compile`` user's training loop has them.

It does no timing, no logging and reads nothing back to the host (.item()) but, in fp16, the
one skip decision of loss scaling (loss_scale.py), so the loop that times it decides every
other sync.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ...config import Tuning, Workload
from .backbones import get_spec, workload_backbone
from .dist import DistContext
from .heads import MarginSoftmaxHead, SampledRowsSGD
from .heads.margin import at_least_fp32
from .loss_scale import DynamicLossScaler
from .modes import (COMPILE_MODES, EAGER, compiled, inductor_options, is_compiled, kept,
                    step_begins, unwrapped)

ONE_GRAPH_PHASE = "backbone_forward+head"
ONE_GRAPH_WHY = ("torch.compile runs the dp backbone and head as one graph: their forward has no "
                 "boundary to time")
AMP_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch 2.13 renamed DDP's broadcast_buffers (re-send buffers before every forward) to
# forward_sync_buffers; the package supports releases on both sides of the rename.
_BUFFER_SYNC_ARG = ("forward_sync_buffers"
                    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                    else "broadcast_buffers")


# No annotations: DDP checks them by identity and this module's are strings (future import).
def _sum_allreduce_hook(group, bucket):
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class FaceModel(nn.Module):
    """Backbone and head as one module so that ``dp`` mode can wrap both in one DDP."""

    def __init__(self, backbone: nn.Module, head: MarginSoftmaxHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.phase_clock = None
        """A profiled step's ``PhaseClock`` while one runs through DDP (``dp``)."""

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        clock = self.phase_clock
        if clock is None:
            return self.head(self.backbone(images), labels)
        with clock.phase("backbone_forward"):
            embeddings = self.backbone(images)
        with clock.phase("head"):
            return self.head(embeddings, labels)


def build_head(workload: Workload, ctx: DistContext) -> MarginSoftmaxHead:
    gen = torch.Generator(device=ctx.device)
    gen.manual_seed(workload.seed * 1000 + 7919 * (ctx.rank + 1))
    return MarginSoftmaxHead(
        workload.num_classes, workload.embedding_size, workload.resolved_margins, workload.scale,
        ctx, mode=workload.fc, sample_ratio=workload.sample_ratio, update=workload.pfc_update,
        generator=gen,
    )


class TrainStep:
    """Call with (images, labels); returns the detached loss tensor of that step.

    ``dtype``: what the weights, activations, gradients and optimizer state are held in
    (float64 for a strict alignment run); ``keep_grad_norm``: keep every step's gradient norm
    before clipping (``last_grad_norm``) even where no clipping needs it; ``mode``: the
    execution mode (``modes.py``), resolved already (``eager``, ``compile``...)."""

    def __init__(self, workload: Workload, ctx: DistContext, tuning: Tuning | None = None,
                 dtype: torch.dtype = torch.float32, keep_grad_norm: bool = False,
                 mode: str = EAGER) -> None:
        spec = get_spec(workload.backbone)
        if spec.task != workload.task:
            raise ValueError(f"backbone {workload.backbone!r} is a {spec.task} backbone, "
                             f"but the workload is {workload.task}")
        self.workload = workload
        self.ctx = ctx
        self.tuning = tuning or Tuning()
        self.mode = mode
        self.step_index = 0
        device = ctx.device
        # Same seed on every rank: identical initial backbones (DDP would broadcast anyway).
        torch.manual_seed(workload.seed)
        backbone = workload_backbone(workload).to(device=device, dtype=dtype)
        if workload.channels_last:
            backbone = backbone.to(memory_format=torch.channels_last)
        self.backbone = backbone
        self.head: MarginSoftmaxHead | None = None
        if workload.task == "face":
            self.head = build_head(workload, ctx).to(device=device, dtype=dtype)
        self.model = self._wrap(backbone)

        main_params = [p for p in backbone.parameters() if p.requires_grad]
        if self.head is not None and isinstance(self.head.weight, nn.Parameter):
            main_params.append(self.head.weight)
        self.optimizers: list[torch.optim.Optimizer] = [torch.optim.SGD(
            main_params, lr=workload.lr, momentum=workload.momentum,
            weight_decay=workload.weight_decay)]
        if self.head is not None and self.head.sparse:
            self.optimizers.append(SampledRowsSGD(self.head, workload.lr, workload.momentum,
                                                  workload.weight_decay))
        self.clip_params = [p for p in backbone.parameters() if p.requires_grad]
        self.amp_dtype = AMP_DTYPES[workload.precision]
        # Not torch.amp.GradScaler: it decides per rank and per optimizer, and sharded heads need
        # one skip decision for all ranks and both optimizers (see loss_scale.py).
        self.scaler = DynamicLossScaler(ctx) if workload.precision == "fp16" else None
        self.skipped_steps: list[int] = []
        """0-based indices of the steps that fp16 loss scaling skipped on every rank."""
        self.keep_grad_norm = keep_grad_norm
        self.last_grad_norm: torch.Tensor | None = None
        """The backbone's gradient norm before clipping, of the last step (on the device)."""

    @property
    def ddp_settings(self) -> dict | None:
        """The DistributedDataParallel settings this step runs with (None: one process)."""
        if not self.ctx.distributed:
            return None
        t = self.tuning
        return {"bucket_cap_mb": t.ddp_bucket_mb, "static_graph": t.ddp_static_graph,
                "broadcast_buffers": t.ddp_broadcast_buffers,
                # Gradients live in the all-reduce buckets: no copy in and out of them, and no
                # second gradient-sized buffer.
                "gradient_as_bucket_view": True}

    def _wrap(self, backbone: nn.Module) -> nn.Module:
        ctx, head = self.ctx, self.head
        whole = head is None or self.workload.fc == "dp"
        model: nn.Module = backbone if head is None else FaceModel(backbone, head)

        def in_mode(module: nn.Module) -> nn.Module:
            return compiled(module, self.mode, self.workload.channels_last)

        if not ctx.distributed:
            return in_mode(model) if whole else FaceModel(in_mode(backbone), head)
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        settings = dict(self.ddp_settings)
        settings[_BUFFER_SYNC_ARG] = settings.pop("broadcast_buffers")
        if whole:
            return in_mode(DDP(model, device_ids=ids, process_group=ctx.group, **settings))
        # mp / pfc: the head is sharded and stays out of DDP. Its loss is the mean over the global
        # batch and identical on every rank, so each rank's backbone gradient is one partial of
        # the true gradient: they must be summed, not averaged as DDP does by default.
        wrapped = DDP(backbone, device_ids=ids, process_group=ctx.group, **settings)
        wrapped.register_comm_hook(ctx.group, _sum_allreduce_hook)
        return FaceModel(in_mode(wrapped), head)

    @property
    def compile_settings(self) -> dict | None:
        """What ``torch.compile`` wraps and with which options (None in eager)."""
        if not is_compiled(self.mode):
            return None
        wraps = "backbone" if self.head is None or not self.head_with_backbone else (
            "backbone and head")
        if self.ctx.distributed:
            wraps += ", under DDP (its DDP optimizer splits the graph at the buckets)"
        return {"backend": "inductor", "mode": COMPILE_MODES[self.mode],
                "options": inductor_options(self.mode, self.workload.channels_last),
                "wraps": wraps}

    @property
    def head_with_backbone(self) -> bool:
        """The head runs inside the module that runs the backbone (``dp`` under DDP, or ``dp``
        compiled): its backward runs in the backbone's backward, never apart."""
        return self.head is not None and not isinstance(self.model, FaceModel)

    @property
    def one_graph(self) -> bool:
        """Backbone and head compiled as one graph (``dp`` in a compiled mode): their forward
        cannot be timed apart."""
        return self.head_with_backbone and unwrapped(self.model) is not self.model

    @property
    def pfc_update(self) -> str | None:
        return None if self.head is None else self.head.update

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.amp_dtype)

    def forward_loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            if self.head is None:
                return F.cross_entropy(at_least_fp32(self.model(images)), labels)
            return self.model(images, labels)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._begin()
        loss = self.forward_loss(images, labels)
        scaler = self.scaler
        (loss if scaler is None else scaler.scale_loss(loss)).backward()
        self._update()
        return kept(loss.detach(), self.mode)

    def _begin(self) -> None:
        """Clear the gradients and set this step's rate."""
        step_begins(self.mode)
        lr = self.workload.lr_at(self.step_index)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
            for group in opt.param_groups:
                group["lr"] = lr

    def _update(self) -> None:
        """After the backward: loss scaling's check, clipping, the updates; the step is done."""
        scaler = self.scaler
        if scaler is not None:
            # Every gradient any optimizer applies, before clipping reads the backbone's.
            scaler.unscale_and_check_(self.optimizers)
        if self.workload.clip_grad_norm is not None:
            # foreach norm and clamp stay on the device: no sync.
            self.last_grad_norm = nn.utils.clip_grad_norm_(self.clip_params,
                                                           self.workload.clip_grad_norm)
        elif self.keep_grad_norm:
            self.last_grad_norm = nn.utils.clip_grad_norm_(self.clip_params, float("inf"))
        if scaler is None or scaler.should_step():
            for opt in self.optimizers:
                opt.step()
        else:
            self.skipped_steps.append(self.step_index)
        if scaler is not None:
            scaler.update()
        self.step_index += 1

    def _ddp(self) -> DDP | None:
        """The DDP module whose all-reduce carries the replicated gradients (None: one process)."""
        model = unwrapped(self.model)
        if isinstance(model, DDP):
            return model
        backbone = unwrapped(getattr(model, "backbone", None))
        return backbone if isinstance(backbone, DDP) else None

    def profiled(self, images: torch.Tensor, labels: torch.Tensor, clock,
                 skip_comm: bool = False) -> torch.Tensor:
        """The same step as ``__call__``, phase by phase on ``clock`` (``backends.phases``);
        ``skip_comm`` runs it under DDP's ``no_sync`` (no gradient all-reduce). Where the head
        is outside DDP (one process, ``mp``, ``pfc``), its backward to the embeddings runs
        inside ``head``, through a detached copy of them, and the backbone's backward after it
        from their gradient; under DDP ``dp`` it runs with the backbone's in ``backward``."""
        ddp = self._ddp()
        # A context per use: no_sync's is a generator, good for one ``with``.
        comm = ddp.no_sync if skip_comm and ddp is not None else contextlib.nullcontext
        scaler = self.scaler
        with clock.phase("optimizer"):
            self._begin()
        with comm(), self._autocast():
            if self.head is None:
                with clock.phase("backbone_forward"):
                    logits = self.model(images)
                with clock.phase("head"):
                    loss = F.cross_entropy(at_least_fp32(logits), labels)
                scaled = loss if scaler is None else scaler.scale_loss(loss)
            elif self.one_graph:
                with clock.phase(ONE_GRAPH_PHASE):
                    loss = self.model(images, labels)
                scaled = loss if scaler is None else scaler.scale_loss(loss)
            elif self.head_with_backbone:  # dp under DDP
                face = ddp.module
                face.phase_clock = clock
                try:
                    loss = self.model(images, labels)
                finally:
                    face.phase_clock = None
                scaled = loss if scaler is None else scaler.scale_loss(loss)
            else:
                with clock.phase("backbone_forward"):
                    embeddings = self.model.backbone(images)
                with clock.phase("head"):
                    cut = embeddings.detach().requires_grad_()
                    loss = self.model.head(cut, labels)
                    (loss if scaler is None else scaler.scale_loss(loss)).backward()
                scaled = None
        with comm():
            with clock.phase("backward"):
                if scaled is not None:
                    scaled.backward()
                else:
                    embeddings.backward(cut.grad)
        with clock.phase("optimizer"):
            self._update()
        return kept(loss.detach(), self.mode)

    @property
    def lr(self) -> float:
        """The rate the last step's optimizer ran at."""
        return self.optimizers[0].param_groups[0]["lr"]

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (None without loss scaling). Reading it syncs with the
        device: read it after the measured window."""
        return None if self.scaler is None else self.scaler.current_scale()
