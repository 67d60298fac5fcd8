"""commbench: the curve from two gloo ranks through the command's own path, on one node and on
two over loopback; failures that end with a message naming the rank rather than a hang (a
rank's own exception, a death by a signal, on this node or another); and the arithmetic (bus
bandwidth factors, the fit)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_util import left_behind, reserved_ports
from trainperf.backends.spawn import STACK_SIGNAL
from trainperf.cli import build_parser, scale as scale_cli
from trainperf.scale import commbench, commbench_launch
from trainperf.scale.commbench import (CommbenchError, CommbenchSpec, busbw_factor,
                                       fit_alpha_beta, load_fabric, message_sizes)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["commbench", *argv])


SMALL = ("--device", "cpu", "--devices", "2", "--min-bytes", "1KiB", "--max-bytes", "16MiB",
         "--factor", "4", "--iters", "5", "--warmup", "2", "--timeout", "120")
TINY = ("--device", "cpu", "--ops", "all_reduce", "--min-bytes", "1KiB", "--max-bytes", "16KiB",
        "--iters", "2", "--warmup", "1")
"""Five sizes of one collective: a fault at index 1 strikes at the second, 2 KiB."""


@pytest.mark.slow
def test_two_gloo_ranks_draw_the_curve(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRAINPERF_FAULT", raising=False)
    out = tmp_path / "cb"
    assert scale_cli.cmd_commbench(parse(*SMALL, "--out", str(out))) == 0
    assert str(out / "commbench.json") in capsys.readouterr().out
    doc = json.loads((out / "commbench.json").read_text())
    assert doc["schema"] == commbench.SCHEMA
    assert (doc["backend"], doc["world_size"], doc["nnodes"]) == ("gloo", 2, 1)
    assert doc["env"]["torch_version"] and doc["env"]["cpu_count"]
    assert [r["op"] for r in doc["ops"]] == list(commbench.OPS)
    md = (out / "commbench.md").read_text()
    for rec in doc["ops"]:
        if "unsupported" in rec:
            assert rec["unsupported"].strip()
            assert rec["op"] in md
            continue
        pts = rec["points"]
        sizes = [p["bytes"] for p in pts]
        assert sizes == sorted(set(sizes)) and sizes == message_sizes(1024, 16 * 2**20, 4, 8)
        assert pts[-1]["time_s"] > pts[0]["time_s"], rec["op"]
        assert pts[-1]["busbw_GBps"] > pts[0]["busbw_GBps"], rec["op"]
        factor = busbw_factor(rec["op"], 2)
        for p in pts:
            assert p["algbw_GBps"] == pytest.approx(p["bytes"] / p["time_s"] / 1e9)
            assert p["busbw_GBps"] == pytest.approx(p["algbw_GBps"] * factor)
        assert f"torch.distributed.{rec['call']}" in md
        beside = rec["beside_compute"]  # on CPUs: the largest size beside computation
        assert beside["bytes"] == sizes[-1] and 0 <= beside["compute_share_taken"] <= 1
        assert beside["slowdown"] == pytest.approx(beside["time_s"] / pts[-1]["time_s"])
    fabric = load_fabric(out)
    assert set(fabric) == {r["op"] for r in doc["ops"] if "points" in r}
    for entry in fabric.values():
        assert entry["latency_s"] > 0 and entry["busbw_Bps"] > 0
        assert 0 <= entry["compute_share_taken"] <= 1 and entry["slowdown_beside_compute"] > 0
        assert (entry["nnodes"], entry["devices_per_node"], entry["backend"]) == (1, 2, "gloo")
    with pytest.raises(ValueError, match="already holds"):
        commbench_launch.run_commbench(CommbenchSpec(), out)
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank-0.log", "rank-1.log"]
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_a_failing_rank_is_named_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@1")  # rank 0, at the second size measured
    spec = CommbenchSpec(ops=("all_reduce",), min_bytes=1024, max_bytes=4096, iters=2,
                         warmup=1, timeout_s=120)
    with pytest.raises(CommbenchError) as err:
        commbench_launch.run_commbench(spec, tmp_path / "cb")
    # Its own exception first, rank 1's broken connection (or its being stopped) after it.
    assert str(err.value).startswith("rank 0: RuntimeError: injected failure (TRAINPERF_FAULT)")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cb" / "commbench.json").exists()
    assert left_behind(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("kind,death", [("kill", "SIGKILL (signal 9)"),
                                        ("segv", "SIGSEGV (signal 11)")])
def test_a_rank_killed_by_a_signal_is_named_with_it(tmp_path, monkeypatch, kind, death):
    """Rank 1 dies without a word (as under the kernel's OOM killer) or of a native crash at
    the second size: the launcher's exit event says how, the rank's last line where in the
    sweep, and that comes before rank 0's broken connection."""
    monkeypatch.setenv("TRAINPERF_FAULT", f"{kind}@1/1")
    spec = scale_cli.commbench_spec(parse(*TINY))
    with pytest.raises(CommbenchError) as err:
        commbench_launch.run_commbench(spec, tmp_path / "cb")
    text = str(err.value)
    assert text.startswith(f"rank 1 died of {death} at all_reduce, 2 KiB"), text
    assert "\n" not in text
    if kind == "segv":  # the fault handler's innermost frame: where Python was
        assert "in inject (faults.py:" in text, text
    assert not (tmp_path / "cb" / "commbench.json").exists()
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_a_hung_rank_is_stopped_at_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPERF_FAULT", "hang@0")
    spec = CommbenchSpec(ops=("all_reduce",), min_bytes=1024, max_bytes=1024, timeout_s=4)
    with pytest.raises(CommbenchError, match="no result within 4 s"):
        commbench_launch.run_commbench(spec, tmp_path / "cb")
    assert left_behind(tmp_path) == []


# ------------------------------------------------------------------- two nodes over loopback

def start_nodes(tmp_path: Path, *extra: str, fault: str = "") -> list[subprocess.Popen]:
    """Two ``trainperf commbench`` processes meeting at one endpoint, one rank each, each
    writing into its own folder (n0, n1: the rendezvous decides which becomes node 0)."""
    endpoint = f"127.0.0.1:{reserved_ports()[0]}"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRAINPERF_FAULT=fault)
    return [subprocess.Popen([sys.executable, "-c", NODE, "commbench", *TINY,
                              "--devices", "1", "--nnodes", "2", "--rdzv", endpoint, *extra,
                              "--out", str(tmp_path / f"n{n}")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             # pytest-xdist's workers ignore SIGINT, and a child inherits that
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            for n in (0, 1)]


NODE = (f"import faulthandler, sys; faulthandler.register({int(STACK_SIGNAL)}, "
        "all_threads=True); from trainperf.cli import main; sys.exit(main(sys.argv[1:]))")
"""The command line, able to say where it is: a node that does not end in time is asked for
its threads' stacks before it is killed, and the test's failure shows them."""


def finish(procs: list[subprocess.Popen], limit_s: float = 150) -> list[tuple[int, str]]:
    """Each node's exit code and the last line of its stderr; a generous limit that only stops
    a hung test, whose failure then shows where each node was."""
    deadline = time.monotonic() + limit_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.send_signal(STACK_SIGNAL)
            time.sleep(2)
            for q in procs:
                q.kill()
            stacks = [q.communicate()[1][-6000:] for q in procs]
            raise AssertionError("a node did not end within the limit; their output:\n"
                                 + "\n----\n".join(stacks))
    ended = []
    for p in procs:
        _, err = p.communicate()
        lines = err.strip().splitlines()
        ended.append((p.returncode, lines[-1] if lines else ""))
    return ended


@pytest.mark.slow
def test_two_nodes_over_loopback_measure_one_curve(tmp_path):
    ended = finish(start_nodes(tmp_path, "--ops", "all_reduce,all_gather"))
    assert [code for code, _ in ended] == [0, 0], ended
    docs = [json.loads((tmp_path / f"n{n}" / "commbench.json").read_text()) for n in (0, 1)]
    for doc in docs:
        assert (doc["nnodes"], doc["devices_per_node"], doc["world_size"]) == (2, 1, 2)
        assert [r["op"] for r in doc["ops"]] == ["all_reduce", "all_gather"]
        for rec in doc["ops"]:
            if "unsupported" in rec:
                continue
            assert [p["bytes"] for p in rec["points"]] == message_sizes(1024, 16384, 2, 8)
            assert all(p["time_s"] > 0 for p in rec["points"])
    # Both nodes hold the slowest rank's times, all-reduced across the two.
    assert docs[0]["ops"] == docs[1]["ops"]
    clusters = [json.loads(next((tmp_path / f"n{n}").glob("node*/cluster.json")).read_text())
                for n in (0, 1)]
    assert sorted(c["node_rank"] for c in clusters) == [0, 1]
    assert clusters[0]["ports"] == clusters[1]["ports"]
    assert left_behind(tmp_path) == []


@pytest.mark.slow
def test_a_rank_dying_on_one_node_is_named_on_the_other(tmp_path):
    """Global rank 1 (node 1's only rank) is killed at the second size while rank 0 hangs
    outside any collective, as a rank on a GPU whose NCCL never notices a lost peer would:
    rank 0 alone would wait for the 300 s collective timeout, or the 600 s whole. Node 1 tells,
    node 0 hears, stops its rank and both report the dead rank first."""
    started = time.monotonic()
    procs = start_nodes(tmp_path, "--timeout", "600", fault="hang@1/0,kill@1/1")
    ended = finish(procs)
    took = time.monotonic() - started
    assert [code for code, _ in ended] == [1, 1], ended
    for _, line in ended:
        assert line.startswith("trainperf: commbench failed: node 1: rank 1 died of SIGKILL "
                               "(signal 9) at all_reduce, 2 KiB"), line
        assert "node 0: its ranks were stopped when another node's part failed" in line
    assert took < 150, took  # far inside the collective timeout: nobody waited it out
    assert left_behind(tmp_path) == []


def both_at(folder: Path, words: str) -> bool:
    logs = list(folder.rglob("rank-*.log"))
    return len(logs) == 2 and all(words in log.read_text() for log in logs)


@pytest.mark.slow
def test_an_interrupted_node_stops_the_other(tmp_path):
    """Ctrl-C on one node stops its ranks and tells the other node, which stops its own at
    once; both ranks hang, so only that can end it."""
    procs = start_nodes(tmp_path, "--timeout", "600", fault="hang@1/0,hang@1/1")
    deadline = time.monotonic() + 120
    while not both_at(tmp_path, "2048 bytes"):  # each rank past its first size
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            finish(procs, 5)
        time.sleep(0.2)
    procs[0].send_signal(signal.SIGINT)
    stopped = time.monotonic()
    ended = finish(procs)
    assert ended[0] == (130, "trainperf: commbench interrupted; every rank was stopped"), ended
    assert ended[1][0] == 1 and "interrupted (Ctrl-C or SIGTERM)" in ended[1][1], ended
    assert time.monotonic() - stopped < 60
    assert left_behind(tmp_path) == []


def test_busbw_factors_are_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert busbw_factor("reduce_scatter", 4) == pytest.approx(3 / 4)
    assert busbw_factor("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("broadcast", 2)


def test_sizes_are_whole_parts_per_rank():
    assert message_sizes(4096, 65536, 2, 8) == [4096, 8192, 16384, 32768, 65536]
    # Three ranks of float32: every size a multiple of 12 bytes, never above the request.
    sizes = message_sizes(1000, 10**6, 10, 12)
    assert sizes == [996, 9996, 99996, 999996]
    assert message_sizes(1, 64, 2, 32) == [32, 64]  # 1..16 all round up to one unit, kept once


@pytest.mark.parametrize("op,world", [("all_reduce", 8), ("all_gather", 16),
                                      ("reduce_scatter", 4)])
def test_fit_recovers_latency_and_bandwidth(op, world):
    latency_s, busbw_Bps = 23e-6, 180e9
    factor = busbw_factor(op, world)
    points = []
    for size in message_sizes(1024, 2**30, 2, 4 * world):
        t = latency_s + factor * size / busbw_Bps
        points.append({"bytes": size, "time_s": t, "algbw_GBps": size / t / 1e9,
                       "busbw_GBps": factor * size / t / 1e9})
    fit_latency, fit_busbw = fit_alpha_beta(list(reversed(points)))  # order does not matter
    assert fit_latency == pytest.approx(latency_s, rel=0.01)
    assert fit_busbw == pytest.approx(busbw_Bps, rel=0.001)
    with pytest.raises(ValueError, match="no measured points"):
        fit_alpha_beta([])


def test_fit_takes_the_usual_small_message_cost_not_the_luckiest():
    """A CPU rank on one core waits a scheduler tick now and then: small collectives take
    0.3-4 ms. The latency is what they cost as a rule (the median), not the one lucky size."""
    busbw = 0.12e9
    small = [1.9e-3, 2.2e-3, 0.4e-3, 1.7e-3, 2.5e-3, 2.0e-3]
    points = []
    for i, size in enumerate(message_sizes(4096, 2**26, 2, 8)):
        t = (small[i] if i < len(small) else 2e-3) + size / busbw
        points.append({"bytes": size, "time_s": t, "busbw_GBps": size / t / 1e9})
    latency_s, fit_busbw = fit_alpha_beta(points)
    assert latency_s == pytest.approx(2.0e-3, rel=0.05)
    assert fit_busbw == pytest.approx(busbw, rel=0.01)


def test_what_a_collective_takes_beside_compute_reaches_the_fabric_on_cpus_only(tmp_path):
    """Gloo's copies and sums and the kernel's TCP share the cores training computes on;
    NCCL's kernels do not, so a GPU curve carries none of it."""
    spec = CommbenchSpec(devices_per_node=1, nnodes=2, rdzv="node0:29400")
    raw = {"backend": "gloo", "world_size": 2, "env": {},
           "ops": [{"op": "all_reduce", "call": "all_reduce",
                    "points": [{"bytes": 2**12, "time_s": 4e-4},
                               {"bytes": 2**26, "time_s": 0.56}],
                    "beside_compute": {"bytes": 2**26, "time_s": 0.84,
                                       "compute_share_taken": 0.12}}]}
    doc = commbench.document(spec, raw, {})
    assert doc["ops"][0]["beside_compute"]["slowdown"] == pytest.approx(1.5)
    assert "12.0% of the computation's speed" in commbench.markdown(doc)
    (tmp_path / "commbench.json").write_text(json.dumps(doc))
    entry = load_fabric(tmp_path)["all_reduce"]
    assert entry["compute_share_taken"] == 0.12
    assert entry["slowdown_beside_compute"] == pytest.approx(1.5)
    (tmp_path / "commbench.json").write_text(json.dumps({**doc, "device": "cuda"}))
    assert "compute_share_taken" not in load_fabric(tmp_path)["all_reduce"]


def test_load_fabric_reads_a_written_document(tmp_path):
    spec = CommbenchSpec(devices_per_node=4, nnodes=2, rdzv="node0:29400")
    raw = {"backend": "nccl", "world_size": 8, "env": {"torch_version": "x"},
           "ops": [{"op": "all_reduce", "call": "all_reduce",
                    "points": [{"bytes": 2**12, "time_s": 2e-5}, {"bytes": 2**30, "time_s": 1e-2}]},
                   {"op": "reduce_scatter", "unsupported": "gloo: not here"}]}
    doc = commbench.document(spec, raw, {"host": "h"})
    (tmp_path / "commbench.json").write_text(json.dumps(doc))
    fabric = load_fabric(tmp_path / "commbench.json")
    assert list(fabric) == ["all_reduce"]
    ar = fabric["all_reduce"]
    # The small message's time less its bandwidth term; the large one's time less that.
    assert ar["latency_s"] == pytest.approx(2e-5 - 1.75 * 2**12 / ar["busbw_Bps"], rel=1e-9)
    assert ar["busbw_Bps"] == pytest.approx(1.75 * 2**30 / (1e-2 - ar["latency_s"]), rel=1e-9)
    assert (ar["nnodes"], ar["devices_per_node"], ar["world_size"], ar["backend"]) == (2, 4, 8,
                                                                                       "nccl")
    assert "Not measured: gloo: not here" in commbench.markdown(doc)
    one_rank = commbench.document(CommbenchSpec(devices_per_node=1), {**raw, "world_size": 1},
                                  {})
    (tmp_path / "one.json").write_text(json.dumps(one_rank))
    assert load_fabric(tmp_path / "one.json") == {}  # no link crossed: nothing to model
    (tmp_path / "other.json").write_text('{"schema": "trainperf.results/v1"}')
    with pytest.raises(ValueError, match="not a trainperf.commbench/v1"):
        load_fabric(tmp_path / "other.json")


@pytest.mark.parametrize("argv,message", [
    (("--factor", "1"), "--factor must be > 1"),
    (("--factor", "0.5"), "--factor must be > 1"),
    (("--min-bytes", "2MiB", "--max-bytes", "1MiB"), "--min-bytes <= --max-bytes"),
    (("--nnodes", "2"), "--rdzv must be HOST:PORT"),
    (("--nnodes", "2", "--rdzv", "node0"), "--rdzv must be HOST:PORT"),
    (("--devices", "0"), "--devices and --nnodes must be >= 1"),
    (("--ops", "all_reduce,broadcast"), "--ops takes a list of"),
    (("--iters", "0"), "--iters must be >= 1"),
    (("--max-bytes", "lots"), "cannot read a size"),
])
def test_bad_input_is_a_one_line_error(argv, message):
    with pytest.raises(ValueError, match=message) as err:
        scale_cli.commbench_spec(parse("--device", "cpu", *argv))
    assert "\n" not in str(err.value)


def test_launch_argv_single_and_multi_node(tmp_path):
    from trainperf.scale import commbench_worker

    spec = CommbenchSpec(devices_per_node=4, ops=("all_gather",), min_bytes=64, max_bytes=4096,
                         factor=4, iters=3, warmup=0, dtype="bfloat16", timeout_s=60)
    one = commbench_launch.launch_argv(spec, tmp_path, python="py")
    assert one[:7] == ["py", "-m", "trainperf.backends.spawn", "--backend=torch", "--nproc=4",
                       f"--module={commbench.WORKER_MODULE}", f"--logs={tmp_path / 'logs'}"]
    assert not any("cluster" in a or "torch.distributed.run" in a for a in one)
    # The ranks append their error events where the launcher appends its exit events.
    events = f"{tmp_path / 'events.jsonl'}"
    assert f"--events={events}" in one[:one.index("--")]
    # What the ranks are told is the spec, read back by the worker's own parser.
    got = commbench_worker.parse_args(one[one.index("--") + 1:])
    assert (got.out, got.events, got.ops) == (tmp_path / "worker.json", events, "all_gather")
    assert (got.min_bytes, got.max_bytes, got.factor, got.iters, got.warmup) == (64, 4096, 4, 3, 0)
    assert (got.dtype, got.device, got.timeout_s) == ("bfloat16", "cpu", 30)
    multi = commbench_launch.launch_argv(
        CommbenchSpec(devices_per_node=8, nnodes=4, rdzv="n0:29400"), tmp_path / "node2",
        tmp_path / "node2" / "cluster.json", "py")
    assert f"--cluster={tmp_path / 'node2' / 'cluster.json'}" in multi[:multi.index("--")]
    assert "--nproc=8" in multi and f"--logs={tmp_path / 'node2' / 'logs'}" in multi


def test_cuda_defaults_to_a_gibibyte(monkeypatch):
    monkeypatch.setattr(scale_cli, "gpu_count", lambda: 8)
    spec = scale_cli.commbench_spec(parse())
    assert (spec.device, spec.max_bytes, spec.devices_per_node) == ("cuda", 2**30, 2)
    monkeypatch.setattr(scale_cli, "gpu_count", lambda: 1)
    with pytest.raises(ValueError, match="this machine has 1 GPU"):
        scale_cli.commbench_spec(parse())


def test_a_missing_call_falls_back_then_is_recorded(monkeypatch):
    import torch
    import torch.distributed as dist

    from trainperf.scale import commbench_worker as worker

    def lacks(*args, **kwargs):
        raise RuntimeError("ProcessGroupX does not support this\nmore detail")

    tensor_call, list_call = worker.CALLS["all_gather"]
    monkeypatch.setattr(dist, tensor_call, lacks)
    monkeypatch.setattr(dist, list_call, lambda outs, inp: None)
    cpu = torch.device("cpu")
    assert worker.choose_call("all_gather", 64, 2, torch.float32, cpu) == (list_call, "")
    monkeypatch.setattr(dist, list_call, lacks)
    call, reason = worker.choose_call("all_gather", 64, 2, torch.float32, cpu)
    assert call is None and "\n" not in reason
    assert reason == (f"{tensor_call}: ProcessGroupX does not support this; "
                      f"{list_call}: ProcessGroupX does not support this")

    def broken_peer(*args, **kwargs):
        raise dist.DistNetworkError("Connection closed by peer")

    monkeypatch.setattr(dist, tensor_call, broken_peer)
    with pytest.raises(dist.DistNetworkError):  # a failure, never "unsupported"
        worker.choose_call("all_gather", 64, 2, torch.float32, cpu)
