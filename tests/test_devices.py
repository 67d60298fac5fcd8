"""MFU divides by the peak the work ran at: each engine's FLOPs at its own number format."""

from __future__ import annotations

import pytest

from trainperf import results
from trainperf.devices import TFLOPS, mfu_peak
from trainperf.protocol import Start

SPLIT = {"conv": 90.0, "matmul": 10.0}


def test_fp32_convolutions_at_tf32_matmuls_at_fp32():
    peak, basis = mfu_peak("NVIDIA H100 80GB HBM3", "fp32", SPLIT, tf32_conv=True,
                           tf32_matmul=False)
    assert peak == pytest.approx(100 / (90 / (495 * TFLOPS) + 10 / (67 * TFLOPS)))
    assert "conv 90.0% at TF32 495" in basis and "matmul 10.0% at FP32 67" in basis
    # Under the TF32 peak that a single-basis MFU would have used: 10% of the FLOPs at a peak
    # 7x lower cost as much time as the other 90%.
    assert 67 * TFLOPS < peak < 0.65 * 495 * TFLOPS


def test_tf32_everywhere_and_half_precision_use_one_peak():
    both, _ = mfu_peak("NVIDIA H100 80GB HBM3", "fp32", SPLIT, True, True)
    assert both == pytest.approx(495 * TFLOPS)
    half, basis = mfu_peak("NVIDIA A100-SXM4-40GB", "bf16", SPLIT, True, False)
    assert half == pytest.approx(312 * TFLOPS) and "BF16" in basis


def test_no_tf32_units_means_fp32_whatever_the_flags():
    peak, _ = mfu_peak("Tesla V100-SXM2-16GB", "fp32", SPLIT, True, True)
    assert peak == pytest.approx(15.7 * TFLOPS)


def test_unknown_device_or_format_gives_no_mfu():
    assert mfu_peak("AMD EPYC", "fp32", SPLIT) == (None, None)
    assert mfu_peak("Tesla V100-SXM2-16GB", "bf16", SPLIT) == (None, None)
    assert mfu_peak("NVIDIA H100", "fp32", None) == (None, None)


def test_case_mfu_uses_the_blended_peak():
    start = Start(world_size=2, global_batch=128, device="cuda:0", workload={},
                  env={"device_names": ["NVIDIA H100 80GB HBM3"] * 2, "tf32_cudnn": True,
                       "tf32_matmul": False},
                  train_flops_per_sample=100e9, train_flops_by_op={"conv": 90e9, "matmul": 10e9})
    run = {"run": 1, "status": "ok", "samples_per_s": 2000.0, "flags": [],
           "peak_memory_bytes": None}
    case = results.case_record(results.CaseKey(1, 2, 64), "fp32", [run], start)
    peak = 100 / (90 / (495 * TFLOPS) + 10 / (67 * TFLOPS))
    assert case["mfu"] == pytest.approx(2000.0 * 100e9 / (2 * peak))
    assert "TF32" in case["mfu_peak_basis"]


def test_fp32_on_tf32_units_without_recorded_flags_gets_no_mfu():
    """A record that does not say whether its fp32 work ran in TF32 could be 7x off either
    way: no MFU, rather than one divided by the fp32 peak (how JAX's and TensorFlow's fp32
    runs were once counted, while both ran TF32)."""
    assert mfu_peak("NVIDIA H200", "fp32", SPLIT) == (None, None)
    assert mfu_peak("NVIDIA H200", "fp32", SPLIT, tf32_conv=True) == (None, None)
    # Only the engines that did work need a flag; bf16 and a V100 need none.
    assert mfu_peak("NVIDIA H200", "fp32", {"conv": 0.0, "matmul": 5.0}, None, False)[0] == \
        pytest.approx(67 * TFLOPS)
    assert mfu_peak("NVIDIA H200", "bf16", SPLIT)[0] == pytest.approx(989 * TFLOPS)
    assert mfu_peak("Tesla V100-SXM2-16GB", "fp32", SPLIT)[0] == pytest.approx(15.7 * TFLOPS)


def stand_in_case(env: dict, precision: str = "fp32") -> dict:
    """A case from a stand-in worker's start on an H200: what a framework's worker records."""
    start = Start(world_size=1, global_batch=64, device="cuda:0", workload={},
                  env={"device_names": ["NVIDIA H200"], "device_type": "cuda", **env},
                  train_flops_per_sample=100e9, train_flops_by_op={"conv": 90e9, "matmul": 10e9})
    run = {"run": 1, "status": "ok", "samples_per_s": 1000.0, "flags": [],
           "peak_memory_bytes": None}
    return results.case_record(results.CaseKey(1, 1, 64), precision, [run], start)


@pytest.mark.parametrize("flags,peak_tflops", [
    ({"tf32_cudnn": True, "tf32_matmul": True}, 495),     # --tf32 on: every framework's rule
    ({"tf32_cudnn": False, "tf32_matmul": False}, 67),    # --tf32 off
    ({}, None),                                           # a worker that recorded nothing
])
def test_a_stand_in_workers_fp32_mfu_follows_what_it_recorded(flags, peak_tflops):
    case = stand_in_case(flags)
    assert (case["tf32_conv"], case["tf32_matmul"]) == (flags.get("tf32_cudnn"),
                                                        flags.get("tf32_matmul"))
    if peak_tflops is None:
        assert case["mfu"] is None and case["mfu_peak_basis"] is None
    else:
        assert case["mfu"] == pytest.approx(1000.0 * 100e9 / (peak_tflops * TFLOPS))
