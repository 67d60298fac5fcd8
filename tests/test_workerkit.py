"""The worker skeleton (``backends/workerkit.py``) that every framework's worker runs on, checked
with a framework made of plain Python: the events it writes, in order, with the window's
arithmetic; failures as error events and exit codes; the declaration checked before anything
is built; ``start`` after the first step for frameworks that learn something there; the
compile time a framework times itself, the first step's excess apart from it, and start-up from
the launch to the end of step 0."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pytest

from trainperf.backends.base import Backend, Capabilities, Launch
from trainperf import results
from trainperf.backends.workerkit import (FrameworkRun, device_used_bytes, environment,
                                         memory_fields, process_start_time, tf32_setting,
                                         tf32_wanted, worker_entry)
from trainperf.config import TUNING_SETTINGS, Measure, Tuning
from trainperf.protocol import LAUNCHED_AT_ENV, RunSpec, decode
from trainperf.recipes import get_recipe

STEP_S = 0.002
DECLARED = Backend(name="plain", framework="plain", launch=lambda req: Launch([]),
                   capabilities=Capabilities(heads=("dp",), precisions={"cpu": ("fp32",)},
                                             families=("iresnet",), modes={"cpu": ("eager",)}))


class PlainRun(FrameworkRun):
    """Steps that sleep; the 'device' is the host, so every wait and sync is a no-op."""

    backend = DECLARED
    built = False

    def connect(self) -> None:
        self.device, self.device_kind = "cpu", "cpu"

    def memory_now(self) -> int:
        return 1000

    def build(self) -> None:
        PlainRun.built = True
        self.train_step = SimpleNamespace(markers=(), skipped_steps=[], loss_scale=None)

    def start_fields(self, baseline: int) -> dict:
        return {"env": {"framework": "plain"}, "settings": {"baseline_seen": baseline},
                "backbone_params": 7, "pfc_update": None}

    def step(self, index: int) -> float:
        time.sleep(STEP_S)
        return 10.0 - index

    def read_losses(self, outputs: list) -> list[float]:
        return [float(v) for v in outputs]

    def memory_over_ranks(self) -> dict:
        return {"peak_memory_bytes": 2000, "peak_memory_bytes_per_rank": [2000]}


class FirstStepRun(PlainRun):
    """A framework that learns something for its ``start`` in step 0 (torch counts the graphs
    CUDA graph trees skipped there)."""

    start_after_first_step = True

    def start_fields(self, baseline: int) -> dict:
        fields = super().start_fields(baseline)
        fields["settings"]["learned_in_step_0"] = getattr(self, "learned", None)
        return fields

    def step(self, index: int) -> float:
        if index == 0:
            self.learned = 3
        return super().step(index)


COMPILE_S = 0.3
STEP_1_S = 1.0


class LazyCompileRun(PlainRun):
    """A mode that compiles inside its first step, for a known time it times itself, and
    counts its compilations; its step 0 becomes ready a little after it returns and its step 1
    is long, so that a loop that reads step 0's time only after step 1 would show it."""

    def build(self) -> None:
        super().build()
        self.compiled, self.compiling_s = 0, 0.0

    def step(self, index: int) -> float:
        if index == 0:
            t0 = time.perf_counter()
            time.sleep(COMPILE_S)
            self.compiling_s += time.perf_counter() - t0
            self.compiled += 1
        if index == 1:
            time.sleep(STEP_1_S)
        return super().step(index)

    def markers(self) -> list:
        return [len(self.markers_seen)] if hasattr(self, "markers_seen") else [0]

    def wait(self, markers) -> None:
        if markers == [0]:
            time.sleep(0.05)  # step 0's work still runs when the loop goes on to step 1

    def compile_count(self) -> int:
        return self.compiled

    def compile_seconds(self) -> float:
        return self.compiling_s

    def compile_measure(self) -> str:
        return "a sleep standing in for a compiler, timed around it"


@pytest.fixture(autouse=True)
def keep_switch_interval():
    """The entry shortens the interpreter's switch interval, as a worker process wants."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def run_worker(tmp_path, run_class, iters=6, warmup=2, **changes):
    workload = get_recipe("tiny-arcface").workload.replace(**changes)
    spec = RunSpec(workload, Measure(runs=1, iters=iters, warmup=warmup), device="cpu")
    spec_path, events_path = tmp_path / "spec.json", tmp_path / "events.jsonl"
    spec_path.write_text(json.dumps(spec.to_dict()))
    PlainRun.built = False
    code = worker_entry(["--spec", str(spec_path), "--events", str(events_path)], "plain",
                        run_class)
    lines = events_path.read_text().splitlines() if events_path.exists() else []
    return code, [decode(json.loads(line)) for line in lines]


def test_a_run_writes_start_every_step_in_order_and_end(tmp_path):
    code, events = run_worker(tmp_path, PlainRun)
    assert code == 0
    kinds = [e.KIND for e in events]
    assert kinds == ["start"] + ["step"] * 6 + ["end"]
    start, steps, end = events[0], events[1:-1], events[-1]
    assert start.baseline_memory_bytes == 1000 and start.settings["baseline_seen"] == 1000
    assert start.settings["max_steps_in_flight"] == 2 and start.global_batch == 8
    assert [s.index for s in steps] == list(range(6))
    assert [s.warmup for s in steps] == [True, True] + [False] * 4
    assert all(s.seconds >= 0 for s in steps)
    # The window's rate is its samples over its wall time, which holds the counted steps (their
    # stamps lie inside it, whatever the machine's load).
    assert end.window_steps == 4 and end.window_samples == 32
    assert end.samples_per_s == pytest.approx(32 / end.window_s)
    assert end.window_s >= sum(s.seconds for s in steps[2:]) * 0.999
    assert end.losses == [10.0, 9.0, 8.0, 7.0, 6.0, 5.0] and end.loss_last == 5.0
    assert end.peak_memory_bytes == 2000 and end.baseline_memory_bytes == 1000


def test_what_the_backend_does_not_declare_fails_before_anything_is_built(tmp_path):
    code, events = run_worker(tmp_path, PlainRun, fc="mp")
    assert code == 1 and not PlainRun.built
    assert [e.KIND for e in events] == ["error"]
    assert events[0].message == "ValueError: the plain backend runs --fc dp; not mp"
    (tmp_path / "p").mkdir()
    code, events = run_worker(tmp_path / "p", PlainRun, precision="bf16")
    assert code == 1 and "runs --precision fp32 on a CPU" in events[0].message


@pytest.mark.parametrize("fault,code,kind", [("oom@3", 3, "oom"), ("raise@3", 1, "exception")])
def test_a_failing_step_is_an_error_event_and_its_exit_code(tmp_path, monkeypatch, fault, code,
                                                           kind):
    monkeypatch.setenv("TRAINPERF_FAULT", fault)
    got, events = run_worker(tmp_path, PlainRun)
    assert got == code
    assert events[0].KIND == "start" and events[-1].KIND == "error"
    assert events[-1].kind == kind
    assert "end" not in [e.KIND for e in events]


def test_a_fault_after_the_last_step_strikes_after_end(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@6")
    code, events = run_worker(tmp_path, PlainRun, iters=6)
    assert code == 1 and [e.KIND for e in events][-2:] == ["end", "error"]


def test_start_after_the_first_step_carries_what_it_learned(tmp_path, monkeypatch):
    code, events = run_worker(tmp_path, FirstStepRun)
    assert code == 0 and events[0].KIND == "start" and events[1].KIND == "step"
    assert events[0].settings["learned_in_step_0"] == 3
    # A run that fails before its first step is timed still says what ran.
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@0")
    (tmp_path / "again").mkdir()
    code, events = run_worker(tmp_path / "again", FirstStepRun)
    assert code == 1 and [e.KIND for e in events] == ["start", "error"]
    assert events[0].settings["learned_in_step_0"] is None


def test_compile_time_is_the_frameworks_own_and_the_first_steps_excess_is_apart(tmp_path):
    code, events = run_worker(tmp_path, LazyCompileRun)
    assert code == 0
    steps, end = [e for e in events if e.KIND == "step"], events[-1]
    # What the framework timed around its compilation, which happened inside step 0.
    assert COMPILE_S <= end.compile_s <= steps[0].seconds
    assert end.compile_measure == "a sleep standing in for a compiler, timed around it"
    assert [s.compiles for s in steps] == [1] * 6
    run = results.run_record(1, events, "ok")
    assert run["compile_s"] == end.compile_s and run["compile_measure"] == end.compile_measure
    window = sorted(s.seconds for s in steps if not s.warmup)
    assert run["first_step_excess_s"] == pytest.approx(steps[0].seconds - window[2])
    assert run["first_step_s"] == steps[0].seconds


def test_start_up_counts_from_the_launch_to_the_end_of_step_zero(tmp_path, monkeypatch):
    launched = time.time() - 5.0
    monkeypatch.setenv(LAUNCHED_AT_ENV, repr(launched))
    code, events = run_worker(tmp_path, LazyCompileRun)
    assert code == 0
    start, steps, end = events[0], [e for e in events if e.KIND == "step"], events[-1]
    step_0_ended = launched + end.startup_s
    # The loop began after ``start`` was written; step 0 ended its own time later, and step 1
    # (a second long) ended after that. Read when its time was drained, which here is after
    # step 1, step 0 would seem to end with step 1.
    assert step_0_ended >= start.t + steps[0].seconds - 1e-3
    assert steps[1].t - step_0_ended >= STEP_1_S * 0.99
    assert end.startup_s > 5.0


def test_without_a_launch_stamp_start_up_counts_from_the_process_start(tmp_path, monkeypatch):
    import psutil

    monkeypatch.delenv(LAUNCHED_AT_ENV, raising=False)
    started = process_start_time()
    # /proc's boot time is whole seconds: psutil's figure may be up to a second off.
    assert abs(started - psutil.Process().create_time()) < 1.5 and started < time.time()
    code, events = run_worker(tmp_path, PlainRun)
    assert code == 0 and events[-1].startup_s >= time.time() - started - 60


def test_an_unreadable_spec_is_an_error_event(tmp_path):
    spec_path, events_path = tmp_path / "spec.json", tmp_path / "events.jsonl"
    spec_path.write_text("{not json")
    code = worker_entry(["--spec", str(spec_path), "--events", str(events_path)], "plain",
                        PlainRun)
    (event,) = [decode(json.loads(line)) for line in events_path.read_text().splitlines()]
    assert code == 1 and event.KIND == "error" and "JSONDecodeError" in event.message


TUNED = Backend(name="plain", framework="plain", launch=lambda req: Launch([]),
                capabilities=Capabilities(heads=("dp",), precisions={"cpu": ("fp32",)},
                                          families=("iresnet",), modes={"cpu": ("eager",)},
                                          tuning={"ddp_bucket_mb": "its own bucket size"}))


class TunedRun(PlainRun):
    backend = TUNED
    applies: dict = {"ddp_bucket_mb": 8.0}

    def applied_tuning(self) -> dict:
        return dict(self.applies)


def test_the_start_records_each_setting_as_applied_and_none_for_the_rest(tmp_path):
    code, events = run_worker(tmp_path, TunedRun)
    assert code == 0
    tuning = events[0].settings["tuning"]
    assert tuning == {**dict.fromkeys(TUNING_SETTINGS), "ddp_bucket_mb": 8.0}


def test_a_worker_that_applies_an_undeclared_setting_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(TunedRun, "applies", {"cudnn_benchmark": True})
    code, events = run_worker(tmp_path, TunedRun)
    assert code != 0 and "does not declare" in events[-1].message


def test_memory_rows_carry_device_used_memory_apart_from_the_peak():
    rows = [(100, 150, 900), (120, 160, 950)]
    assert memory_fields(rows, with_reserved=True, with_device_used=True) == {
        "peak_memory_bytes": 120, "peak_memory_bytes_per_rank": [100, 120],
        "peak_reserved_bytes": 160, "device_used_bytes": 950}
    # A rank that could not read the driver: no figure rather than the others' largest.
    assert memory_fields([(1, 900), (2, -1)], False, True)["device_used_bytes"] is None


def test_the_environment_names_its_memory_kind_and_tf32_only_on_a_gpu(monkeypatch):
    monkeypatch.setattr("trainperf.backends.workerkit.gpu_names", lambda: ["NVIDIA H200"])
    gpu = environment("plain", "1", True, "its allocator's peak", memory_kind="allocator_peak",
                      tf32_cudnn=True, tf32_matmul=False, tf32_switch="plain.tf32")
    assert (gpu["memory_kind"], gpu["tf32_cudnn"], gpu["tf32_matmul"],
            gpu["tf32_switch"]) == ("allocator_peak", True, False, "plain.tf32")
    cpu = environment("plain", "1", False, "its allocator's peak", memory_kind="allocator_peak",
                      tf32_cudnn=True, tf32_matmul=True, tf32_switch="plain.tf32")
    assert (cpu["memory_kind"], cpu["tf32_cudnn"], cpu["tf32_switch"]) == (
        "resident_set_peak", None, None)
    with pytest.raises(ValueError, match="memory_kind"):
        environment("plain", "1", True, "?", memory_kind="nvidia-smi")
    assert tf32_wanted(Tuning(), True) is True and tf32_wanted(Tuning(tf32="off"), True) is False
    assert tf32_wanted(Tuning(), False) is None


def test_device_used_memory_without_a_cuda_driver_is_none():
    """This machine has no libcuda: the driver's figure is absent, not 0."""
    import ctypes.util
    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is installed here; the figure would be real")
    assert device_used_bytes(0) is None


def test_the_tf32_a_run_applied_is_what_both_engines_ran_in():
    assert tf32_setting(True, True) == "on" and tf32_setting(False, False) == "off"
    assert tf32_setting(False, True) == "mixed" and tf32_setting(True, None) == "mixed"
    assert tf32_setting(None, None) is None
