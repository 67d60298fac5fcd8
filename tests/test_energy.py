"""Each run's GPU energy: which boards a run's devices are (``CUDA_VISIBLE_DEVICES`` read as CUDA
reads it), the counter's readings and a window's joules between them, the run's record, case and
report, and on several nodes every node's joules brought to node 0.

No GPU ran these: the counter is a stand-in NVML (``nvml_standin``) that rises with the wall
clock at a known power per board, and the runs that read it are a stand-in worker's, declared
as GPU runs; a real CPU run (torch, tiny-arcface) shows that a CPU run reads nothing.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import nvml_standin
from nvml_standin import BOARDS
from run_util import reserved_ports
from trainperf import energy, results
from trainperf.attempts import RunLauncher
from trainperf.backends import get_backend
from trainperf.backends.base import Launch, rank_gpu
from trainperf.config import Measure, Topology, Tuning
from trainperf.energy import Board, NotMeasured, board_for, counter_between, run_entries
from trainperf.node_agreement import Nodes
from trainperf.plan_model import Case, Plan
from trainperf.progress import QuietProgress
from trainperf.protocol import End, RunSpec, Step
from trainperf.recipes import get_recipe
from trainperf.rendezvous import NodeGroup
from trainperf.report.energy import energy_section
from trainperf.run_energy import METHOD, Part, RunEnergy, RunMeter, window_edges

UUID = {b["watts"]: b["uuid"] for b in BOARDS}
"""The stand-in's boards by their power: 100 W is CUDA's device 0 (the lowest PCI bus)."""
LISTED = [Board(i, b["uuid"], b["bus"].upper(), b["name"]) for i, b in enumerate(BOARDS)]


@pytest.fixture
def standin(tmp_path, monkeypatch):
    """``import pynvml`` gives the stand-in over ``BOARDS`` for this test."""
    return nvml_standin.install(monkeypatch, tmp_path / "nvml")


# -- which boards ------------------------------------------------------------------------------

def test_an_index_is_cudas_order_which_is_the_pci_bus_order_not_nvmls():
    # NVML lists the 200 W board first; CUDA's device 0 is the one on the lowest bus (100 W).
    assert [board_for(str(i), LISTED, None).uuid for i in range(3)] == [
        UUID[100.0], UUID[200.0], UUID[400.0]]
    assert board_for("0", LISTED, "PCI_BUS_ID").index == 1
    with pytest.raises(NotMeasured, match="CUDA device 3 is not among the 3 board"):
        board_for("3", LISTED, None)


def test_a_uuid_or_a_prefix_only_one_board_has_names_it_exactly():
    assert board_for(UUID[400.0], LISTED, None).uuid == UUID[400.0]
    assert board_for("GPU-4d9", LISTED, None).uuid == UUID[400.0]  # CUDA takes a prefix
    with pytest.raises(NotMeasured, match="several boards' do"):
        board_for("GPU-", LISTED, None)
    with pytest.raises(NotMeasured, match="no board's UUID starts with it"):
        board_for("GPU-ffff", LISTED, None)


def test_what_cannot_be_told_for_sure_is_not_measured():
    with pytest.raises(NotMeasured, match="MIG instance, which keeps no energy counter"):
        board_for("MIG-5e2c0000-0000-0000-0000-000000000000", LISTED, None)
    with pytest.raises(NotMeasured, match="neither a device index nor a GPU UUID"):
        board_for("gpu0", LISTED, None)
    # Boards of two models: CUDA's default order puts the faster first, which no reading of
    # NVML's list can place; PCI_BUS_ID and UUIDs still can.
    mixed = [LISTED[0], dataclasses.replace(LISTED[1], name="NVIDIA A100-SXM4-40GB"), LISTED[2]]
    with pytest.raises(NotMeasured, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        board_for("0", mixed, None)
    assert board_for("0", mixed, "PCI_BUS_ID").uuid == UUID[100.0]
    assert board_for(UUID[200.0], mixed, None).uuid == UUID[200.0]


@pytest.mark.parametrize("visible,devices,entries", [
    (None, 2, ["0", "1"]),  # unset: every board, the local ranks' indices
    ("2,0", 1, ["2"]),
    (" 3, 5 ,7", 2, ["3", "5"]),
    ("GPU-aa,GPU-bb", 2, ["GPU-aa", "GPU-bb"]),
    ("4", 2, ["4"]),  # fewer visible than ranks: the ranks share it (torch) or fail
    ("", 2, []),  # none visible
])
def test_a_runs_boards_are_the_ones_its_local_ranks_take(visible, devices, entries):
    assert run_entries(visible, devices) == entries
    # Every backend picks local rank r's GPU by the same rule (backends.base.rank_gpu).
    assert [g for g in (rank_gpu(r, visible) for r in range(devices)) if g] == entries


def test_nvml_lists_the_boards_and_names_what_it_cannot_read(standin, tmp_path, monkeypatch):
    with energy.Nvml() as nvml:
        assert nvml.boards() == LISTED  # bus ids read from bytes, as older bindings give them
        picked = nvml.resolve(["1", "GPU-4d9", "1"], None)
        assert [b.uuid for b in picked] == [UUID[200.0], UUID[400.0]]  # a shared board once
        assert nvml.power_w(picked[0]) == 200.0
        with pytest.raises(NotMeasured, match="CUDA_VISIBLE_DEVICES is empty"):
            nvml.resolve([], None)
    old = [dict(b, counter=False) for b in BOARDS]  # a driver without the counter
    nvml_standin.install(monkeypatch, tmp_path / "old", old)
    with energy.Nvml() as nvml:
        with pytest.raises(NotMeasured, match=r"keeps no energy counter for NVIDIA H100.*"
                                              r"\(NVML: Not Supported\)"):
            nvml.energy_mj(nvml.resolve(["0"], None)[0])
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    with pytest.raises(NotMeasured, match="NVML is not installed"):
        energy.Nvml()


# -- the counter and the window ------------------------------------------------------------------

def test_a_windows_joules_lie_between_the_readings_around_its_edges():
    times = [10.0, 11.0, 12.0, 13.0]
    counter = [0.0, 100.0, 300.0, 600.0]  # mJ: 0.1 W, then 0.2 W, then 0.3 W
    joules, error = counter_between(times, counter, 10.5, 12.5)
    assert joules == pytest.approx((450.0 - 50.0) / 1000)
    # Nothing is known inside [10, 11] and [12, 13]: the rise lies between 0.2 and 0.6 J.
    assert error == pytest.approx(0.2)
    assert counter_between(times, counter, 11.0, 12.0) == (pytest.approx(0.2), 0.0)
    with pytest.raises(NotMeasured, match="do not cover the window"):
        counter_between(times, counter, 9.0, 12.0)
    with pytest.raises(NotMeasured, match="went backwards"):
        counter_between(times, [0.0, 100.0, 5.0, 600.0], 10.5, 12.5)
    with pytest.raises(NotMeasured, match="no length"):
        counter_between(times, counter, 12.0, 12.0)


def test_the_sampler_reads_the_boards_counters_summed(standin):
    with energy.Nvml() as nvml:
        boards = nvml.resolve(["0", "2"], None)  # 100 W + 400 W
        sampler = energy.CounterSampler(nvml, boards, interval_s=0.01).start()
        time.sleep(0.05)
        t0 = time.time()
        time.sleep(0.2)
        t1 = time.time()
        sampler.stop()  # its last reading falls after t1
    joules, error = sampler.between(t0, t1)
    # The stand-in's counters rise at exactly 500 W: the estimate is exact but for the
    # counters' whole millijoules.
    assert joules == pytest.approx(500.0 * (t1 - t0), abs=0.01)
    gaps = [b - a for a, b in zip(sampler.times_s, sampler.times_s[1:])]
    assert 0 <= error <= 2 * 500.0 * max(gaps) + 0.01
    assert standin.READS.get(UUID[200.0]) is None  # the board the run was not given


def test_the_window_ends_with_its_last_step_as_the_worker_stamped_it():
    steps = [Step(index=i, seconds=0.1, samples=8, warmup=i < 2, t=100.0 + i) for i in range(5)]
    end = End(samples_per_s=80.0, window_s=2.5, window_samples=24, window_steps=3,
              loss_first=1.0, loss_last=0.9, t=104.3)
    assert window_edges([*steps, end]) == (104.0 - 2.5, 104.0)
    assert window_edges(steps) is None  # no end: no window


# -- the record ------------------------------------------------------------------------------

def test_a_part_of_the_nodes_gives_no_samples_per_joule():
    whole = RunEnergy({0: Part(600.0, 3.0, ["GPU-a"]), 1: Part(400.0, 2.0, ["GPU-b"])}, 2)
    got = whole.fields(2000)
    assert got["energy_j"] == 1000.0 and got["samples_per_j"] == 2.0
    assert got["energy_error_j"] == 5.0 and got["energy_scope"] == "all 2 nodes"
    assert got["energy_devices"] == ["GPU-a", "GPU-b"] and got["energy_note"] is None
    assert got["energy_method"] == METHOD
    part = RunEnergy({0: Part(600.0, 3.0, ["GPU-a"]),
                      1: Part(note="not measured: NVML is not installed")}, 3).fields(2000)
    assert part["energy_j"] == 600.0 and part["samples_per_j"] is None
    assert part["energy_scope"] == "node 0 of 3"
    assert part["energy_note"] == ("node 1: not measured: NVML is not installed; "
                                   "node 2: told nothing within 10 s")
    follower = RunEnergy({1: Part(400.0, 2.0, ["GPU-b"])}, 2, node_rank=1).fields(2000)
    assert follower["samples_per_j"] is None and follower["energy_scope"] == "node 1 of 2"
    assert follower["energy_note"] == "node 0: holds the run's energy over every node"
    cpu = RunEnergy({0: Part(note="not measured: a CPU run draws on no GPU board")})
    assert cpu.fields(2000)["energy_j"] is None
    assert cpu.fields(2000)["energy_note"] == "not measured: a CPU run draws on no GPU board"


STANDIN_WORKER = textwrap.dedent('''\
    """A stand-in worker: the protocol's events of a run, its steps slept, no framework."""
    import json, sys, time

    events = sys.argv[sys.argv.index("--events") + 1]
    iters, warmup, batch = 8, 2, 16

    def emit(kind, **fields):
        with open(events, "a") as f:
            f.write(json.dumps({"event": kind, "rank": 0, "t": time.time(), **fields}) + "\\n")

    emit("start", world_size=2, global_batch=batch, device="cuda:0",
         env={"device_names": ["stand-in"] * 2}, workload={})
    for i in range(iters):
        if i == warmup:
            window_start = time.perf_counter()
        time.sleep(0.03)
        emit("step", index=i, seconds=0.03, samples=batch, warmup=i < warmup)
    window_s = time.perf_counter() - window_start
    emit("end", samples_per_s=batch * (iters - warmup) / window_s, window_s=window_s,
         window_samples=batch * (iters - warmup), window_steps=iters - warmup,
         loss_first=2.0, loss_last=1.5)
''')


def standin_run(tmp_path: Path, measure_energy: bool = True, device: str = "cuda") -> dict:
    """One launch of the stand-in worker through the runner's launcher, as a GPU run of two
    ranks: its record."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "standin_worker.py"
    script.write_text(STANDIN_WORKER, encoding="utf-8")
    recipe = get_recipe("tiny-arcface")
    case = Case(Topology(2, device=device), 8)
    out = tmp_path / "out"
    plan = Plan(recipe.name, recipe.workload, Measure(runs=1, iters=8, warmup=2), [case], out)
    backend = dataclasses.replace(
        get_backend("torch"),
        launch=lambda req: Launch([sys.executable, str(script), *req.worker_args]))
    kept: list[dict] = []
    launcher = RunLauncher(backend, sys.executable, Nodes(plan), out, kept.append,
                           QuietProgress())
    run_dir = out / "runs" / "1n2g_b8_run1"
    run_dir.mkdir(parents=True)
    spec = RunSpec(recipe.workload, plan.measure, Tuning(), device)
    (run_dir / "spec.json").write_text(json.dumps(spec.to_dict()), encoding="utf-8")
    launched = launcher.launch(case, run_dir, spec, "stand-in", {"case": "1n2g", "batch": 8,
                                                                 "run": 1},
                               energy=measure_energy)
    return launched.record(1, run_dir)


def test_a_gpu_runs_record_holds_its_boards_joules_over_its_window(standin, tmp_path,
                                                                   monkeypatch):
    # A scheduler gave this node the 400 W board (by UUID) and CUDA's device 0 (100 W).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{UUID[400.0][:12]},0,1")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    run = standin_run(tmp_path)
    assert run["status"] == "ok", run["error"]
    assert run["energy_devices"] == [UUID[400.0], UUID[100.0]]
    assert run["energy_j"] == pytest.approx(500.0 * run["window_s"], rel=1e-3)
    assert run["samples_per_j"] == pytest.approx(run["window_samples"] / run["energy_j"])
    assert run["energy_scope"] == "1 node" and run["energy_note"] is None
    assert run["energy_error_j"] >= 0
    assert standin.READS.get(UUID[200.0]) is None  # visible, but no rank of the run took it
    # The case, its export figures and the report beside samples/s.
    case = results.case_record(results.CaseKey(1, 2, 8), "fp32", [run], None)
    assert case["median_samples_per_j"] == run["samples_per_j"]
    assert case["wh_per_million_samples"] == pytest.approx(1e6 / run["samples_per_j"] / 3600)
    assert case["energy_note"] is None
    doc = results.document("tiny-arcface", {}, {}, {}, [case])
    text = energy_section([doc], ["torch"])
    assert text.startswith("## Energy") and f"| {case['median_samples_per_j']:.3f} |" in text
    assert "| 1/1 | 2 (1 node) |" in text and "Not measured" not in text


def test_a_board_without_a_counter_and_a_launch_that_is_not_timed_read_nothing(
        tmp_path, monkeypatch):
    nvml_standin.install(monkeypatch, tmp_path / "nvml",
                         [dict(b, counter=False) for b in BOARDS])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    run = standin_run(tmp_path / "old")
    assert run["status"] == "ok" and run["energy_j"] is None and run["samples_per_j"] is None
    assert run["energy_note"].startswith("not measured: the driver keeps no energy counter")
    probe = standin_run(tmp_path / "probe", measure_energy=False)
    assert probe["status"] == "ok" and "energy_j" not in probe


def test_a_cpu_run_reads_no_board_and_the_report_says_so_in_one_line(standin, tmp_path,
                                                                      monkeypatch):
    """A real torch run on the CPU, with NVML (the stand-in) installed and boards visible."""
    from trainperf.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    out = tmp_path / "cpu"
    assert main(["run", "tiny-arcface", "--device", "cpu", "--runs", "1", "--iters", "4",
                 "--warmup", "2", "--out", str(out)]) == 0
    (case,) = json.loads((out / "results.json").read_text())["cases"]
    (run,) = case["runs"]
    assert run["status"] == "ok" and run["energy_j"] is None and run["energy_devices"] == []
    assert run["energy_note"] == "not measured: a CPU run draws on no GPU board"
    assert case["median_samples_per_j"] is None and case["energy_note"] == run["energy_note"]
    assert standin.READS == {}  # no counter was read
    report = (out / "report.md").read_text()
    assert "Energy: not measured (a CPU run draws on no GPU board)." in report
    assert "samples/J" not in report


# -- several nodes ---------------------------------------------------------------------------

def test_node_zero_sums_every_nodes_boards_over_its_window(standin):
    """Two nodes meet on a real store (in threads of this process); each reads its own
    boards: node 0 CUDA's device 0 (100 W), node 1 device 1 (200 W), as emulated nodes are
    given theirs. Node 0 alone knows the window, from its worker's events."""
    (port,) = reserved_ports(1)
    groups = [NodeGroup(f"127.0.0.1:{port}", 2, 30.0, run_id="energy", node_rank=n)
              for n in (0, 1)]
    join = [threading.Thread(target=g.join, args=({"plan": 1},)) for g in groups]
    for t in join:
        t.start()
    for t in join:
        t.join()
    meters = [RunMeter(Topology(1, nnodes=2, node_rank=n, device="cuda"), True) for n in (0, 1)]
    for n, meter in enumerate(meters):
        meter.start({"CUDA_VISIBLE_DEVICES": str(n)})
    time.sleep(0.05)
    t0 = time.time()
    time.sleep(0.3)
    t1 = time.time()
    seen = [Step(index=0, seconds=0.3, samples=32, warmup=False, t=t1),
            End(samples_per_s=1.0, window_s=t1 - t0, window_samples=32, window_steps=1,
                loss_first=1.0, loss_last=1.0, t=t1)]
    got: dict[int, RunEnergy] = {}

    def settle(n: int) -> None:
        got[n] = meters[n].settle(seen if n == 0 else [], True, groups[n], "1n1g_b8_run1")

    threads = [threading.Thread(target=settle, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    closing = [threading.Thread(target=g.close) for g in groups]
    for t in closing:
        t.start()
    for t in closing:
        t.join()
    lead, follower = got[0].fields(32), got[1].fields(32)
    assert lead["energy_j"] == pytest.approx(300.0 * (t1 - t0), abs=0.01)
    assert lead["energy_scope"] == "all 2 nodes" and lead["energy_note"] is None
    assert lead["energy_devices"] == [UUID[100.0], UUID[200.0]]
    assert lead["samples_per_j"] == pytest.approx(32 / lead["energy_j"])
    assert follower["energy_j"] == pytest.approx(200.0 * (t1 - t0), abs=0.01)
    assert follower["samples_per_j"] is None and follower["energy_scope"] == "node 1 of 2"


def test_nodes_exchange_nothing_where_none_reads_a_board(standin):
    """A CPU run, or one that did not end ok: every node knows it alike, so none waits for
    the others, and each says why in the words of one node."""
    group = SimpleNamespace(node_rank=1, nnodes=2)  # never called: a call would fail here
    meter = RunMeter(Topology(1, nnodes=2, node_rank=1, device="cpu"), True)
    meter.start({})
    fields = meter.settle([], True, group, "1n1g_b8_run1").fields(None)
    assert fields["energy_j"] is None and fields["energy_scope"] is None
    assert fields["energy_note"] == "not measured: a CPU run draws on no GPU board"
    failed = RunMeter(Topology(1, nnodes=2, node_rank=1, device="cuda"), True)
    failed.start({"CUDA_VISIBLE_DEVICES": "1"})
    assert failed.settle([], False, group, "m").fields(None)["energy_note"] == (
        "not measured: the run did not end ok")


def test_a_report_sets_measured_cases_apart_from_those_without_a_figure():
    def case(name: str, per_j: float | None, note: str | None) -> dict:
        run = {"run": 1, "status": "ok", "flags": [], "samples_per_s": 100.0,
               "window_s": 10.0, "window_samples": 1000, "energy_j": 1000.0 / per_j
               if per_j else None, "energy_error_j": 5.0 if per_j else None,
               "samples_per_j": per_j, "energy_scope": "1 node" if per_j else None,
               "energy_devices": ["GPU-a"] if per_j else [], "energy_note": note}
        c = {"case": name, "batch_size_per_device": 8, "median_samples_per_s": 100.0,
             "runs": [run], **energy.case_energy([run])}
        return c

    gpu = {"cases": [case("1n1g", 2.0, None)]}
    cpu = {"cases": [case("1n1g", None, "not measured: a CPU run draws on no GPU board")]}
    old = {"cases": [{"case": "1n1g", "batch_size_per_device": 8, "runs": []}]}
    text = energy_section([gpu, cpu, old], ["h100", "cpu", "old"])
    # 1000 samples at 2 samples/J: 500 J over 10 s, 50 W, within 5 J; 10^6 / 2 / 3600 = 138.89
    # Wh per million samples.
    assert "| h100 | 1n1g | 8 | 100.00 | 2.000 | 138.89 | 50 | 1.0% | 1/1 | 1 (1 node) |" in text
    assert "- cpu 1n1g b8: a CPU run draws on no GPU board" in text
    assert "- old 1n1g b8: recorded before trainperf read energy" in text
    assert energy_section([cpu], ["cpu"]) == (
        "Energy: not measured (a CPU run draws on no GPU board).")
