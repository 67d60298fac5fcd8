"""The training step that trainperf measures in MXNet, equal to torch's ``TrainStep``.

Backbone (a Gluon block recorded by autograd), head (``heads.py``, forward and backward by
hand, its embedding gradient injected with ``backward(out_grad)``), gradient all-reduce
(``comm.py``: Horovod's, or a kvstore's), clipping, SGD with momentum and weight decay.

Modes (``backend.MODES``): ``hybrid`` (the default, the seeds' MXNet) hybridizes the backbone
with ``static_alloc`` and ``static_shape``: Gluon traces it into one graph at the first step and
runs it as a ``CachedOp`` whose memory is planned once (that build is counted and timed where
Gluon does it, :class:`GraphBuilds`); ``imperative`` leaves it a plain Gluon block, each
operator dispatched from Python as the forward reaches it and recorded by autograd (the backward
replays the recorded operators). The head, the collectives and the update are NDArray
operations in both modes, so only the backbone's execution differs. Both run the same
operators (PReLU composed from elementwise ones, ``models.PReLU``, in both): their float32
losses agree to rounding (tiny-arcface's first, to one float32 ulp), and both align with torch
in float64, with the same stand-ins (``tests/test_mxnet_modes.py``). Nothing is read back
to the host inside a step except, in fp16, the one overflow decision of loss scaling, and in a
sampling ``pfc`` head the count of positives when it could exceed the sample
(``heads.sample_classes``).

Gradients, as torch's DDP set-up:

- ``dp`` and classification: every gradient (backbone and the whole class matrix) is the mean
  over ranks: the collective sums, the update divides by the world size (``rescale_grad``).
- ``mp`` and ``pfc``: the loss is the mean over the gathered global batch and the same on every
  rank, so each rank's backbone gradient is one partial of the true gradient: they are summed,
  not averaged. The class-matrix shard's gradient stays local.
- kvstore ``device`` (several contexts in one process) combines per-context gradients like
  ``dp`` over processes; each context then updates its own copy, as Gluon's Trainer does
  without ``update_on_kvstore``.

Clipping: the backbone's gradient (the reduced one) is scaled by ``min(1, max_norm / (norm +
1e-6))`` with ``norm`` its global L2 norm, as ``torch.nn.utils.clip_grad_norm_``. The norm, the
coefficient and their use stay on the device. On a GPU the fused update takes per-array learning
rates and weight decays as device arrays (``preloaded_multi_sgd_mom_update``), so the clipped
update ``lr * (coef * g + wd * w)`` runs as ``(lr * coef) * (g + (wd / coef) * w)``. On a CPU
MXNet's multi-tensor kernels run on one thread (ResNet50's 161 arrays: 143 ms a step, against
30 ms for ``sgd_mom_update`` array by array on 2 threads), so there each array takes
``sgd_mom_update`` and the coefficient scales the gradients in place first, as gluon's
``clip_global_norm`` does.

SGD: torch's ``buf = m * buf + g + wd * w; w -= lr * buf``. MXNet's fused op keeps ``mom = m *
mom - lr * (g + wd * w); w += mom``, which is the same with ``mom = -lr * buf`` while the rate is
constant; when the rate changes (``lr_steps``) the momentum is rescaled by ``new / old`` before
the update, so the two stay identical at every step (this needs a nonzero rate at every step).
A sparse ``pfc`` head's class matrix takes the same update on the rows it sampled (insightface's
memory bank): those rows of the weight and of its momentum are gathered, updated with the same
kernel (weight decay on them only) and written back; rows not sampled keep their weights and
momentum (the rate change's rescaling, which keeps every row's momentum in the current rate's
form, aside).

Precision: ``fp16`` uses MXNet AMP (``mxnet.contrib.amp.init``: convolutions and fully
connected layers in half precision, fp32 master weights and gradients) with dynamic loss scaling
of torch's policy (start 2**16, halve on an overflow, double after 2000 clean steps). The head
runs its three class-matrix products in half precision with the loss scale folded into its
gradient (as torch's autocast head does), its margin and softmax in fp32. The overflow check
covers every gradient of every rank and is one decision for all of them; it is read back to the
host (the skip is host control flow), so the scale lives on the host and unscaling is folded
into the update's ``rescale_grad``. GPU only: MXNet has no half-precision GEMM on a CPU.
``bf16`` is refused everywhere: MXNet 1.9's bfloat16 AMP is a oneDNN CPU feature with no CUDA
path, and the CPU path has not been made to run the same head (untried).

Strict alignment (``AlignSpec``, ``trainperf align``): the run is held and computed in the
spec's dtype, float64 included: the network is cast (MXNet's native CPU kernels take float64;
oneDNN's do not, and are not used for it), the head, the inputs, the gradients and the momentum
are in that dtype too. Three of MXNet's kernels cannot compute exactly in float64, so a float64
run replaces them by stand-ins of MXNet's elementwise operations, whose scalars are C doubles,
that follow the same rule: the fused SGD (``preloaded_multi_sgd_mom_update`` takes its rates
and decays as float32 arrays, its momentum as a C float, 0.9 -> 0.89999998) by
:func:`momentum_sgd`; ``multi_sum_sq`` (its output is float32) by a sum of squares per array
in the arrays' dtype (:func:`global_norm`); BatchNorm's running-statistics update (its
momentum a C float) by ``alignment.MXNetRunningStatistics`` (and the head's ``clip``, whose
bounds are C floats, by ``heads._clamp``). ``tests/test_mxnet_standins.py`` shows each stand-in
computing what its native kernel computes, in float32. The gradient norm
before clipping and the rate of the last update are kept for the dump (``last_grad_norm``,
``last_lr``).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import mxnet as mx
import numpy as np
from mxnet import autograd

from ...config import AlignSpec, Topology, Tuning, Workload
from ..base import require
from ..scaling import LossScale
from ..workerkit import breaks_margin, computes_in, dumps_state, start_batch
from . import models
from .alignment import MXNetRunningStatistics
from .backend import BACKEND, HYBRID, kvstore_rules
from .comm import Comm
from .heads import MarginSoftmaxHead, put_rows

UPDATE_CHUNK = 45
"""Arrays per fused update / sum-of-squares call (MXNet's multi-tensor kernels take a bounded
number; its own LAMB optimizer uses 45)."""

_AMP_ON = False


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + UPDATE_CHUNK, n)) for i in range(0, n, UPDATE_CHUNK)]


def global_norm(grads: Sequence[mx.nd.NDArray], rescale: float, fused: bool) -> mx.nd.NDArray:
    """The global L2 norm of ``grads`` times ``rescale`` ([1], on the device). ``fused``: MXNet's
    ``multi_sum_sq``, whose output is float32 whatever the input (on a CPU it adds each array's
    squares one after another in a float32); otherwise (the stand-in of wider dtypes) each
    array's ``sum`` of squares in its own dtype, exact to rounding. Either way the per-array
    sums are added and rooted in their dtype."""
    if fused:
        sums = [mx.nd.multi_sum_sq(*grads[part], num_arrays=part.stop - part.start)
                for part in _chunks(len(grads))]
    else:
        sums = [mx.nd.sum(mx.nd.square(g)).reshape((1,)) for g in grads]
    return mx.nd.sqrt(mx.nd.sum(mx.nd.concat(*sums, dim=0))) * rescale


def momentum_sgd(weights: Sequence[mx.nd.NDArray], grads: Sequence[mx.nd.NDArray],
                 moms: Sequence[mx.nd.NDArray], momentum: float, lr: float, wd: float,
                 rescale: float, coef: mx.nd.NDArray | None = None) -> list[mx.nd.NDArray]:
    """The fused update's rule (``preloaded_multi_sgd_mom_update``) with elementwise
    operations, whose scalars MXNet takes as C doubles, in place: ``mom = momentum * mom - lr *
    (coef * rescale * g + wd * w); w += mom``, ``coef`` a [1] array or None (1). The stand-in
    of float64 runs (module doc). Returns a view of one updated element (for the step's
    marker)."""
    for w, g, mom in zip(weights, grads, moms):
        d = g * rescale if coef is None else mx.nd.broadcast_mul(g, coef * rescale)
        mom[:] = mom * momentum - (d + w * wd) * lr
        w += mom
    return [weights[-1].reshape((-1,))[0:1]]


def check_precision(precision: str, device_type: str) -> None:
    """ValueError unless the backend's declaration runs ``precision`` on this device."""
    require(BACKEND.precision_refusal(precision, "cuda" if device_type in ("gpu", "cuda")
                                      else "cpu"))


def enable_amp() -> None:
    """Turn on MXNet AMP (float16) once per process, before any network runs."""
    global _AMP_ON
    if not _AMP_ON:
        from mxnet.contrib import amp
        amp.init(target_dtype="float16")
        _AMP_ON = True


def check_alignment(workload: Workload, comm: Comm, dtype: str) -> None:
    """ValueError unless an alignment run in ``dtype`` can run as asked: it computes in one
    dtype throughout (no AMP) and dumps one rank per process."""
    if workload.precision != "fp32":
        raise ValueError(f"an alignment run computes in {dtype} throughout: --precision fp32, "
                         f"not {workload.precision}")
    if len(comm.contexts) > 1:
        raise ValueError("an alignment run dumps one rank per process: horovod or dist_sync, "
                         "not device")


def synthetic_batch(workload: Workload, rank: int, ctx: mx.Context
                    ) -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    """One batch per rank, seeded by (seed, rank) so ranks see different samples: normal images
    [B, 3, H, W] and uniform labels, made once with numpy (float64 labels: exact class ids for
    the head's float64 label all-gather; classification takes them as float32)."""
    rs = np.random.RandomState(workload.seed * 1000 + rank + 1)
    side = workload.input_size
    images = rs.standard_normal((workload.batch_size, 3, side, side)).astype(np.float32)
    labels = rs.randint(0, workload.num_classes, workload.batch_size)
    return to_device(workload, images, labels, ctx)


def to_device(workload: Workload, images: np.ndarray, labels: np.ndarray, ctx: mx.Context,
              dtype: str = "float32") -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    """Images in ``dtype`` and labels as the step takes them: float64 class ids for the face
    head, float32 for classification's ``pick`` (exact class ids; ``pick`` takes float32
    indices into float64 data too)."""
    return (mx.nd.array(np.asarray(images, dtype=dtype), ctx=ctx, dtype=dtype),
            mx.nd.array(np.asarray(labels), ctx=ctx, dtype=label_dtype(workload)))


def label_dtype(workload: Workload) -> str:
    """The labels' dtype on the device (``to_device``)."""
    return "float64" if workload.task == "face" else "float32"


def init_batch(workload: Workload, arrays: Any, rank: int, ctx: mx.Context,
               dtype: str = "float32") -> tuple[mx.nd.NDArray, mx.nd.NDArray]:
    """Rank ``rank``'s batch from an alignment file (``AlignSpec.start``), images in
    ``dtype``."""
    return to_device(workload, *start_batch(workload, arrays, rank, dtype), ctx, dtype)


class GraphBuilds:
    """How many times a hybridized network's graph was made ready to run, and the seconds Gluon
    spent building it. Builds: each time Gluon built its ``CachedOp`` (at the first call, and
    again after anything cleared it: a ``hybridize``, a ``cast``); plans: each time the
    ``CachedOp`` planned it again for an input whose shape or dtype differs from the last one on
    that context (with ``static_shape`` MXNet infers the graph's shapes and types, plans and
    allocates its memory again then; the first call on each context is part of the build).
    MXNet keeps no such count itself: the builds are counted and timed by wrapping the
    network's ``_build_cache`` (Gluon 1.9's own method that traces ``hybrid_forward`` into a
    symbol and constructs the ``CachedOp``, whose constructor derives the backward graph), the
    plans counted by the inputs the step hands the network. A plan runs in C++ inside the
    ``CachedOp``'s forward and backward calls, with their operators' dispatch, so no timer
    can hold it alone: :attr:`seconds` leaves it out (``MEASURE``)."""

    MEASURE = ("Gluon HybridBlock._build_cache, every build summed (hybrid_forward traced into "
               "a symbol, the CachedOp constructed with its backward graph); not the "
               "static_alloc shape inference and memory planning MXNet runs inside the "
               "CachedOp's first forward and backward calls on each context (and again on a "
               "re-plan), which cannot be timed apart from those calls' operator dispatch")
    """What :attr:`seconds` holds (``compile_measure``)."""

    def __init__(self, net: mx.gluon.HybridBlock) -> None:
        self.builds = 0
        self.replans = 0
        self.seconds = 0.0
        """Host seconds spent inside ``_build_cache``, over every build. It waits on nothing
        the engine runs: tracing and the ``CachedOp``'s construction are host work."""
        self._last: dict[str, tuple] = {}
        build = net._build_cache

        def counted(*args: Any) -> Any:
            self.builds += 1
            self._last.clear()  # a new CachedOp plans every context afresh
            begin = time.perf_counter()
            try:
                return build(*args)
            finally:
                self.seconds += time.perf_counter() - begin

        net._build_cache = counted

    def saw(self, images: mx.nd.NDArray) -> None:
        """Note an input the network is about to run."""
        where, signature = str(images.context), (images.shape, images.dtype)
        last = self._last.get(where)
        if last is not None and last != signature:
            self.replans += 1
        self._last[where] = signature

    @property
    def count(self) -> int:
        return self.builds + self.replans


class TrainStep:
    """Call with one (images, labels) pair per context of ``comm``; returns the loss NDArray of
    the first context (rank 0's loss in ``device`` mode) without waiting for it.

    ``init``: an alignment start's arrays (``workerkit.load_init``); ``align``: the alignment
    run's spec (its dtype, whether it dumps, its rule breaks), None in a throughput run;
    ``mode``: ``hybrid`` or ``imperative`` (``backend.MODES``; ``default``: the first)."""

    def __init__(self, workload: Workload, comm: Comm, tuning: Tuning | None = None,
                 init: Any = None, align: AlignSpec | None = None, mode: str = HYBRID) -> None:
        require(BACKEND.model_refusal(workload))
        self.mode = BACKEND.resolve_mode(mode, "cuda" if comm.device_type == "gpu" else "cpu")
        """How the backbone executes (module doc)."""
        if comm.mode == "device":  # the declaration's kvstore rule, on this process's contexts
            require(kvstore_rules(workload, Topology(devices_per_node=len(comm.contexts)),
                                  Tuning(mxnet_kvstore="device")))
        check_precision(workload.precision, comm.device_type)
        self.dtype = computes_in(align)
        """What the weights, activations, gradients and momentum are held in."""
        if align is not None:
            check_alignment(workload, comm, self.dtype)
        rates = [workload.lr * f for f in (1.0, *workload.lr_scales)]
        if workload.momentum and any(r == 0 for r in rates):
            raise ValueError("the mxnet step keeps momentum in MXNet's lr-scaled form and "
                             "needs a nonzero learning rate at every step")
        self.workload = workload
        self.comm = comm
        self.tuning = tuning or Tuning()
        self.contexts = list(comm.contexts)
        self.step_index = 0
        self.fp16 = workload.precision == "fp16"
        if self.fp16:
            enable_amp()

        # Same seed on every rank; register() below makes every copy rank 0's anyway.
        mx.random.seed(workload.seed)
        net = models.build_backbone(
            workload.backbone, embedding_size=workload.embedding_size,
            num_classes=workload.num_classes, input_size=workload.input_size,
            output_block=workload.output_block, dropout=workload.dropout)
        net.initialize(ctx=self.contexts)
        if init is not None:
            models.load_torch_arrays(net, init, ctx=self.contexts)
        if self.dtype != "float32":
            net.cast(self.dtype)  # float32 start values widen exactly
        self.fused = self.dtype == "float32"
        """Run MXNet's own fused update, norm and BatchNorm statistics, exact in float32 only;
        wider dtypes take their stand-ins (module doc)."""
        self.update_kernel = "multi" if comm.device_type == "gpu" else "per_array"
        """MXNet's update kernel in float32: ``multi`` (``preloaded_multi_sgd_mom_update``,
        fewest launches) on a GPU, ``per_array`` (``sgd_mom_update``, multi-threaded) on a
        CPU (module doc)."""
        # Before the first forward: it sets the BatchNorms' momentum for the graph (the
        # imperative blocks read it at every call).
        self.running = None if self.fused else MXNetRunningStatistics(net)
        self.graph: GraphBuilds | None = None
        if self.mode == HYBRID:
            self.graph = GraphBuilds(net)
            net.hybridize(static_alloc=True, static_shape=True)
        self.net = net
        self.params = [p for p in net.collect_params().values() if p.grad_req != "null"]

        self.heads: list[MarginSoftmaxHead] = []
        if workload.task == "face":
            mm_dtype = "float16" if self.fp16 else None
            straight = breaks_margin(align)
            self.heads = [MarginSoftmaxHead(
                workload.num_classes, workload.embedding_size, workload.resolved_margins,
                workload.scale, comm, ctx, mode=workload.fc, rank=rank, seed=workload.seed,
                mm_dtype=mm_dtype, dtype=self.dtype, straight_through=straight,
                sample_ratio=workload.sample_ratio, update=workload.pfc_update)
                for ctx, rank in zip(self.contexts, comm.ranks)]
            if init is not None:
                for head in self.heads:
                    head.set_weight(np.asarray(init["head/weight"]))
        self.sharded = workload.task == "face" and workload.fc != "dp"

        # Per context: the backbone's arrays, then (dp) the head's; all in one update group
        # order. Reduced over ranks: the backbone, and the head unless it is sharded.
        bb_data = [p.list_data() for p in self.params]
        bb_grad = [p.list_grad() for p in self.params]
        head_data = [[h.weight for h in self.heads]] if self.heads else []
        head_grad = [[h.grad for h in self.heads]] if self.heads else []
        reduced_data = bb_data + ([] if self.sharded else head_data)
        self._reduced_grads = bb_grad + ([] if self.sharded else head_grad)
        self._keys = comm.register(reduced_data)
        n_ctx = len(self.contexts)
        self._bb = [([d[c] for d in bb_data], [g[c] for g in bb_grad]) for c in range(n_ctx)]
        self._bb_mom = [[mx.nd.zeros(w.shape, ctx=w.context, dtype=self.dtype) for w in ws]
                        for ws, _ in self._bb]
        # One momentum row per class row, sampled or not (a sparse head keeps them per row).
        self._head_mom = [mx.nd.zeros(h.weight.shape, ctx=h.weight.context, dtype=self.dtype)
                          for h in self.heads]
        self._mom_lr: float | None = None
        """The rate the MXNet-form momentum is expressed in (mom = -lr * torch's buf)."""
        self.keep_grad_norm = dumps_state(align)
        """Compute the gradient norm before clipping even where nothing clips (for the dump)."""
        self.last_grad_norm: mx.nd.NDArray | None = None
        """The backbone's reduced gradient norm before clipping, of the last update (first
        context, on the device); None where nothing needed it."""
        self.last_lr = workload.lr
        """The rate of the last update (before any: the optimizer's first rate)."""
        world = comm.world_size
        # Average (dp, classification) or sum (mp and pfc backbone) of the summed gradients.
        self._bb_rescale = 1.0 if self.sharded else 1.0 / world
        self._head_rescale = 1.0 if self.sharded else 1.0 / world
        self._consts: dict[tuple, mx.nd.NDArray] = {}

        self.scaler = LossScale() if self.fp16 else None
        self.skipped_steps: list[int] = []
        """0-based indices of the steps that fp16 loss scaling skipped on every rank."""
        self.markers: list[mx.nd.NDArray] = []
        """Per context, a small fresh array that is ready when the last step has finished on
        that context (its update included): what the timing watcher waits on."""

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (None in other precisions)."""
        return self.scaler.scale if self.scaler is not None else None

    @property
    def settings(self) -> dict:
        return {"kvstore": self.comm.mode, "contexts": len(self.contexts),
                "hybridize": {"static_alloc": True, "static_shape": True}
                if self.mode == HYBRID else None,
                "update": (f"elementwise momentum SGD in {self.dtype}" if not self.fused
                           else "fused preloaded_multi_sgd_mom_update"
                           if self.update_kernel == "multi" else "sgd_mom_update per array")
                + ", update_on_kvstore off",
                "amp": "float16" if self.fp16 else None,
                "loss_scaling": "dynamic, one overflow decision for all ranks"
                if self.fp16 else None}

    def compile_count(self) -> int | None:
        """Hybrid: how many times the backbone's graph was built or planned again so far
        (:class:`GraphBuilds`). Imperative: None, there is no graph to build (each operator
        runs as it is called)."""
        return self.graph.count if self.graph is not None else None

    def compile_seconds(self) -> float:
        """Hybrid: the seconds Gluon spent building the backbone's graph so far
        (:class:`GraphBuilds`). Imperative: 0.0, nothing is built."""
        return self.graph.seconds if self.graph is not None else 0.0

    def compile_measure(self) -> str:
        """What :meth:`compile_seconds` holds, in one line."""
        if self.graph is not None:
            return GraphBuilds.MEASURE
        return "imperative: nothing is compiled (each operator runs as Python reaches it)"

    @property
    def pfc_update(self) -> str | None:
        """The class-matrix update that runs: ``full`` (no sampling), ``sparse`` or ``dense``;
        None without a face head."""
        return self.heads[0].update if self.heads else None

    # ------------------------------------------------------------------------------ step

    def _const(self, c: int, n: int, value: float) -> mx.nd.NDArray:
        key = (c, n, value)
        arr = self._consts.get(key)
        if arr is None:
            arr = self._consts[key] = mx.nd.full((n,), value, ctx=self.contexts[c],
                                                 dtype="float32")
        return arr

    def _check(self, batches: Sequence[tuple[mx.nd.NDArray, mx.nd.NDArray]]) -> None:
        if len(batches) != len(self.contexts):
            raise ValueError(f"{len(batches)} batches for {len(self.contexts)} contexts")

    def _class_loss(self, outs: list[mx.nd.NDArray], batches: Sequence[tuple],
                    grad_scale: float) -> tuple[list[mx.nd.NDArray], list[mx.nd.NDArray]]:
        """Classification's losses and the scaled ones to differentiate (inside the record)."""
        # The loss in float32 from fp16 logits, in the run's dtype otherwise.
        losses = [-mx.nd.mean(mx.nd.pick(mx.nd.log_softmax(out.astype(self.dtype), axis=1),
                                         labels, axis=1))
                  for out, (_, labels) in zip(outs, batches)]
        return losses, [loss * grad_scale for loss in losses] if grad_scale != 1.0 else losses

    def _face_head(self, outs: list[mx.nd.NDArray], batches: Sequence[tuple],
                   grad_scale: float) -> tuple[list[mx.nd.NDArray], list[mx.nd.NDArray]]:
        """The face heads' losses and the embeddings' gradients (their own backward included)."""
        results = [head.forward_backward(out, labels, grad_scale)
                   for head, out, (_, labels) in zip(self.heads, outs, batches)]
        return [loss for loss, _ in results], [grad for _, grad in results]

    def _backward(self, outs: list[mx.nd.NDArray], upstream: list[mx.nd.NDArray]) -> None:
        """The backbone's backward from the face head's embedding gradients, or from the
        scaled classification losses."""
        if self.heads:
            autograd.backward(outs, head_grads=upstream)
        else:
            autograd.backward(upstream)
        if self.running is not None:
            self.running.update()  # after the backward pass that left the batch statistics

    def _backbone(self, batches: Sequence[tuple[mx.nd.NDArray, mx.nd.NDArray]]
                  ) -> list[mx.nd.NDArray]:
        """The backbone's forward on every context (inside the record)."""
        if self.graph is not None:
            for images, _ in batches:
                self.graph.saw(images)
        return [self.net(images) for images, _ in batches]

    def _forward_backward(self, batches: Sequence[tuple[mx.nd.NDArray, mx.nd.NDArray]],
                          grad_scale: float) -> list[mx.nd.NDArray]:
        self._check(batches)
        with autograd.record():
            outs = self._backbone(batches)
            if not self.heads:
                losses, upstream = self._class_loss(outs, batches, grad_scale)
        if self.heads:
            losses, upstream = self._face_head(outs, batches, grad_scale)
        self._backward(outs, upstream)
        return losses

    def _all_finite(self) -> bool:
        """Whether every gradient of every rank is finite: one decision for all ranks, read
        back to the host (the one sync of an fp16 step)."""
        flags = []
        for c, (_, grads) in enumerate(self._bb):
            arrays = list(grads) + ([self.heads[c].grad] if self.heads else [])
            for part in _chunks(len(arrays)):
                chunk = arrays[part]
                flags.append(mx.nd.multi_all_finite(*chunk, num_arrays=len(chunk),
                                                    init_output=True)
                             .as_in_context(self.contexts[0]))
        finite = mx.nd.min(mx.nd.concat(*flags, dim=0)).reshape((1,))
        bad = self.comm.allreduce_sum_("loss_scale/overflow", 1.0 - finite)
        return float(bad.asscalar()) == 0.0

    def _sgd_fused(self, c: int, weights: list, grads: list, moms: list, lr: float, wd: float,
                   rescale: float, coef: mx.nd.NDArray | None = None) -> list[mx.nd.NDArray]:
        """Fused momentum SGD of context ``c``'s arrays (float32), clipped by ``coef`` (a [1]
        array) unless it is None: ``lr * (coef * g + wd * w)`` runs as ``(lr * coef) * (g +
        (wd / coef) * w)``, the rates and decays as device arrays. Returns a view of one
        updated element per fused call (for the step's marker)."""
        if coef is None:
            def lrs_of(n):
                return self._const(c, n, lr)

            def wds_of(n):
                return self._const(c, n, wd)
        else:
            lr_coef, wd_coef = coef * lr, wd / coef

            def lrs_of(n):
                return mx.nd.broadcast_to(lr_coef, shape=(n,))

            def wds_of(n):
                return mx.nd.broadcast_to(wd_coef, shape=(n,))
        done = []
        for part in _chunks(len(weights)):
            n = part.stop - part.start
            args = []
            for w, g, m in zip(weights[part], grads[part], moms[part]):
                args += [w, g, m]
            mx.nd.preloaded_multi_sgd_mom_update(
                *args, lrs_of(n), wds_of(n), momentum=self.workload.momentum,
                rescale_grad=rescale, num_weights=n, out=weights[part])
            done.append(weights[part][0].reshape((-1,))[0:1])
        return done

    def _sgd_per_array(self, c: int, weights: list, grads: list, moms: list, lr: float,
                       wd: float, rescale: float, coef: mx.nd.NDArray | None = None
                       ) -> list[mx.nd.NDArray]:
        """``sgd_mom_update`` on each array, the gradients scaled in place by ``coef`` first
        where it is given; called as ``_sgd_fused`` is (``c`` goes unused)."""
        if coef is not None:
            for g in grads:
                mx.nd.broadcast_mul(g, coef.reshape((1,) * g.ndim), out=g)
        for w, g, m in zip(weights, grads, moms):
            mx.nd.sgd_mom_update(w, g, m, lr=lr, wd=wd, momentum=self.workload.momentum,
                                 rescale_grad=rescale, out=w)
        return [w.reshape((-1,))[0:1] for w in weights]

    def _sgd_exact(self, c: int, weights: list, grads: list, moms: list, lr: float, wd: float,
                   rescale: float, coef: mx.nd.NDArray | None = None) -> list[mx.nd.NDArray]:
        """:func:`momentum_sgd`, called as ``_sgd_fused`` is (``c`` goes unused)."""
        return momentum_sgd(weights, grads, moms, self.workload.momentum, lr, wd, rescale, coef)

    def _clip_coef(self, c: int, grads: list, rescale: float) -> mx.nd.NDArray | None:
        """torch's ``min(1, max_norm / (norm + 1e-6))`` of context ``c``'s backbone gradients
        ([1], on the device), or None without clipping. The norm is kept for the dump
        (``last_grad_norm``), and computed for it alone where nothing clips."""
        max_norm = self.workload.clip_grad_norm
        if not grads or (max_norm is None and not self.keep_grad_norm):
            return None
        norm = global_norm(grads, rescale, self.fused)
        if c == 0:
            self.last_grad_norm = norm
        return None if max_norm is None else mx.nd.minimum(max_norm / (norm + 1e-6), 1.0)

    def _update(self, lr: float, grad_scale: float) -> None:
        if self._mom_lr is not None and lr != self._mom_lr:
            ratio = lr / self._mom_lr
            for mom in [m for ms in self._bb_mom for m in ms] + self._head_mom:
                mom *= ratio
        self._mom_lr = self.last_lr = lr
        wd = self.workload.weight_decay
        sgd = (self._sgd_exact if not self.fused else
               self._sgd_fused if self.update_kernel == "multi" else self._sgd_per_array)
        self.markers = []
        for c, (weights, grads) in enumerate(self._bb):
            rescale = self._bb_rescale / grad_scale
            done = sgd(c, weights, grads, self._bb_mom[c], lr, wd, rescale,
                       self._clip_coef(c, grads, rescale))
            if self.heads:
                head, mom = self.heads[c], self._head_mom[c]
                head_rescale = self._head_rescale / grad_scale
                if head.sparse:
                    done += self._update_sampled_rows(c, sgd, head, mom, lr, wd, head_rescale)
                else:
                    done += sgd(c, [head.weight], [head.grad], [mom], lr, wd, head_rescale)
            self.markers.append(mx.nd.add_n(*done) if len(done) > 1 else done[0].copy())

    @staticmethod
    def _update_sampled_rows(c: int, sgd: Any, head: MarginSoftmaxHead, mom: mx.nd.NDArray,
                             lr: float, wd: float, rescale: float) -> list[mx.nd.NDArray]:
        """The update of a sparse ``pfc`` head (module doc): the rows it sampled and their
        momentum gathered, updated by ``sgd`` and written back. Returns views of the written
        arrays (for the step's marker)."""
        rows_mom = mx.nd.take(mom, head.index)
        sgd(c, [head.rows], [head.grad], [rows_mom], lr, wd, rescale)
        put_rows(mom, rows_mom, head.index)
        put_rows(head.weight, head.rows, head.index)
        return [head.weight.reshape((-1,))[0:1], mom.reshape((-1,))[0:1]]

    def compute_gradients(self, batches: Sequence[tuple[mx.nd.NDArray, mx.nd.NDArray]]
                          ) -> list[mx.nd.NDArray]:
        """Forward, backward and the gradient sum over ranks (no update); returns each context's
        loss. The summed gradients are in the parameters' ``grad()`` and the heads' ``grad``,
        times the loss scale in fp16; ``apply`` turns them into the update."""
        grad_scale = self.loss_scale if self.fp16 else 1.0
        losses = self._forward_backward(batches, grad_scale)
        self.comm.sum_(self._keys, self._reduced_grads)
        return losses

    def apply(self, losses: list[mx.nd.NDArray]) -> None:
        """Clip and step (or, in fp16 after an overflow anywhere, skip) with this step's rate."""
        lr = self.workload.lr_at(self.step_index)
        step = True
        if self.fp16:
            grad_scale = self.loss_scale
            step = self._all_finite()
            self.scaler.update(step)
        else:
            grad_scale = 1.0
        if step:
            self._update(lr, grad_scale)
        else:
            self.skipped_steps.append(self.step_index)
            self.markers = [loss.copy() for loss in losses]
        self.step_index += 1

    def __call__(self, batches: Sequence[tuple[mx.nd.NDArray, mx.nd.NDArray]]
                 ) -> mx.nd.NDArray:
        losses = self.compute_gradients(batches)
        self.apply(losses)
        return losses[0]

    def profiled(self, batches: Sequence[tuple[mx.nd.NDArray, mx.nd.NDArray]], clock: Any,
                 skip_comm: bool = False) -> mx.nd.NDArray:
        """The same step as ``__call__``, phase by phase on ``clock`` (``backends.phases``),
        whose stamps fence the engine. The face head computes its own backward to the
        embeddings, so ``head`` holds it. The gradient sum is queued right after the backward,
        as ``__call__`` queues it, inside ``backward``: the engine starts a gradient's pushpull
        as soon as the backward has written it. ``skip_comm`` leaves the sum out, to measure
        how much of it the backward hides (``phases.NO_COMM``)."""
        self._check(batches)
        grad_scale = self.loss_scale if self.fp16 else 1.0
        with autograd.record():
            with clock.phase("backbone_forward"):
                outs = self._backbone(batches)
            if not self.heads:
                with clock.phase("head"):
                    losses, upstream = self._class_loss(outs, batches, grad_scale)
        if self.heads:
            with clock.phase("head"):
                losses, upstream = self._face_head(outs, batches, grad_scale)
        with clock.phase("backward"):
            self._backward(outs, upstream)
            if not skip_comm:
                self.comm.sum_(self._keys, self._reduced_grads)
        with clock.phase("optimizer"):
            self.apply(losses)
        return losses[0]
