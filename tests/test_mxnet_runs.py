"""The MXNet backend end to end through the CLI: the same runner, results and report as torch,
frameworks side by side, and failures (a raised error, a killed rank, an out-of-memory, a hang)
recorded as results with no process of the run left behind, the scheduler and server included."""

from __future__ import annotations

import json

import pytest

from trainperf import results
from trainperf.backends.phases import DELAY_ENV
from trainperf.cli import main
from declarations import assert_runs_as_declared
from run_util import (BREAKDOWN, PHASE_DELAY_S, assert_a_suspended_rank_is_named,
                      assert_delay_lands, assert_started_again, assert_timed_runs_unprofiled,
                      left_behind, ports_taken_first)

pytestmark = pytest.mark.slow
SHORT = ["--runs", "1", "--iters", "6", "--warmup", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory, mxnet_python):
    out = tmp_path_factory.mktemp("frameworks") / "tiny"
    with ports_taken_first():
        # Each in its default mode: the ports taken are those of a timed run's first launch,
        # not of a --mode best probe (the default where frameworks are compared).
        code = main(["run", "tiny-arcface", "--framework", "torch,mxnet", "--devices", "1,2",
                     *SHORT, "--mode", "default", "--out", str(out)])
    return code, out


def test_torch_and_mxnet_run_side_by_side(side_by_side):
    code, out = side_by_side
    assert code == 0
    docs = {name: results.load(out / name) for name in ("torch", "mxnet")}
    for name, doc in docs.items():
        assert doc["framework"] == name
        assert_runs_as_declared(doc)
        assert [c["world_size"] for c in doc["cases"]] == [1, 2]
        assert all(c["median_samples_per_s"] > 0 for c in doc["cases"])
        assert doc["cases"][1]["speedup"] is not None
    env = docs["mxnet"]["env"]
    assert env["framework"] == "mxnet" and env["framework_version"] == "1.9.1"
    # Two ranks talk through Horovod by default (gloo on a CPU); one rank through nothing.
    one, two = (c["settings"] for c in docs["mxnet"]["cases"])
    assert (one["kvstore"], two["kvstore"]) == ("local", "horovod")
    assert one["tuning"]["mxnet_kvstore"] is None and two["tuning"]["mxnet_kvstore"] == "horovod"
    assert {k for k, v in two["tuning"].items() if v is not None} == {"mxnet_kvstore"}
    assert docs["mxnet"]["cases"][1]["memory_kind"] == "resident_set_peak"
    assert docs["torch"]["env"]["framework"] == "pytorch"
    # One step's samples are the same global batch in both frameworks.
    for t, m in zip(docs["torch"]["cases"], docs["mxnet"]["cases"]):
        assert t["runs"][0]["samples_per_step"] == m["runs"][0]["samples_per_step"]
        assert len(m["runs"][0]["step_times_s"]) == 4 and len(m["runs"][0]["losses"]) == 6
        # MXNet's default is hybrid: its graph is built inside step 0, and timed there.
        run = m["runs"][0]
        assert 0 < run["compile_s"] <= run["first_step_s"], run


@pytest.mark.parametrize("framework", ["torch", "mxnet"])
def test_a_launch_whose_ports_were_taken_starts_again(side_by_side, framework):
    """The first 2-rank launch of each framework found its ports taken (the store's, Horovod's
    rendezvous): it failed before its first step and ran again on fresh ports."""
    _, out = side_by_side
    error = assert_started_again(out / framework)["retries"][0]["error"]
    assert {"torch": "EADDRINUSE", "mxnet": "Address already in use"}[framework] in error


def test_the_report_compares_the_frameworks(side_by_side):
    _, out = side_by_side
    text = (out / "report.md").read_text()
    assert "## Comparison: tiny-arcface fp32 fc=dp" in text
    header = next(line for line in text.splitlines() if line.startswith("| node_num"))
    assert ("| pytorch mode | pytorch samples/s | pytorch speedup | mxnet mode | mxnet samples/s |"
            in header)
    modes = {n: results.load(out / n)["cases"][0]["mode"] for n in ("torch", "mxnet")}
    assert f"| 1 | 1 | 8 | {modes['torch']} | " in text and modes["mxnet"] in ("hybrid",
                                                                             "imperative")
    assert header.endswith("| mxnet / pytorch |")  # the ratio column
    ratio_rows = [line for line in text.splitlines() if line.startswith("| 1 | 1 | 8 |")]
    ratio = float(ratio_rows[0].strip("| \n").split(" | ")[-1].split()[0])
    docs = {n: results.load(out / n) for n in ("torch", "mxnet")}
    expected = (docs["mxnet"]["cases"][0]["median_samples_per_s"]
                / docs["torch"]["cases"][0]["median_samples_per_s"])
    assert ratio == pytest.approx(expected, abs=1e-3)
    assert "mxnet 1.9.1 on" in text and "pytorch" in text  # each framework's environment
    assert (out / "throughput.png").exists()


def test_rn50_and_the_device_kvstore(tmp_path, mxnet_python):
    """ResNet50 v1b on 1 and 2 ranks, the 2 ranks as one process with two contexts (kvstore
    device, as gluon-cv ran), where one graph build serves both contexts: built and timed once,
    in step 0, never again."""
    out = tmp_path / "rn50"
    code = main(["run", "rn50-v1b-imagenet", "--framework", "mxnet", "--devices", "1,2",
                 "--batch-size", "2", "--runs", "1", "--iters", "3", "--warmup", "1",
                 "--device", "cpu", "--mxnet-kvstore", "device", "--out", str(out)])
    assert code == 0
    doc = results.load(out)
    assert [c["runs"][0]["samples_per_step"] for c in doc["cases"]] == [2, 4]
    assert doc["tuning"]["mxnet_kvstore"] == "device"
    for case in doc["cases"]:
        run = case["runs"][0]
        assert run["recompiles_in_window"] == 0
        assert 0 < run["compile_s"] <= run["first_step_s"], run
    assert left_behind(tmp_path) == []


@pytest.mark.parametrize("fault,status,words", [
    ("raise@3:2", "failed", "injected"),
    ("kill@3:2", "failed", None),
    ("oom@3:2", "oom", "out of memory"),
])
def test_a_failing_rank_is_a_result_and_leaves_nothing(fault, status, words, tmp_path,
                                                       monkeypatch, mxnet_python):
    monkeypatch.setenv("TRAINPERF_FAULT", fault)  # on rank 0; rank 1 is left waiting on it
    code = main(["run", "tiny-arcface", "--framework", "mxnet", "--devices", "2", "--fc",
                 "mp", *SHORT, "--out", str(tmp_path / "r")])
    assert code == 1
    run = results.load(tmp_path / "r")["cases"][0]["runs"][0]
    assert run["status"] == status and run["samples_per_s"] is None
    if words:
        assert words in run["error"]
    assert left_behind(tmp_path) == []


def test_a_suspended_rank_is_named_with_where_the_run_stalled(tmp_path, mxnet_python):
    """Rank 1 stopped with SIGSTOP (rank 0 waits on its parameter server): the run is stopped
    as hung under --stall-timeout, naming rank 1, since when, and where rank 0 was."""
    assert_a_suspended_rank_is_named("mxnet", tmp_path / "r", "--fc", "mp")


def test_a_hung_rank_times_out_and_leaves_nothing(tmp_path, monkeypatch, mxnet_python):
    """The hang sleeps far past the limit, so the outcome cannot depend on the machine's load."""
    monkeypatch.setenv("TRAINPERF_FAULT", "hang@3")
    code = main(["run", "tiny-arcface", "--framework", "mxnet", "--devices", "2", *SHORT,
                 "--timeout", "10", "--out", str(tmp_path / "r")])
    assert code == 1
    run = results.load(tmp_path / "r")["cases"][0]["runs"][0]
    assert run["status"] == "timeout"
    assert left_behind(tmp_path) == []


def test_mxnet_refuses_what_it_does_not_run(tmp_path, capsys):
    """Partial FC, like mp, needs a rank per process: kvstore device is data parallel only."""
    assert main(["run", "tiny-arcface", "--framework", "mxnet", "--devices", "2", "--fc", "pfc",
                 "--mxnet-kvstore", "device", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert ("kvstore device runs data parallel only (--fc dp); use horovod (the default) for "
            "--fc pfc") in err
    assert not (tmp_path / "r").exists()


def test_the_breakdown_splits_an_mp_step_into_phases(tmp_path, monkeypatch, mxnet_python):
    """One profiled run (the fixture above runs torch too, and data parallel only): the
    hand-written mp head runs its own backward and its collectives in ``head``; the gradient
    allreduce runs in ``backward``, as the engine overlaps it there, and every other step skips
    it to tell how much of it is not hidden. Every profiled step sleeps in its head: the sleep
    must land there and in no timed run."""
    out = tmp_path / "bd"
    monkeypatch.setenv(DELAY_ENV, f"head={PHASE_DELAY_S}")
    code = main(["run", "tiny-arcface", "--framework", "mxnet", "--devices", "2", "--fc", "mp",
                 "--runs", "1", "--iters", "2", "--warmup", "1", "--device", "cpu", *BREAKDOWN,
                 "--trace", "--out", str(out)])
    assert code == 0
    assert_timed_runs_unprofiled(out)
    bd = assert_delay_lands(results.load(out)["cases"][0], "head")
    assert bd["merged"] == {} and bd["head_has_backward"] is True
    assert bd["method"].startswith("mx.profiler Task ranges")
    assert list(bd["phases_s"]) == ["data", "backbone_forward", "head", "backward", "grad_comm",
                                    "optimizer", "other"]
    assert bd["hidden_comm_measured"] and bd["steps"] == bd["no_comm_steps"] == 2
    summed = ["horovod_allreduce"]
    assert bd["collectives"] == {"head": summed, "backward": summed}
    assert bd["matmul_what"] == "mx.nd.dot float32 1024^3"
    trace = out / bd["folder"] / "trace"
    assert sorted(f.name for f in trace.iterdir()) == ["mxnet-trace-rank0.json",
                                                       "mxnet-trace-rank1.json"]
    assert out / bd["trace"] == trace / "mxnet-trace-rank0.json"
    events = json.loads((trace / "mxnet-trace-rank0.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e.get("cat") == "trainperf"} == {
        "data", "backbone_forward", "head", "backward", "optimizer"}
    assert left_behind(tmp_path) == []
