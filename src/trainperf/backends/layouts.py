"""torch's arrays in other frameworks' networks: the layout conversions, one check of a whole
set of arrays before any of it is loaded, and the rows of a class matrix each rank holds.

Standard library and numpy only: every framework's worker imports it, and each pins its own
numpy.

Layouts, named by how torch holds an array and how an NHWC framework (JAX, TensorFlow) holds
it; a framework that keeps torch's layout for a kind of array uses ``vector`` for it:

- ``conv``: torch OIHW, the framework HWIO ([kh, kw, in / groups, out]).
- ``linear``: torch [out, in], the framework [in, out].
- ``linear_chw``: a linear layer that reads a flattened (C, H, W) map: torch [out, C*H*W]
  with its columns in (C, H, W) order, the framework [H*W*C, out] with its rows in the order an
  NHWC map flattens (``chw`` gives (C, H, W)).
- ``vector``: the same in both (vectors, and any array a framework holds as torch does).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping

import numpy as np

LAYOUTS = ("conv", "linear", "linear_chw", "vector")
# Axis orders taking torch's array to the framework's and back (None: the same array). A
# linear_chw weight's shape turns as a linear weight's does.
_TO_FRAMEWORK = {"conv": (2, 3, 1, 0), "linear": (1, 0), "vector": None}
_TO_TORCH = {"conv": (3, 2, 0, 1), "linear": (1, 0), "vector": None}


def _known(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return layout


def _map_shape(chw: tuple[int, int, int] | None) -> tuple[int, int, int]:
    if chw is None:
        raise ValueError("the linear_chw layout needs the flattened map's (C, H, W)")
    return chw


def _permuted(value: np.ndarray, axes: tuple[int, ...] | None) -> np.ndarray:
    return value if axes is None else np.ascontiguousarray(value.transpose(axes))


def from_torch(value: Any, layout: str, chw: tuple[int, int, int] | None = None) -> np.ndarray:
    """torch's array -> the framework's, in ``layout`` (the dtype is kept)."""
    value = np.asarray(value)
    if _known(layout) == "linear_chw":
        # A linear layer over a whole (C, H, W) map is a convolution whose kernel covers the
        # map: its HWIO kernel, flattened, has its rows in NHWC flatten order.
        c, h, w = _map_shape(chw)
        return from_torch(value.reshape(-1, c, h, w), "conv").reshape(h * w * c, -1)
    return _permuted(value, _TO_FRAMEWORK[layout])


def to_torch(value: Any, layout: str, chw: tuple[int, int, int] | None = None) -> np.ndarray:
    """The inverse of :func:`from_torch`: the framework's array -> torch's."""
    value = np.asarray(value)
    if _known(layout) == "linear_chw":
        c, h, w = _map_shape(chw)
        return to_torch(value.reshape(h, w, c, -1), "conv").reshape(-1, c * h * w)
    return _permuted(value, _TO_TORCH[layout])


def torch_shape(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The shape torch gives an array the framework holds in ``layout`` with ``shape``."""
    axes = _TO_TORCH["linear" if _known(layout) == "linear_chw" else layout]
    shape = tuple(int(s) for s in shape)
    return shape if axes is None else tuple(shape[a] for a in axes)


def layout_of_rank(ndim: int) -> str:
    """The layout of an array of ``ndim`` dimensions in a framework whose only 4-d arrays are
    convolution kernels and whose only 2-d ones are linear weights (JAX's backbones)."""
    return {4: "conv", 2: "linear"}.get(ndim, "vector")


def checked_torch_arrays(arrays: Any, prefix: str, shapes: Mapping[str, tuple[int, ...]],
                         fixed_gamma: Collection[str] = (), dtype: Any = None
                         ) -> dict[str, np.ndarray]:
    """Every array a network needs, by torch name, from ``arrays[prefix + torch name]`` (a dict
    or an ``np.load`` result), in torch's layout: ``shapes`` is each torch name the network
    holds -> its torch shape, in the order the problems are told. Keys under ``prefix`` ending
    in ``num_batches_tracked`` are ignored (BatchNorm's step count, which no loader takes from
    torch); keys outside ``prefix`` are not looked at. ``fixed_gamma``: names of BatchNorm
    gammas a network holds at 1, which must be all ones (a network that holds one at 1 would
    silently disagree with a file that does not). ``dtype``: what each array is read as (None:
    as stored).

    Raises one ValueError naming every missing, unexpected or wrongly shaped array and every
    fixed gamma that is not all ones, so a caller checks everything before it changes
    anything."""
    keys = {k[len(prefix):] for k in arrays.keys() if k.startswith(prefix)}
    keys = {k for k in keys if not k.endswith("num_batches_tracked")}
    missing = [name for name in shapes if name not in keys]
    unexpected = sorted(keys - set(shapes))
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected)}")
    values: dict[str, np.ndarray] = {}
    for name, expected in shapes.items():
        if name not in keys:
            continue
        value = np.asarray(arrays[prefix + name], dtype=dtype)
        if tuple(value.shape) != tuple(expected):
            problems.append(f"{name}: shape {tuple(value.shape)}, expected {tuple(expected)}")
        elif name in fixed_gamma and not np.all(value == 1):
            problems.append(f"{name}: a fixed BatchNorm gamma must be all ones")
        values[name] = value
    if problems:
        raise ValueError(f"cannot load torch arrays (prefix {prefix!r}): " + "; ".join(problems))
    return values


def shard_of(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s rows when ``total`` rows (a class matrix) are split over
    ``world_size`` ranks: balanced, the first ``total % world_size`` ranks one row more. Every
    sharded head splits by this one rule (OneFlow's ``split(0)`` does the same), so a start
    file's class matrix and a checkpoint reshard alike in every framework."""
    base, rem = divmod(total, world_size)
    return rank * base + min(rank, rem), base + (1 if rank < rem else 0)
