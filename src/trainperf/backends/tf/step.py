"""The training step that trainperf measures in TensorFlow, equal to torch's ``TrainStep``.

One ``tf.function`` runs a whole step inside ``strategy.run``: backbone forward (training-mode
BatchNorm, dropout), head or softmax loss, gradients by ``tf.GradientTape``, the gradient
all-reduce, clipping and the SGD update. It returns this rank's loss and a marker, without
reading anything back to the host: the loop decides every sync.

Modes (``MODES``, the backend's ``Capabilities.modes``): ``function`` traces the step into a
graph that Grappler rewrites and TensorFlow's executor runs op by op (``jit_compile=False``);
``xla`` compiles the whole traced step, the collectives of several GPU ranks (NCCL) included,
into one XLA program (``jit_compile=True``), so every shape in it must be known when it is
traced, and every collective must be one XLA lowers: the all-reduce, so a sharded head gathers
by a sum (``comm.XLA_COLLECTIVES``, ``Comm.all_gather_by_sum``). A sampling ``pfc`` grows its
sample on the device to hold every positive, a size XLA cannot compile, and TensorFlow compiles
no collective for CPU devices: the backend refuses those cases under ``xla``
(``backend.xla_refusal``). Both modes trace once, before the first call
(``trace``, timed by the worker: ``compiling.py``); a second trace (``traces``) is a
recompilation.

Gradients, as torch's DDP set-up:

- ``dp`` and classification: every gradient (backbone and the whole class matrix) is the mean
  over ranks, in batched all-reduces of about ``pack_bytes`` each (``Comm.all_reduce_mean``,
  ``--ddp-bucket-mb``). Each rank's loss is the mean over its own batch, so the mean of the
  gradients is the gradient of the global-batch mean.
- ``mp`` and ``pfc``: the loss is the mean over the gathered global batch, the same on every
  rank, and each rank differentiates its share of it (``heads.py``), so each rank's backbone
  gradient is one partial of the true gradient: they are summed (``Comm.all_reduce_sum``). The
  class-matrix shard's gradient stays local.

The class matrix's update: ``dp``, ``mp`` and ``pfc`` without sampling run the update below on
the whole matrix (shard). A sampling ``pfc`` takes the gradient of the sampled rows only (the
gather's output) and, ``sparse`` (default), applies it to those rows (``sparse_momentum``):
``buf[rows] = m * buf[rows] + g + wd * w[rows]; w[rows] -= lr * buf[rows]``, momentum kept per
row, the rows not sampled and their momentum untouched (the Partial FC paper, PLSC). ``dense``
reproduces insightface's arcface_torch: the whole shard's gradient (zero off the sample),
momentum and weight decay on every row, every step.

Clipping (face recipes): the reduced backbone gradient is scaled by ``min(1, max_norm / (norm +
1e-6))``, ``norm`` its global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` (not
``tf.clip_by_global_norm``, which divides by ``max(norm, max_norm)``). The class matrix is not
clipped, as in torch.

SGD: torch's ``buf = m * buf + g + wd * w; w -= lr * buf`` for every trainable array (BatchNorm
and PReLU included, as torch's SGD does), written with TensorFlow's fused
``ResourceApplyMomentum`` (``accum = accum * m + grad; var -= lr * accum``: torch's rule exactly,
given ``grad = g + wd * w``; zero-initialised buffers make the first step ``buf = g + wd * w``, as
torch). Not Keras' SGD, whose momentum form and weight decay differ. The rate comes from the
step counter on the device (``lr_steps`` / ``lr_scales``), so no value crosses from the host.

Precision: ``fp32``; ``fp16`` on a GPU as mixed precision: images, convolutions, BatchNorm,
PReLU, dense layers and the class-matrix product in float16 with float32 variables (the casts
sit in the layers), the margin and softmax in float32, and dynamic loss scaling of torch's policy
(start 2**16, halve on an overflow, double after 2000 clean steps) kept entirely on the device:
the overflow flag is taken after the all-reduce, so every rank sees the same gradients and makes
the same decision (a sharded head's local gradient adds its own flag to the all-reduce), and
``tf.cond`` skips the update without a host read-back. ``fp16`` on a CPU and ``bf16`` anywhere
are refused (``check_precision``).

Strict alignment (``AlignSpec``): ``dtype="float64"`` holds every variable, BatchNorm statistic,
momentum buffer, rate and input in float64 and computes the whole step in it (BatchNorm composed
of ``tf.nn`` ops, the fused kernel having no float64 version); ``keep_state`` also keeps, on the
device, each step's gradient norm before clipping (computed even where the workload does not
clip) and the rate the update ran at, for ``StepState``. Neither adds an op to other runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from ...config import Workload
from ..base import require
from ..scaling import (BACKOFF as LOSS_SCALE_BACKOFF, GROWTH as LOSS_SCALE_GROWTH,
                       INIT as LOSS_SCALE_INIT, INTERVAL as LOSS_SCALE_INTERVAL)
from ..workerkit import start_batch
from . import models
from .backend import BACKEND, xla_refusal
from .comm import Comm
from .heads import MarginSoftmaxHead

CLIP_EPS = 1e-6
MODES = ("function", "xla")
SPARSE_UPDATE_OPS = frozenset({"ResourceGather", "Mul", "AddV2", "ResourceScatterUpdate",
                               "ResourceScatterAdd", "ResourceScatterSub"})
"""The ops of ``sparse_momentum``, each with a GPU kernel in TensorFlow 2.21 for float16, float32
and float64, int32 indices: ``tensorflow/core/kernels/resource_variable_ops.cc`` registers
ResourceGather for ``DEVICE_GPU`` over ``TF_CALL_GPU_ALL_TYPES``, and ResourceScatterUpdate,
ResourceScatterAdd and ResourceScatterSub over ``TF_CALL_GPU_NUMBER_TYPES``
(``REGISTER_SCATTER_ARITHMETIC_GPU``); the cwise kernels, Mul and AddV2 (``cwise_op_mul_1.cc``,
``cwise_op_add_1.cc``); the 2.21.0 CUDA wheel's registry lists a ``GPU`` kernel for each. Not
``ResourceSparseApplyMomentum``: ``core/kernels/training_ops.cc`` registers it for
``DEVICE_CPU`` only ("this op works on cpu only"), so on a GPU its variable would be read and
written across the PCIe bus, or not placed. ``tests/test_tf_device_ops.py`` keeps the ops traced
here equal to this set."""


def sparse_momentum(var: tf.Variable, buf: tf.Variable, rows: tf.Tensor, grad: tf.Tensor,
                    index: tf.Tensor, rate: tf.Tensor, momentum: tf.Tensor,
                    weight_decay: float) -> list[tf.Operation]:
    """torch's SGD on rows ``index`` (unique) of ``var`` and their momentum ``buf`` only:
    ``rows`` is ``var[index]`` as the step read it, ``grad`` its gradient. The arithmetic of
    ``ResourceSparseApplyMomentum`` and its roundings (``accum = accum * m + g; var -= lr *
    accum``, per row, ``g`` the gradient plus the weight decay), with ops that have GPU kernels
    (``SPARSE_UPDATE_OPS``). Each sum is a scatter-add, not an add of tensors: Grappler's
    arithmetic optimizer would turn a chain of adds into one AddN, in another order."""
    decayed = grad + weight_decay * rows
    kept = tf.raw_ops.ResourceGather(resource=buf.handle, indices=index, dtype=buf.dtype)
    return [tf.raw_ops.ResourceScatterUpdate(resource=buf.handle, indices=index,
                                             updates=kept * momentum),
            tf.raw_ops.ResourceScatterAdd(resource=buf.handle, indices=index, updates=decayed),
            tf.raw_ops.ResourceScatterSub(
                resource=var.handle, indices=index,
                updates=rate * tf.raw_ops.ResourceGather(resource=buf.handle, indices=index,
                                                         dtype=buf.dtype))]


def check_precision(precision: str, device_type: str) -> None:
    """ValueError unless the backend's declaration runs ``precision`` on this device."""
    require(BACKEND.precision_refusal(precision, "cuda" if device_type in ("gpu", "cuda")
                                      else "cpu"))


def synthetic_batch(workload: Workload, rank: int, device: str) -> tuple[tf.Tensor, tf.Tensor]:
    """One batch per rank, seeded by (seed, rank) so ranks see different samples: normal NHWC
    images and uniform labels, drawn with numpy and put on ``device`` once."""
    rs = np.random.RandomState(workload.seed * 1000 + rank + 1)
    side = workload.input_size
    images = rs.standard_normal((workload.batch_size, side, side, 3)).astype(np.float32)
    labels = rs.randint(0, workload.num_classes, workload.batch_size)
    return to_device(workload, images, labels, device)


def init_batch(workload: Workload, arrays: Any, rank: int, device: str, dtype: str = "float32"
               ) -> tuple[tf.Tensor, tf.Tensor]:
    """Rank ``rank``'s batch from an alignment file (``AlignSpec.start``: NCHW images), its
    images in ``dtype`` (the run's)."""
    images, labels = start_batch(workload, arrays, rank, dtype)
    return to_device(workload, images.transpose(0, 2, 3, 1), labels, device, dtype)


def to_device(workload: Workload, images: np.ndarray, labels: np.ndarray, device: str,
              dtype: str = "float32") -> tuple[tf.Tensor, tf.Tensor]:
    """Images in the step's input dtype (float16 under mixed precision, else ``dtype``, the
    variables') and int32 labels, on ``device``."""
    tf_dtype = tf.float16 if workload.precision == "fp16" else tf.as_dtype(dtype)
    with tf.device(device):
        return (tf.constant(np.ascontiguousarray(images, dtype=dtype), dtype=tf_dtype),
                tf.constant(np.asarray(labels), dtype=tf.int32))


def _all_finite(arrays: list[tf.Tensor]) -> tf.Tensor:
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(a)) for a in arrays])


class TrainStep:
    """Call with (images, labels); returns (this rank's loss, marker) as device tensors. The
    marker is the step counter read after every update of the step has run.

    ``dtype``: what the variables, buffers and the step's arithmetic are in (float64 for a
    strict alignment run); ``keep_state``: keep each step's gradient norm and rate
    (``grad_norm``, ``rate``); ``straight_through``: the head's negative control;
    ``pack_bytes``: the size of the gradient all-reduce's packs (0: one)."""

    def __init__(self, workload: Workload, comm: Comm, init: Any = None,
                 dtype: str = "float32", keep_state: bool = False,
                 straight_through: bool = False, mode: str = "function",
                 pack_bytes: int = 0) -> None:
        require(BACKEND.model_refusal(workload))
        if mode not in MODES:
            raise ValueError(f"the TensorFlow step runs in mode {', '.join(MODES)}, not {mode!r}")
        check_precision(workload.precision, comm.device_type)
        if mode == "xla":
            require(xla_refusal(workload, comm.world_size,
                                "cuda" if comm.device_type == "gpu" else "cpu"))
        self.mode = mode
        self.workload = workload
        self.comm = comm
        self.pack_bytes = int(pack_bytes)
        self.fp16 = workload.precision == "fp16"
        self.dtype = tf.as_dtype(dtype)
        if self.fp16 and self.dtype != tf.float32:
            raise ValueError("mixed float16 keeps float32 variables; not " + dtype)
        compute = tf.float16 if self.fp16 else self.dtype
        with tf.device(comm.tf_device):
            self.backbone = models.build_backbone(
                workload.backbone, embedding_size=workload.embedding_size,
                num_classes=workload.num_classes, input_size=workload.input_size,
                output_block=workload.output_block, dropout=workload.dropout,
                seed=workload.seed, dtype=dtype)
            if init is not None:
                models.load_torch_arrays(self.backbone, init)
            self.head: MarginSoftmaxHead | None = None
            if workload.task == "face":
                self.head = MarginSoftmaxHead(
                    workload.num_classes, workload.embedding_size, workload.resolved_margins,
                    workload.scale, comm=comm, mode=workload.fc,
                    sample_ratio=workload.sample_ratio, update=workload.pfc_update,
                    seed=workload.seed, compute_dtype=compute, dtype=self.dtype,
                    straight_through=straight_through, gather_by_sum=mode == "xla")
                if init is not None:
                    self.head.set_weight(np.asarray(init["head/weight"]))
            self.sharded = self.head is not None and self.head.sharded
            self.sparse = self.head is not None and self.head.sparse
            self.backbone_vars = self.backbone.trainable_variables
            self.variables = self.backbone_vars + ([self.head.weight] if self.head else [])
            self.buffers = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                            for v in self.variables]
            self.step_count = tf.Variable(0, dtype=tf.int64, trainable=False)
            # Alignment runs only: what the last step's update saw (before the first step, no
            # norm, NaN, and the schedule's first rate).
            self.grad_norm: tf.Variable | None = None
            self.rate: tf.Variable | None = None
            if keep_state:
                self.grad_norm = tf.Variable(float("nan"), dtype=self.dtype, trainable=False)
                self.rate = tf.Variable(self._rate(), trainable=False)
            self.loss_scale = tf.Variable(LOSS_SCALE_INIT if self.fp16 else 1.0,
                                          dtype=tf.float32, trainable=False)
            self.clean_steps = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._fn = tf.function(self._step, jit_compile=mode == "xla", autograph=False)

    @property
    def traces(self) -> int:
        """How many times the step's function has been traced (each trace a new graph and,
        under XLA, a new compilation)."""
        return self._fn.experimental_get_tracing_count()

    def trace(self, images: tf.Tensor, labels: tf.Tensor) -> None:
        """Trace the step into its graph for this batch's shapes and dtypes, running nothing,
        so that a call with such a batch finds the graph in the function's cache (where it is
        there already, only the lookup runs)."""
        self._fn.get_concrete_function(images, labels)

    @property
    def pfc_update(self) -> str | None:
        """Which class-matrix update runs: ``full``, ``sparse`` or ``dense`` (None without a
        head)."""
        return None if self.head is None else self.head.update

    @property
    def settings(self) -> dict:
        return {"strategy": type(self.comm.strategy).__name__,
                "communication": self.comm.communication,
                "variables": "plain per-process variables, gradients all-reduced in the "
                             "replica context",
                "graph": BACKEND.capabilities.mode_words[self.mode],
                "update": "ResourceApplyMomentum (torch's SGD rule)"
                + ("; class rows: the same rule, gathered and scattered back (sparse_momentum)"
                   if self.sparse else ""),
                "gradient_pack_bytes": self.pack_bytes if self.comm.distributed else None,
                "backbone_gradient": "sum over ranks" if self.sharded else "mean over ranks",
                "mixed_precision": "float16" if self.fp16 else None,
                "loss_scaling": "dynamic, on the device, one decision for all ranks"
                if self.fp16 else None}

    # ------------------------------------------------------------------------------ graph

    def _rate(self) -> tf.Tensor:
        """The rate of the step the counter is at: ``lr``, times each scale from its boundary
        on (``Workload.lr_at``'s rule), in the variables' dtype."""
        wl = self.workload
        rate = tf.constant(wl.lr, self.dtype)
        for boundary, factor in zip(wl.lr_steps, wl.lr_scales):
            rate = tf.where(self.step_count >= boundary, tf.constant(wl.lr * factor, self.dtype),
                            rate)
        return rate

    def gradients(self, images: tf.Tensor, labels: tf.Tensor
                  ) -> tuple[tf.Tensor, list[tf.Tensor], tuple[tf.Tensor, tf.Tensor] | None]:
        """This rank's loss and the gradients of what it differentiates (times the loss scale
        in fp16), not reduced over ranks: one per variable, the class matrix's dense (the
        whole matrix or shard; zero off a dense pfc's sample), or for a sparse pfc the
        sampled rows'. The last: a sparse pfc's (sampled row index, the rows' values), or
        None."""
        head = self.head
        with tf.GradientTape() as tape:
            out = self.backbone(images, training=True)
            if head is None:
                # float32 at least: float16 logits are widened, float64 ones kept.
                loss = objective = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels, tf.cast(out, self.dtype)))
                sources, sample = self.variables, None
            else:
                selection = head.select(labels)
                rows = head.rows(selection)
                loss = head.logits_and_loss(out, selection, rows)[1]
                objective = head.replica_objective(loss)
                sources = self.backbone_vars + [rows if self.sparse else head.weight]
                sample = (selection.index, rows) if self.sparse else None
            scaled = objective * self.loss_scale if self.fp16 else objective
        grads = tape.gradient(scaled, sources)
        # Each in its variable's dtype (float32, float64 in an alignment run); a dense pfc's
        # gather gradient (indexed slices) as the whole shard's.
        return loss, [tf.cast(tf.convert_to_tensor(g), v.dtype)
                      for g, v in zip(grads, self.variables)], sample

    def _reduce(self, grads: list[tf.Tensor]) -> tuple[list[tf.Tensor], tf.Tensor | None]:
        """Gradients over ranks (module doc) and, for a sharded head in fp16, how many ranks'
        local shard gradients are not all finite (None otherwise)."""
        if not self.sharded:
            return self.comm.all_reduce_mean(grads, self.pack_bytes), None
        nb = len(self.backbone_vars)
        local = grads[nb:]
        flag = []
        if self.fp16:
            # The shard's gradient is not reduced: its overflow travels as a count, so that
            # every rank makes the same decision.
            flag = [tf.cast(tf.logical_not(_all_finite(local)), tf.float32)]
        reduced = self.comm.all_reduce_sum(grads[:nb] + flag, self.pack_bytes)
        return reduced[:nb] + local, (reduced[nb] if self.fp16 else None)

    def _update(self, grads: list[tf.Tensor], sample: tuple[tf.Tensor, tf.Tensor] | None
                ) -> list[tf.Operation]:
        """Clip the backbone's part and apply SGD to every variable, to a sparse pfc's sampled
        rows only (and, in an alignment run, keep the norm before clipping and the rate)."""
        wl = self.workload
        grads = list(grads)
        nb = len(self.backbone_vars)
        ops = []
        if (wl.clip_grad_norm is not None or self.grad_norm is not None) and nb:
            norm = tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads[:nb]]))
            if self.grad_norm is not None:
                ops.append(self.grad_norm.assign(norm))
            if wl.clip_grad_norm is not None:
                coef = tf.minimum(wl.clip_grad_norm / (norm + CLIP_EPS), 1.0)
                grads[:nb] = [g * coef for g in grads[:nb]]
        rate = self._rate()
        if self.rate is not None:
            ops.append(self.rate.assign(rate))
        momentum = tf.constant(wl.momentum, self.dtype)
        for var, buf, grad in zip(self.variables, self.buffers, grads):
            if sample is not None and var is self.head.weight:
                index, rows = sample
                ops.extend(sparse_momentum(var, buf, rows, grad, index, rate, momentum,
                                           wl.weight_decay))
                continue
            ops.append(tf.raw_ops.ResourceApplyMomentum(
                var=var.handle, accum=buf.handle, lr=rate, grad=grad + wl.weight_decay * var,
                momentum=momentum, use_locking=False, use_nesterov=False))
        return ops

    def _replica(self, images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor,
                                                                       tf.Tensor]:
        loss, grads, sample = self.gradients(images, labels)
        grads, shards_bad = self._reduce(grads)
        if not self.fp16:
            with tf.control_dependencies(self._update(grads, sample)):
                marker = self.step_count.assign_add(1)
            return loss, marker, tf.constant(False)
        grads = [g / self.loss_scale for g in grads]
        # After the all-reduce: an inf or NaN on any rank is in every rank's reduced gradient.
        finite = _all_finite(grads)
        if shards_bad is not None:
            finite = tf.logical_and(finite, shards_bad == 0.0)

        def step():
            with tf.control_dependencies(self._update(grads, sample)):
                grown = self.clean_steps + 1 >= LOSS_SCALE_INTERVAL
                return tf.group(
                    self.loss_scale.assign(tf.where(grown, self.loss_scale * LOSS_SCALE_GROWTH,
                                                    self.loss_scale)),
                    self.clean_steps.assign(tf.where(grown, tf.constant(0, tf.int64),
                                                     self.clean_steps + 1)))

        def skip():
            return tf.group(self.loss_scale.assign(self.loss_scale * LOSS_SCALE_BACKOFF),
                            self.clean_steps.assign(0))

        done = tf.cond(finite, step, skip)
        with tf.control_dependencies([done]):
            marker = self.step_count.assign_add(1)
        return loss, marker, tf.logical_not(finite)

    def _step(self, images: tf.Tensor, labels: tf.Tensor):
        return self.comm.strategy.run(self._replica, args=(images, labels))

    def __call__(self, images: tf.Tensor, labels: tf.Tensor
                 ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """(loss, marker, skipped): device tensors of this step, nothing waited for."""
        return self._fn(images, labels)
