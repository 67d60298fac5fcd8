"""The JAX backend end to end through the CLI: the same runner, results and report as torch,
strict alignment against torch through ``trainperf.align`` (float64, every tensor's update,
with its negative controls, on one rank and on two), and a failing rank recorded as a result
with no process of the run left behind.

Compilation dominates these runs' cost on a CPU, so the workers get XLA flags that compile
several times faster (no LLVM optimisation, no fusion emitters: the same arithmetic, rounded
differently in places) and a persistent compilation cache shared by the module's runs (the
fault test's rank 0 loads the program the two-rank run compiled). Nothing here depends on how
fast anything ran.

The float64 alignment runs compile at XLA's optimisation level 1 instead (``ALIGN_COMPILE``):
XLA's CPU client hands float32 convolutions to Eigen's kernels, but emits float64 ones as loop
nests of its own, which level 0 leaves unoptimised (measured here: 3 steps of tiny-arcface took
about 40 s at level 0, 3 s at level 1, for a compilation about 4 s longer).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from trainperf import results
from trainperf.cli import main
from trainperf.config import TUNING_SETTINGS
from trainperf.envs import state
from trainperf.outcome import names_bind_failure
from align_checks import align, assert_one_rank_with_controls, assert_strictly_aligned
from declarations import assert_runs_as_declared
from run_util import (BREAKDOWN, assert_a_suspended_rank_is_named, assert_delay_lands,
                      assert_started_again, assert_timed_runs_unprofiled, left_behind,
                      ports_taken_first)

pytestmark = pytest.mark.slow
SHORT = ["--runs", "1", "--iters", "4", "--warmup", "1", "--device", "cpu"]
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
ALIGN_COMPILE = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
COMPILED = {1: "backbone_forward+head+backward+optimizer",
            2: "backbone_forward+head+backward+grad_comm+optimizer"}
"""The phase a profiled run times its compiled step as, by world size."""
DELAY_S = 1.0
"""The sleep put in the compiled step of each profiled step: longer than run_util's, because
two JAX ranks on a two-core machine take up to 1 s a step when other tests run."""


@pytest.fixture(scope="module")
def compile_env(tmp_path_factory):
    """Environment of the module's runs: fast XLA compilation and one compilation cache."""
    cache = tmp_path_factory.mktemp("jax_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", FAST_COMPILE)
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
        mp.delenv("TRAINPERF_FAULT", raising=False)
        yield


@pytest.fixture
def align_env(compile_env, monkeypatch):
    """The module's environment, with float64's compile flags (module docstring)."""
    monkeypatch.setenv("XLA_FLAGS", ALIGN_COMPILE)


@pytest.fixture(scope="module")
def mp_run(tmp_path_factory, jax_python, compile_env):
    out = tmp_path_factory.mktemp("jax_runs") / "tiny"
    os.environ["TRAINPERF_PHASE_DELAY"] = ",".join(f"{name}={DELAY_S}"
                                                   for name in COMPILED.values())
    try:
        with ports_taken_first():
            code = main(["run", "tiny-arcface", "--framework", "jax", "--devices", "1,2", "--fc",
                         "mp", *SHORT, *BREAKDOWN, "--trace", "--out", str(out)])
    finally:
        del os.environ["TRAINPERF_PHASE_DELAY"]
    return code, out


def test_a_launch_whose_ports_were_taken_starts_again(mp_run):
    """The first 2-rank launch found its ports taken (the coordinator's among them): it failed
    before its first step and ran again on fresh ports."""
    _, out = mp_run
    run = assert_started_again(out)
    # JAX raises "Failed to start RPC server", or, now and then, dies of SIGSEGV after gRPC's
    # "Failed to add port": either way in words the runner takes for a failed bind.
    assert names_bind_failure(run["retries"][0]["error"]), run["retries"][0]["error"]


def test_mp_on_one_and_two_ranks_gives_results(mp_run):
    code, out = mp_run
    assert code == 0
    doc = results.load(out)
    assert doc["framework"] == "jax"
    assert_runs_as_declared(doc)
    env = doc["env"]
    assert env["framework"] == "jax"
    assert env["framework_version"] == state("jax").versions["jax"]
    assert env["device_type"] == "cpu" and env["flax_version"] and env["optax_version"]
    assert [c["world_size"] for c in doc["cases"]] == [1, 2]
    for case in doc["cases"]:
        run = case["runs"][0]
        assert run["status"] == "ok" and run["samples_per_s"] > 0
        assert run["samples_per_step"] == 8 * case["world_size"]
        assert len(run["step_times_s"]) == 3 and len(run["losses"]) == 4
        assert all(math.isfinite(v) for v in run["losses"])
        # Four SGD steps on one fixed batch: the margin loss falls.
        assert run["losses"][-1] < run["losses"][0]
        assert run["peak_memory_bytes"] > 0
        assert len(run["peak_memory_bytes_per_rank"]) == case["world_size"]
        settings = case["settings"]
        assert "lower" in settings["compile"] and "compile_s" not in settings
        # The step's one compilation, timed around its lowering and XLA's compile before the
        # loop (a load of the module's persistent cache where an earlier run compiled it).
        assert run["compile_s"] > 0 and run["recompiles_in_window"] == 0
        assert ".lower(...)" in run["compile_measure"]
        assert "persistent compilation cache" in run["compile_measure"]
        assert settings["mesh"] == {"axis": "r", "devices": case["world_size"]}
        assert case["pfc_update"] == "full"
        # On a CPU JAX applies none of its declared settings (both are GPU-only).
        assert settings["tuning"] == dict.fromkeys(TUNING_SETTINGS)
    assert env["memory_kind"] == "resident_set_peak"
    assert env["tf32_cudnn"] is env["tf32_matmul"] is env["tf32_switch"] is None
    assert doc["cases"][1]["speedup"] is not None
    # Two ranks on this node's cores: each rank ran its share (the runner's threads per rank,
    # test_jax_threads.py), and the gradients were reduced as one buffer across the processes.
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    starts = [e for e in events if e.get("event") == "start"]
    # Each worker's own record too: NHWC is the one layout JAX's backbones have.
    assert all(s["workload"]["channels_last"] for s in starts)
    # Every timed step ran the one executable compiled before the loop.
    for case in doc["cases"]:
        compiles = [e.get("compiles") for e in events if e.get("event") == "step"
                    and e["case"] == case["case"] and not e.get("profile")]
        assert compiles == [1] * 4, (case["case"], compiles)
    # Each case's timed run, then its profiled one (--breakdown).
    assert [(s["world_size"], bool(s.get("profile"))) for s in starts] == [
        (1, False), (1, True), (2, False), (2, True)]
    share = max(1, (os.cpu_count() or 1) // 2)
    assert starts[2]["env"]["threads"] == share
    assert [r["xla_pool_threads"] for r in starts[2]["env"]["threads_per_rank"]] == [share] * 2
    assert (share == 1) == ("--xla_cpu_multi_thread_eigen=false" in starts[2]["env"]["xla_flags"])
    assert starts[2]["settings"]["grad_reduce"].startswith("one flat buffer")
    assert starts[0]["settings"]["grad_reduce"] == "none (one rank)"


def test_breakdown_times_the_compiled_step_as_one_phase(mp_run):
    """One XLA program per step: the profiled run tells apart only the batch (``data``) and
    the compiled step, which holds the delay put in it. On 2 ranks the gradient psum is inside
    the program, so it is named in the merged phase, never timed or measured on its own."""
    _, out = mp_run
    assert_timed_runs_unprofiled(out)
    for case in results.load(out)["cases"]:
        name = COMPILED[case["world_size"]]
        bd = assert_delay_lands(case, name, DELAY_S)
        assert list(bd["phases_s"]) == ["data", name, "other"]
        assert list(bd["merged"]) == [name] and "one XLA program" in bd["merged"][name]
        assert "jax.jit" in bd["method"] and bd["head_has_backward"] is True
        assert bd["no_comm_steps"] == 0 and not bd["hidden_comm_measured"]
        assert bd["matmul_flops_per_s"] > 0 and bd["matmul_what"].startswith("jnp.dot")
        assert bd["trace"].endswith("perfetto_trace.json.gz") and (out / bd["trace"]).is_file()


def test_strict_alignment_with_torch_and_its_controls(tmp_path, jax_python, align_env, capsys):
    """dp on one rank, 3 steps in float64: aligned with torch tensor by tensor, and each rule
    broken on purpose (weight decay, momentum, clipping, the margin's gradient) fails the
    check on a tensor or a scalar."""
    assert_one_rank_with_controls("jax", tmp_path / "a", capsys)
    assert left_behind(tmp_path) == []


def test_strict_alignment_on_two_ranks(tmp_path, jax_python, align_env, capsys):
    """The reductions and the sharded head in float64: dp, mp and pfc (at ratio 1.0) on two
    ranks, each rank's state (its BatchNorm statistics, its rows of the class matrix) against
    torch's rank."""
    code, outcome = align("jax", tmp_path / "a", "2", "dp,mp,pfc")
    assert code == 0, capsys.readouterr().out
    assert outcome["dtype"] == "float64" and outcome["aligned"]
    assert [(c["fc"], c["ranks"]) for c in outcome["checks"]] == [
        ("dp", 2), ("mp", 2), ("pfc", 2)]
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
    assert left_behind(tmp_path) == []


def test_a_suspended_rank_is_named_with_where_the_run_stalled(tmp_path, jax_python, compile_env):
    """Rank 1 stopped with SIGSTOP (rank 0 waits in the step's collective): the run is stopped
    as hung under --stall-timeout, naming rank 1, since when, and where rank 0 was."""
    assert_a_suspended_rank_is_named("jax", tmp_path / "r", "--fc", "mp")


def test_failing_ranks_are_results_and_leave_nothing(tmp_path, monkeypatch, jax_python,
                                                     compile_env):
    """One rank killed outright (no error event: as the kernel's OOM killer would) and rank 0
    of two raising while rank 1 waits on it in a collective: both runs are ``failed``
    results, and no process of either is left."""
    monkeypatch.setenv("TRAINPERF_FAULT", "kill@0:1,raise@0:2")
    code = main(["run", "tiny-arcface", "--framework", "jax", "--devices", "1,2", "--fc", "mp",
                 *SHORT, "--out", str(tmp_path / "r")])
    assert code == 1
    killed, raised = (c["runs"][0] for c in results.load(tmp_path / "r")["cases"])
    for run in (killed, raised):
        assert run["status"] == "failed" and run["samples_per_s"] is None
    assert killed["exit_code"] not in (0, None) and "injected" in raised["error"]
    assert left_behind(tmp_path) == []
