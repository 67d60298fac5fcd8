"""Strict alignment: MXNet trains the same numbers as PyTorch from the same start, and the
check notices when a framework does not."""

from __future__ import annotations

import json

import pytest

from trainperf import align
from trainperf.align import AlignRequest, compare, run_alignment
from trainperf.cli import main
from trainperf.recipes import get_recipe

pytestmark = pytest.mark.slow


def test_mxnet_is_aligned_with_torch_on_1_and_2_ranks(tmp_path, mxnet_python, capsys):
    """1 and 2 ranks here (the other frameworks' tests check 2 ranks, whose torch runs this
    session shares): MXNet's 1-rank kvstore is a path of its own."""
    out = tmp_path / "align"
    code = main(["align", "tiny-arcface", "--framework", "mxnet", "--devices", "1,2",
                 "--fc", "dp,mp", "--steps", "3", "--out", str(out)])
    printed = capsys.readouterr().out
    outcome = json.loads((out / "align.json").read_text())
    assert code == 0, printed
    assert outcome["aligned"] and "ALIGNED" in printed
    assert {(c["fc"], c["ranks"]) for c in outcome["checks"]} == {
        ("dp", 1), ("dp", 2), ("mp", 1), ("mp", 2)}
    for c in outcome["checks"]:
        assert c["params"]["torch"] == c["params"]["other"] > 0
        assert len(c["losses"]["torch"]) == len(c["losses"]["other"]) == 3
        # The losses move (the steps update the weights), and both sides move alike.
        assert c["losses"]["torch"][-1] < c["losses"]["torch"][0] / 2
        assert c["first_loss_rel_diff"] <= align.FIRST_LOSS_RTOL
    # 2 ranks really differ from 1 (each rank has its own batch): the check is not vacuous.
    by = {(c["fc"], c["ranks"]): c["losses"]["torch"] for c in outcome["checks"]}
    assert by[("mp", 2)][0] != by[("mp", 1)][0]
    assert outcome["workload"]["dropout"] == 0.0


def test_a_framework_that_trains_differently_is_caught(tmp_path, monkeypatch):
    """A negative control: the candidate (torch itself here) runs with a 10% higher learning
    rate. The first loss still agrees (same weights, same batch); the later ones must not."""
    real_run = align._run

    def candidate_with_other_lr(req, workload, framework, devices, init, out):
        if out.name.startswith("candidate"):
            workload = workload.replace(lr=workload.lr * 1.1)
        return real_run(req, workload, framework, devices, init, out)

    monkeypatch.setattr(align, "_run", candidate_with_other_lr)
    req = AlignRequest("tiny-arcface", get_recipe("tiny-arcface").workload, "torch", [1],
                       ["dp"], 3, 300.0, tmp_path)
    outcome = run_alignment(req)
    check = outcome["checks"][0]
    assert not outcome["aligned"]
    assert check["first_loss_rel_diff"] == 0.0
    assert check["max_loss_rel_diff"] > align.LATER_LOSS_RTOL


@pytest.mark.parametrize("torch_losses,other_losses,params,problem", [
    ([50.0, 20.0], [50.0, 20.0], (10, 10), None),
    ([50.0, 20.0], [50.0, 20.0], (10, 11), "parameter counts differ"),
    ([50.0, 20.0], [50.01, 20.0], (10, 10), "first loss differs"),
    ([50.0, 20.0], [50.0, 20.1], (10, 10), "a loss differs"),
    ([0.5, 0.2], [0.5, 0.2015], (10, 10), None),  # below 1 the difference is absolute
    ([50.0, float("nan")], [50.0, float("nan")], (10, 10), "not finite"),
    ([50.0, 20.0], None, (10, 10), "no losses"),
])
def test_the_verdict(torch_losses, other_losses, params, problem):
    check = compare(torch_losses, other_losses, *params)
    assert check["aligned"] == (problem is None)
    if problem:
        assert any(problem in p for p in check["problems"])


def test_torchs_side_is_run_once_per_start_and_reused(tmp_path, monkeypatch):
    """With TRAINPERF_ALIGN_CACHE set, a check from the same start, workload, ranks and steps
    reuses torch's earlier run; any change (here the start's contents) runs torch again, and a
    failed torch run is never kept."""
    from trainperf.backends.torch.alignment import write_start

    calls = []

    def fake_run(req, workload, framework, devices, init, out):
        calls.append(out)
        status = "failed" if workload.lr == 0.5 else "ok"
        return {"status": status, "losses": [1.0, 0.5]}, 42

    monkeypatch.setattr(align, "_run", fake_run)
    monkeypatch.setenv(align.CACHE_ENV, str(tmp_path / "cache"))
    workload = get_recipe("tiny-arcface").workload.replace(dropout=0.0)
    init = tmp_path / "start.npz"
    write_start(workload, 2, init)
    req = AlignRequest("tiny-arcface", workload, "paddle", [2], ["mp"], 3, 60.0, tmp_path)
    first = align._torch_reference(req, workload, 2, init, tmp_path / "a")
    again = align._torch_reference(req, workload, 2, init, tmp_path / "b")
    assert first == again and len(calls) == 1
    write_start(workload.replace(seed=1), 2, init)  # other weights: torch runs again
    align._torch_reference(req, workload, 2, init, tmp_path / "c")
    assert len(calls) == 2
    failing = workload.replace(lr=0.5)
    for _ in range(2):
        align._torch_reference(req, failing, 2, init, tmp_path / "d")
    assert len(calls) == 4
