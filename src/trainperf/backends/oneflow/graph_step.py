"""The training step in OneFlow's graph mode (``--mode graph``): one ``oneflow.nn.Graph``, as
OneFlow's own training scripts (oneflow_face, the model zoo's) run it, and as the seeds' OneFlow
ran its lazy jobs.

The graph holds the model (backbone and head; the backbone alone in classification, whose
classes are its last Linear), ``add_optimizer(SGD, lr_sch=...)`` and a ``build`` that runs the
forward, the loss and ``loss.backward()``, with ``allow_fuse_add_to_output`` and
``allow_fuse_model_update_ops`` on, as OneFlow's own training graphs set them. OneFlow compiles
it on its first call into one job (forward, autograd's backward, the collectives the tensors'
SBP asks for, the clip, the schedule and the update) and every later call launches that job:
nothing of the step runs op by op from Python. What the eager step (``step.py``) calls itself,
the graph owns:

- the update: ``flow.optim.SGD`` added to the graph, momentum and weight decay (each variable's
  ``l2``) applied by the job's update ops. Two parameter groups: the backbone's, and the class
  matrix's (a face head's).
- clipping: the backbone group's ``clip_grad_max_norm`` and ``clip_grad_norm_type`` (the
  graph's own clip by global norm, over that group only, as the eager step clips the backbone
  only). The norm stays inside the job: a graph run keeps no gradient norm.
- the rate: ``Workload.lr_at``'s piecewise-constant schedule as OneFlow's own schedulers, a
  ``SequentialLR`` of ``ConstantLR`` (one per segment, milestones at ``lr_steps``), which the
  graph turns into its job's learning-rate op; no schedule where the rate is constant.
- several ranks: global tensors over every rank, OneFlow's idiom for graphs. The backbone's
  parameters are ``broadcast``; each rank's batch is its piece of one ``split(0)`` batch; the
  class matrix is ``broadcast`` in ``dp`` and ``split(0)`` in ``mp`` (``heads.py``, as in eager
  mode). A ``broadcast`` parameter's gradient from ``split(0)`` data is a ``partial_sum`` that
  the job all-reduces: with the loss the mean over the global batch, that is DDP's average in
  ``dp`` and the sum of the shards' parts in ``mp``, with nothing scaled by hand. BatchNorm
  normalises each rank's piece by its own statistics, as under DDP (the tests compare the first
  2-rank loss with eager mode's).
- the loss: the head returns every sample's loss (``per_sample``); the graph backpropagates
  their mean and returns them, and the step's loss is the mean of this rank's part: its own
  batch's in ``dp`` and classification, the gathered batch's in ``mp``, as eager mode records.
- the sharded head (``MarginSoftmaxHead.in_graph``): its log-sum-exp is shifted by the scale,
  the logits' bound, since the row maxima of split(1) logits need each rank's local shard,
  which a graph cannot read; and the gathered embeddings' gradient is said to be ``split(0)``,
  without which the backbone's last BatchNorm took a gradient that mixed the ranks' batches.

Measured against the eager step on the same start (``tests/test_oneflow_modes.py``): without
clipping, ``dp`` and classification give bit-identical losses through a change of the rate; with
clipping acting, 1e-5 to 7e-5 apart, as each mode sums the norm's squares in float32 in its own
order; ``mp`` on 2 ranks, the first loss within 1.2e-7 and the backbone's updates within 4e-6.

Refused (``backend.graph_refusal`` up front, :func:`check_graph` here):

- ``pfc`` with sampling (a ratio below 1): the sparse update changes the sampled rows outside
  any optimizer, which a graph's job cannot hold, and the sample's size depends on the batch's
  labels where positives can outnumber it, a shape known only when the step runs (OneFlow's own
  ``distributed_partial_fc_sample`` op has no CPU kernel and drops positives past its size,
  ``heads.sample_classes``). At ratio 1 ``pfc`` is ``mp`` and runs.
- a rate that grows at a step (``lr_scales`` above 1): ``ConstantLR`` takes factors in [0, 1].
- float64 (a strict alignment run): OneFlow 0.9's graph cannot train float64 parameters. Its
  job updates every variable from a float32 gradient and a float32 rate (measured on the CPU:
  ``Cannot find the kernel matching Current OperatorConf ... op_type_name: sgd_update ... model
  kDouble, model_diff kFloat, learning_rate kFloat``, with momentum, weight decay and clipping
  off too), and a graph can take no gradient without that training job (``autograd.grad`` in
  ``build``: ``job has no TrainConf``), so no float64 stand-in can run inside it either.

Outputs: a graph reuses its output buffers (``config.set_outputs_buffer_size``, 2 by default),
so each step's loss and markers are fresh tensors computed from them as soon as the call
returns; OneFlow's virtual machine orders those reads after the job that writes them.
"""

from __future__ import annotations

import time
from typing import Any

import oneflow as flow
import oneflow.nn as nn

from ...config import Tuning, Workload
from ..base import require
from .backend import BACKEND, GRAPH_FLOAT64, graph_refusal
from .dist import Dist
from .heads import MarginSoftmaxHead
from .step import build_model, classification_loss

FOREVER = 2**62
"""``ConstantLR``'s ``total_iters`` for a segment that lasts until the next milestone."""
GRAPH_MODULE = "oneflow.nn.Graph"


def check_graph(workload: Workload, dtype: flow.dtype) -> None:
    """ValueError (one line) for what graph mode does not run (module docstring)."""
    require(graph_refusal(workload))
    if dtype != flow.float32:
        raise ValueError(GRAPH_FLOAT64)


class SampleLosses(nn.Module):
    """Backbone and head (None in classification) as one module: every sample's loss."""

    def __init__(self, backbone: nn.Module, head: MarginSoftmaxHead | None) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: flow.Tensor, labels: flow.Tensor) -> flow.Tensor:
        out = self.backbone(images)
        if self.head is None:
            return classification_loss(out, labels, reduction="none")
        return self.head(out, labels, per_sample=True)


class StepGraph(nn.Graph):
    """One training step as a graph; ``builds`` counts how many times OneFlow traced
    ``build`` (it compiles the job after each trace), ``compile_s`` the seconds its
    compilations took (:meth:`_compile`)."""

    MEASURE = ("oneflow.nn.Graph._compile at the graph's first call: build() traced into a "
               "job and the job's passes (build_graph), then the eager Sync OneFlow does "
               "before planning, the plan's compilation and the runtime's init "
               "(finish_complie_and_init_runtime)")
    """What ``compile_s`` holds (``compile_measure``)."""

    def __init__(self, model: nn.Module, optimizer: flow.optim.Optimizer,
                 schedule: Any) -> None:
        super().__init__()
        self.model = model
        # What OneFlow's own training graphs (oneflow_face, the model zoo) switch on.
        self.config.allow_fuse_add_to_output(True)
        self.config.allow_fuse_model_update_ops(True)
        self.add_optimizer(optimizer, lr_sch=schedule)
        self.builds = 0
        self.compile_s = 0.0

    def _compile(self, *args: Any, **kwargs: Any) -> Any:
        """OneFlow 0.9's ``nn.Graph.__call__`` runs this once, before the graph's first run:
        ``build_graph`` (the trace of ``build`` and the job's passes) and
        ``finish_complie_and_init_runtime`` (an eager Sync, the plan and the runtime, on every
        rank together). Timed here, around the framework's own compile path, on the host: the
        only wait inside is the Sync OneFlow itself does there."""
        begin = time.perf_counter()
        try:
            return super()._compile(*args, **kwargs)
        finally:
            self.compile_s += time.perf_counter() - begin

    def build(self, images: flow.Tensor, labels: flow.Tensor) -> flow.Tensor:
        self.builds += 1
        losses = self.model(images, labels)
        losses.mean().backward()
        return losses


def piecewise_schedule(optimizer: flow.optim.Optimizer, workload: Workload) -> Any:
    """``Workload.lr_at`` as OneFlow's schedulers (None: a constant rate)."""
    if not workload.lr_steps:
        return None
    factors = (1.0, *workload.lr_scales)
    parts = [flow.optim.lr_scheduler.ConstantLR(optimizer, factor=f, total_iters=FOREVER)
             for f in factors]
    return flow.optim.lr_scheduler.SequentialLR(optimizer, parts,
                                                milestones=list(workload.lr_steps))


def _marker(t: flow.Tensor) -> flow.Tensor:
    """One element of this rank's part of global ``t``, as a fresh local tensor."""
    return t.to_local().detach().view(-1)[:1].clone()


class GraphTrainStep:
    """The graph-mode twin of ``step.TrainStep``: call with this rank's (images, labels) as
    :meth:`place` made them; returns this step's loss as a local device scalar, without
    waiting for it. The arguments are ``TrainStep``'s; ``dtype`` must be float32 and
    ``keep_grad_norm`` keeps nothing (the graph's clip keeps its norm inside the job)."""

    def __init__(self, workload: Workload, dist: Dist, tuning: Tuning | None = None,
                 init: Any = None, dtype: flow.dtype = flow.float32,
                 keep_grad_norm: bool = False, straight_through: bool = False) -> None:
        require(BACKEND.work_refusal(workload, dist.device_type))
        check_graph(workload, dtype)
        self.workload, self.dist = workload, dist
        self.tuning = tuning or Tuning()
        self.sharded = workload.task == "face" and workload.fc in ("mp", "pfc")
        self.step_index = 0
        # The eager step's start, the same in either mode; then made global.
        backbone, head = build_model(workload, dist, init, dtype, straight_through)
        broadcast = dict(placement=dist.placement, sbp=flow.sbp.broadcast)
        backbone.to_global(**broadcast)
        if head is not None and not self.sharded:
            # The sharded head's matrix is split(0) already; dp's is made one global copy.
            head.to_global(**broadcast)
        if self.sharded:
            head.in_graph = True
        self.backbone, self.head = backbone, head
        self.clip_params = [p for p in backbone.parameters() if p.requires_grad]
        self.optimizer = self._sgd(self.clip_params, None if head is None else head.weight)
        self.schedule = piecewise_schedule(self.optimizer, workload)
        self.graph = StepGraph(SampleLosses(backbone, head), self.optimizer, self.schedule)
        self.skipped_steps: list[int] = []
        """fp16 loss scaling would list skipped steps here; fp32 skips none."""
        self.loss_scale: float | None = None
        self.last_grad_norm: flow.Tensor | None = None
        """Never kept: the graph's clip computes the norm inside its job."""
        self.markers: list[flow.Tensor] = []

    def _sgd(self, backbone: list, head_weight: flow.Tensor | None) -> flow.optim.Optimizer:
        """The graph's SGD: the backbone's group clipped to the workload's norm, the class
        matrix's (a face head's) not, as the eager step."""
        w = self.workload
        clip = ({} if w.clip_grad_norm is None else
                {"clip_grad_max_norm": float(w.clip_grad_norm), "clip_grad_norm_type": 2.0})
        groups = [{"params": backbone, **clip}]
        if head_weight is not None:
            groups.append({"params": [head_weight]})
        return flow.optim.SGD(groups, lr=w.lr, momentum=w.momentum,
                              weight_decay=w.weight_decay)

    def place(self, images: flow.Tensor, labels: flow.Tensor
              ) -> tuple[flow.Tensor, flow.Tensor]:
        """This rank's batch as its piece of the global ``split(0)`` batch the graph takes
        (no copy: each rank keeps its own samples)."""
        split = dict(placement=self.dist.placement, sbp=flow.sbp.split(0))
        return images.to_global(**split), labels.to_global(**split)

    @property
    def compiles(self) -> int:
        """How many times the graph was traced and compiled (once, on its first call)."""
        return self.graph.builds

    @property
    def compile_s(self) -> float:
        """Seconds the graph's compilation took (:meth:`StepGraph._compile`)."""
        return self.graph.compile_s

    @property
    def settings(self) -> dict:
        w = self.workload
        head = "global split(0) class matrix" if self.sharded else "global broadcast class matrix"
        if self.head is None:
            head = "none: the classes are the backbone's last Linear"
        return {"ddp": None, "oneflow_ddp": None, "head": head, "sgd_fused": None,
                "amp": None, "loss_scaling": None,
                "oneflow_graph": {
                    "module": GRAPH_MODULE,
                    "optimizer": "add_optimizer(flow.optim.SGD), the backbone's group"
                                 + ("" if self.head is None else " and the class matrix's"),
                    "clip": (None if w.clip_grad_norm is None else
                             f"backbone group clip_grad_max_norm={w.clip_grad_norm:g}, "
                             "clip_grad_norm_type=2"),
                    "lr_schedule": ("SequentialLR of ConstantLR" if self.schedule is not None
                                    else "constant"),
                    "tensors": "global: backbone broadcast, batch split(0)",
                    "fuse": "allow_fuse_add_to_output, allow_fuse_model_update_ops"}}

    def __call__(self, images: flow.Tensor, labels: flow.Tensor) -> flow.Tensor:
        losses = self.graph(images, labels)
        self.step_index += 1
        # Fresh tensors, read after the job has run: the graph reuses its outputs' buffers.
        self.markers = [_marker(self.clip_params[-1])]
        if self.head is not None:
            self.markers.append(_marker(self.head.weight))
        return losses.to_local().mean()

    @property
    def pfc_update(self) -> str | None:
        return None if self.head is None else self.head.update

    @property
    def lr(self) -> float:
        """The rate of the last step by the rule the graph's schedule was built from
        (``Workload.lr_at``): the rate the job computes stays inside it."""
        return self.workload.lr_at(max(self.step_index - 1, 0))
