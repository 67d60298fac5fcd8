"""commbench: the curve from two gloo ranks through the command's own path, failures that end
with a message rather than a hang, and the arithmetic (bus bandwidth factors, the fit)."""

from __future__ import annotations

import argparse
import json

import psutil
import pytest

from trainperf.cli import build_parser, scale as scale_cli
from trainperf.scale import commbench
from trainperf.scale.commbench import (CommbenchError, CommbenchSpec, busbw_factor,
                                       fit_alpha_beta, load_fabric, message_sizes)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["commbench", *argv])


SMALL = ("--device", "cpu", "--devices", "2", "--min-bytes", "1KiB", "--max-bytes", "16MiB",
         "--factor", "4", "--iters", "5", "--warmup", "2", "--timeout", "120")


def leftover(tag: str) -> list[psutil.Process]:
    """Processes still running whose command line names ``tag`` (this test's own folder)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(tag in part for part in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            pass
    return found


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
    fabric = load_fabric(out)
    assert set(fabric) == {r["op"] for r in doc["ops"] if "points" in r}
    for entry in fabric.values():
        assert entry["latency_s"] > 0 and entry["busbw_Bps"] > 0
        assert (entry["nnodes"], entry["devices_per_node"], entry["backend"]) == (1, 2, "gloo")
    with pytest.raises(ValueError, match="already holds"):
        commbench.run_commbench(CommbenchSpec(), out)


@pytest.mark.slow
def test_a_failing_rank_is_named_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@1")  # rank 0, at the second size measured
    spec = CommbenchSpec(ops=("all_reduce",), min_bytes=1024, max_bytes=4096, iters=2,
                         warmup=1, timeout_s=120)
    with pytest.raises(CommbenchError, match="rank 0: RuntimeError: injected failure"):
        commbench.run_commbench(spec, tmp_path / "cb")
    assert not (tmp_path / "cb" / "commbench.json").exists()


@pytest.mark.slow
def test_a_hung_rank_is_stopped_at_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPERF_FAULT", "hang@0")
    spec = CommbenchSpec(ops=("all_reduce",), min_bytes=1024, max_bytes=1024, timeout_s=4)
    with pytest.raises(CommbenchError, match="no result within 4 s"):
        commbench.run_commbench(spec, tmp_path / "cb")
    assert leftover(str(tmp_path)) == []


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
    assert ar["latency_s"] == 2e-5
    assert ar["busbw_Bps"] == pytest.approx(1.75 * 2**30 / (1e-2 - 2e-5))
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
    one = commbench.launch_argv(CommbenchSpec(devices_per_node=4), tmp_path / "w.json", "py")
    assert one[:6] == ["py", "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "4"]
    assert one[one.index("-m", 3) + 1] == commbench.WORKER_MODULE
    multi = commbench.launch_argv(CommbenchSpec(devices_per_node=8, nnodes=4, rdzv="n0:29400",
                                                rdzv_id="job7"), tmp_path / "w.json", "py")
    joined = " ".join(multi)
    assert ("--nnodes 4 --rdzv-backend c10d --rdzv-endpoint n0:29400 --rdzv-id job7 "
            "--nproc-per-node 8") in joined
    assert "--standalone" not in multi


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
