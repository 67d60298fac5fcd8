"""`trainperf run` end to end on CPU: results schema, the window placed by known delays,
statistics from the runs, the report table, the DLPerf export, failures as results, resume, two
nodes."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

from declarations import assert_runs_as_declared
from run_util import ports_taken_first, reserved_ports
from trainperf import results
from trainperf.cli import main
from trainperf.config import TUNING_SETTINGS, Tuning

pytestmark = pytest.mark.slow
# No --timeout: a healthy run must never race a wall-clock limit that a busy machine can pass.
TINY = ["--device", "cpu"]


# Known delays in the 1-device runs: the last warm-up step and the first counted step.
DELAYS = {9: 0.2, 10: 1.0}


@pytest.fixture(scope="module")
def e2e(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("e2e") / "run"
    os.environ["TRAINPERF_FAULT"] = ",".join(f"sleep={s}@{i}:1" for i, s in DELAYS.items())
    try:
        rc = main(["run", "tiny-arcface", "--devices", "1,2", "--runs", "2", "--iters", "30",
                   "--warmup", "10", *TINY, "--out", str(out)])
    finally:
        del os.environ["TRAINPERF_FAULT"]
    assert rc == 0
    return out


def test_results_follow_the_schema(e2e):
    doc = results.load(e2e)  # validates
    assert doc["schema"] == "trainperf.results/v1"
    assert [c["case"] for c in doc["cases"]] == ["1n1g", "1n2g"]
    assert doc["measure"] == {"runs": 2, "iters": 30, "warmup": 10, "timeout_s": 1800.0,
                              "memory_limit_bytes": None, "threads": None}
    assert doc["tuning"] == {**dataclasses.asdict(Tuning()), "mode": "default"}
    assert Tuning().tf32 == "on"
    assert doc["framework"] == "torch"
    assert_runs_as_declared(doc)
    assert doc["model"] == "iresnet_tiny"  # no DLPerf key for the tiny recipe
    env = doc["env"]
    for key in ("framework_version", "python", "host", "cpu_model", "trainperf_version",
                "trainperf_commit", "device_type", "cudnn_benchmark"):
        assert key in env
    one, two = doc["cases"]
    assert one["settings"]["ddp"] is None and one["settings"]["cudnn_benchmark"] is None
    # What each run applied, by name: on a CPU neither cuDNN nor TF32 exists, and one rank
    # has no DDP; another framework's settings are never torch's.
    nothing = dict.fromkeys(TUNING_SETTINGS)
    assert one["settings"]["tuning"] == nothing
    assert two["settings"]["tuning"] == {**nothing, "ddp_bucket_mb": 25.0,
                                         "ddp_static_graph": True,
                                         "ddp_broadcast_buffers": False}
    for c in doc["cases"]:
        assert c["memory_kind"] == "resident_set_peak" and c["tf32_matmul"] is None
        assert all(r["memory_kind"] == "resident_set_peak" and r["device_used_bytes"] is None
                   for r in c["runs"])
    assert two["settings"]["ddp"] == {"bucket_cap_mb": 25.0, "static_graph": True,
                                      "broadcast_buffers": False,
                                      "gradient_as_bucket_view": True}
    for c in doc["cases"]:
        assert len(c["runs"]) == 2
        for r in c["runs"]:
            assert r["status"] == "ok" and r["peak_memory_bytes"] > 0
            per_rank = r["peak_memory_bytes_per_rank"]
            assert len(per_rank) == c["world_size"] and max(per_rank) == r["peak_memory_bytes"]
            assert r["predicted_peak_bytes"] > r["baseline_memory_bytes"] > 0
            assert len(r["step_times_s"]) == 20 and len(r["warmup_step_times_s"]) == 10
            assert np.isfinite(r["loss_first"]) and np.isfinite(r["loss_last"])
    # The launcher's account of every rank: one exit each, clean, and an output file of its own.
    # The folder's stream holds them, tagged with the run; the run keeps no copy of its own.
    stream = [json.loads(line) for line in (e2e / "events.jsonl").read_text().splitlines()]
    for c in doc["cases"]:
        for r in c["runs"]:
            folder = e2e / "runs" / f"{c['case']}_b8_run{r['run']}"
            assert not (folder / "events.jsonl").exists() and (folder / "worker.log").exists()
            exits = [e for e in stream if e["event"] == "exit" and e["case"] == c["case"]
                     and e["run"] == r["run"]]
            assert sorted(e["rank"] for e in exits) == list(range(c["world_size"]))
            assert all(e["returncode"] == 0 and not e["stopped"] for e in exits)
            assert {Path(e["log"]).name for e in exits} == {
                f"rank-{n}.log" for n in range(c["world_size"])}


def test_window_holds_the_counted_steps(e2e):
    """The delays sit on known steps: each shows in its own step's time, on its side of the
    window edge, and the window's figure covers exactly the counted steps. (Lower bounds only,
    so a busy machine cannot fail this; tests/test_timing.py checks the window on a fake clock.)"""
    one = results.load(e2e)["cases"][0]
    for r in one["runs"]:
        warm, counted = r["warmup_step_times_s"], r["step_times_s"]
        assert warm[9] >= DELAYS[9] and counted[0] >= DELAYS[10]
        assert r["window_s"] >= counted[0]
        assert r["window_samples"] == len(counted) * r["samples_per_step"] == 20 * 8


def test_statistics_recomputed_from_runs(e2e):
    doc = results.load(e2e)
    medians = {}
    for c in doc["cases"]:
        rates = []
        for r in c["runs"]:
            samples_per_step = 8 * c["world_size"]
            assert r["samples_per_step"] == samples_per_step
            assert r["samples_per_s"] == pytest.approx(r["window_samples"] / r["window_s"],
                                                       rel=1e-12)
            rates.append(r["samples_per_s"])
        assert c["median_samples_per_s"] == pytest.approx(float(np.median(rates)), rel=1e-6)
        assert c["average_samples_per_s"] == pytest.approx(float(np.mean(rates)), rel=1e-6)
        q75, q25 = np.percentile(rates, [75, 25])
        assert c["iqr_samples_per_s"] == pytest.approx(q75 - q25, rel=1e-6, abs=1e-9)
        medians[c["world_size"]] = c["median_samples_per_s"]
    two = doc["cases"][1]
    assert two["speedup"] == pytest.approx(medians[2] / medians[1], rel=1e-9)
    assert two["scaling_efficiency"] == pytest.approx(medians[2] / medians[1] / 2, rel=1e-9)
    assert doc["cases"][0]["speedup"] == 1.0


def test_events_file_holds_every_step(e2e):
    events = [json.loads(line) for line in (e2e / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"]
    assert len(steps) == 4 * 30
    assert sum(e["event"] == "run_end" for e in events) == 4


def test_report_table(e2e):
    text = (e2e / "report.md").read_text()
    doc = results.load(e2e)
    assert "| node_num | gpu_num | batch/device | samples/s (median) |" in text
    for c in doc["cases"]:
        row = (f"| 1 | {c['world_size']} | 8 | {c['median_samples_per_s']:.2f} | "
               f"{c['average_samples_per_s']:.2f} |")
        assert row in text
    assert (e2e / "throughput.png").stat().st_size > 1000
    assert (e2e / "speedup.png").stat().st_size > 1000


def test_export_uses_dlperf_model_keys():
    """DLPerf's JSON is keyed r100 / y1 / r50 / rn50, as its logs and tables are."""
    from trainperf.recipes import RECIPES

    keys = {name: r.reference_model for name, r in RECIPES.items() if r.reference_model}
    assert keys == {"r100-arcface-emore": "r100", "r100-cosface-glint360k": "r100",
                    "y1-arcface-emore": "y1", "r50-arcface-plsc": "r50",
                    "rn50-v1b-imagenet": "rn50"}
    case = {"case": "1n1g", "world_size": 1, "batch_size_per_device": 128, "runs": [],
            "median_samples_per_s": 400.0, "average_samples_per_s": 401.0,
            "iqr_samples_per_s": 1.0, "ok_runs": 1, "flags": []}
    doc = results.document("rn50-v1b-imagenet", {"backbone": "resnet50_v1b"}, {}, {}, [case],
                           model="rn50")
    assert results.export_dlperf(doc) == {"rn50": {"1n1g": {
        "average_speed": 401.0, "median_speed": 400.0, "speedup": 1.0,
        "batch_size_per_device": 128}}}


def test_export_dlperf(e2e, tmp_path, capsys):
    out = tmp_path / "dlperf.json"
    assert main(["export", str(e2e), "--format", "dlperf", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    doc = results.load(e2e)
    entry = data["iresnet_tiny"]["1n2g"]
    assert entry["median_speed"] == round(doc["cases"][1]["median_samples_per_s"], 2)
    assert entry["batch_size_per_device"] == 8
    assert set(entry) == {"average_speed", "median_speed", "speedup", "batch_size_per_device"}


def test_report_of_two_folders_side_by_side(e2e, tmp_path):
    assert main(["report", str(e2e), str(e2e), "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "## Comparison" in text and "#2 samples/s" in text


def processes_naming(folder: Path) -> list[psutil.Process]:
    """Live processes whose command line names ``folder`` (launchers and workers of a run pass
    their spec path), so other test sessions on the machine do not count."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(folder) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            continue
    return out


@pytest.mark.parametrize("fault,status", [("raise@3:1", "failed"), ("oom@3:1", "oom")])
def test_failures_are_results_and_the_matrix_goes_on(fault, status, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPERF_FAULT", fault)  # only in the 1-device case
    rc = main(["run", "tiny-arcface", "--devices", "1,2", "--runs", "1", "--iters", "12",
               "--warmup", "4", *TINY, "--out", str(tmp_path / "r")])
    assert rc == 1
    doc = results.load(tmp_path / "r")
    bad, good = doc["cases"]
    assert bad["runs"][0]["status"] == status
    assert bad["runs"][0]["samples_per_s"] is None and bad["median_samples_per_s"] is None
    assert "injected" in bad["runs"][0]["error"]
    assert good["runs"][0]["status"] == "ok" and good["median_samples_per_s"] > 0
    assert good["speedup"] is None  # no 1-device figure to compare with
    assert "failed_runs" in bad["flags"]
    assert status in (tmp_path / "r" / "report.md").read_text()
    assert processes_naming(tmp_path) == []


def test_a_hung_run_is_killed_at_its_timeout(tmp_path, monkeypatch):
    """Only a run that hangs lives under the short limit, and it sleeps far past it: it times
    out however busy the machine is, and no healthy run can be mistaken for a hung one."""
    monkeypatch.setenv("TRAINPERF_FAULT", "hang@3")
    rc = main(["run", "tiny-arcface", "--devices", "1", "--runs", "1", "--iters", "12",
               "--warmup", "4", "--device", "cpu", "--timeout", "15",
               "--out", str(tmp_path / "r")])
    assert rc == 1
    run = results.load(tmp_path / "r")["cases"][0]["runs"][0]
    assert run["status"] == "timeout" and run["samples_per_s"] is None
    # Since when, and where the rank was when it was stopped (its stack, asked for first).
    assert run["error"].startswith("run exceeded its timeout and was killed at step 3; where "
                                   "each rank was: rank 0 in inject (faults.py:"), run["error"]
    assert "timeout" in (tmp_path / "r" / "report.md").read_text()
    assert processes_naming(tmp_path) == []


def test_resume_finishes_only_missing_runs(tmp_path):
    out = tmp_path / "r"
    args = ["run", "tiny-arcface", "--devices", "1", "--runs", "2", "--iters", "8",
            "--warmup", "2", "--threads", "1", *TINY]
    assert main([*args, "--out", str(out)]) == 0
    # --threads reaches the worker, which says what its framework runs with
    spec = json.loads((out / "runs" / "1n1g_b8_run1" / "spec.json").read_text())
    assert spec["threads"] == 1 and results.load(out)["measure"]["threads"] == 1
    assert '"torch_num_threads": 1' in (out / "events.jsonl").read_text()
    # Simulate a runner killed during run 2: drop everything after run 2 started.
    lines = (out / "events.jsonl").read_text().splitlines()
    cut = next(i for i, line in enumerate(lines)
               if json.loads(line).get("event") == "run_start" and json.loads(line)["run"] == 2)
    (out / "events.jsonl").write_text("\n".join(lines[:cut]) + "\n")
    first_run = results.load(out)["cases"][0]["runs"][0]
    assert main([*args, "--resume", str(out)]) == 0
    doc = results.load(out)
    runs = doc["cases"][0]["runs"]
    assert [r["run"] for r in runs] == [1, 2]
    assert runs[0] == first_run  # kept, not re-measured
    text = (out / "events.jsonl").read_text()
    assert text.count('"run_start"') == 2
    # A second plain run into the same folder is refused rather than mixed in.
    assert main([*args, "--out", str(out)]) == 2
    # So is a resume under another limit: its runs would not be comparable.
    assert main([*args, "--memory-limit", "4GiB", "--resume", str(out)]) == 2
    assert main([*args, "--ddp-bucket-mb", "16", "--resume", str(out)]) == 2
    assert main([*args[:-len(TINY)], "--threads", "2", *TINY, "--resume", str(out)]) == 2


def test_two_nodes_over_loopback(tmp_path):
    """Two nodes' runners on one machine; the ports node 0 published for the first attempt are
    taken before its rank binds them: both nodes agree to start the run again, meet afresh, and
    measure it."""
    port = str(reserved_ports()[0])
    codes = {}

    def node(rank: int) -> None:
        codes[rank] = main(["run", "tiny-arcface", "--devices", "1", "--nnodes", "2",
                            "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                            "--master-port", port, "--runs", "1", "--iters", "10",
                            "--warmup", "3", *TINY, "--out", str(tmp_path / f"node{rank}")])

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    with ports_taken_first():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert codes == {0: 0, 1: 0}
    doc = results.load(tmp_path / "node0")
    case = doc["cases"][0]
    assert case["case"] == "2n1g" and case["world_size"] == 2 and case["nodes"] == 2
    assert case["runs"][0]["samples_per_step"] == 16  # both nodes' batches
    assert case["median_samples_per_s"] > 0
    follower = json.loads((tmp_path / "node1" / "results.json").read_text())
    assert follower["role"] == "follower"
    assert follower["cases"][0]["runs"][0]["status"] == "ok"
    # Whichever node's ports were taken, both started the run again, together.
    for n in (0, 1):
        [given_up] = results.load(tmp_path / f"node{n}")["cases"][0]["runs"][0]["retries"]
        assert given_up["attempt"] == 1 and given_up["reason"]


def test_status_rules():
    from trainperf.outcome import decide
    from trainperf.protocol import End, Error, Exit, Start, Step

    def status(events, timed_out=False):
        got = decide(events, timed_out)
        return got.status, got.error

    start = Start(world_size=2, global_batch=16, device="cpu", env={}, workload={}, t=1.0)
    steps = [Step(index=i, seconds=1.0, samples=16, warmup=False, t=2.0 + i) for i in range(3)]
    end = End(samples_per_s=1.0, window_s=1.0, window_samples=1, window_steps=1,
              loss_first=1.0, loss_last=1.0, t=10.0)
    clean = [Exit(rank=r, returncode=0, t=11.0) for r in range(2)]
    # Once the window is reported and every process left cleanly the run is ok; an exception
    # at shutdown (its own error event, its protocol exit code) is kept as a warning.
    assert status([start, end, *clean]) == ("ok", None)
    late = Error(kind="exception", rank=1, message="RuntimeError: at teardown", t=10.5)
    assert status([start, end, late, Exit(rank=1, returncode=1, t=11.0)]) == ("ok", None)
    assert status([start]) == ("failed", None)
    assert status([start], True)[0] == "timeout"
    peer = Error(kind="exception", rank=0, message="Connection closed")
    cause = Error(kind="exception", rank=1, message="ValueError: x")
    assert status([start, peer, cause]) == ("failed", "ValueError: x")
    oom = Error(kind="oom", rank=1, message="OOM")
    assert status([start, peer, oom]) == ("oom", "OOM")
    # A native death is the cause, named with where rank 0 was, even after the window: the
    # peer's broken connection comes after it, and a process the launcher stopped is no cause.
    segv = Exit(rank=1, returncode=-11, t=3.5)
    stopped = Exit(rank=0, returncode=-15, stopped=True, t=4.0)
    assert status([start, *steps, peer, segv, stopped]) == (
        "failed", "rank 1 died of SIGSEGV (signal 11) at step 2; then rank 0: Connection closed")
    after = Exit(rank=1, returncode=-6, t=10.5)
    assert status([start, *steps, end, after, clean[0]]) == (
        "failed", "rank 1 died of SIGABRT (signal 6) after the last step")
    # Under --memory-limit a native crash is an allocation the cap refused; a kill is not.
    got = decide([start, *steps, peer, segv, stopped], False, memory_capped=True)
    assert got.status == "oom" and got.error.endswith("(taken as out of memory: a crash under "
                                                      "--memory-limit)")
    killed = Exit(rank=1, returncode=-9, t=3.5)
    assert decide([start, killed], False, memory_capped=True).status == "failed"
    helper = Exit(rank=-1, process="server on node 0", returncode=134, t=1.5)
    assert status([start, helper]) == (
        "failed", "server on node 0 exited with code 134 (SIGABRT) before the first step")
