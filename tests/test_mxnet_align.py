"""MXNet's strict alignment with torch (``trainperf align``): three SGD steps from torch's start
in float64, each tensor's update within the float64 tolerance of torch's (BatchNorm's running
means included; the running variances, which MXNet's kernel moves with the biased batch
variance, are the backend's one declared difference of rule, measured and not judged), on one
rank with the negative controls that break one rule in MXNet's run only (weight decay,
momentum, clipping, the margin's derivative), and on two ranks (dp, mp and pfc, one process per
rank over Horovod's gloo, the default layout: the summed gradients, the gathered embeddings and
the sharded softmax, all in float64; ``test_mxnet_launch.py`` holds dist_sync's collectives to
the same exactness).

torch's side of each check runs once per session (``shared_torch_alignment_runs``)."""

from __future__ import annotations

import json

import pytest

from align_checks import align, assert_one_rank_with_controls, assert_strictly_aligned
from trainperf.align.tensors import FLOAT64
from run_util import left_behind

pytestmark = pytest.mark.slow


def test_float64_alignment_on_one_rank_catches_every_control(tmp_path, mxnet_python, capsys):
    outcome = assert_one_rank_with_controls("mxnet", tmp_path / "align", capsys,
                                            declared="running_var")
    # The running means are judged with everything else: MXNet's rule moves them as torch's.
    means = [t for t in outcome["checks"][0]["all_errors"] if t["tensor"].endswith("running_mean")]
    assert means and all(t["error"] < FLOAT64.update for t in means)
    assert max(t["error"] for t in outcome["checks"][0]["declared"]) > 1e-3  # n / (n - 1)
    assert left_behind(tmp_path) == []


def test_float64_alignment_on_two_ranks_dp_mp_and_pfc(tmp_path, mxnet_python, capsys):
    code, outcome = align("mxnet", tmp_path / "align", "2", "dp,mp,pfc")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert outcome["aligned"] and outcome["dtype"] == "float64", printed
    assert {(c["fc"], c["ranks"]) for c in outcome["checks"]} == {("dp", 2), ("mp", 2),
                                                                 ("pfc", 2)}
    starts = [json.loads(line) for f in (tmp_path / "align").rglob("events.jsonl")
              for line in f.read_text().splitlines() if '"start"' in line]
    mine = [e for e in starts if e.get("event") == "start" and e["env"]["framework"] == "mxnet"]
    assert len(mine) == 3 and {e["env"]["kvstore"] for e in mine} == {"horovod"}
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
    # Each rank trains on its own batch: the ranks' losses differ in dp, agree in mp (one loss
    # over the gathered batch).
    by = {c["fc"]: c["steps"] for c in outcome["checks"]}
    first = {fc: {s["rank"]: s["loss"]["other"] for s in steps if s["step"] == 0}
             for fc, steps in by.items()}
    assert first["dp"][0] != first["dp"][1]
    assert first["mp"][0] == first["mp"][1] and first["pfc"][0] == first["pfc"][1]
    assert left_behind(tmp_path) == []
