"""The TensorFlow backend end to end through the CLI: a run on 1 and 2 ranks (results, env,
losses), strict alignment with torch in float64 (``trainperf align``, dp on 2 ranks), a failing rank
(raised on one of 2 ranks, or killed) recorded as a result with no process of the run left
behind.

TensorFlow takes seconds to start in each process, so the CLI runs as few times as it can: one
module-scoped run whose results several tests read, one alignment, one run of failures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainperf import results
from trainperf.cli import main
from trainperf.outcome import names_bind_failure
from align_checks import align, assert_strictly_aligned
from declarations import assert_runs_as_declared
from mode_runs import step_compiles
from run_util import (BREAKDOWN, PHASE_DELAY_S, assert_a_suspended_rank_is_named,
                      assert_delay_lands, assert_started_again, assert_timed_runs_unprofiled,
                      left_behind, ports_taken_first)

pytestmark = pytest.mark.slow
ITERS, WARMUP = 4, 1
SHORT = ["--runs", "1", "--iters", str(ITERS), "--warmup", str(WARMUP), "--device", "cpu"]
GRAPH = {1: "backbone_forward+head+backward+optimizer",
         2: "backbone_forward+head+backward+grad_comm+optimizer"}
"""The phase a profiled run times its step's graph as, by world size."""


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tf_python):
    out = tmp_path_factory.mktemp("tf_run") / "tiny"
    os.environ["TRAINPERF_PHASE_DELAY"] = ",".join(f"{name}={PHASE_DELAY_S}"
                                                   for name in GRAPH.values())
    try:
        with ports_taken_first():
            code = main(["run", "tiny-arcface", "--framework", "tf", "--devices", "1,2", *SHORT,
                         *BREAKDOWN, "--trace", "--out", str(out)])
    finally:
        del os.environ["TRAINPERF_PHASE_DELAY"]
    return code, out


def test_a_launch_whose_ports_were_taken_starts_again(tiny_run):
    """The first 2-rank launch found its ports taken (each worker's gRPC server's among them):
    it failed before its first step and ran again on fresh ports."""
    _, out = tiny_run
    run = assert_started_again(out)
    assert names_bind_failure(run["retries"][0]["error"]), run["retries"][0]["error"]


def test_run_on_one_and_two_ranks(tiny_run, tf_python):
    code, out = tiny_run
    assert code == 0
    doc = results.load(out)
    assert doc["framework"] == "tf"
    assert_runs_as_declared(doc)
    assert [c["world_size"] for c in doc["cases"]] == [1, 2]
    for case in doc["cases"]:
        run = case["runs"][0]
        assert run["status"] == "ok" and run["samples_per_s"] > 0
        # The global batch: 8 samples per rank.
        assert run["samples_per_step"] == 8 * case["world_size"]
        assert len(run["step_times_s"]) == ITERS - WARMUP and len(run["losses"]) == ITERS
        # Training on one fixed batch: the loss falls from about ln(1000) + the margin.
        assert all(v == v for v in run["losses"]) and run["losses"][-1] < run["losses"][0]
        assert run["peak_memory_bytes"] > 0
        settings = case["settings"]
        # TensorFlow's default mode, traced once, inside step 0 (its trace timed there, on 2
        # ranks under the multi-worker strategy too), and never again.
        assert run["mode"] == settings["mode"] == "function"
        assert run["recompiles_in_window"] == 0
        assert 0 < run["compile_s"] <= run["first_step_s"], run
        assert run["compile_measure"].startswith("tf.function tracing: get_concrete_function")
        assert "compile_s" not in settings
        assert settings["communication"] == (None if case["world_size"] == 1 else "RING")
        # oneDNN's custom CPU ops are off unless asked for, as TensorFlow itself reports.
        assert settings["onednn_opts"] is False
        # What ran of the tuning: the gradient all-reduce's packs only where there is one;
        # cuDNN and TF32 on a GPU only.
        two = case["world_size"] == 2
        assert settings["tuning"] == {
            "cudnn_benchmark": None, "ddp_bucket_mb": 25.0 if two else None,
            "ddp_static_graph": None, "ddp_broadcast_buffers": None, "mxnet_kvstore": None,
            "tf_onednn": False, "tf32": None}
        assert settings["gradient_pack_bytes"] == (25 * 2**20 if two else None)
    assert doc["tuning"]["tf_onednn"] is False
    env = doc["env"]
    version = json.loads(Path(tf_python).parent.parent.joinpath("trainperf-env.json")
                         .read_text())["versions"]["tensorflow"]
    assert env["framework"] == "tensorflow" and env["framework_version"] == version == "2.21.0"
    assert env["device_type"] == "cpu"
    assert env["memory_kind"] == "resident_set_peak"
    assert env["tf32_cudnn"] is env["tf32_matmul"] is env["tf32_switch"] is None
    assert "tf32" not in env and "cudnn_autotune" not in env
    assert doc["cases"][1]["speedup"] is not None
    # Every step's trace count, from step 0 on: the explicit trace was the only one.
    assert step_compiles(out) == {"1n1g": [1] * ITERS, "1n2g": [1] * ITERS}
    assert left_behind(out) == []




def test_breakdown_times_the_graph_as_one_phase(tiny_run):
    """One tf.function graph per step: the profiled run tells apart only the batch (``data``)
    and the graph, which holds the delay put in it. On 2 ranks the gradient all-reduce is
    inside the graph, so it is named in the merged phase, never timed or measured on its
    own."""
    _, out = tiny_run
    assert_timed_runs_unprofiled(out)
    for case in results.load(out)["cases"]:
        name = GRAPH[case["world_size"]]
        bd = assert_delay_lands(case, name)
        assert list(bd["phases_s"]) == ["data", name, "other"]
        assert list(bd["merged"]) == [name] and "one tf.function graph" in bd["merged"][name]
        assert "tf.profiler" in bd["method"] and bd["head_has_backward"] is True
        assert bd["no_comm_steps"] == 0 and not bd["hidden_comm_measured"]
        assert bd["matmul_flops_per_s"] > 0 and bd["matmul_what"].startswith("tf.linalg")
        assert bd["trace"].endswith(".xplane.pb") and (out / bd["trace"]).is_file()


def test_aligned_in_float64_on_two_ranks(tmp_path, tf_python):
    """torch's weights and batches, three SGD steps in float64, dp on 2 ranks (the float64
    gradient all-reduce included): every tensor's update on both ranks within 1e-8 of torch's.
    One rank and the negative controls: ``test_tf_align.py``."""
    code, outcome = align("tf", tmp_path / "align", "2", "dp")
    assert code == 0, [c["problems"] for c in outcome["checks"]]
    assert outcome["aligned"] and outcome["dtype"] == "float64"
    [check] = outcome["checks"]
    assert (check["fc"], check["ranks"]) == ("dp", 2)
    assert_strictly_aligned(check)
    # Both ranks compared, each on its own batch (so their first losses differ).
    first = {row["rank"]: row["loss"]["other"] for row in check["steps"] if row["step"] == 0}
    assert first[0] != first[1]
    assert left_behind(tmp_path) == []


def test_a_suspended_rank_is_named_with_where_the_run_stalled(tmp_path, tf_python):
    """Rank 1 stopped with SIGSTOP (TensorFlow's collective would give up on it by itself only
    after about a minute): the run is stopped as hung under --stall-timeout, naming rank 1,
    since when, and where rank 0 was."""
    assert_a_suspended_rank_is_named("tf", tmp_path / "r")


def test_failing_ranks_are_results_and_leave_nothing(tmp_path, monkeypatch, tf_python):
    """In one invocation (TensorFlow's start-up is the cost): on 2 ranks, rank 0 raises while
    rank 1 waits on it in the gradient all-reduce; on 1 rank, the process is killed outright
    (SIGKILL, writing nothing). Both at step 0, before TensorFlow spends seconds compiling.
    ``--tf-onednn`` reaches the workers: the raising rank's start event says that TensorFlow
    runs its oneDNN ops (no step runs, so none of them can crash here)."""
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@0:2,kill@0:1")
    code = main(["run", "tiny-arcface", "--framework", "tf", "--devices", "1,2", *SHORT,
                 "--tf-onednn", "--out", str(tmp_path / "r")])
    assert code == 1
    doc = results.load(tmp_path / "r")
    assert doc["tuning"]["tf_onednn"] is True
    assert doc["cases"][1]["settings"]["onednn_opts"] is True
    killed, raised = [c["runs"][0] for c in doc["cases"]]
    assert killed["status"] == raised["status"] == "failed"
    assert killed["samples_per_s"] is None and raised["samples_per_s"] is None
    assert "injected failure" in raised["error"]
    assert left_behind(tmp_path) == []
