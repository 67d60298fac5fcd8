"""The training step that trainperf measures in Paddle (dynamic graph, or its backbone as a
static program), equal to torch's ``TrainStep``.

Backbone (a ``paddle.nn.Layer``, recorded by autograd), head (``heads.py``, forward and backward
by hand, its embedding gradient handed to the backbone's graph with
``paddle.autograd.backward``), gradient all-reduce, clipping, SGD with momentum and weight
decay. This module owns precision. Nothing is read back to the host inside a step except, in
fp16, the one overflow decision of loss scaling, and in a sampling ``pfc`` head the count of
positives when it could exceed the sample (``heads.sample_classes``).

Modes (``Capabilities.modes``): ``dygraph`` runs every operation eagerly. ``static`` turns the
backbone into a static program with ``paddle.jit.to_static(net, full_graph=True)``, the way
PaddleClas's ``Global.to_static`` trains (its model wrapped, loss and optimizer in dygraph):
dy2static transcribes the forward's source into one PIR program, with no fallback to Python,
and derives its backward program; autograd runs the pair as one operation, so the head's
gradient reaches it through ``paddle.autograd.backward`` as before. One program is built per
input shape and mode of the layer (training here), inside the first step that calls it:
:meth:`TrainStep.compile_count` counts them and :class:`ProgramBuilds` times their building
where Paddle builds them (:meth:`TrainStep.compile_seconds`; dygraph builds nothing, 0.0). The
rest of the step stays in dygraph, in both modes the same code:

- The head: its backward is written by hand, not derived, so it cannot join the backbone's
  program, and dy2static refuses it as a program of its own (seen with 3.3.1: in-place
  operations on views, "subtract_'s output variable is a viewed Tensor in dygraph"; its state
  kept in attributes; sampling's count read back to the host). Its collectives are not what
  stops it: an all-reduce in a static program runs on gloo, given the default group (static
  mode refuses a group passed by name).
- The gradient all-reduce, clipping and the optimizers: Paddle's own optimizer is a dygraph
  object in a to_static training loop, as in PaddleClas.

Gradients, as torch's DDP set-up:

- ``dp`` and classification: every gradient (backbone and the whole class matrix) is the mean
  over ranks.
- ``mp`` and ``pfc``: the loss is the mean over the gathered global batch and the same on every
  rank, so each rank's backbone gradient is one partial of the true gradient: they are summed,
  not averaged. The class-matrix shard's gradient stays local.

The backbone's gradients are all-reduced after the backward, packed into flat buckets of at most
``Tuning.ddp_bucket_mb`` (one collective per bucket instead of one per parameter, which on gloo
costs about a millisecond each); unlike torch's DDP the all-reduce does not overlap the backward.
Paddle's ``DataParallel`` is not used: it averages, and ``mp`` needs sums.

Clipping: the backbone's reduced gradient is scaled by ``min(1, max_norm / (norm + 1e-6))`` with
``norm`` its global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` (Paddle's
``ClipGradByGlobalNorm`` has no 1e-6 and would also clip the head). The coefficient stays on
the device and shares one multiply per gradient with the dp mean and the fp16 unscaling.

SGD: ``paddle.optimizer.Momentum`` (multi-tensor, :func:`native_optimizer`) on the backbone
with L2 weight decay inside the op computes ``buf = m * buf + (g + wd * w); w -= lr * buf``,
torch's SGD exactly (the rate is set before every step from ``lr_steps``/``lr_scales``). The
class matrix is updated by the head itself (``MarginSoftmaxHead.sgd_step``: the same formula,
or per sampled row).

Profiled steps (``run --breakdown``): :meth:`TrainStep.profiled` runs the same pieces as
``__call__``, each in its phase (``backends.phases``); none is merged.

Alignment runs (``trainperf.config.AlignSpec``, ``TrainStep(align=...)``) hold and compute
everything in the asked dtype: the backbone is built with that default dtype (parameters and
BatchNorm statistics), the batch, the head and its momentum are made in it. Where Paddle's own
kernels hold a number of their rule as a float32 attribute (BatchNorm, the global pool's
backward, the momentum op), a float64 run computes the same rule with the number held exactly
(``alignment``); Paddle's rule stays, BatchNorm's biased running variance included. With a
dump, the gradient norm before clipping is kept every step, also where the workload does not
clip (``last_grad_norm``). A throughput run does none of this.

Precision: ``fp32`` everywhere; ``fp16`` and ``bf16`` on a GPU only, through ``paddle.amp``
(``auto_cast`` level O1: convolutions and matrix products in half precision, float32 weights,
the ops on neither of Paddle's lists, BatchNorm and PReLU among them, in their input's type),
the head's three class-matrix products in the same half type with its margin and softmax in
float32. ``fp16`` adds dynamic loss scaling of torch's policy (start 2**16, halve on an
overflow, double after 2000 clean steps), one decision for all ranks (the finiteness of every
gradient of every rank, all-reduced and read back: the skip is host control flow). A CPU run
refuses both: in Paddle's CPU build ``auto_cast`` leaves the backbone in float32 and no float16
or bfloat16 matrix-product kernel is registered (seen with 3.3.1), so nothing of the half-
precision arithmetic would run. The GPU path has not been run here (no GPU build of Paddle on
the machines this was written on); the loss-scaling bookkeeping is tested on a CPU with autocast
off.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import numpy as np
import paddle
import paddle.nn.functional as F

from ...config import AlignSpec, Tuning, Workload
from ..base import require
from ..phases import PhaseClock
from ..scaling import LossScale
from ..workerkit import breaks_margin, computes_in, dumps_state, start_batch
from . import models
from .alignment import ExactMomentum, use_exact_kernels
from .backend import BACKEND, DYGRAPH, STATIC
from .comm import Comm
from .heads import MarginSoftmaxHead

AMP_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def check_precision(precision: str, device_type: str) -> None:
    """ValueError unless the backend's declaration runs ``precision`` on this device."""
    require(BACKEND.precision_refusal(precision, "cuda" if device_type in ("gpu", "cuda")
                                      else "cpu"))


def synthetic_batch(workload: Workload, rank: int) -> tuple[paddle.Tensor, paddle.Tensor]:
    """One batch per rank, made once on the device with Paddle's generator seeded by (seed,
    rank) so ranks see different samples: normal images [B, 3, H, W] and uniform labels."""
    paddle.seed(workload.seed * 1000 + rank + 1)
    side = workload.input_size
    images = paddle.randn([workload.batch_size, 3, side, side], dtype="float32")
    labels = paddle.randint(0, workload.num_classes, [workload.batch_size], dtype="int64")
    return images, labels


def init_batch(workload: Workload, arrays: Any, rank: int, dtype: str = "float32"
               ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Rank ``rank``'s batch from an alignment file (``AlignSpec.start``), images in
    ``dtype``."""
    images, labels = start_batch(workload, arrays, rank, dtype)
    return paddle.to_tensor(images), paddle.to_tensor(labels)


@contextlib.contextmanager
def default_dtype(dtype: str) -> Iterator[None]:
    """Paddle's default dtype set to ``dtype`` for what is built inside (a layer's parameters
    and BatchNorm statistics take it when they are created), the old one back after."""
    old = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(old)


def native_optimizer(params: list[paddle.Tensor], lr: float, momentum: float,
                     weight_decay: float) -> paddle.optimizer.Momentum:
    """The backbone's optimizer as a throughput run times it (module doc): Paddle's momentum
    op, multi-tensor, the L2 decay inside the op."""
    return paddle.optimizer.Momentum(learning_rate=lr, momentum=momentum, parameters=params,
                                     weight_decay=weight_decay or None, use_multi_tensor=True)


def static_backbone(net: paddle.nn.Layer) -> paddle.nn.Layer:
    """``net`` with its forward converted by dy2static (module doc): ``net`` itself, its
    parameters and buffers the program's, its ``forward`` a ``StaticFunction`` that builds a
    program the first time it sees an input shape and runs it after."""
    return paddle.jit.to_static(net, full_graph=True)


class ProgramBuilds:
    """The host seconds dy2static spends building a ``StaticFunction``'s programs, timed where
    Paddle builds them and summed over every program it builds (Paddle 3.3.1, PIR):

    - each new entry of the function's program cache (``ProgramCache._build_once``, one per
      input shape and mode: the forward's source transcribed, then run once under a static
      program guard into a PIR program, and the partial-program layer that will run it), timed
      by wrapping that method of this function's cache;
    - each layer's train (or inference) program, built at the layer's first call: the forward
      program cloned, its backward appended, Paddle's passes, the pair the ``run_program``
      operation runs. Paddle times it itself (the layer's ``_compile_time_counter``, which
      dy2static's SOT mode also reads for its compile-time limit).

    Not counted: the executor's own preparation at a program's first run, inside the C++
    ``run_program`` operation (the programs lowered to kernels, its interpreter built); Paddle
    times it nowhere Python can read. All of it is host work, the same on a GPU."""

    MEASURE = ("paddle.jit.to_static program builds: ProgramCache._build_once timed (the "
               "forward transcribed into a PIR program) plus each partial program's own "
               "_compile_time_counter (its backward program and passes); not the executor's "
               "preparation at the first run")

    def __init__(self, function: Any) -> None:
        self.cache = function.program_cache
        self.translate_s = 0.0
        build = self.cache._build_once

        def timed_build(key: Any) -> Any:
            began = time.perf_counter()
            try:
                return build(key)
            finally:
                self.translate_s += time.perf_counter() - began

        # An attribute of this cache only: ``__getitem__`` builds through it on a miss.
        self.cache._build_once = timed_build

    def seconds(self) -> float:
        return self.translate_s + sum(layer._compile_time_counter.get_total_time()
                                      for _, layer in self.cache._caches.values())


def static_executor() -> dict:
    """How Paddle's executor schedules a static program's operations, as a run records it: on
    its own pool of host threads (Paddle's default) or one after another on the calling
    thread (``FLAGS_new_executor_serial_run``); each operation's own threads are the run's
    intra-op threads either way."""
    flags = paddle.get_flags(["FLAGS_new_executor_serial_run"])
    return {"serial_run": bool(flags["FLAGS_new_executor_serial_run"])}


def _buckets(params: list[paddle.Tensor], bucket_bytes: float) -> list[list[int]]:
    """Consecutive parameter indices grouped into buckets of at most ``bucket_bytes`` of
    float32 gradient (a larger parameter is a bucket of its own)."""
    buckets: list[list[int]] = []
    size = 0.0
    for i, p in enumerate(params):
        nbytes = 4.0 * int(np.prod(p.shape))
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0.0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _global_norm(grads: list[paddle.Tensor]) -> paddle.Tensor:
    """The L2 norm of all of ``grads`` as one vector (a scalar on the device)."""
    return paddle.sqrt(paddle.add_n([paddle.sum(g * g) for g in grads]))


class TrainStep:
    """Call with (images, labels); returns the step's loss as a detached device tensor, not
    waited on.

    ``align``: an alignment run's spec (module doc): its dtype (float64: Paddle's rule with
    exact constants where a kernel holds float32 ones), the gradient norm kept every step where
    it dumps, and its rule breaks."""

    def __init__(self, workload: Workload, comm: Comm, tuning: Tuning | None = None,
                 init: Any = None, align: AlignSpec | None = None, mode: str = DYGRAPH
                 ) -> None:
        require(BACKEND.model_refusal(workload))
        check_precision(workload.precision, comm.device_type)
        if mode not in (DYGRAPH, STATIC):
            raise ValueError(f"the paddle step runs in {DYGRAPH} or {STATIC}, not {mode!r}")
        self.mode = mode
        self.workload = workload
        self.comm = comm
        self.tuning = tuning or Tuning()
        self.step_index = 0
        self.amp_dtype = AMP_DTYPES.get(workload.precision)
        self.fp16 = workload.precision == "fp16"
        self.dtype = computes_in(align)
        """What the weights, activations, gradients and optimizer state are held in."""
        self.keep_grad_norm = dumps_state(align)
        self.last_grad_norm: paddle.Tensor | None = None
        """The backbone's reduced gradient norm before clipping, of the last step (on the
        device); kept where the step clips, or where ``keep_grad_norm`` asks for it."""

        # Same seed on every rank; rank 0's weights are broadcast below anyway.
        paddle.seed(workload.seed)
        with default_dtype(self.dtype):
            net = models.build_backbone(
                workload.backbone, embedding_size=workload.embedding_size,
                num_classes=workload.num_classes, input_size=workload.input_size,
                output_block=workload.output_block, dropout=workload.dropout)
        if init is not None:
            models.load_torch_arrays(net, init)
        if self.dtype == "float64":
            use_exact_kernels(net)
        net.train()
        self.net = static_backbone(net) if mode == STATIC else net
        self.builds = ProgramBuilds(self.net.forward) if mode == STATIC else None
        self.params = models.trainable_parameters(net)
        # Every rank starts from rank 0's backbone (what torch's DDP does at construction).
        for p, _ in models.torch_names(net).values():
            comm.broadcast_(p)

        self.head: MarginSoftmaxHead | None = None
        if workload.task == "face":
            self.head = MarginSoftmaxHead(
                workload.num_classes, workload.embedding_size, workload.resolved_margins,
                workload.scale, comm, mode=workload.fc, sample_ratio=workload.sample_ratio,
                update=workload.pfc_update, seed=workload.seed,
                mm_dtype=self.amp_dtype or self.dtype, dtype=self.dtype)
            self.head.straight_through = breaks_margin(align)
            if init is not None:
                self.head.set_weight(np.asarray(init["head/weight"]))
        # The head drew its matrix from its own seed; dropout masks and pfc samples differ by
        # rank from here on.
        paddle.seed(workload.seed * 1000 + 104729 * (comm.rank + 1))
        self.sharded = self.head is not None and self.head.sharded

        make_optimizer = ExactMomentum if self.dtype == "float64" else native_optimizer
        self.opt: Any = make_optimizer(self.params, workload.lr, workload.momentum,
                                       workload.weight_decay)
        self._buckets = _buckets(self.params, self.tuning.ddp_bucket_mb * 2**20)
        # Average (dp, classification) or sum (sharded heads' backbone) of the summed gradients.
        self._mean = 1.0 if self.sharded else 1.0 / comm.world_size

        self.scaler = LossScale() if self.fp16 else None
        self._grad_scale = 1.0
        self._bad: paddle.Tensor | None = None
        self.skipped_steps: list[int] = []
        """0-based indices of the steps that fp16 loss scaling skipped on every rank."""

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None in other precisions)."""
        return self.scaler.scale if self.scaler is not None else None

    @property
    def lr(self) -> float:
        """The rate the optimizer ran the last step at (the workload's base rate before the
        first), read from the optimizer (a read from the device for Paddle's)."""
        return float(self.opt.get_lr())

    def compile_count(self) -> int | None:
        """Static: how many programs dy2static has built for the backbone so far (its program
        cache: one per input shape). Dygraph: None, nothing is compiled."""
        if self.mode != STATIC:
            return None
        return len(self.net.forward.program_cache)

    def compile_seconds(self) -> float:
        """Static: the seconds Paddle has spent building the backbone's programs
        (:class:`ProgramBuilds`). Dygraph: 0.0, nothing is built."""
        return self.builds.seconds() if self.builds is not None else 0.0

    def compile_measure(self) -> str:
        if self.builds is None:
            return "dygraph: nothing is compiled (every operation runs eagerly)"
        return ProgramBuilds.MEASURE

    @property
    def settings(self) -> dict:
        return {"graph": "dynamic (eager)" if self.mode == DYGRAPH else
                "backbone: paddle.jit.to_static(full_graph=True), PIR programs run by Paddle's "
                "executor; head, all-reduce and optimizer dynamic",
                "gradient_allreduce": None if not self.comm.distributed else
                {"after_backward": True, "bucket_mb": self.tuning.ddp_bucket_mb,
                 "buckets": len(self._buckets), "backend": self.comm.backend},
                "optimizer": "alignment.ExactMomentum" if isinstance(self.opt, ExactMomentum)
                else "paddle.optimizer.Momentum(use_multi_tensor=True), L2 decay in op",
                "amp": None if self.amp_dtype is None else f"paddle.amp O1 {self.amp_dtype}",
                "loss_scaling": "dynamic, one overflow decision for all ranks"
                if self.fp16 else None,
                **({"static_executor": static_executor()} if self.mode == STATIC else {})}

    @property
    def pfc_update(self) -> str | None:
        return None if self.head is None else self.head.update

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return paddle.amp.auto_cast(enable=True, level="O1", dtype=self.amp_dtype)

    # ------------------------------------------------------------------------------ step

    def forward_backward(self, images: paddle.Tensor, labels: paddle.Tensor,
                         grad_scale: float = 1.0) -> paddle.Tensor:
        """Forward and backward of this rank's batch (gradients times ``grad_scale``, no
        reduction, no update); returns the loss."""
        out = self.backbone_forward(images)
        loss, root, grad = self.head_loss(out, labels, grad_scale)
        self.backward_from(root, grad)
        return loss

    def backbone_forward(self, images: paddle.Tensor) -> paddle.Tensor:
        with self._autocast():
            return self.net(images)

    def head_loss(self, out: paddle.Tensor, labels: paddle.Tensor, grad_scale: float
                  ) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor | None]:
        """(loss, root, gradient): where the backbone's backward starts. A face head runs its
        forward and its hand-written backward to the embeddings ``out`` (the root, with their
        gradient); classification's root is the loss itself, times ``grad_scale``."""
        if self.head is None:
            # Half-precision logits go to float32; float64 ones (alignment) stay.
            loss = F.cross_entropy(out if out.dtype == paddle.float64 else out.astype("float32"),
                                   labels)
            return loss, (loss * grad_scale if grad_scale != 1.0 else loss), None
        loss, grad = self.head.forward_backward(out, labels, grad_scale)
        return loss, out, grad

    @staticmethod
    def backward_from(root: paddle.Tensor, grad: paddle.Tensor | None) -> None:
        if grad is None:
            root.backward()
        else:
            paddle.autograd.backward([root], [grad])

    @paddle.no_grad()
    def _reduce(self) -> None:
        """Sum the backbone's gradients (and the dp head's) over ranks, in place: each bucket
        packed flat, all-reduced, and written back."""
        comm = self.comm
        if not comm.distributed:
            return
        grads = [p.grad for p in self.params]
        for bucket in self._buckets:
            flat = comm.all_reduce_sum_(paddle.concat([grads[i].reshape([-1]) for i in bucket]))
            parts = paddle.split(flat, [int(np.prod(grads[i].shape)) for i in bucket])
            for i, part in zip(bucket, parts):
                paddle.assign(part.reshape(grads[i].shape), output=grads[i])
        if self.head is not None and not self.sharded:
            comm.all_reduce_sum_(self.head.grad)

    @paddle.no_grad()
    def _overflow(self) -> paddle.Tensor:
        """A [1] tensor, nonzero where any gradient of any rank is not finite (device side)."""
        arrays = [p.grad for p in self.params] + ([self.head.grad] if self.head else [])
        finite = paddle.stack([paddle.isfinite(a).all() for a in arrays]).all()
        return self.comm.all_reduce_sum_(paddle.logical_not(finite).astype("float32")
                                         .reshape([1]))

    @paddle.no_grad()
    def _scale_and_clip(self, factor: float) -> None:
        """Backbone gradients times ``factor`` (the dp mean, the fp16 unscaling) and the clip
        coefficient of the scaled gradient's global norm; the coefficient stays on the device.
        The norm is kept in ``last_grad_norm``; without clipping it is computed only where
        ``keep_grad_norm`` asks for it."""
        grads = [p.grad for p in self.params]
        clip = self.workload.clip_grad_norm
        if clip is None or not grads:
            if self.keep_grad_norm and grads:
                self.last_grad_norm = _global_norm(grads) * factor
            if factor != 1.0:
                for g in grads:
                    g.scale_(factor)
            return
        norm = self.last_grad_norm = _global_norm(grads) * factor
        coef = paddle.clip(clip / (norm + 1e-6), max=1.0) * factor
        for g in grads:
            g.multiply_(coef)

    def compute_gradients(self, images: paddle.Tensor, labels: paddle.Tensor
                          ) -> paddle.Tensor:
        """Forward, backward and the gradient sum over ranks (no update); returns the loss.
        The summed gradients are in the parameters' ``grad`` and the head's ``grad``, times the
        loss scale in fp16; ``apply`` turns them into the update."""
        self._grad_scale = self.loss_scale if self.fp16 else 1.0
        loss = self.forward_backward(images, labels, self._grad_scale)
        self._reduce()
        self._bad = self._overflow() if self.fp16 else None
        return loss

    def apply(self) -> None:
        """Average (dp), unscale, clip and step (or, in fp16 after an overflow anywhere, skip)
        with this step's rate."""
        wl = self.workload
        lr = wl.lr_at(self.step_index)
        step = True
        if self._bad is not None:
            step = float(self._bad.numpy()[0]) == 0.0  # the one read-back of an fp16 step
            self.scaler.update(step)
        if step:
            self._scale_and_clip(self._mean / self._grad_scale)
            self.opt.set_lr(lr)
            self.opt.step()
            if self.head is not None:
                head_mean = 1.0 if self.sharded else 1.0 / self.comm.world_size
                self.head.sgd_step(lr, wl.momentum, wl.weight_decay,
                                   head_mean / self._grad_scale)
        else:
            self.skipped_steps.append(self.step_index)
        # Paddle's default: zeroed in place. Freeing them instead (set_to_zero=False) made the
        # next backward fault in ~100 MB of fresh pages on a CPU, 4% of a ResNet50 step at
        # batch 2 (benchmarks/results/native_parity-cpu/README.md).
        self.opt.clear_grad()
        self.step_index += 1

    def __call__(self, images: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
        loss = self.compute_gradients(images, labels)
        self.apply()
        # The loop keeps every step's loss until its window ends: an attached one would keep
        # its step's autograd graph (and the memory it holds) alive with it.
        return loss.detach()

    def profiled(self, images: paddle.Tensor, labels: paddle.Tensor, clock: PhaseClock
                 ) -> paddle.Tensor:
        """The step of ``__call__`` phase by phase on ``clock`` (``backends.phases``). The
        gradient all-reduce is a call of its own after the backward, so ``grad_comm`` holds all
        of it; fp16's overflow vote belongs to loss scaling and runs in ``optimizer``, with the
        clip, the updates and the zeroing of the gradients (which end the step, as in
        ``apply``)."""
        self._grad_scale = self.loss_scale if self.fp16 else 1.0
        with clock.phase("backbone_forward"):
            out = self.backbone_forward(images)
        with clock.phase("head"):
            loss, root, grad = self.head_loss(out, labels, self._grad_scale)
        with clock.phase("backward"):
            self.backward_from(root, grad)
        if self.comm.distributed:
            with clock.phase("grad_comm"):
                self._reduce()
        with clock.phase("optimizer"):
            self._bad = self._overflow() if self.fp16 else None
            self.apply()
        return loss.detach()
