"""torch's execution modes (``Capabilities.modes`` in ``backend.py``): how the step's modules
are wrapped, and how many graphs the compiler has made so far.

- ``eager``: the modules as they are, one kernel per op.
- ``compile``: ``torch.compile`` with its default backend, inductor (C++/OpenMP kernels on a
  CPU, Triton on a GPU).
- ``compile-cudagraphs``: ``torch.compile(mode="reduce-overhead")`` (passed as that mode's
  inductor options): each graph captured once as a CUDA graph and replayed (CUDA only; the
  backend declares it there alone).

``torch.compile`` is lazy: a module compiles on its first call, so a run's compilation happens
in its first step, inside the warm-up, and a guard that fails later compiles again
(``graphs_compiled`` counts both). ``compile_seconds`` is torch's own timing of those
compilations: TorchDynamo's frame compiles (capture, AOTAutograd, inductor's code generation and
kernel builds) and AOTAutograd's backward compiles, which run lazily in the first backward.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

EAGER = "eager"
COMPILE_MODES = {"compile": "default", "compile-cudagraphs": "reduce-overhead"}
"""``torch.compile``'s ``mode`` for each compiled mode (backend: inductor, its default)."""
CUDA_GRAPH_MODES = ("compile-cudagraphs",)

RECOMPILE_AT_ENV = "TRAINPERF_TEST_RECOMPILE_AT"
"""A test hook: ``STEP`` makes the worker drop every compiled graph (``torch._dynamo.reset``)
just before that step, so that the step compiles again, as a failed guard would make it; tests
use it to prove that a recompilation inside the window is caught."""


def is_compiled(mode: str) -> bool:
    return mode != EAGER


def inductor_options(mode: str, channels_last: bool) -> dict:
    """Inductor's settings for ``mode``: those its ``torch.compile`` mode sets, and, where the
    run asked for channels-first, no layout optimization. That optimization turns convolutions
    channels-last on its own; the layout is a setting trainperf records and sweeps
    (``--memory-format``), so the compiler keeps the one asked for. It also keeps a channels-
    first run clear of a oneDNN bug seen on an AVX-512 CPU (AMD EPYC, torch 2.13, eager as
    well): the backward of a 1x1 stride-2 convolution in NHWC whose input has fewer than 16
    channels (the tiny IResNet's first downsampling) corrupts the heap, as ``Tuning.tf_onednn``
    records of TensorFlow's oneDNN."""
    from torch._inductor import list_mode_options

    options = dict(list_mode_options(COMPILE_MODES[mode]))
    if not channels_last:
        options["layout_optimization"] = False
    return options


def compiled(module: nn.Module, mode: str, channels_last: bool) -> nn.Module:
    """``module`` as ``mode`` runs it: itself in eager, else ``torch.compile``'s wrapper, which
    shares its parameters and buffers (its ``state_dict`` names gain ``_orig_mod.``: read the
    weights from the module itself)."""
    if not is_compiled(mode):
        return module
    if mode not in COMPILE_MODES:
        raise ValueError(f"the torch backend has no mode {mode!r}")
    # options= holds the mode's own settings: torch.compile takes a mode or options, not both.
    return torch.compile(module, backend="inductor",
                         options=inductor_options(mode, channels_last))


def unwrapped(module: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``module`` where it is not a compiled one."""
    return getattr(module, "_orig_mod", module)


def graphs_compiled(mode: str) -> int | None:
    """Graphs TorchDynamo has captured and handed to inductor in this process so far (a first
    compilation, a recompilation after a failed guard, each graph of a graph break); None in
    eager. The counter is the process's own and ``torch._dynamo.reset`` does not lower it."""
    if not is_compiled(mode):
        return None
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiler_seconds() -> float:
    """torch's own total of its compile phases in this process, since the last
    ``torch._dynamo.reset``: ``entire_frame_compile`` (``convert_frame``'s timer around each
    frame's compile, which holds graph capture, the DDP optimizer's per-bucket subgraphs and
    inductor's forward and, where it lowers them at once, backward code) plus
    ``entire_backward_compile`` (AOTAutograd's lazy backward compile, at the first backward).
    Neither phase runs inside the other, so their sum counts nothing twice."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


_seconds_before_reset = 0.0
"""Compile seconds of the compilations that ``force_recompile`` dropped: ``torch._dynamo.reset``
clears torch's timers with the graphs."""


def compile_seconds(mode: str) -> float:
    """Seconds this process has spent compiling, summed over every compilation (recompilations
    and each graph of a graph break included); 0.0 in eager, which compiles nothing."""
    if not is_compiled(mode):
        return 0.0
    return _seconds_before_reset + _compiler_seconds()


def compile_measure(mode: str, device_type: str) -> str:
    """What ``compile_seconds`` times, in one line."""
    if not is_compiled(mode):
        return "eager: nothing is compiled"
    text = ("torch.compile: TorchDynamo's frame compiles (capture, AOTAutograd, inductor code "
            "generation) and AOTAutograd's lazy backward compiles, every graph and "
            "recompilation, as torch._dynamo.utils.calculate_time_spent()['total_wall_time']")
    if device_type == "cuda":
        # Both run at a graph's first calls, after its compile, under timers of their own.
        text += ("; not Triton's autotuning at a kernel's first launch nor CUDA graph "
                 "recording")
    return text


def step_begins(mode: str) -> None:
    """Tell CUDA graph trees that a training step begins: the graphs' outputs of the last one
    are no longer read, and their memory may be used again."""
    if mode in CUDA_GRAPH_MODES:
        torch.compiler.cudagraph_mark_step_begin()


def kept(t: torch.Tensor, mode: str) -> torch.Tensor:
    """``t`` as it can be kept past the step: a CUDA graph's output lives in memory that the
    next replay writes again, so a loss kept for after the window is copied out of it."""
    return t.clone() if mode in CUDA_GRAPH_MODES else t


def cudagraph_skips(mode: str) -> int | None:
    """Graphs inductor compiled but ran without a CUDA graph (it logs why: an input mutated, a
    CPU tensor, dynamic shapes...), in a CUDA graph mode; None in the others."""
    if mode not in CUDA_GRAPH_MODES:
        return None
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def recompile_step() -> int | None:
    """The step before which ``RECOMPILE_AT_ENV`` asks for a recompilation, or None."""
    text = os.environ.get(RECOMPILE_AT_ENV, "").strip()
    return int(text) if text else None


def force_recompile() -> None:
    """Drop every compiled graph, so that the next call of a compiled module compiles again."""
    global _seconds_before_reset
    _seconds_before_reset += _compiler_seconds()
    torch._dynamo.reset()
