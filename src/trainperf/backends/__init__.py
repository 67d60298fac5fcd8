"""The backends trainperf can run, by ``--framework`` name. A new framework is one folder with a
``backend.py`` (stdlib only) and one line here."""

from __future__ import annotations

from .base import Backend
from .jax.backend import BACKEND as _JAX
from .mxnet.backend import BACKEND as _MXNET
from .oneflow.backend import BACKEND as _ONEFLOW
from .paddle.backend import BACKEND as _PADDLE
from .tf.backend import BACKEND as _TF
from .torch.backend import BACKEND as _TORCH

BACKENDS: dict[str, Backend] = {b.name: b for b in (_TORCH, _MXNET, _PADDLE, _JAX, _TF, _ONEFLOW)}


def get_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown framework {name!r}; known: {', '.join(BACKENDS)}") from None
