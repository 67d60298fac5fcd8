"""Capacity searches on CPU under a per-process memory limit, 2 ranks, mp and pfc; a search per
framework and device count; a probe that fails for another reason than memory ending its search
on a failure, never read as a capacity."""

from __future__ import annotations

import json

import pytest

from test_cli_run import processes_naming
from trainperf.cli import main
from trainperf.config import Measure, Topology, Workload
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan
from trainperf.search import Probe, next_guess, search_plans, step_for

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
    # What limited it: memory, at the smallest value that ran out of it.
    assert doc["limited_by"] == {"reason": "out_of_memory", "value": fail}
    return by_value


@pytest.mark.parametrize("fc", ["mp"])  # pfc's capacity is searched by test_max_classes
def test_max_batch(tmp_path, fc):
    rc, doc, out = search(tmp_path, "max-batch", fc, "700MiB", 32)
    assert rc == 0
    check_bracket(doc)
    assert doc["settings"]["fc"] == fc and doc["settings"]["world_size"] == 2
    text = (out / "report.md").read_text()
    assert "| node_num | devices | batch/device |" in text
    assert f"Limited by memory: out of memory at batch {doc['smallest_fail']}." in text
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


@pytest.mark.parametrize("argv,said", [
    (["max-batch", "--batch-size", "8,16"], "search max-batch finds the batch: give one "
     "--batch-size (its first probe) or --start, not a list"),
    (["max-classes", "--num-classes", "1000,2000"], "search max-classes finds the class "
     "count: give one --num-classes (its first probe) or --start, not a list"),
    (["max-batch", "--runs", "2"], "a search probes each value once (--runs 1)"),
])
def test_search_usage_errors(argv, said, tmp_path, capsys):
    kind, *rest = argv
    assert main(["search", kind, "tiny-arcface", "--device", "cpu", *rest,
                 "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip() == f"trainperf: error: {said}"
    assert not (tmp_path / "s").exists()


def test_the_help_promises_no_list_the_search_refuses():
    from trainperf.cli import build_parser

    search = next(a for a in build_parser()._actions if hasattr(a, "choices")
                  and isinstance(a.choices, dict))
    helps = {a.dest: a.help for a in search.choices["search"]._actions}
    assert "max-batch: one value" in helps["batch_size"]
    assert "max-classes: one value" in helps["num_classes"]
    assert "one search per count" in helps["devices"]
    assert "one search per framework" in helps["framework"]


def plans_of(frameworks: list[str], devices: list[int], batches: list[int], root):
    """``run``'s plans as ``throughput_plans`` names them: one per framework (``root/<fw>``
    where there are several), every (batch, devices) case in each."""
    workload = get_recipe("tiny-arcface").workload
    cases = [Case(Topology(d, device="cpu"), b) for b in batches for d in devices]
    return [Plan("tiny-arcface", workload, Measure(runs=1, iters=6, warmup=2), cases,
                 root / fw if len(frameworks) > 1 else root, framework=fw)
            for fw in frameworks]


def test_one_search_per_framework_and_device_count_each_in_its_folder(tmp_path):
    one = search_plans("max-batch", plans_of(["torch"], [2], [8], tmp_path), tmp_path)
    assert [p.out_dir for p in one] == [tmp_path]  # a single search writes where it is told
    several = search_plans("max-batch", plans_of(["torch", "mxnet"], [1, 2], [8], tmp_path),
                           tmp_path)
    assert [(p.out_dir.name, p.framework, [c.topology.devices_per_node for c in p.cases])
            for p in several] == [("torch-1n1g", "torch", [1]), ("torch-1n2g", "torch", [2]),
                                  ("mxnet-1n1g", "mxnet", [1]), ("mxnet-1n2g", "mxnet", [2])]
    # max-classes takes a batch list: one search per batch, its workload at that batch.
    by_batch = search_plans("max-classes", plans_of(["torch"], [1], [8, 16], tmp_path),
                            tmp_path)
    assert [(p.out_dir.name, p.workload.batch_size) for p in by_batch] == [("b8", 8),
                                                                          ("b16", 16)]
    assert isinstance(by_batch[0].workload, Workload)


def test_a_probe_that_fails_ends_the_search_on_a_failure(tmp_path, capsys):
    """Batch 1 trains nothing: the E block's BatchNorm1d refuses one value per channel. That
    probe failed; it did not run out of memory, so the search ends there and says so, rather
    than reading it as the capacity ('not even one fits')."""
    out = tmp_path / "s"
    rc = main(["search", "max-batch", "tiny-arcface", "--device", "cpu", "--start", "1",
               "--iters", "3", "--warmup", "1", "--out", str(out)])
    assert rc == 1
    doc = json.loads((out / "search.json").read_text())
    assert doc["answer"] is None and [p["status"] for p in doc["probes"]] == ["failed"]
    error = "ValueError: Expected more than 1 value per channel when training, got input " \
            "size torch.Size([1, 64])"
    assert doc["limited_by"] == {"reason": "failure", "value": 1, "status": "failed",
                                 "error": error}
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("search max-batch ended on a failure, not a capacity: probe "
                       f"batch_size=1 failed: {error}")
    assert ("**Ended on a failure, not a capacity**: the probe at batch 1 failed: "
            "ValueError: Expected more than 1 value") in (out / "report.md").read_text()
    assert processes_naming(tmp_path) == []


def test_a_hung_probe_ends_the_search_too(tmp_path, monkeypatch, capsys):
    """A probe that hangs (``TRAINPERF_FAULT``) is stopped by the stall limit: a timeout, not
    a capacity."""
    monkeypatch.setenv("TRAINPERF_FAULT", "hang@2")
    out = tmp_path / "s"
    rc = main(["search", "max-classes", "tiny-arcface", "--device", "cpu", "--iters", "4",
               "--warmup", "1", "--stall-timeout", "3", "--out", str(out)])
    assert rc == 1
    doc = json.loads((out / "search.json").read_text())
    [probe] = doc["probes"]
    assert probe["value"] == 1000 and probe["status"] == "timeout"
    assert doc["limited_by"]["reason"] == "failure" and doc["answer"] is None
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "search max-classes ended on a failure, not a capacity: probe num_classes=1000 "
        "timeout: run went 3 s without a step and was stopped as hung at step 2")
    assert processes_naming(tmp_path) == []


def test_device_counts_each_searched_and_reported_together(tmp_path, monkeypatch, capsys):
    """``--devices 1,2``: a search per count, each in its folder, one report over both. The
    2-rank probes fail for good (an exception at step 1 in runs of world size 2): that search
    ends on a failure, the 1-device one still finds its answer, and the exit status says that
    not every search did."""
    monkeypatch.setenv("TRAINPERF_FAULT", "raise@1:2")
    out = tmp_path / "s"
    rc = main(["search", "max-batch", "tiny-arcface", "--devices", "1,2", "--fc", "mp",
               "--memory-limit", "700MiB", "--start", "32", *FAST[2:], "--out", str(out)])
    assert rc == 1
    one = json.loads((out / "1n1g" / "search.json").read_text())
    two = json.loads((out / "1n2g" / "search.json").read_text())
    check_bracket(one)
    assert one["settings"]["world_size"] == 1 and two["settings"]["world_size"] == 2
    assert two["answer"] is None and two["limited_by"]["reason"] == "failure"
    assert two["limited_by"]["error"] == "RuntimeError: injected failure (TRAINPERF_FAULT)"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "search max-batch 1n2g: ended on a failure, not a capacity: probe batch_size=32 "
        "failed: RuntimeError: injected failure (TRAINPERF_FAULT)")
    report = (out / "report.md").read_text()
    assert f"### max-batch of `tiny-arcface` (torch, 1 device): {one['answer']}" in report
    assert "### max-batch of `tiny-arcface` (torch, 2 devices): none" in report
    assert processes_naming(tmp_path) == []


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
