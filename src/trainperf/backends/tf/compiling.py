"""What a TensorFlow run spends compiling its step (``End.compile_s``), timed where TensorFlow
compiles it, and what that figure holds.

Tracing (both modes): ``tf.function`` turns the Python step into a graph (a concrete function:
the forward, ``GradientTape``'s backward, the strategy's replica call) the first time it meets
an input signature. :class:`CompileClock` traces explicitly (``TrainStep.trace``, that is
``get_concrete_function``), on the host clock, just before the call that needs the graph (step
0's, or a step whose batch changed shape or dtype), so that the call finds the graph in the
function's cache and its trace count does not move. The trace happens inside step 0, as it did
when the call traced: the compile time is part of that step's time.

XLA (``--mode xla``): TensorFlow compiles a traced graph into one XLA program inside the graph's
first call, when its ``XlaLaunch`` kernel runs (``DeviceCompiler::CompileStrict``: the graph
lowered to HLO, XLA's passes and code generation, the executable cached), on a CPU and a GPU
alike. TensorFlow 2.21 offers no compile ahead of that call that fills the cache it reads
(``experimental_get_compiler_ir`` compiles a copy of its own), and it keeps the seconds it times
around each compilation in two places: the monitoring counter
``/tensorflow/core/xla_compilation_time_usecs``, which Python cannot read (``tf.monitoring``
makes new metrics and reads none of TensorFlow's own), and a ``VLOG(1)`` line of
``device_compilation_profiler.cc``, "Compiled <graph> <n> times, compile time: <us> us". An xla
run's launch turns that line on (``backend.XLA_COMPILE_LOG``); its stderr is its own log file
(``spawn``), so the clock notes where the file ends before the first call and, after the last
step, reads what TensorFlow wrote after that point: every compilation of the run, recompilations
included, in TensorFlow's own microseconds. Nothing is redirected and nothing waits on the
device.

Not in the figure: the graph optimizations TensorFlow runs when a graph's first call instantiates
it in ``--mode function`` (placement, Grappler, partitioning, the executor's kernels). They
happen inside that call, and TensorFlow 2.21 times them only into
``/tensorflow/core/function_graph_optimization_time_usecs``, a counter Python cannot read (its
log line says only when they finished).
"""

from __future__ import annotations

import os
import re
import stat
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the module itself stays standard library only, for its tests
    from .step import TrainStep

XLA_COMPILED = re.compile(rb"\] Compiled \S+ \d+ times, compile time: (\d+) us")
"""TensorFlow's line for one XLA compilation (``device_compilation_profiler.cc``, 2.21)."""
OWN_LOG = "/proc/self/fd/2"

TRACE_MEASURE = ("tf.function tracing: get_concrete_function on the host clock before the call "
                 "that first needs each graph")
FUNCTION_MEASURE = (TRACE_MEASURE + "; not the graph optimizations (placement, Grappler) at "
                    "that call, which TensorFlow 2.21 times only into a counter Python cannot "
                    "read")
XLA_MEASURE = (TRACE_MEASURE + ", plus XLA's compilation of each graph at its first call "
               "(lowering to HLO, XLA's passes, code generation) as TensorFlow times it: "
               "device_compilation_profiler's 'compile time' lines in this process's log")


def own_log_end() -> int | None:
    """Where this process's stderr file ends now; None where stderr is not a regular file (a
    terminal, a pipe), which cannot be read back."""
    try:
        info = os.fstat(2)
    except OSError:
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def xla_compile_seconds(since: int) -> list[float]:
    """The seconds of every XLA compilation TensorFlow logged into this process's stderr file
    after byte ``since``."""
    with open(OWN_LOG, "rb") as log:
        log.seek(since)
        return [int(us) / 1e6 for us in XLA_COMPILED.findall(log.read())]


class CompileClock:
    """Calls the step (``__call__``, as ``TrainStep``), tracing before the call that needs a new
    graph, and keeps the run's compile time (module doc)."""

    def __init__(self, step: TrainStep, xla: bool) -> None:
        self.step = step
        self.xla = xla
        self.trace_s = 0.0
        self.untimed_traces = 0
        """Traces a call made by itself (the clock's signature missed a change TensorFlow saw):
        their time is in no figure."""
        self.log_from: int | None = None
        """Under XLA: where this process's log ended before the first call of the step."""
        self._signature: tuple | None = None
        self._calls = 0
        self._missing: str | None = None
        """Why the last ``seconds`` was None."""

    def __call__(self, images: Any, labels: Any) -> Any:
        signature = (images.shape, images.dtype, labels.shape, labels.dtype)
        if signature != self._signature:
            self._signature = signature
            before = self.step.traces
            began = time.perf_counter()
            self.step.trace(images, labels)
            if self.step.traces != before:
                self.trace_s += time.perf_counter() - began
        if self.xla and self._calls == 0:
            self.log_from = own_log_end()
        self._calls += 1
        before = self.step.traces
        out = self.step(images, labels)
        self.untimed_traces += self.step.traces - before
        return out

    def seconds(self) -> float | None:
        """The run's compile seconds so far: its traces, and under XLA every compilation since
        the step's first call; None where a part could not be timed (``measure`` says which)."""
        self._missing = None
        if self.untimed_traces:
            self._missing = (f"{self.untimed_traces} trace(s) a call made by itself, which the "
                             "clock did not see coming, were not timed")
            return None
        if not self.xla or self._calls == 0:
            return self.trace_s
        if self.log_from is None:
            self._missing = ("this process's stderr is not a file, so XLA's lines could not be "
                             "read back")
            return None
        compiled = xla_compile_seconds(self.log_from)
        if not compiled:
            self._missing = ("TensorFlow logged no compilation (its log settings are the "
                             "launch's: backend.XLA_COMPILE_LOG)")
            return None
        return self.trace_s + sum(compiled)

    def measure(self) -> str:
        """What ``seconds`` timed (one line), after it was read."""
        text = XLA_MEASURE if self.xla else FUNCTION_MEASURE
        return f"{text}; unknown: {self._missing}" if self._missing else text
