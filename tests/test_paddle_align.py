"""Paddle's strict alignment with torch on one rank (``trainperf align``): three SGD steps from
torch's start in float64, each tensor's update within the float64 tolerance of torch's, and the
negative controls, each breaking one rule in Paddle's run only, that the check must catch. The
running variances follow Paddle's rule (the biased batch variance), not torch's: the backend
declares it, and the check measures them apart.

The 2-rank checks (mp and pfc: the gathered embeddings, the sharded softmax, the summed backbone
gradients, all in float64) are in ``test_paddle_runs.py``. torch's side of each check runs once
per session (``shared_torch_alignment_runs``)."""

from __future__ import annotations

import pytest

from align_checks import assert_one_rank_with_controls
from run_util import left_behind

pytestmark = pytest.mark.slow


def test_float64_alignment_on_one_rank_catches_every_control(tmp_path, paddle_python, capsys):
    outcome = assert_one_rank_with_controls("paddle", tmp_path / "align", capsys,
                                            declared="running_var")
    assert len(outcome["checks"][0]["declared"]) == 19  # one per BatchNorm
    assert left_behind(tmp_path) == []
