"""Capacity searches on CPU under a per-process memory limit, 2 ranks, mp and pfc."""

from __future__ import annotations

import json

import pytest

from test_cli_run import processes_naming
from trainperf.cli import main
from trainperf.search import Probe, next_guess, step_for

pytestmark = pytest.mark.slow
RESOLUTION = 0.25  # coarse: each probe is a 2-rank run, and the bracket logic is the same
FAST = ["--devices", "2", "--device", "cpu", "--iters", "4", "--warmup", "1",
        "--resolution", str(RESOLUTION)]


def search(tmp_path, kind, fc, limit, start):
    out = tmp_path / "s"
    rc = main(["search", kind, "tiny-arcface", "--fc", fc, "--memory-limit", limit,
               "--start", str(start), *FAST, "--out", str(out)])
    doc = json.loads((out / "search.json").read_text())
    return rc, doc, out


def check_bracket(doc):
    by_value = {p["value"]: p for p in doc["probes"]}
    answer, fail = doc["answer"], doc["smallest_fail"]
    assert answer is not None and fail is not None
    assert by_value[answer]["status"] == "ok"
    assert by_value[fail]["status"] == "oom"
    assert 0 < fail - answer <= doc["resolution_step"] == step_for(answer, RESOLUTION)
    # Every probe agrees with the bracket: nothing at or below the answer failed.
    for p in doc["probes"]:
        assert (p["status"] == "ok") == (p["value"] <= answer)
    assert doc["peak_memory_bytes_at_answer"] == by_value[answer]["peak_memory_bytes"] > 0
    return by_value


@pytest.mark.parametrize("fc", ["mp"])  # pfc's capacity is searched by test_max_classes
def test_max_batch(tmp_path, fc):
    rc, doc, out = search(tmp_path, "max-batch", fc, "700MiB", 32)
    assert rc == 0
    check_bracket(doc)
    assert doc["settings"]["fc"] == fc and doc["settings"]["world_size"] == 2
    text = (out / "report.md").read_text()
    assert "| node_num | devices | batch/device |" in text
    assert processes_naming(tmp_path) == []


# One head per search kind keeps the suite short; the memory model's mp and pfc terms are
# compared with measurements in benchmarks/memory_model.py.
@pytest.mark.parametrize("fc,start", [("pfc", 400_000)])
def test_max_classes(tmp_path, fc, start):
    rc, doc, out = search(tmp_path, "max-classes", fc, "800MiB", start)
    assert rc == 0
    by_value = check_bracket(doc)
    assert processes_naming(tmp_path) == []
    # The memory model, a few points with a generous margin (benchmarks/ records the table).
    for p in by_value.values():
        if p["status"] == "ok":
            assert abs(p["predicted_peak_bytes"] - p["peak_memory_bytes"]) < 0.3 * p[
                "peak_memory_bytes"]
    # The report reads the search folder too.
    assert main(["report", str(out), "--out", str(tmp_path / "rep")]) == 0
    assert f"{doc['answer']:,}" in (tmp_path / "rep" / "report.md").read_text()


def test_growth_aims_under_the_limit_from_two_measured_points():
    fits = [Probe(100, "ok", 300, None, None, ""), Probe(200, "ok", 500, None, None, "")]
    # 2 bytes per unit measured; 1000 bytes of limit: the limit lies at 450 units.
    assert next_guess(fits, 1000, 10**6) == int(200 + 0.97 * 500 / 2)
    assert next_guess(fits, None, 10**6) == 400  # no limit known: double
    # One point: scaled by limit / peak (300 bytes at 100 units: 323 units).
    assert next_guess(fits[:1], 1000, 10**6) == int(100 * 0.97 * 1000 / 300)
    assert next_guess(fits[:1], 310, 10**6) == 125  # at least 1.25x
    assert next_guess(fits[:1], None, 10**6) == 200
    assert next_guess(fits, 10**9, 10**6) == 800  # never more than 4x in one move


def test_search_usage_errors(capsys):
    assert main(["search", "max-batch", "tiny-arcface", "--devices", "1,2"]) == 2
    assert "one --devices value" in capsys.readouterr().err


def test_allocation_failures_read_as_out_of_memory():
    from trainperf.backends.torch.runtime import is_oom

    assert is_oom(RuntimeError("std::bad_alloc"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried ..."))
    assert is_oom(RuntimeError("could not create a primitive"), memory_capped=True)
    assert not is_oom(RuntimeError("could not create a primitive"))
    assert not is_oom(RuntimeError("shape mismatch"))
    # gloo's work re-raises a MemoryError from a future's callback as a RuntimeError (seen in
    # CI's capacity search, where the cap refused the all-gather's buffer)
    assert is_oom(RuntimeError("Got the following error when running the callback: "
                               "MemoryError: <EMPTY MESSAGE>"))
    try:
        try:
            raise MemoryError()
        except MemoryError as e:
            raise RuntimeError("collective failed") from e
    except RuntimeError as wrapped:
        assert is_oom(wrapped)
