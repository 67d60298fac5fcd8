"""OneFlow's strict alignment with torch on one rank (``trainperf align``): three SGD steps from
torch's start in float64, every tensor's update within 1e-8 of torch's (through OneFlow's own
BatchNorm and SGD arithmetic with exact constants, ``exact.py``), and the negative controls,
each one rule broken in OneFlow's run, which the check must catch.

The 2-rank checks (dp and mp, the float64 gradient all-reduce) are in ``test_oneflow_runs.py``.
torch's side of each check runs once per session (``shared_torch_alignment_runs``)."""

from __future__ import annotations

import pytest

from align_checks import assert_one_rank_with_controls
from run_util import left_behind

pytestmark = pytest.mark.slow


def test_aligned_in_float64_and_each_control_is_caught(tmp_path, oneflow_python, capsys):
    outcome = assert_one_rank_with_controls("oneflow", tmp_path / "align", capsys)
    # 96 backbone parameters and BatchNorm statistics (the fixed gamma included), the head.
    assert outcome["checks"][0]["tensors_compared"] == 97
    assert left_behind(tmp_path) == []
