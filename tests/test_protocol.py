"""The runner-worker contract: specs and events round-trip, a broken one is named, and a worker
in another framework's environment can import the contract without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainperf import protocol
from trainperf.config import Measure, Topology, Tuning
from trainperf.protocol import End, Error, ProtocolError, RunSpec, Start, Step
from trainperf.recipes import get_recipe
from trainperf.attempts import Watched
from trainperf.runner import Case, Plan, Runner


def spec() -> RunSpec:
    return RunSpec(get_recipe("tiny-arcface").workload, Measure(runs=1, iters=5, warmup=1),
                   Tuning(ddp_bucket_mb=16.0), "cpu", 1)


def test_spec_round_trips_through_json():
    s = spec()
    again = RunSpec.from_dict(json.loads(json.dumps(s.to_dict())))
    # The workload travels with its margins resolved from the loss: the same work.
    assert again.to_dict() == s.to_dict() and again.tuning == s.tuning


def test_spec_of_another_version_or_incomplete_is_refused():
    d = spec().to_dict()
    with pytest.raises(ProtocolError, match="speaks 'trainperf.protocol/v0'"):
        RunSpec.from_dict({**d, "protocol": "trainperf.protocol/v0"})
    del d["measure"]
    with pytest.raises(ProtocolError, match="lacks 'measure'"):
        RunSpec.from_dict(d)
    with pytest.raises(ValueError, match="unknown workload fields"):
        RunSpec.from_dict({**spec().to_dict(), "workload": {"backbone": "x", "bogus": 1}})


def test_events_round_trip():
    events = [
        Start(world_size=2, global_batch=16, device="cpu", env={"framework": "x"},
              workload={"backbone": "b"}, train_flops_by_op={"conv": 1.0, "matmul": 2.0}),
        Step(index=3, seconds=0.25, samples=16, warmup=False),
        End(samples_per_s=64.0, window_s=1.0, window_samples=64, window_steps=4,
            loss_first=9.0, loss_last=7.5, final_loss_scale=32768.0),
        Error(kind="oom", message="out of memory", traceback=["a", "b"]),
    ]
    for e in events:
        e.rank, e.t = 1, 123.5
        assert protocol.decode(json.loads(protocol.encode(e))) == e


@pytest.mark.parametrize("raw,needle", [
    ({"event": "stp", "index": 1}, "unknown event 'stp'"),
    ({"event": "step", "index": 1, "seconds": 0.1, "samples": 8}, "lacks 'warmup'"),
    ({"event": "step", "index": "1", "seconds": 0.1, "samples": 8, "warmup": False},
     "'index' is not"),
    ({"event": "step", "index": 1, "seconds": 0.1, "samples": True, "warmup": False},
     "'samples' is not"),
    ({"event": "error", "kind": "crash", "message": "x"}, "error kind"),
    (["step"], "JSON object"),
])
def test_broken_events_are_named(raw, needle):
    with pytest.raises(ProtocolError, match=needle):
        protocol.decode(raw)


def test_unknown_fields_are_ignored_for_later_workers():
    e = protocol.decode({"event": "step", "index": 1, "seconds": 0.1, "samples": 8,
                         "warmup": True, "compile_s": 3.0, "case": "1n1g"})
    assert e == Step(index=1, seconds=0.1, samples=8, warmup=True)


def test_the_contract_imports_without_torch():
    code = ("import sys, trainperf.protocol, trainperf.config; "
            "bad = sorted(m for m in ('torch', 'numpy') if m in sys.modules); "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_runner_keeps_a_malformed_event_as_a_warning(tmp_path: Path):
    plan = Plan("tiny-arcface", get_recipe("tiny-arcface").workload, Measure(),
                [Case(Topology(), 8)], tmp_path)
    runner = Runner(plan)
    done = Watched()
    runner.launcher._take([{"event": "step", "index": 0, "seconds": 0.1, "samples": 8,
                            "warmup": True}, {"event": "end", "samples_per_s": 1.0}], done,
                          {"case": "1n1g", "batch": 8, "run": 1})
    assert done.seen == [Step(index=0, seconds=0.1, samples=8, warmup=True)]
    assert len(done.warnings) == 1 and "broke the protocol" in done.warnings[0]
    kept = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(kept) == 2  # what the worker wrote is kept as written


def test_error_of_the_exception_being_handled():
    try:
        raise MemoryError("no room")
    except MemoryError as exc:
        oom = Error.of_exception(exc, oom=True)
        other = Error.of_exception(exc, oom=False)
    assert (oom.kind, oom.exit_code, other.kind, other.exit_code) == ("oom", 3, "exception", 1)
    assert oom.message == "MemoryError: no room"
    assert any("raise MemoryError" in line for line in oom.traceback)
