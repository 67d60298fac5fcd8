"""JAX's side of a profiled run (``backends.phases``).

The step is one XLA program (``jax.jit`` of ``jax.shard_map``, ``step.py``): the backbone's
forward, the head, autodiff's backward, the gradient's reduction over ranks and the SGD update
are compiled, fused and scheduled together, and the host sees one call and one finish. So the
phases are ``data`` (this step's batch on the device) and the compiled step, timed as one merged
phase; the stamps are the worker's fence (``jax.block_until_ready`` on the step's state) and
the host clock. ``jax.profiler`` traces the profiled steps, each phase one ``TraceAnnotation``.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ..phases import compiled_step_phase, matmul_rate as timed_matmul_rate
from .step import COMPUTE_DTYPES

METHOD = ("one XLA program per step (jax.jit): data, then the compiled step as one phase, each "
          "closed by jax.block_until_ready and the host clock; jax.profiler TraceAnnotation "
          "ranges")
RANGE_PREFIX = "trainperf/"


def merged_phases(world_size: int) -> dict[str, str]:
    comm = ", the gradient psum/pmean over ranks" if world_size > 1 else ""
    return {compiled_step_phase(world_size):
            f"one XLA program (jax.jit of jax.shard_map): the backbone's forward, the head, "
            f"autodiff's backward{comm} and the SGD update are fused and scheduled by XLA "
            f"into one executable, which the host can only wait for as a whole"}


def annotate(name: str) -> contextlib.AbstractContextManager:
    return jax.profiler.TraceAnnotation(RANGE_PREFIX + name)


@contextlib.contextmanager
def profiler(run: Any, trace_dir: str | None) -> Iterator[None]:
    """``jax.profiler.trace`` over the profiled steps, only when a trace is asked for: nothing
    else reads its events. Each rank writes into its own folder (ranks on one host would
    otherwise share one file name); rank 0's Perfetto trace becomes ``run.trace``."""
    if not trace_dir:
        yield
        return
    folder = os.path.join(trace_dir, f"rank{run.rank}")
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        yield
    if run.rank != 0:
        return
    found = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*",
                                          "perfetto_trace.json.gz")))
    if found:
        run.trace = found[-1]
        # No absolute path: the results' folder may move.
        run.trace_open = ("open https://ui.perfetto.dev and load it (or run tensorboard "
                          "--logdir on its rank0 folder, with tensorboard-plugin-profile)")


def matmul_rate(device: Any, precision: str) -> tuple[float, str]:
    """FLOP/s of ``jnp.dot`` under ``jax.jit`` on the run's device in its compute dtype."""
    n = 8192 if device.platform == "gpu" else 1024
    dtype = COMPUTE_DTYPES[precision]
    rs = np.random.RandomState(0)
    a, b = (jax.device_put(jnp.asarray(rs.standard_normal((n, n)), dtype), device)
            for _ in range(2))
    dot = jax.jit(jnp.dot)
    last: list[jax.Array] = []

    def run() -> None:
        last[:] = [dot(a, b)]

    rate = timed_matmul_rate(run, 2.0 * n**3, lambda: jax.block_until_ready(last))
    return rate, f"jnp.dot (jax.jit) {jnp.dtype(dtype).name} {n}^3"
