"""TensorFlow's strict alignment with torch on one rank (``trainperf align``): three SGD steps
from torch's start in float64, every tensor's update within 1e-8 of torch's (BatchNorm composed
of tf.nn ops in float64, the fused kernel having no float64 version), and the negative controls
that the check must catch, each breaking one rule in TensorFlow's run.

The 2-rank check (the gradient all-reduce in float64) is in ``test_tf_runs.py``. torch's side
of each check runs once per session (``shared_torch_alignment_runs``)."""

from __future__ import annotations

import pytest

from align_checks import assert_one_rank_with_controls
from run_util import left_behind

pytestmark = pytest.mark.slow


def test_aligned_in_float64_and_every_control_is_caught(tmp_path, tf_python, capsys):
    outcome = assert_one_rank_with_controls("tf", tmp_path / "align", capsys)
    assert outcome["checks"][0]["params"]["other"] == 278712
    assert outcome["checks"][0]["tensors_compared"] == 97  # every parameter and statistic
    assert left_behind(tmp_path) == []
