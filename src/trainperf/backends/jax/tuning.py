"""The speed settings the JAX backend honours (``backend.TUNING``), each by JAX's or XLA's own
switch, and what a run applied, read back from JAX where it can say.

TF32 (``Tuning.tf32``): JAX's ``jax_default_matmul_precision``, the default precision of every
dot and convolution on 32-bit inputs that does not name its own (none of trainperf's does), set
before the step is traced (the option is part of the trace context and of jit's cache key).
In JAX 0.10.2 (``jax/_src/lax/lax.py``, ``_precision_strings``) ``tensorfloat32`` is
``Precision.HIGH`` and ``float32`` is ``Precision.HIGHEST``; XLA's GPU backend runs a float32
GEMM in TF32 when TF32 is enabled (XLA's default) and the precision is at most HIGH
(``xla/service/gpu/matmul_utils.cc``, ``GetBlasComputationType``), and lets cuDNN use TF32 for a
convolution on the same condition (``allow_tf32`` in ``xla/backends/gpu/autotuner/cudnn.cc``,
as in the older ``xla/service/gpu/autotuning/conv_algorithm_picker.cc``).
So ``tensorfloat32`` runs both in TF32 and ``float32`` runs both in full fp32. On a CPU the
option changes nothing (``lax.Precision``'s docstring) and is left as the caller had it.

cuDNN's timing of algorithms (``Tuning.cudnn_benchmark``): XLA times every convolution's (and
GEMM's) candidates when it compiles, at its default ``xla_gpu_autotune_level`` 4; level 0 takes
the first candidate without timing any ("Set GEMM and Convolution auto-tuning level. 0 = off",
``xla/debug_options_flags.cc``). Off, the step is compiled with that compiler option (its own,
through ``Lowered.compile(compiler_options=)``); on, nothing is passed and XLA keeps its
default. The one level governs GEMMs too: said in the declaration.

Only JAX is imported, and only inside the functions: the worker sets JAX's process variables
before JAX starts (``worker.configure_process``).
"""

from __future__ import annotations

import os
from typing import Any

from ...config import Tuning
from ..base import xla_autotunes
from ..workerkit import tf32_ran, tf32_wanted

PRECISION_OPTION = "jax_default_matmul_precision"
PRECISIONS = {True: "tensorfloat32", False: "float32"}
"""The option's value for TF32 on (HIGH) and off (HIGHEST, full fp32)."""
IN_TF32 = {None: True, "default": True, "fastest": True, "bfloat16": True, "high": True,
           "bfloat16_3x": True, "tensorfloat32": True, "TF32_TF32_F32": True,
           "highest": False, "float32": False, "F32_F32_F32": False}
"""Whether a float32 dot or convolution runs in TF32 on a GPU with TF32 units, by the option's
value (None: JAX's default, Precision.DEFAULT); a value not here is not known to say."""
AUTOTUNE_OPTION = "xla_gpu_autotune_level"
NO_AUTOTUNE = {AUTOTUNE_OPTION: 0}


def matmul_precision(tuning: Tuning, gpu: bool) -> str | None:
    """The value this run sets ``jax_default_matmul_precision`` to; None on a CPU."""
    wanted = tf32_wanted(tuning, gpu)
    return None if wanted is None else PRECISIONS[wanted]


def compiler_options(tuning: Tuning, gpu: bool) -> dict[str, Any] | None:
    """The compile options of the step: no autotuning where cuDNN's timing is off, on a GPU."""
    return dict(NO_AUTOTUNE) if gpu and not tuning.cudnn_benchmark else None


def configure(tuning: Tuning, gpu: bool) -> None:
    """Set the precision before anything is traced (a CPU run keeps the caller's)."""
    import jax

    precision = matmul_precision(tuning, gpu)
    if precision is not None:
        jax.config.update(PRECISION_OPTION, precision)


def tf32_fields(gpu: bool) -> dict[str, Any]:
    """``environment``'s TF32 fields as JAX holds them now (None on a CPU)."""
    if not gpu:
        return {"tf32_cudnn": None, "tf32_matmul": None, "tf32_switch": None}
    import jax

    value = jax.config.jax_default_matmul_precision
    on, switch = tf32_ran(IN_TF32.get(value),
                          f"jax.config {PRECISION_OPTION}={value!r} (dots and convolutions)")
    return {"tf32_cudnn": on, "tf32_matmul": on, "tf32_switch": switch}


def applied(gpu: bool, options: dict[str, Any] | None) -> dict[str, Any]:
    """``FrameworkRun.applied_tuning``: both settings are GPU-only (none on a CPU); TF32 as
    JAX holds it, autotuning as the step was compiled (``options``)."""
    if not gpu:
        return {}
    on = tf32_fields(True)["tf32_matmul"]
    # The step's own option wins; without one, a level in the caller's XLA_FLAGS holds.
    return {"tf32": None if on is None else ("on" if on else "off"),
            "cudnn_benchmark": xla_autotunes(os.environ.get("XLA_FLAGS", ""),
                                             (options or {}).get(AUTOTUNE_OPTION))}
