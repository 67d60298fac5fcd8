"""The Paddle backend end to end through the CLI: a measured run on 1 and 2 ranks (mp), strict
float64 alignment with torch on 2 ranks (mp and pfc at ratio 1.0: the sharded softmax, the
gathered embeddings and the summed backbone gradients), and failures (a killed rank, a raised
error with a peer left waiting in a collective) recorded as results with no process of the run
left behind.

The tests keep to the fewest runs that cover this: one CLI invocation each for the measured
runs, for the faults (the faults name the world size they hit, so one invocation fails both
of its cases differently) and for the 2-rank alignment. ``dp`` on 2 ranks is checked step by
step in ``test_paddle_heads.py``; alignment on one rank, with its negative controls, in
``test_paddle_align.py``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from trainperf import envs, results
from trainperf.backends.torch.backbones import build_backbone
from trainperf.cli import main
from trainperf.config import TUNING_SETTINGS
from align_checks import align, assert_strictly_aligned
from declarations import assert_runs_as_declared
from run_util import (BREAKDOWN, PHASE_DELAY_S, assert_a_suspended_rank_is_named,
                      assert_delay_lands, assert_started_again, assert_timed_runs_unprofiled,
                      left_behind, ports_taken_first)

pytestmark = pytest.mark.slow
SHORT = ["--runs", "1", "--iters", "4", "--warmup", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, paddle_python):
    out = tmp_path_factory.mktemp("paddle_run") / "tiny"
    os.environ["TRAINPERF_PHASE_DELAY"] = f"head={PHASE_DELAY_S}"
    try:
        with ports_taken_first():
            code = main(["run", "tiny-arcface", "--framework", "paddle", "--devices", "1,2", "--fc",
                         "mp", *SHORT, *BREAKDOWN, "--trace", "--out", str(out)])
    finally:
        del os.environ["TRAINPERF_PHASE_DELAY"]
    return code, out


def test_a_launch_whose_ports_were_taken_starts_again(measured):
    """The first 2-rank launch found its ports taken (the store's among them): it failed
    before its first step and ran again on fresh ports."""
    _, out = measured
    assert_started_again(out)


def test_a_measured_run_on_one_and_two_ranks(measured):
    code, out = measured
    assert code == 0
    doc = results.load(out)
    assert doc["framework"] == "paddle"
    assert_runs_as_declared(doc)
    assert [c["world_size"] for c in doc["cases"]] == [1, 2]
    env = doc["env"]
    manifest = json.loads((Path(envs.env_dir("paddle")) / "trainperf-env.json").read_text())
    assert env["framework"] == "paddle"
    assert env["framework_version"] == manifest["versions"]["paddle"]
    assert env["device_type"] == "cpu"
    for case, samples in zip(doc["cases"], (8, 16)):
        run = case["runs"][0]
        assert run["status"] == "ok" and run["samples_per_s"] > 0
        assert run["samples_per_step"] == samples  # the global batch: 8 per rank
        assert len(run["step_times_s"]) == 3 and len(run["warmup_step_times_s"]) == 1
        assert all(t > 0 for t in run["step_times_s"])
        losses = run["losses"]
        assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
        assert losses[-1] < losses[0]  # four steps on one batch: it learns
        assert run["window_samples"] == 3 * samples
        assert len(run["peak_memory_bytes_per_rank"]) == case["world_size"]
        # Paddle's default mode, dygraph, builds no program.
        assert run["mode"] == "dygraph" and run["compile_s"] == 0.0
        # On a CPU only the gradient buckets apply, on two ranks.
        applied = {k: v for k, v in case["settings"]["tuning"].items() if v is not None}
        assert applied == ({"ddp_bucket_mb": 25.0} if case["world_size"] == 2 else {})
        assert set(case["settings"]["tuning"]) == set(TUNING_SETTINGS)
    assert env["memory_kind"] == "resident_set_peak"
    assert env["tf32_cudnn"] is env["tf32_matmul"] is env["tf32_switch"] is None
    assert doc["cases"][1]["speedup"] is not None
    assert left_behind(out) == []


def test_events_say_what_ran(measured):
    _, out = measured
    starts = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()
              if '"event": "start"' in line]
    # Each case's timed run, then its profiled one (--breakdown).
    assert [(s["world_size"], bool(s.get("profile"))) for s in starts] == [
        (1, False), (1, True), (2, False), (2, True)]
    torch_params = sum(p.numel() for p in build_backbone(
        "iresnet_tiny", embedding_size=starts[0]["workload"]["embedding_size"]).parameters())
    for s in starts:
        assert s["backbone_params"] == torch_params
        assert s["pfc_update"] == "full" and s["workload"]["fc"] == "mp"
    assert starts[2]["settings"]["gradient_allreduce"]["backend"] == "gloo"
    assert starts[2]["env"]["collective_backend"] == "gloo"


def test_breakdown_splits_every_phase(measured):
    """The profiled run splits the step without merging anything: the head (with its
    hand-written backward) holds the delay put in it, and on 2 ranks the gradient all-reduce,
    an explicit call after the backward, is timed as grad_comm rather than measured as hidden."""
    _, out = measured
    assert_timed_runs_unprofiled(out)
    for case in results.load(out)["cases"]:
        bd = assert_delay_lands(case, "head")
        assert bd["merged"] == {} and bd["head_has_backward"] is True
        assert "paddle.profiler RecordEvent" in bd["method"]
        assert bd["no_comm_steps"] == 0 and not bd["hidden_comm_measured"]
        expected = ["data", "backbone_forward", "head", "backward", "optimizer", "other"]
        if case["world_size"] == 2:
            expected.insert(4, "grad_comm")
            assert bd["phases_s"]["grad_comm"] > 0
        assert list(bd["phases_s"]) == expected
        trace = json.loads((out / bd["trace"]).read_text())
        ranges = {e.get("name", "").split("[")[0] for e in trace["traceEvents"]}
        assert {f"trainperf/{name}" for name in expected[:-1]} <= ranges


def test_aligned_in_float64_with_torch_on_two_ranks(tmp_path, paddle_python, capsys):
    code, outcome = align("paddle", tmp_path / "align", "2", "mp,pfc")
    table = capsys.readouterr().out
    assert code == 0, table
    assert outcome["aligned"] and outcome["dtype"] == "float64", table
    assert outcome["workload"]["sample_ratio"] == 1.0
    assert [(c["fc"], c["ranks"]) for c in outcome["checks"]] == [("mp", 2), ("pfc", 2)]
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
    assert left_behind(tmp_path) == []


def test_a_suspended_rank_is_named_with_where_the_run_stalled(tmp_path, paddle_python):
    """Rank 1 stopped with SIGSTOP (Paddle's gloo would give up on it by itself only after
    about a minute): the run is stopped as hung under --stall-timeout, naming rank 1, since
    when, and where rank 0 was."""
    assert_a_suspended_rank_is_named("paddle", tmp_path / "r", "--fc", "mp")


def test_failing_ranks_are_results_and_leave_nothing(tmp_path, monkeypatch, paddle_python):
    """One rank killed outright (no event written), and rank 0 of 2 raising while rank 1 waits
    on it in a collective: both runs are ``failed`` results, the raised one with its message."""
    monkeypatch.setenv("TRAINPERF_FAULT", "kill@1:1,raise@1:2")
    code = main(["run", "tiny-arcface", "--framework", "paddle", "--devices", "1,2", "--fc",
                 "mp", *SHORT, "--out", str(tmp_path / "r")])
    assert code == 1
    killed, raised = (c["runs"][0] for c in results.load(tmp_path / "r")["cases"])
    for run in (killed, raised):
        assert run["status"] == "failed" and run["samples_per_s"] is None
    assert "injected failure" in raised["error"]
    assert left_behind(tmp_path) == []
