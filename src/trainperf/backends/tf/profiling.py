"""TensorFlow's side of a profiled run (``backends.phases``).

The step is one ``tf.function`` graph (``step.py``): the backbone's forward, the head,
``GradientTape``'s backward, the gradient all-reduce and the SGD update all run inside one
graph call, which Grappler rewrites and TensorFlow's executor schedules as a whole, and the host
sees one call. So the phases are ``data`` (this step's batch on the device) and the graph, timed
as one merged phase; the stamps are the worker's sync and the host clock. TensorFlow's profiler
traces the profiled steps, each phase one ``tf.profiler.experimental.Trace`` range.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Iterator

import numpy as np
import tensorflow as tf

from ..phases import compiled_step_phase, matmul_rate as timed_matmul_rate

def method(mode: str) -> str:
    """How a profiled run's phases are timed, for the step's mode (``function`` or ``xla``)."""
    graph = "jit_compile on: one XLA program" if mode == "xla" else "jit_compile off"
    return (f"one TensorFlow graph per step (tf.function, {graph}): data, then the graph as "
            "one phase, each closed by the worker's sync (sync_devices; with several ranks, "
            "the last step's loss and counter read back) and the host clock; "
            "tf.profiler.experimental.Trace ranges")


RANGE_PREFIX = "trainperf/"


def merged_phases(world_size: int) -> dict[str, str]:
    comm = ", the gradient all-reduce" if world_size > 1 else ""
    return {compiled_step_phase(world_size):
            f"one tf.function graph (strategy.run inside it): the backbone's forward, the "
            f"head, GradientTape's backward{comm} and the SGD update run in one graph call, "
            f"rewritten by Grappler and scheduled by TensorFlow's executor as a whole"}


def annotate(name: str) -> contextlib.AbstractContextManager:
    return tf.profiler.experimental.Trace(RANGE_PREFIX + name)


@contextlib.contextmanager
def profiler(run: Any, trace_dir: str | None) -> Iterator[None]:
    """TensorFlow's profiler over the profiled steps, only when a trace is asked for: nothing
    else reads its events. Each rank writes into its own folder (ranks on one host would
    otherwise share one file name); rank 0's profile becomes ``run.trace``."""
    if not trace_dir:
        yield
        return
    folder = os.path.join(trace_dir, f"rank{run.rank}")
    tf.profiler.experimental.start(folder)
    try:
        yield
    finally:
        tf.profiler.experimental.stop()
    if run.rank != 0:
        return
    found = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb")))
    if found:
        run.trace = found[-1]
        # No absolute path: the results' folder may move.
        run.trace_open = ("run tensorboard --logdir on its rank0 folder (with "
                          "tensorboard-plugin-profile installed), Profile tab")


def matmul_rate(device: str, precision: str) -> tuple[float, str]:
    """FLOP/s of ``tf.linalg.matmul`` on the run's device in its compute dtype (TF32 as
    TensorFlow's setting has it on a GPU)."""
    n = 8192 if device.startswith("/GPU") else 1024
    dtype = tf.float16 if precision == "fp16" else tf.float32
    rs = np.random.RandomState(0)
    with tf.device(device):
        a, b = (tf.constant(rs.standard_normal((n, n)), dtype=dtype) for _ in range(2))
    last: list[tf.Tensor] = []

    def run() -> None:
        with tf.device(device):
            last[:] = [tf.linalg.matmul(a, b)]

    def fence() -> None:
        # One element read back: it waits for the product (ops on a device run in order)
        # without copying it.
        last[0][0, 0].numpy()

    rate = timed_matmul_rate(run, 2.0 * n**3, fence)
    return rate, f"tf.linalg.matmul {dtype.name} {n}^3"
