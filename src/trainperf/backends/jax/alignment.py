"""JAX's side of a strict alignment run (``trainperf.align``): what one rank holds after a
step, in torch's names and layouts (``workerkit.StepState``).

Everything is read back to the host here, and only here: ``measured_run`` asks for it after
the device has finished the step, in alignment runs alone.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..layouts import shard_of
from ..workerkit import StepState
from . import models
from .step import TrainStep, _lr_at


def _host(layout, tree: Any) -> Any:
    """This rank's value of every leaf (its block of a rank-split leaf), as numpy."""
    return jax.tree.map(layout.local_value, tree)


def backbone_arrays(step: TrainStep) -> dict[str, np.ndarray]:
    """Every backbone variable by ``backbone/<torch name>``: parameters, the fixed BN gamma
    and this rank's own BatchNorm statistics (their leading rank axis dropped)."""
    layout, state = step.layout, step.state
    stats = jax.tree.map(lambda x: x[0], _host(layout, state["batch_stats"]))
    return models.torch_arrays({"params": _host(layout, state["params"]["backbone"]),
                                "batch_stats": stats, "frozen": _host(layout, step.frozen)})


def head_rows(step: TrainStep) -> np.ndarray:
    """The class rows this rank holds: the whole matrix for ``dp``, its shard (without the
    padding that evens out the blocks) for ``mp`` / ``pfc``."""
    head, layout = step.head, step.layout
    weight = step.state["head"]["weight"] if step.sparse else step.state["params"]["head"]
    rows = layout.local_value(weight)
    if not head.sharded:
        return rows
    return rows[:shard_of(head.num_classes, layout.rank, head.world_size)[1]]


def step_state(step: TrainStep) -> StepState:
    """The rank's state after the last step (or as loaded, before the first), with that
    step's gradient norm before clipping and its rate, as the step itself computed them;
    before any step, the rate its schedule gives the first step and no norm."""
    arrays = backbone_arrays(step)
    if step.head is not None:
        arrays["head/weight"] = head_rows(step)
    layout, record = step.layout, step.last_record
    if record is None:
        counter = layout.local_value(step.state["step"])
        return StepState(arrays, None, float(_lr_at(step.workload, counter, step.dtype)))
    return StepState(arrays, float(layout.local_value(record["grad_norm"])),
                     float(layout.local_value(record["lr"])))
