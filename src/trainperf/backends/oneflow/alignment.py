"""OneFlow's side of a strict alignment run (``trainperf.config.AlignSpec``): each step's state
in torch's names and layouts, for ``workerkit.write_dump``.

The backbone's ``state_dict`` keys are torch's and its layouts too (``models.py``: every family),
so the state is read without renaming or transposing anything; the class matrix of a face step is
this rank's rows (all of them in dp, its ``split(0)`` shard in mp and pfc, which is
``layouts.shard_of``'s). A classification step has no head: its classes are the backbone's last
Linear, under the backbone's names, as torch's dump has them.
"""

from __future__ import annotations

import oneflow as flow

from ..workerkit import StepState
from .step import TrainStep


def _host(t: flow.Tensor) -> object:
    """A numpy copy of this rank's part of ``t`` (its local shard where it is global)."""
    return (t.to_local() if t.is_global else t).detach().cpu().numpy().copy()


def step_state(step: TrainStep) -> StepState:
    """The step's weights and BatchNorm statistics after its last update (the start, before
    any), by torch name (the class matrix only where the step has a head), with its gradient
    norm before clipping and its rate. Reads back from the device: call after a sync, in
    alignment runs only."""
    arrays = {f"backbone/{k}": _host(v) for k, v in step.backbone.state_dict().items()
              if not k.endswith("num_batches_tracked")}
    if step.head is not None:
        arrays["head/weight"] = _host(step.head.weight)
    norm = step.last_grad_norm
    return StepState(arrays, None if norm is None else float(norm.numpy()), step.lr)
