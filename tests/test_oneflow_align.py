"""OneFlow's strict alignment with torch on one rank (``trainperf align``): three SGD steps from
torch's start in float64, every tensor's update within 1e-8 of torch's (through OneFlow's own
BatchNorm and SGD arithmetic with exact constants, ``exact.py``), and the negative controls,
each one rule broken in OneFlow's run, which the check must catch.

The other backbone families, MobileFaceNet (PReLU, depthwise convolutions, GDC) and ResNet v1b
(classification: no head, cross-entropy over the logits), each at its tiny size for two steps.

The 2-rank checks (dp and mp, the float64 gradient all-reduce) are in ``test_oneflow_runs.py``.
torch's side of each check runs once per session (``shared_torch_alignment_runs``)."""

from __future__ import annotations

import pytest

from align_checks import assert_one_rank_with_controls, assert_strictly_aligned
from run_util import left_behind
from trainperf.align import AlignRequest, run_alignment
from trainperf.backends.torch.backbones import workload_backbone
from trainperf.recipes import get_recipe

pytestmark = pytest.mark.slow


def test_aligned_in_float64_and_each_control_is_caught(tmp_path, oneflow_python, capsys):
    outcome = assert_one_rank_with_controls("oneflow", tmp_path / "align", capsys)
    # 96 backbone parameters and BatchNorm statistics (the fixed gamma included), the head.
    assert outcome["checks"][0]["tensors_compared"] == 97
    assert left_behind(tmp_path) == []


# family -> (the recipe whose backbone it is, that recipe's workload shrunk to the tiny size)
TINY_FAMILIES = {
    "mobilefacenet": ("y1-arcface-emore", {"backbone": "mobilefacenet_tiny", "embedding_size": 64,
                                           "input_size": 32, "batch_size": 2, "num_classes": 16}),
    "resnet_v1b": ("rn50-v1b-imagenet", {"backbone": "resnet_v1b_tiny", "input_size": 32,
                                         "batch_size": 2, "num_classes": 10}),
}


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_each_other_family_aligned_in_float64(tmp_path, oneflow_python, family):
    """Every parameter and BatchNorm statistic of the tiny backbone (and a face recipe's class
    matrix) compared after each of two steps, within the float64 tolerance."""
    recipe, changes = TINY_FAMILIES[family]
    workload = get_recipe(recipe).workload.replace(**changes)
    outcome = run_alignment(AlignRequest(recipe, workload, "oneflow", [1], ["dp"], 2, 300.0,
                                         tmp_path / "align"))
    [check] = outcome["checks"]
    assert_strictly_aligned(check)
    state = [k for k in workload_backbone(workload).state_dict()
             if not k.endswith("num_batches_tracked")]
    assert check["tensors_compared"] == len(state) + (workload.task == "face")
    assert left_behind(tmp_path) == []
