"""The training step that trainperf measures in OneFlow, equal to torch's ``TrainStep``.

Backbone (a local module on every rank), head (``heads.py``), backward, gradient all-reduce,
clipping, SGD with momentum and weight decay. OneFlow runs eager operations asynchronously on its
virtual machine: a call queues the step's work and returns, and nothing inside a step reads a
device value back to the host, except in a sampling ``pfc`` head the gathered labels where
positives could exceed a rank's sample (``heads.MarginSoftmaxHead.sample_sizes``).

Gradients, as torch's DDP set-up:

- ``dp``: backbone and head form one module under OneFlow's ``DistributedDataParallel``, which
  averages every gradient over ranks in buckets while the backward still runs (it scales each
  gradient by 1 / world size, then all-reduces).
- ``mp`` and ``pfc``: the loss is the mean over the gathered global batch and the same on every
  rank, so each rank's backbone gradient is one partial of the true gradient: they must be
  summed. The backbone alone is under DDP, and the gradient of its output (the embeddings) is
  multiplied by the world size before it flows into the backbone, so DDP's average is the sum
  (exact for a power-of-two world size; otherwise one rounding). The class-matrix shard is a
  global ``split(0)`` parameter whose gradient stays on its rank (``heads.py``); a sampling
  ``pfc`` head's sparse update has a gradient of its sampled rows only, which no optimizer
  holds: the head applies it itself (``MarginSoftmaxHead.sparse_step``), after the backbone's
  update.
- classification (ResNet v1b): no head; the backbone's last Linear gives the logits, the loss
  is their softmax cross-entropy, and the backbone is under DDP as in ``dp``.
- One process: no DDP, nothing to reduce.

Clipping: ``oneflow.nn.utils.clip_grad_norm_`` on the (reduced) backbone gradient, as
``torch.nn.utils.clip_grad_norm_``: scaled by ``min(1, max_norm / (norm + 1e-6))`` on the
device, with no read-back.

SGD: ``oneflow.optim.SGD``, whose momentum update in OneFlow 0.9 is torch's: ``buf = m * buf +
g + wd * w; w -= lr * buf`` (checked in the tests against ``oracle.sgd_momentum_step``). On a GPU
the backbone's arrays are updated by OneFlow's fused multi-tensor kernel (``SGD(fused=True)``,
which OneFlow turns off, with a warning, for arrays not on a GPU): ``flow._C.
multi_tensor_momentum_update`` with the group's rate, momentum and weight decay, dampening 0,
no Nesterov (``python/oneflow/nn/optimizer/sgd.py``, v0.9.0), whose kernel is registered for
CUDA float32 (``oneflow/user/kernels/multi_tensor_model_update_kernel.cpp``) and computes, per
element, ``g + wd * w`` (its ``l1`` and ``l2`` left 0), ``buf = m * buf + g``, ``w -= lr * buf``
(``MultiTensorMomentumUpdateGpu`` in ``multi_tensor_model_update_kernel_util.cu``): the CPU
path's ``momentum_update`` rule, where the weight decay comes in as its ``l2``
(``MomentumUpdateFunctor``, ``model_update_kernel_util.h``). It has never run here (no GPU);
``tests/test_oneflow_tuning.py`` runs the fused call's arguments through that rule on a CPU. The
rate of each step is ``Workload.lr_at``.

Alignment (``trainperf.config.AlignSpec``): ``dtype`` float64 holds the weights, BatchNorm
statistics, activations, the head, the gradients and the momentum in float64, with BatchNorm,
SGD and the gradient all-reduce written in ``exact.py`` (OneFlow's kernels take their epsilon,
momentum, rate and weight decay as 32-bit floats, and its DDP takes float32 parameters only);
``keep_grad_norm`` keeps each step's gradient norm before clipping
(:attr:`TrainStep.last_grad_norm`), also where the workload does not clip.

Profiled steps (``run --breakdown``): :meth:`TrainStep.profiled` runs the same step split into
phases (``backends.phases``); ``profiling.py`` says how they are timed.

Graph mode (``--mode graph``) is ``graph_step.py``: the same model from :func:`build_model` in
one ``nn.Graph`` with the graph's own optimizer, clipping and schedule.

Precision: fp32 only; ``fp16`` and ``bf16`` are refused (the backend's declaration,
:func:`check_workload`). OneFlow's eager mode has autocast but no dynamic loss scaler (its
``GradScaler`` serves ``nn.Graph`` only), and a hand-written one could not be run here (no
GPU).
"""

from __future__ import annotations

from typing import Any

import oneflow as flow
import oneflow.nn as nn
import oneflow.nn.functional as F

from ...config import Tuning, Workload
from ..base import require
from ..workerkit import start_batch
from . import exact, models
from .backend import BACKEND
from .dist import Dist
from .heads import MarginSoftmaxHead, at_least_fp32

DDP_BUCKET_PARAMS = 10
"""Parameters per all-reduce bucket of OneFlow's DDP (its default: it counts arrays, not
bytes, so ``Tuning.ddp_bucket_mb`` has no equivalent)."""


def check_workload(workload: Workload, device_kind: str = "cpu") -> None:
    """ValueError for what this backend does not run (its declaration), before anything is
    built."""
    require(BACKEND.work_refusal(workload, device_kind))


def synthetic_batch(workload: Workload, dist: Dist) -> tuple[flow.Tensor, flow.Tensor]:
    """One batch per rank, drawn on the device once and seeded by (seed, rank) so ranks see
    different samples: normal images [B, 3, H, W] and uniform int64 labels."""
    gen = flow.Generator(device=dist.device_type)
    gen.manual_seed(workload.seed * 1000 + dist.rank + 1)
    side = workload.input_size
    images = flow.randn(workload.batch_size, 3, side, side, generator=gen, device=dist.device)
    labels = flow.randint(0, workload.num_classes, (workload.batch_size,), generator=gen,
                          device=dist.device, dtype=flow.int64)
    return images, labels


def init_batch(workload: Workload, arrays: Any, dist: Dist, dtype: flow.dtype = flow.float32
               ) -> tuple[flow.Tensor, flow.Tensor]:
    """This rank's batch from an alignment file (``AlignSpec.start``), its images in
    ``dtype``."""
    images, labels = start_batch(workload, arrays, dist.rank, DTYPE_NAMES[dtype])
    return (flow.tensor(images, dtype=dtype, device=dist.device),
            flow.tensor(labels, dtype=flow.int64, device=dist.device))


def build_model(workload: Workload, dist: Dist, init: Any = None,
                dtype: flow.dtype = flow.float32, straight_through: bool = False,
                exact_statistics: bool = False) -> tuple[nn.Module, MarginSoftmaxHead | None]:
    """(backbone, head) on this rank's device, from ``init`` (an alignment start) where given;
    the head is None in classification, whose classes are the backbone's last Linear. The same
    seed on every rank: identical initial backbones (DDP broadcasts rank 0's too)."""
    flow.manual_seed(workload.seed)
    backbone = models.build_backbone(
        workload.backbone, embedding_size=workload.embedding_size,
        num_classes=workload.num_classes, input_size=workload.input_size,
        output_block=workload.output_block, dropout=workload.dropout,
        exact_statistics=exact_statistics).to(device=dist.device, dtype=dtype)
    if init is not None:
        models.load_torch_arrays(backbone, init)
    if workload.task != "face":
        return backbone, None
    head = MarginSoftmaxHead(workload.num_classes, workload.embedding_size,
                             workload.resolved_margins, workload.scale, dist,
                             mode=workload.fc, seed=workload.seed, dtype=dtype,
                             straight_through=straight_through,
                             sample_ratio=workload.sample_ratio, update=workload.pfc_update)
    if init is not None:
        head.set_weight(init["head/weight"])
    return backbone, head


def classification_loss(logits: flow.Tensor, labels: flow.Tensor,
                        reduction: str = "mean") -> flow.Tensor:
    """Softmax cross-entropy of a classification backbone's logits, in fp32 or wider."""
    return F.cross_entropy(at_least_fp32(logits), labels, reduction=reduction)


class FaceModel(nn.Module):
    """Backbone and head as one module, so that ``dp`` puts both under one DDP."""

    def __init__(self, backbone: nn.Module, head: MarginSoftmaxHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.phase_clock = None
        """A profiled step's ``PhaseClock`` while one runs through DDP (``dp`` on several
        ranks): DDP's hooks belong to this module's call, so the split must happen inside it."""

    def forward(self, images: flow.Tensor, labels: flow.Tensor) -> flow.Tensor:
        clock = self.phase_clock
        if clock is None:
            return self.head(self.backbone(images), labels)
        with clock.phase("backbone_forward"):
            embeddings = self.backbone(images)
        with clock.phase("head"):
            return self.head(embeddings, labels)


def _local(loss: flow.Tensor) -> flow.Tensor:
    """A step's result: this rank's copy of the loss, out of the graph."""
    return (loss.to_local() if loss.is_global else loss).detach()


DTYPE_NAMES = {flow.float32: "float32", flow.float64: "float64"}
"""OneFlow's dtypes by ``AlignSpec.dtype``'s names."""


class TrainStep:
    """Call with (images, labels); returns this step's loss as a local device scalar (rank's own
    batch in dp, the global batch in mp and pfc), without waiting for it.

    ``dtype``: what the weights, activations, gradients and optimizer state are held in
    (float64 for a strict alignment run); ``keep_grad_norm``: keep every step's gradient norm
    before clipping (``last_grad_norm``) even where no clipping needs it; ``straight_through``:
    the margin's gradient passed through unchanged (an alignment run's negative control)."""

    def __init__(self, workload: Workload, dist: Dist, tuning: Tuning | None = None,
                 init: Any = None, dtype: flow.dtype = flow.float32,
                 keep_grad_norm: bool = False, straight_through: bool = False) -> None:
        check_workload(workload, dist.device_type)
        self.workload = workload
        self.dist = dist
        self.tuning = tuning or Tuning()
        self.step_index = 0
        self.sharded = workload.task == "face" and workload.fc in ("mp", "pfc")
        self.exact_float64 = exact_float64 = dtype == flow.float64
        self.data_parallel: exact.DataParallel | None = None
        """A float64 run's data-parallel wrapper on several ranks (OneFlow's DDP takes float32
        only), whose gradients the step averages itself."""
        backbone, head = build_model(workload, dist, init, dtype, straight_through,
                                     exact_statistics=exact_float64)
        self.backbone, self.head = backbone, head
        self.model, self.embedding_model = self._wrap(backbone, head)

        self.clip_params = [p for p in backbone.parameters() if p.requires_grad]
        main = list(self.clip_params) + ([head.weight] if head is not None and not self.sharded
                                         else [])
        self.optimizers = [self._sgd(main, fused=dist.device_type == "cuda",
                                     exact_float64=exact_float64)]
        if self.sharded and not head.sparse:
            # A global parameter: its own optimizer (the fused kernel takes local arrays).
            self.optimizers.append(self._sgd([head.weight], False, exact_float64))
        self._last_backbone = self.clip_params[-1]
        self.skipped_steps: list[int] = []
        """fp16 loss scaling would list skipped steps here; fp32 skips none."""
        self.loss_scale: float | None = None
        self.keep_grad_norm = keep_grad_norm
        self.last_grad_norm: flow.Tensor | None = None
        """The backbone's gradient norm before clipping, of the last step (on the device)."""

    def _sgd(self, params: list, fused: bool, exact_float64: bool) -> flow.optim.Optimizer:
        """OneFlow's SGD, or in a float64 run the one that applies the rate, the weight decay and
        the momentum in float64 (``exact.SGD``)."""
        w = self.workload
        if exact_float64:
            return exact.SGD(params, lr=w.lr, momentum=w.momentum, weight_decay=w.weight_decay)
        return flow.optim.SGD(params, lr=w.lr, momentum=w.momentum,
                              weight_decay=w.weight_decay, fused=fused)

    def _ddp(self, module: nn.Module) -> nn.Module:
        if self.exact_float64:
            self.data_parallel = exact.DataParallel(module, self.dist,
                                                    self.tuning.ddp_broadcast_buffers)
            return self.data_parallel
        return nn.parallel.DistributedDataParallel(
            module, broadcast_buffers=self.tuning.ddp_broadcast_buffers,
            bucket_size=DDP_BUCKET_PARAMS)

    def _wrap(self, backbone: nn.Module, head: MarginSoftmaxHead | None
              ) -> tuple[nn.Module | None, nn.Module]:
        """(the module that maps (images, labels) to the loss in dp, images to logits in
        classification, or None when sharded; the module that maps images to embeddings)."""
        if not self.sharded:
            model = FaceModel(backbone, head) if head is not None else backbone
            return (self._ddp(model) if self.dist.distributed else model), backbone
        return None, (self._ddp(backbone) if self.dist.distributed else backbone)

    @property
    def settings(self) -> dict:
        ddp = None
        if self.dist.distributed:
            exact_dp = self.data_parallel is not None
            ddp = {"module": "trainperf.backends.oneflow.exact.DataParallel" if exact_dp
                   else "oneflow.nn.parallel.DistributedDataParallel",
                   "wraps": "backbone" if self.sharded or self.head is None
                   else "backbone and head",
                   "bucket_params": None if exact_dp else DDP_BUCKET_PARAMS,
                   "broadcast_buffers": self.tuning.ddp_broadcast_buffers,
                   "backbone_gradient": "sum (embedding gradient times world size)"
                   if self.sharded else "mean"}
        # Not under "ddp": that key holds torch DDP's arguments (bucket MiB, static graph),
        # which the report reads and OneFlow's DDP does not have.
        head = "global split(0) class matrix" if self.sharded else "local class matrix"
        if self.head is None:
            head = "none: the classes are the backbone's last Linear"
        elif self.head.sampling:
            head += (f"; pfc samples {self.workload.sample_ratio} of each shard, "
                     f"{self.head.update} update")
        return {"ddp": None, "oneflow_ddp": ddp, "head": head,
                "sgd_fused": self.optimizers[0].param_groups[0]["fused"],
                "amp": None, "loss_scaling": None}

    def _summed(self, grad: flow.Tensor) -> flow.Tensor:
        """The embeddings' gradient times the world size: DDP's average of the backbone's
        gradient is then the sum the sharded head's loss needs (module docstring)."""
        return grad * float(self.dist.world_size)

    def forward_loss(self, images: flow.Tensor, labels: flow.Tensor) -> flow.Tensor:
        if self.head is None:
            return classification_loss(self.model(images), labels)
        if not self.sharded:
            return self.model(images, labels)
        emb = self.embedding_model(images)
        if self.dist.distributed:
            emb.register_hook(self._summed)
        return self.head(emb, labels)

    def _begin(self) -> None:
        """Zero the gradients and set this step's rate."""
        lr = self.workload.lr_at(self.step_index)
        for opt in self.optimizers:
            # In place, not None: DDP's gradients are views into its all-reduce buckets.
            opt.zero_grad(set_to_none=False)
            for group in opt.param_groups:
                group["lr"] = lr

    def compute_gradients(self, images: flow.Tensor, labels: flow.Tensor) -> flow.Tensor:
        """Forward and backward with this step's rate set; returns the loss tensor (global in
        mp and pfc). Afterwards every gradient is reduced over ranks (or queued to be: OneFlow
        orders the all-reduces before anything that reads them); :meth:`apply` clips and
        steps."""
        self._begin()
        loss = self.forward_loss(images, labels)
        loss.backward()
        if self.data_parallel is not None:
            self.data_parallel.average_gradients()
        return loss

    def apply(self) -> None:
        if self.workload.clip_grad_norm is not None:
            self.last_grad_norm = nn.utils.clip_grad_norm_(self.clip_params,
                                                           self.workload.clip_grad_norm)
        elif self.keep_grad_norm:
            # The same norm with nothing clipped: an infinite bound scales every gradient by 1.
            self.last_grad_norm = nn.utils.clip_grad_norm_(self.clip_params, float("inf"))
        for opt in self.optimizers:
            opt.step()
        if self.head is not None and self.head.sparse:
            w = self.workload
            self.head.sparse_step(self.optimizers[0].param_groups[0]["lr"], w.momentum,
                                  w.weight_decay)
        self.step_index += 1

    def __call__(self, images: flow.Tensor, labels: flow.Tensor) -> flow.Tensor:
        loss = self.compute_gradients(images, labels)
        self.apply()
        return _local(loss)

    # -- profiled steps (``backends.phases``) -------------------------------------------------
    @property
    def ddp(self) -> nn.Module | None:
        """The module under OneFlow's DDP, whose hooks all-reduce the replicated gradients
        during the backward (None: one process, or a float64 run's ``exact.DataParallel``)."""
        module = self.model if not self.sharded else self.embedding_model
        return module if getattr(module, "_is_ddp_module", False) else None

    @property
    def head_in_backward(self) -> bool:
        """Whether the head's backward runs with the backbone's (``dp`` under DDP; always in
        classification, whose head phase is the loss alone)."""
        return self.head is None or (self.model is not None and self.dist.distributed)

    def _skip_all_reduce(self) -> None:
        """Let the coming backward reduce nothing. OneFlow 0.9's DDP has no ``no_sync``: its
        hooks skip every bucket they find marked reduced (the second flag of each parameter's
        state, which every forward clears), and still scale each gradient by 1 / world size."""
        for state in self.ddp._ddp_state_for_reversed_params.values():
            state[1] = True

    def profiled(self, images: flow.Tensor, labels: flow.Tensor, clock: Any,
                 skip_comm: bool = False) -> flow.Tensor:
        """The same step as ``__call__``, phase by phase on ``clock`` (``backends.phases``);
        ``skip_comm`` runs its backward without DDP's all-reduce. Where the head is outside DDP
        (one process, ``mp``, ``pfc``) its backward to the embeddings runs inside ``head``,
        through a detached copy of them, and the backbone's backward after it from their
        gradient; under DDP (``dp`` on several ranks) it runs with the backbone's in
        ``backward``. Classification's head phase is its loss, whose backward is the
        backbone's."""
        with clock.phase("optimizer"):
            self._begin()
        if self.head is None:
            with clock.phase("backbone_forward"):
                logits = self.model(images)
            with clock.phase("head"):
                loss = classification_loss(logits, labels)
        elif self.head_in_backward:
            face = self.model.module if self.data_parallel is not None else self.model
            face.phase_clock = clock
            try:
                loss = self.model(images, labels)
            finally:
                face.phase_clock = None
        else:
            with clock.phase("backbone_forward"):
                emb = self.embedding_model(images)
            with clock.phase("head"):
                cut = emb.detach().requires_grad_()
                loss = self.head(cut, labels)
                loss.backward()
        if skip_comm:
            self._skip_all_reduce()
        with clock.phase("backward"):
            if self.head_in_backward:
                loss.backward()
            else:
                # OneFlow runs no hook of the tensor a backward starts from: the scaling
                # that forward_loss hooks on the embeddings is applied here.
                emb.backward(self._summed(cut.grad) if self.dist.distributed else cut.grad)
        if self.data_parallel is not None:
            with clock.phase("grad_comm"):
                self.data_parallel.average_gradients()
        with clock.phase("optimizer"):
            self.apply()
        return _local(loss)

    @property
    def pfc_update(self) -> str | None:
        """Which class-matrix update ran: ``full`` (no sampling), ``sparse`` or ``dense``; None
        in classification."""
        return None if self.head is None else self.head.update

    @property
    def lr(self) -> float:
        """The rate the last step's optimizer ran at."""
        return float(self.optimizers[0].param_groups[0]["lr"])

    @property
    def markers(self) -> list[flow.Tensor]:
        """Small fresh tensors that are ready once the last step's updates have run (one
        element of the last array each optimizer updates, copied after the update)."""
        marks = [self._last_backbone.detach().view(-1)[:1].clone()]
        if self.head is not None:
            marks.append(self.head.local_weight().detach().view(-1)[:1].clone())
        return marks
