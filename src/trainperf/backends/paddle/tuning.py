"""The speed settings the Paddle backend honours (``backend.TUNING``) as the worker applies and
records them.

TF32 (``Tuning.tf32``): Paddle's own switches, set before anything is built. Paddle 3.x keeps
one global each for cuBLAS's and cuDNN's TF32 (``phi::SetAllowTF32Cublas`` / ``Cudnn`` in
``paddle/phi/backends/context_pool.cc``, given to Python as ``core.set_cublas_switch`` /
``set_cudnn_switch``), read where Paddle calls cuBLAS (a context's ``CublasCall`` takes its TF32
handle only while the switch is on) and builds a convolution's cuDNN descriptor
(``cdesc.set(..., AllowTF32Cudnn())``). Their defaults moved in 3.3 (the CPU wheel
of 3.3.1 holds cuBLAS's off and cuDNN's on, as torch), and PaddlePaddle/Paddle PR 77781 (3.3.0,
cherry-picked as 77842) added the flags ``FLAGS_cublas_allow_tf32`` (off) and
``FLAGS_cudnn_allow_tf32`` (on): the worker sets both switches and, where the build defines
them, both flags, to the one value the rule asks for. ``NVIDIA_TF32_OVERRIDE`` comes with the
launch (``backend.TF32_OVERRIDE``). What ran is read back from Paddle and from the process's
own environment (a library's ``setenv`` included, which Python's ``os.environ`` would miss).

cuDNN's algorithm search (``Tuning.cudnn_benchmark``): ``FLAGS_cudnn_exhaustive_search``, given
with the launch and read back where the build defines it. The gradient buckets
(``Tuning.ddp_bucket_mb``) size trainperf's own all-reduce (``step.py``), on several ranks only.
"""

from __future__ import annotations

import os
from typing import Any

import paddle

from ...config import Tuning
from ..workerkit import process_env, tf32_setting, tf32_wanted
from .backend import CUDNN_SEARCH_FLAG, TF32_OVERRIDE

TF32_FLAGS = {"matmul": "FLAGS_cublas_allow_tf32", "conv": "FLAGS_cudnn_allow_tf32"}


def defined_flags(names: list[str]) -> dict[str, Any]:
    """{flag: value} for the flags this build of Paddle defines (its GPU-only flags are
    missing from a CPU build, where ``get_flags`` raises ValueError)."""
    found = {}
    for name in names:
        try:
            found.update(paddle.get_flags([name]))
        except ValueError:
            continue
    return found


def configure(tuning: Tuning, gpu: bool) -> None:
    """Set Paddle's TF32 switches as the rule asks (nothing on a CPU)."""
    wanted = tf32_wanted(tuning, gpu)
    if wanted is None:
        return
    core = paddle.base.core
    core.set_cublas_switch(wanted)
    core.set_cudnn_switch(wanted)
    flags = defined_flags(list(TF32_FLAGS.values()))
    if flags:
        paddle.set_flags({name: wanted for name in flags})


def tf32_fields(gpu: bool) -> dict[str, Any]:
    """``environment``'s TF32 fields, as Paddle and the environment hold them now: a product
    runs in TF32 only where its switch, its flag (where defined) and the override all allow it
    (None on a CPU)."""
    if not gpu:
        return {"tf32_cudnn": None, "tf32_matmul": None, "tf32_switch": None}
    core = paddle.base.core
    flags = defined_flags(list(TF32_FLAGS.values()))
    override = process_env(TF32_OVERRIDE)
    allowed = override != "0"
    switch = "paddle.base.core.set_cublas_switch, set_cudnn_switch"
    if flags:
        switch += ", paddle.set_flags(" + ", ".join(sorted(flags)) + ")"
    return {"tf32_matmul": bool(core.get_cublas_switch())
            and bool(flags.get(TF32_FLAGS["matmul"], True)) and allowed,
            "tf32_cudnn": bool(core.get_cudnn_switch())
            and bool(flags.get(TF32_FLAGS["conv"], True)) and allowed,
            "tf32_switch": f"{switch}; {TF32_OVERRIDE}="
                           + ("unset" if override is None else override)}


def exhaustive_search() -> bool:
    """Whether cuDNN's exhaustive search is on: Paddle's flag, else the launch's variable."""
    flags = defined_flags([CUDNN_SEARCH_FLAG])
    if flags:
        return bool(flags[CUDNN_SEARCH_FLAG])
    return os.environ.get(CUDNN_SEARCH_FLAG) == "1"


def applied(tuning: Tuning, gpu: bool, distributed: bool) -> dict[str, Any]:
    """``FrameworkRun.applied_tuning``: the bucket size on several ranks; on a GPU the search
    and TF32 as read back (``mixed`` where convolutions and products differ)."""
    out: dict[str, Any] = {}
    if distributed:
        out["ddp_bucket_mb"] = tuning.ddp_bucket_mb
    if gpu:
        fields = tf32_fields(True)
        out["tf32"] = tf32_setting(fields["tf32_cudnn"], fields["tf32_matmul"])
        out["cudnn_benchmark"] = exhaustive_search()
    return out
