"""TensorFlow's execution modes: ``function`` (``tf.function``, jit_compile off, its default) and
``xla`` (``jit_compile=True``, the whole step one XLA program).

- A run in each mode through the runner (tiny-arcface, dp, one rank, dropout off so that the
  two modes start from the same computation): the record names the mode, the losses are
  finite, the first loss of ``xla`` is ``function``'s within float32 rounding (the same
  weights and batch, the arithmetic only fused and reordered by XLA), and the step compiled
  once, inside step 0: its compile time (the trace and, under XLA, XLA's own figure) is part of
  that step's time, and every step's trace count is 1.
- ``compiling.CompileClock`` in this interpreter with a stand-in step: a trace is timed only
  where it happens, a trace the call made itself leaves the figure unknown, and XLA's lines are
  read back from this process's stderr file after the first call.
- The cases ``xla`` cannot run are refused up front, in one line: several CPU ranks (TensorFlow
  compiles no collective for CPU devices inside ``jit_compile``) and a sampling pfc (its sample
  grows on the device, a shape XLA cannot compile). ``--mode best`` probes ``xla`` only where
  it is not refused.
- Strict alignment with torch in float64 under ``xla`` (XLA on a CPU computes in float64),
  dp and mp on one rank.

Each TensorFlow run costs seconds of start-up and XLA's compilation: two runs in one module
fixture, one alignment."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import pytest

from align_checks import align, assert_strictly_aligned
from mode_runs import step_compiles
from run_util import left_behind
from trainperf.backends import get_backend
from trainperf.backends.tf.compiling import CompileClock
from trainperf.cli import main
from trainperf.config import Measure, Topology, Tuning
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner

pytestmark = pytest.mark.slow
MODES = ("function", "xla")
ITERS, WARMUP = 4, 1
FLOAT32_ROUNDING = 1e-5
"""Relative: the first loss (about 50, a sum over 1000 classes after a network of a few dozen
layers) in float32, whose unit roundoff is 6e-8, computed in another order by XLA; seen: 1.5e-7."""
TWO_CPU_RANKS = "runs --mode xla on one CPU rank only"
SAMPLING_PFC = "runs --fc pfc with sampling (--sample-ratio below 1) in --mode function only"


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory, tf_python):
    """mode -> (results document, output folder) of one run of tiny-arcface in that mode."""
    root = tmp_path_factory.mktemp("tf_modes")
    workload = get_recipe("tiny-arcface").workload.replace(dropout=0.0)
    docs = {}
    for mode in MODES:
        plan = Plan("tiny-arcface", workload, Measure(runs=1, iters=ITERS, warmup=WARMUP),
                    [Case(Topology(devices_per_node=1, device="cpu"), workload.batch_size)],
                    root / mode, Tuning(mode=mode), framework="tf")
        docs[mode] = Runner(plan).run(), root / mode
    return docs


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_runs_and_is_recorded(mode_runs, mode):
    doc, out = mode_runs[mode]
    [case] = doc["cases"]
    [run] = case["runs"]
    assert run["status"] == "ok", run["error"]
    assert run["mode"] == case["settings"]["mode"] == mode
    assert case["settings"]["graph"] == get_backend("tf").capabilities.mode_words[mode]
    assert len(run["losses"]) == ITERS and all(math.isfinite(v) for v in run["losses"])
    assert run["losses"][-1] < run["losses"][0]
    # Traced (and, under XLA, compiled) once, inside step 0 in the warm-up; not again.
    assert 0 < run["compile_s"] <= run["first_step_s"], run
    assert run["recompiles_in_window"] == 0
    assert run["compile_measure"].startswith("tf.function tracing: get_concrete_function")
    assert ("XLA's compilation" in run["compile_measure"]) == (mode == "xla")
    assert "unknown" not in run["compile_measure"]
    # The explicit trace made the graph the first call found: 1 from step 0 on.
    assert step_compiles(out) == {"1n1g": [1] * ITERS}
    assert all("compile_s" not in start["settings"] for start in events(out, "start"))
    assert left_behind(out) == []


def events(out: Path, kind: str) -> list[dict]:
    """The timed runs' events of ``kind`` in ``out``'s stream (no probe, no profiled run)."""
    found = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return [e for e in found if e["event"] == kind and not e.get("probe")
            and not e.get("profile")]




def test_resnet_v1b_compiles_under_xla(tmp_path, tf_python):
    """ResNet v1b's stem max pool, padded by 1 as torch's, compiles under XLA: XLA refuses a
    pool's own explicit padding, on every device, so the padding is a pad of its own."""
    workload = get_recipe("rn50-v1b-imagenet").workload.replace(
        backbone="resnet_v1b_tiny", input_size=32, batch_size=2)
    plan = Plan("rn50-v1b-imagenet", workload, Measure(runs=1, iters=3, warmup=1),
                [Case(Topology(devices_per_node=1, device="cpu"), 2)], tmp_path,
                Tuning(mode="xla"), framework="tf")
    [run] = Runner(plan).run()["cases"][0]["runs"]
    assert run["status"] == "ok" and run["mode"] == "xla", run["error"]
    assert all(math.isfinite(v) for v in run["losses"]) and run["compile_s"] > 0


def test_xla_starts_from_the_same_loss_as_function(mode_runs):
    first = {mode: mode_runs[mode][0]["cases"][0]["runs"][0]["loss_first"] for mode in MODES}
    assert first["xla"] == pytest.approx(first["function"], rel=FLOAT32_ROUNDING)


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "1,2"], TWO_CPU_RANKS),
    (["--fc", "pfc", "--sample-ratio", "0.5"], SAMPLING_PFC),
])
def test_what_xla_cannot_compile_is_refused_up_front(tmp_path, capsys, argv, needle):
    out = tmp_path / "r"
    code = main(["run", "tiny-arcface", "--framework", "tf", "--mode", "xla", "--device", "cpu",
                 *argv, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("trainperf: error:") and "\n" not in err
    assert needle in err, err
    assert not out.exists(), "refused before anything starts"


def test_only_xla_is_refused_and_only_where_it_cannot_compile():
    """The same cases in ``function`` (and ``default``, ``best``, which probes only the modes
    not refused) run; ``xla`` runs a pfc without sampling (it is mp) and, on GPUs, several
    ranks, every head (NCCL all-reduces compile inside ``jit_compile``, and a sharded head's
    gathers are all-reduces there: ``test_tf_models_heads.py``)."""
    tf = get_backend("tf")
    face = get_recipe("tiny-arcface").workload
    sampling = face.replace(fc="pfc", sample_ratio=0.5)

    def why(workload, ranks, mode, device="cpu"):
        return tf.refusal(workload, Topology(devices_per_node=ranks, device=device),
                          Tuning(mode=mode), device)

    for mode in ("function", "default", "best"):
        assert why(face, 2, mode) is None and why(sampling, 2, mode) is None
    assert TWO_CPU_RANKS in why(face, 2, "xla")
    assert SAMPLING_PFC in why(sampling, 1, "xla")
    assert why(face, 1, "xla") is None
    assert why(face.replace(fc="pfc"), 1, "xla") is None
    for fc in ("dp", "mp", "pfc"):
        assert why(face.replace(fc=fc), 2, "xla", "cuda") is None
    assert SAMPLING_PFC in why(sampling, 2, "xla", "cuda")


def test_xla_aligned_in_float64(tmp_path, tf_python):
    """torch's weights and batches, three SGD steps in float64 compiled by XLA, dp and mp on one
    rank: every tensor's update within 1e-8 of torch's."""
    code, outcome = align("tf", tmp_path / "align", "1", "dp,mp", "--mode", "xla")
    assert code == 0, [c["problems"] for c in outcome["checks"]]
    assert outcome["aligned"] and outcome["dtype"] == "float64" and outcome["mode"] == "xla"
    assert [(c["fc"], c["ranks"]) for c in outcome["checks"]] == [("dp", 1), ("mp", 1)]
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
    assert left_behind(tmp_path) == []


class StandInStep:
    """What ``CompileClock`` reads of ``step.TrainStep``: its trace count, ``trace`` (a new
    signature traces) and the call, which under XLA writes TensorFlow's compile line into this
    process's stderr where a new graph runs for the first time, and which may trace by itself
    (``retrace_in_call``)."""

    def __init__(self, xla_line: bytes = b"") -> None:
        self.traces = 0
        self.seen: set = set()
        self.ran: set = set()
        self.xla_line = xla_line
        self.retrace_in_call = False

    def trace(self, images, labels) -> None:
        if images.shape not in self.seen:
            self.seen.add(images.shape)
            self.traces += 1

    def __call__(self, images, labels):
        if self.retrace_in_call:
            self.traces += 1
        if self.xla_line and images.shape not in self.ran:
            self.ran.add(images.shape)
            os.write(2, self.xla_line)
        return "loss"


def batch(size: int) -> tuple:
    return (SimpleNamespace(shape=(size, 112, 112, 3), dtype="float32"),
            SimpleNamespace(shape=(size,), dtype="int32"))


XLA_LINE = (b"I0000 00:00:1796171848.985688   14064 device_compilation_profiler.cc:113] Compiled "
            b"__inference__step_2015 1 times, compile time: 1500000 us, cumulative: 1500000 us "
            b"(1 s / 1.5 s)\n")
"""TensorFlow 2.21's line, as an xla run's log holds it (seen in rank-0.log)."""


def test_the_clock_times_traces_where_they_happen():
    step = StandInStep()
    clock = CompileClock(step, xla=False)
    assert clock.seconds() == 0.0 and step.traces == 0
    for size in (8, 8, 4, 8):
        assert clock(*batch(size)) == "loss"
    # Two signatures, two traces, each timed; the return to batch 8 traced nothing.
    assert step.traces == 2 and clock.seconds() > 0
    assert "not the graph optimizations" in clock.measure()
    step.retrace_in_call = True
    clock(*batch(8))
    assert clock.seconds() is None and "1 trace(s) a call made by itself" in clock.measure()


@contextlib.contextmanager
def stderr_into(path: Path) -> Iterator[None]:
    """This process's fd 2 pointed at ``path`` (as the launcher points a worker's) inside the
    test's own body: pytest points it back at its capture between a fixture and the test."""
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def test_the_clock_reads_xla_compilations_from_its_own_log(tmp_path):
    log = tmp_path / "rank-0.log"
    log.write_bytes(XLA_LINE)  # written before the run: not the run's
    step = StandInStep(XLA_LINE)
    clock = CompileClock(step, xla=True)
    with stderr_into(log):
        clock(*batch(8))
        clock(*batch(8))
        first, first_trace_s = clock.seconds(), clock.trace_s
        # A new shape: traced, compiled again, and added.
        clock(*batch(4))
        second = clock.seconds()
    assert log.read_bytes().count(b"compile time") == 3
    assert first == pytest.approx(first_trace_s + 1.5) and first_trace_s > 0
    assert second == pytest.approx(clock.trace_s + 3.0) and clock.trace_s > first_trace_s
    assert "unknown" not in clock.measure() and "XLA's compilation" in clock.measure()


def test_xla_compile_time_is_unknown_where_tensorflow_logged_none(tmp_path):
    clock = CompileClock(StandInStep(), xla=True)
    with stderr_into(tmp_path / "rank-0.log"):
        clock(*batch(8))
        assert clock.seconds() is None
    assert "TensorFlow logged no compilation" in clock.measure()
