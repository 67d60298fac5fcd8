"""trainperf.backends.layouts: the torch layout conversions and the check of a set of torch
arrays, which every non-torch backend's loader runs (their own tests load real models)."""

from __future__ import annotations

import numpy as np
import pytest

from trainperf.backends import layouts


def test_conv_and_linear_round_trip():
    rng = np.random.default_rng(0)
    conv = rng.standard_normal((8, 3, 5, 5))  # OIHW
    hwio = layouts.from_torch(conv, "conv")
    assert hwio.shape == (5, 5, 3, 8) and hwio.flags.c_contiguous
    assert hwio[1, 2, 0, 7] == conv[7, 0, 1, 2]
    assert np.array_equal(layouts.to_torch(hwio, "conv"), conv)
    linear = rng.standard_normal((4, 6))  # [out, in]
    assert np.array_equal(layouts.from_torch(linear, "linear"), linear.T)
    assert np.array_equal(layouts.to_torch(linear.T, "linear"), linear)
    vector = rng.standard_normal(3)
    assert layouts.from_torch(vector, "vector") is vector


def test_linear_chw_reads_an_nhwc_flatten_as_torch_reads_nchw():
    rng = np.random.default_rng(1)
    c, h, w, out = 3, 2, 4, 5
    weight = rng.standard_normal((out, c * h * w))
    nchw = rng.standard_normal((2, c, h, w))
    torch_y = nchw.reshape(2, -1) @ weight.T
    nhwc_flat = nchw.transpose(0, 2, 3, 1).reshape(2, -1)
    converted = layouts.from_torch(weight, "linear_chw", (c, h, w))
    assert np.allclose(nhwc_flat @ converted, torch_y)
    assert np.array_equal(layouts.to_torch(converted, "linear_chw", (c, h, w)), weight)


def test_torch_shape_inverts_the_conversions():
    assert layouts.torch_shape((5, 5, 3, 8), "conv") == (8, 3, 5, 5)
    assert layouts.torch_shape((6, 4), "linear") == (4, 6)
    assert layouts.torch_shape((24, 5), "linear_chw") == (5, 24)
    assert layouts.torch_shape((7,), "vector") == (7,)
    assert [layouts.layout_of_rank(n) for n in (1, 2, 4)] == ["vector", "linear", "conv"]


def test_unknown_layout_and_missing_map_shape():
    with pytest.raises(ValueError, match="unknown layout 'nchw'"):
        layouts.from_torch(np.zeros(2), "nchw")
    with pytest.raises(ValueError, match=r"needs the flattened map's \(C, H, W\)"):
        layouts.to_torch(np.zeros((4, 2)), "linear_chw")


SHAPES = {"conv1.weight": (8, 3, 3, 3), "fc.weight": (16, 256), "fc.bias": (16,),
          "features.weight": (16,)}


def _arrays(prefix: str = "backbone/") -> dict[str, np.ndarray]:
    arrays = {prefix + name: np.ones(shape, np.float64) for name, shape in SHAPES.items()}
    arrays[prefix + "bn.num_batches_tracked"] = np.array(3)
    arrays["head/weight"] = np.zeros(2)  # outside the prefix: not looked at
    return arrays


def test_checked_arrays_come_back_by_torch_name():
    values = layouts.checked_torch_arrays(_arrays(), "backbone/", SHAPES,
                                          fixed_gamma={"features.weight"}, dtype=np.float32)
    assert list(values) == list(SHAPES)
    assert all(v.dtype == np.float32 for v in values.values())


def test_every_problem_is_named_in_one_error():
    arrays = _arrays()
    del arrays["backbone/fc.bias"]
    arrays["backbone/extra.weight"] = np.zeros(3)
    arrays["backbone/fc.weight"] = np.zeros((256, 16))
    arrays["backbone/features.weight"] = np.full(16, 2.0)
    with pytest.raises(ValueError) as caught:
        layouts.checked_torch_arrays(arrays, "backbone/", SHAPES, fixed_gamma={"features.weight"})
    assert str(caught.value) == (
        "cannot load torch arrays (prefix 'backbone/'): missing: fc.bias; unexpected: "
        "extra.weight; fc.weight: shape (256, 16), expected (16, 256); features.weight: a "
        "fixed BatchNorm gamma must be all ones")
