"""The OneFlow backend end to end through the CLI: a measured run on 1 and 2 ranks with the
sharded head and its step's breakdown, strict alignment with torch in float64 on 2 ranks (dp and
mp), and failures recorded as results with no process of the run left behind."""

from __future__ import annotations

import json
import os

import pytest

from trainperf import results
from trainperf.backends.torch.backbones import build_backbone
from trainperf.cli import main
from trainperf.config import TUNING_SETTINGS
from align_checks import align, assert_strictly_aligned
from declarations import assert_runs_as_declared
from run_util import (BREAKDOWN, assert_a_suspended_rank_is_named, assert_delay_lands,
                      assert_started_again, assert_timed_runs_unprofiled, left_behind,
                      ports_taken_first)

pytestmark = pytest.mark.slow
SHORT = ["--runs", "1", "--iters", "5", "--warmup", "2", "--device", "cpu"]
HEAD_DELAY_S = 1.0
"""The sleep put in the head of each profiled step: longer than run_util's, because two OneFlow
ranks on a two-core machine take up to 0.7 s in their backward alone when other tests run."""


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory, oneflow_python):
    out = tmp_path_factory.mktemp("oneflow_run") / "tiny"
    os.environ["TRAINPERF_PHASE_DELAY"] = f"head={HEAD_DELAY_S}"
    try:
        with ports_taken_first():
            code = main(["run", "tiny-arcface", "--framework", "oneflow", "--devices", "1,2",
                         "--fc", "mp", *SHORT, *BREAKDOWN, "--trace", "--out", str(out)])
    finally:
        del os.environ["TRAINPERF_PHASE_DELAY"]
    return code, out


def test_a_launch_whose_ports_were_taken_starts_again(mp_run):
    """The first 2-rank launch found its ports taken (the master's among them): it failed
    before its first step and ran again on fresh ports."""
    _, out = mp_run
    assert_started_again(out)


def test_a_sharded_run_on_one_and_two_ranks(mp_run):
    code, out = mp_run
    assert code == 0
    doc = results.load(out)
    assert doc["framework"] == "oneflow" and doc["workload"]["fc"] == "mp"
    assert_runs_as_declared(doc)
    assert doc["env"]["framework"] == "oneflow" and doc["env"]["framework_version"] == "0.9.0"
    assert doc["env"]["device_type"] == "cpu"
    assert [c["world_size"] for c in doc["cases"]] == [1, 2]
    for case in doc["cases"]:
        run = case["runs"][0]
        assert run["status"] == "ok" and run["samples_per_s"] > 0
        assert run["samples_per_step"] == 8 * case["world_size"]
        assert len(run["step_times_s"]) == 3 and len(run["losses"]) == 5
        # Every step trains on the same batch: the loss must fall, and stay finite.
        assert run["losses"][-1] < run["losses"][0] / 2 and "loss_nonfinite" not in run["flags"]
        assert run["peak_memory_bytes"] > 0
        assert len(run["peak_memory_bytes_per_rank"]) == case["world_size"]
        # The default mode is eager: nothing is compiled, and the record says so.
        assert run["mode"] == "eager" and run["compile_s"] == 0.0
    assert doc["cases"][1]["speedup"] is not None
    # The 2-rank settings name the data-parallel wrapper of the sharded set-up.
    assert doc["cases"][1]["settings"]["oneflow_ddp"]["wraps"] == "backbone"
    assert doc["cases"][0]["settings"]["oneflow_ddp"] is None
    # On a CPU only DDP's buffer broadcast applies, where DDP wraps the model (two ranks).
    for case in doc["cases"]:
        applied = {k: v for k, v in case["settings"]["tuning"].items() if v is not None}
        assert applied == ({"ddp_broadcast_buffers": False} if case["world_size"] == 2 else {})
        assert set(case["settings"]["tuning"]) == set(TUNING_SETTINGS)
    assert doc["env"]["memory_kind"] == "resident_set_peak"
    assert doc["env"]["tf32_cudnn"] is doc["env"]["tf32_matmul"] is None


def test_the_worker_reports_torchs_parameter_count(mp_run):
    _, out = mp_run
    starts = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    starts = [e for e in starts if e.get("event") == "start"]
    # Each case's timed run, then its profiled one (--breakdown).
    assert [(e["world_size"], bool(e.get("profile"))) for e in starts] == [
        (1, False), (1, True), (2, False), (2, True)]
    model = build_backbone("iresnet_tiny", embedding_size=64)
    assert {e["backbone_params"] for e in starts} == {sum(p.numel()
                                                          for p in model.parameters())}
    assert left_behind(out) == []


def test_breakdown_splits_every_phase(mp_run):
    """The profiled run splits the step without merging anything: the head (with its backward
    to a detached copy of the embeddings) holds the delay put in it; on 2 ranks DDP's
    all-reduce runs inside the backward, so alternate steps skip it and the difference is the
    communication not hidden. OneFlow's profiler cannot run here: no trace, and rank 0 says
    why."""
    _, out = mp_run
    assert_timed_runs_unprofiled(out)
    for case in results.load(out)["cases"]:
        bd = assert_delay_lands(case, "head", HEAD_DELAY_S)
        assert bd["merged"] == {} and bd["head_has_backward"] is True
        assert bd["method"].startswith("OneFlow virtual-machine sync") and bd["trace"] is None
        assert bd["matmul_what"] == "oneflow.matmul float32 1024^3"
        expected = ["data", "backbone_forward", "head", "backward", "optimizer", "other"]
        if case["world_size"] == 2:
            expected.insert(4, "grad_comm")
            assert bd["hidden_comm_measured"] and (bd["steps"], bd["no_comm_steps"]) == (2, 2)
        else:
            assert not bd["hidden_comm_measured"] and bd["no_comm_steps"] == 0
        assert list(bd["phases_s"]) == expected
        log = (out / bd["folder"] / "rank-0.log").read_text()
        assert "OneFlow writes no trace" in log


def test_aligned_in_float64_on_two_ranks(tmp_path, oneflow_python, capsys):
    """Three SGD steps in float64 from torch's start on 2 ranks, replicated (dp) and sharded
    (mp) heads: every tensor's update on each rank (its own rows of the class matrix in mp)
    within 1e-8 of torch's, through OneFlow's boxing in mp and the float64 gradient all-reduce
    that stands in for OneFlow's float32-only DDP (``exact.DataParallel``). One rank and the
    negative controls: ``test_oneflow_align.py``."""
    code, outcome = align("oneflow", tmp_path / "align", "2", "dp,mp")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert outcome["aligned"] and outcome["dtype"] == "float64" and "ALIGNED" in printed
    assert {(c["fc"], c["ranks"]) for c in outcome["checks"]} == {("dp", 2), ("mp", 2)}
    for c in outcome["checks"]:
        assert_strictly_aligned(c)
    # dp reports rank 0's own batch, mp the gathered one: not the same first loss.
    first = {c["fc"]: c["losses"]["other"][0] for c in outcome["checks"]}
    assert first["dp"] != first["mp"]
    assert left_behind(tmp_path) == []


def test_a_suspended_rank_is_named_with_where_the_run_stalled(tmp_path, oneflow_python):
    """Rank 1 stopped with SIGSTOP (rank 0 waits in the step's collective): the run is stopped
    as hung under --stall-timeout, naming rank 1, since when, and where rank 0 was."""
    assert_a_suspended_rank_is_named("oneflow", tmp_path / "r", "--fc", "mp")


def test_a_failing_rank_is_a_result_and_leaves_nothing(tmp_path, monkeypatch, oneflow_python):
    """Rank 0 raises at its second step while rank 1 waits on it in a collective: the run is a
    ``failed`` result with rank 0's error, and the launcher stops rank 1."""
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@1:2")
    code = main(["run", "tiny-arcface", "--framework", "oneflow", "--devices", "2", "--fc",
                 "mp", *SHORT, "--out", str(tmp_path / "r")])
    assert code == 1
    run = results.load(tmp_path / "r")["cases"][0]["runs"][0]
    assert run["status"] == "failed" and run["samples_per_s"] is None
    assert "RuntimeError: injected failure" in run["error"]
    assert left_behind(tmp_path) == []
