"""TensorFlow's strict alignment with torch on one rank (``trainperf align``): three SGD steps
from torch's start in float64, every tensor's update within 1e-8 of torch's (BatchNorm composed
of tf.nn ops in float64, the fused kernel having no float64 version), and the negative controls
that the check must catch, each breaking one rule in TensorFlow's run. MobileFaceNet (PReLU,
depthwise convolutions, the GDC, a BatchNorm1d with a trained gamma) at its tiny size for two
steps, in both of TensorFlow's modes.

The 2-rank check (the gradient all-reduce in float64) is in ``test_tf_runs.py``; alignment under
``--mode xla`` in ``test_tf_modes.py``. torch's side of each check runs once per session
(``shared_torch_alignment_runs``)."""

from __future__ import annotations

import pytest

from align_checks import assert_one_rank_with_controls, assert_strictly_aligned
from run_util import left_behind
from trainperf.align import AlignRequest, run_alignment
from trainperf.backends.torch.backbones import workload_backbone
from trainperf.recipes import get_recipe

pytestmark = pytest.mark.slow


def test_aligned_in_float64_and_every_control_is_caught(tmp_path, tf_python, capsys):
    outcome = assert_one_rank_with_controls("tf", tmp_path / "align", capsys)
    assert outcome["checks"][0]["params"]["other"] == 278712
    assert outcome["checks"][0]["tensors_compared"] == 97  # every parameter and statistic
    assert left_behind(tmp_path) == []


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_mobilefacenet_aligned_in_float64(tmp_path, tf_python, mode):
    """Y1's recipe on the tiny MobileFaceNet, in each of TensorFlow's modes: every parameter and
    BatchNorm statistic and the class matrix compared after each of two steps, within the
    float64 tolerance."""
    workload = get_recipe("y1-arcface-emore").workload.replace(
        backbone="mobilefacenet_tiny", embedding_size=64, input_size=32, batch_size=2,
        num_classes=16)
    outcome = run_alignment(AlignRequest("y1-arcface-emore", workload, "tf", [1], ["dp"], 2,
                                         300.0, tmp_path / "align", mode=mode))
    assert outcome["mode"] == mode
    [check] = outcome["checks"]
    assert_strictly_aligned(check)
    state = [k for k in workload_backbone(workload).state_dict()
             if not k.endswith("num_batches_tracked")]
    assert check["tensors_compared"] == len(state) + 1  # and the class matrix
    assert left_behind(tmp_path) == []
