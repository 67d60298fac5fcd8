"""Statistics on hand-made inputs."""

from __future__ import annotations

import pytest

from trainperf import stats


def test_median_of_even_count_is_mean_of_middle_pair():
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert stats.median([5.0]) == 5.0
    assert stats.median([]) is None


def test_average_and_iqr():
    assert stats.average([1.0, 2.0, 3.0, 6.0]) == 3.0
    # quartiles of 1,2,3,4,5 with linear interpolation: 2 and 4
    assert stats.iqr([5.0, 1.0, 4.0, 2.0, 3.0]) == 2.0


def test_dlperf_seed_figures():
    # MXNet r100 batch 64, 1n1g per-run values from the DLPerf report.
    runs = [233.94, 238.78, 233.52, 231.46, 233.88]
    s = stats.case_stats(runs)
    assert s.median == 233.88
    assert s.average == pytest.approx(234.316)
    assert s.flags == []


def test_speedup_with_base_case():
    one = stats.case_stats([100.0, 102.0, 98.0])
    four = stats.case_stats([380.0, 390.0, 385.0])
    stats.apply_scaling([(1, 64, one), (4, 64, four)])
    assert one.speedup == 1.0 and one.scaling_efficiency == 1.0
    assert four.speedup == pytest.approx(3.85)
    assert four.scaling_efficiency == pytest.approx(3.85 / 4)
    assert four.flags == []


def test_speedup_without_base_case_is_none():
    two = stats.case_stats([190.0])
    other_batch_base = stats.case_stats([100.0])
    stats.apply_scaling([(2, 64, two), (1, 32, other_batch_base)])
    assert two.speedup is None and two.scaling_efficiency is None


def test_flags():
    base = stats.case_stats([100.0])
    superlinear = stats.case_stats([220.0])
    falling = stats.case_stats([150.0])
    stats.apply_scaling([(1, 8, base), (2, 8, superlinear), (4, 8, falling)])
    assert "superlinear" in superlinear.flags
    assert "throughput_falls" in falling.flags
    assert "throughput_falls" not in superlinear.flags
    spread = stats.case_stats([100.0, 100.0, 120.0, 80.0])
    assert "high_spread" in spread.flags
    failed = stats.case_stats([100.0, None])
    assert "failed_runs" in failed.flags and failed.ok_runs == 1


def test_loss_flags():
    assert stats.loss_flags(float("nan")) == ["loss_nonfinite"]
    assert stats.loss_flags(1.0, nonfinite=2) == ["loss_nonfinite"]
    assert stats.loss_flags(69.0776) == ["loss_clamped"]
    assert stats.loss_flags(12.5) == []
