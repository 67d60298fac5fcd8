"""The speed settings the OneFlow backend honours (``backend.TUNING``) as the worker applies and
records them, and its memory figures on a GPU (OneFlow 0.9.0 keeps no allocator statistics:
nothing under ``python/oneflow/cuda`` reports memory).

TF32 (``Tuning.tf32``): variables given with the launch (``backend.launch_env``), read by OneFlow
and cuDNN when they start, and read back here from the process's own environment, as OneFlow
parses them (``ParseBooleanFromEnv``: unset is the default, ``1``, ``true``, ``yes``, ``on``
and ``y`` in any case are true; ``oneflow/core/common/util.cpp``).

cuDNN's algorithm search (``Tuning.cudnn_benchmark``): OneFlow 0.9.0 decides it per
convolution as ``cudnn_conv_heuristic_search_algo() || !LazyMode::is_enabled()``
(``oneflow/user/kernels/conv_cudnn_kernels.cpp``): eager convolutions always take cuDNN's
heuristic; inside an ``nn.Graph`` the session's ``cudnn_conf`` decides, true (the heuristic) by
default (``oneflow/core/job/resource.proto``). The worker sets it with
``flow.backends.cudnn.enable_conv_heuristic_search_algo`` before the graph is built, which
writes the session's resource config (``python/oneflow/framework/config_util.py``), and reads it
back from there.
"""

from __future__ import annotations

from typing import Any

import oneflow as flow

from ...config import Tuning
from ..workerkit import process_env, tf32_setting
from .backend import TF32_MATMUL_VAR, TF32_OVERRIDE

TRUE_WORDS = ("1", "true", "yes", "on", "y")
"""What OneFlow 0.9's ``StringToBool`` takes as true (case aside)."""


def env_flag(name: str, default: bool) -> bool:
    """A boolean variable as OneFlow's ``ParseBooleanFromEnv`` reads it."""
    value = process_env(name)
    return default if value is None else value.lower() in TRUE_WORDS


def tf32_fields(gpu: bool) -> dict[str, Any]:
    """``environment``'s TF32 fields from the variables OneFlow and cuDNN read (None on a
    CPU)."""
    if not gpu:
        return {"tf32_cudnn": None, "tf32_matmul": None, "tf32_switch": None}
    allowed = process_env(TF32_OVERRIDE) != "0"
    shown = {name: process_env(name) for name in (TF32_MATMUL_VAR, TF32_OVERRIDE)}
    return {"tf32_matmul": env_flag(TF32_MATMUL_VAR, True) and allowed,
            "tf32_cudnn": allowed,
            "tf32_switch": ", ".join(f"{k}={'unset' if v is None else v}"
                                     for k, v in shown.items())}


def _resource() -> Any:
    """The session's resource config as ``config_util._set_resource_attr`` writes it: the
    pending one until the session starts (at the first graph's compile), its own after."""
    from oneflow.framework import session_context

    session = session_context.GetDefaultSession()
    if session.status_ == session.Status.INITED:
        return session.resource
    return session.config_proto.resource


def heuristic_search() -> bool:
    """Whether graph convolutions take cuDNN's heuristic (the session's ``cudnn_conf``)."""
    return bool(_resource().cudnn_conf.cudnn_conv_heuristic_search_algo)


def configure(tuning: Tuning, gpu: bool) -> None:
    """Set the graph's algorithm search as asked, on a GPU, before any graph is built."""
    if gpu:
        flow.backends.cudnn.enable_conv_heuristic_search_algo(not tuning.cudnn_benchmark)


def applied(tuning: Tuning, gpu: bool, graph: bool, ddp: bool) -> dict[str, Any]:
    """``FrameworkRun.applied_tuning``: ``broadcast_buffers`` where OneFlow's DDP wraps the
    model (``ddp``: eager on several ranks); on a GPU the search as convolutions run it (eager:
    never timed) and TF32 as read back (``mixed`` where convolutions and products differ)."""
    out: dict[str, Any] = {}
    if ddp:
        out["ddp_broadcast_buffers"] = tuning.ddp_broadcast_buffers
    if gpu:
        fields = tf32_fields(True)
        out["tf32"] = tf32_setting(fields["tf32_cudnn"], fields["tf32_matmul"])
        out["cudnn_benchmark"] = graph and not heuristic_search()
    return out
