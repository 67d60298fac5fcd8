"""The MXNet side of a strict alignment run (``trainperf.config.AlignSpec``): BatchNorm's running
statistics under MXNet's own rule, exactly, and each step's state in torch's names for the dump.

Running statistics. MXNet's CPU BatchNorm kernel, the one that runs float64, moves its running
arrays in the backward pass as ``running = m * running + (1 - m) * batch`` with Gluon's
momentum ``m`` (0.9 here: torch's 0.1 seen from the other side) and the *biased* batch variance
(the sum of squares over n). torch moves its running variance with the unbiased one (over n - 1):
a difference of rule, declared in ``backend.py`` (``rule_differences``) and measured by `trainperf
align`, not hidden. What MXNet's kernel cannot do is that rule exactly in float64: it holds ``m``
as a C float (0.9f = 0.89999998), 2.4e-7 off the double an alignment run compares with. So there,
and only there, every BatchNorm runs with momentum 0, which leaves the batch's own mean and biased
variance in its running arrays (``0 * running + 1 * batch``, both exact), and
:class:`MXNetRunningStatistics` moves the kept statistics by MXNet's rule, with ``m`` as a C
double (MXNet's ``*_scalar`` operators take one), in the run's dtype. Training-mode BatchNorm
normalises with the batch's statistics, so nothing else in the step changes; throughput runs keep
the native update. ``tests/test_mxnet_standins.py`` shows, in float32 where the native kernel is
exact, that the stand-in leaves what the native kernel leaves.

Names and layouts: every Gluon parameter's path is its torch ``state_dict`` name
(``models.torch_names``) and MXNet holds every array in torch's layout (OIHW convolutions,
[out, in] Dense weights), so the dump is the network's arrays as they are.
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

from ..workerkit import StepState
from . import models


class MXNetRunningStatistics:
    """MXNet's running-statistics rule for every BatchNorm of a network, with its momentum as a
    double, on each of the network's contexts (module doc). Make it before the network first
    runs (it sets the BatchNorms' momentum to 0 for the graph the first forward builds), and
    call :meth:`update` after every backward pass."""

    def __init__(self, net: mx.gluon.HybridBlock) -> None:
        self.layers = []
        for _, block in models.batch_norms(net):
            momentum = float(block._kwargs["momentum"])
            block._kwargs["momentum"] = 0.0  # the op keeps the batch's statistics
            mean, var = block.running_mean, block.running_var
            # The statistics as loaded; after a backward pass the network's own arrays hold
            # the batch's until update() puts the moved ones back.
            kept = [(m.copy(), v.copy()) for m, v in zip(mean.list_data(), var.list_data())]
            self.layers.append((mean, var, momentum, kept))

    def update(self) -> None:
        """MXNet's ``running = m * running + (1 - m) * batch`` (the batch variance biased, as the
        op left it), into the network, in the order MXNet's kernel multiplies and adds.

        Waits for the backward pass first: MXNet's BatchNorm backward writes the running arrays
        in place although they are only inputs of it, so the engine would not order a read or
        a write of them after it (seen: a step's statistics read before it had written them).
        The updates queued here are writes, which the next backward pass, a reader, waits
        for."""
        mx.nd.waitall()
        for mean, var, m, kept in self.layers:
            for batch_mean, batch_var, (run_mean, run_var) in zip(
                    mean.list_data(), var.list_data(), kept):
                run_mean[:] = run_mean * m + batch_mean * (1.0 - m)
                run_var[:] = run_var * m + batch_var * (1.0 - m)
                run_mean.copyto(batch_mean)
                run_var.copyto(batch_var)


def state_arrays(step: Any) -> dict[str, np.ndarray]:
    """A ``step.TrainStep``'s (untyped here: step.py imports this module) weights and
    BatchNorm statistics on this process's first context by torch name, and the rows of the
    class matrix it holds, read back to the host in the dtype the run holds them."""
    ctx = step.contexts[0]
    arrays = {f"backbone/{name}": param.data(ctx).asnumpy()
              for name, param in models.torch_names(step.net).items()}
    if step.heads:
        arrays["head/weight"] = step.heads[0].weight.asnumpy()
    return arrays


def step_state(step: Any) -> StepState:
    """What the dump of the last step holds: the state, the backbone's gradient norm before
    clipping as the step computed it (None where it computed none) and the rate its update
    ran at."""
    norm = step.last_grad_norm
    return StepState(state_arrays(step), None if norm is None else float(norm.asscalar()),
                     float(step.last_lr))
