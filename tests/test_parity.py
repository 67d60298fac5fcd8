"""Native parity (``trainperf.parity``, ``benchmarks/native_parity.py``): the pairs, the record,
the registry and what a comparison report says of it. Speed itself is the benchmark's business:
nothing here asserts a ratio's size."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainperf import parities, parity
from trainperf.report.markdown import parity_lines, render_report

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "benchmarks" / "native_parity.py"


# -- the campaign's bookkeeping, with both sides stood in --------------------------------------

@pytest.fixture
def stand_in_sides(monkeypatch):
    """Both sides replaced by counters: trainperf at 9 samples/s, native at 10, except where a
    row's framework is listed in ``broken`` (its native side fails)."""
    calls: list[tuple[str, str]] = []
    broken: set[str] = set()

    def trainperf_side(row, s, out=None):
        calls.append(("trainperf", row.framework))
        return {"samples_per_s": 9.0, "settings": {"compile": "eager"}, "threads": s.threads,
                "versions": {"framework_version": "9.9", "device_type": "cpu",
                             "device_names": [], "cpu_model": "Test CPU"}}

    def native_side(row, s):
        calls.append(("native", row.framework))
        if row.framework in broken:
            raise parity.SideFailed(f"native {row.framework} exited 1: boom")
        return {"samples_per_s": 10.0, "settings": {"zoo": "zoo model"}, "command": "python x"}

    monkeypatch.setattr(parity, "run_trainperf", trainperf_side)
    monkeypatch.setattr(parity, "run_native", native_side)
    return calls, broken


def test_pairs_interleave_and_every_pair_is_written(tmp_path, stand_in_sides):
    calls, broken = stand_in_sides
    broken.add("mxnet")
    rows = [parity.Row("torch", "rn50", 8), parity.Row("mxnet", "rn50", 8)]
    seen = []
    doc = parity.campaign(rows, parity.Settings(threads=2), tmp_path, pairs=3,
                          on_pair=lambda row, pair: seen.append((row["framework"], pair)))
    # pair k of every row before pair k+1 of any; trainperf first on even pairs
    assert [c for c in calls if c[1] == "torch"] == [
        ("trainperf", "torch"), ("native", "torch"), ("native", "torch"),
        ("trainperf", "torch"), ("trainperf", "torch"), ("native", "torch")]
    assert [f for f, _ in seen] == ["torch", "mxnet"] * 3
    torch_row, mxnet_row = doc["rows"]
    assert [p["order"] for p in torch_row["pairs"]] == ["trainperf first", "native first",
                                                         "trainperf first"]
    assert torch_row["summary"]["median_ratio"] == pytest.approx(0.9)
    assert torch_row["summary"]["pairs_ok"] == 3
    # a failed side ends its pair with one line and the campaign goes on
    assert mxnet_row["summary"] == {"pairs_ok": 0}
    assert all(p["error"] == "native: native mxnet exited 1: boom" for p in mxnet_row["pairs"])
    on_disk = json.loads((tmp_path / "parity.json").read_text())
    assert on_disk["rows"] == doc["rows"] and on_disk["threads"] == 2
    md = (tmp_path / "parity.md").read_text()
    assert ("| torch | default | rn50 | 8 | **0.900** | 0.900 | 0.900 | 3 | 9.00 | 10.00 | "
            "zoo model |") in md
    assert ("| mxnet | default | rn50 | 8 | - | | | 0 | | | native: native mxnet exited 1: "
            "boom |") in md
    # the registry holds the row that has a figure, for reports to find
    found = parities.find("rn50-v1b-imagenet", "torch", "9.9", "cpu", "Test CPU", "fp32")
    assert found["median_ratio"] == pytest.approx(0.9) and found["pairs_ok"] == 3
    assert found["parity_json"] == str(tmp_path / "parity.json")
    assert parities.find("rn50-v1b-imagenet", "mxnet", None, "cpu", None, "fp32") is None


def test_a_budget_starts_no_new_pair_and_says_which(tmp_path, stand_in_sides):
    rows = [parity.Row("torch", "face", 2)]
    doc = parity.campaign(rows, parity.Settings(), tmp_path, pairs=3, budget_s=0.0)
    # the budget is read before each pair, and none fits in 0 s
    assert doc["rows"][0]["pairs"] == [] and doc["rows"][0]["not_started"] == [0, 1, 2]
    assert "| torch | default | face | 2 | - | | | 0 | | | not run |" in \
        (tmp_path / "parity.md").read_text()


def test_what_trainperf_does_not_run_is_said_and_not_timed(tmp_path, stand_in_sides):
    calls, _ = stand_in_sides
    doc = parity.campaign([parity.Row("jax", "rn50", 8, "graph"),
                           parity.Row("torch", "rn50", 8)],
                          parity.Settings(), tmp_path, pairs=1)
    refused, torch_row = doc["rows"]
    assert refused["pairs"] == [] and "the jax backend runs --mode jit" in refused["unsupported"]
    assert {fw for _, fw in calls} == {"torch"} and torch_row["summary"]["pairs_ok"] == 1
    assert "| jax | graph | rn50 | 8 | - | | | 0 | | | trainperf: the jax backend runs --mode " \
           "jit" in (tmp_path / "parity.md").read_text()


def test_bad_cases_and_frameworks_are_one_line_errors(tmp_path):
    for text in ("rn50", "rn50:0", "vit:8", "face:x"):
        with pytest.raises(ValueError, match="expected MODEL:BATCH"):
            parity.parse_case(text)
    with pytest.raises(ValueError, match="no native reference for caffe"):
        parity.check_frameworks(["torch", "caffe"])
    proc = subprocess.run([sys.executable, str(DRIVER), "--frameworks", "caffe",
                           "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "no native reference for caffe" in proc.stderr
    assert not (tmp_path / "parity.json").exists()


# -- the registry and the report ---------------------------------------------------------------

def record(**over) -> dict:
    base = {"recipe": "rn50-v1b-imagenet", "framework": "mxnet", "framework_version": "1.9.1",
            "device_type": "cpu", "device_name": "AMD EPYC", "precision": "fp32", "batch": 8,
            "threads": 2, "pairs_ok": 3, "median_ratio": 0.981, "min_ratio": 0.97,
            "max_ratio": 0.99, "native_step": "gluon model zoo resnet50_v1", "t": 100.0,
            "parity_json": "/r/parity.json"}
    return {**base, **over}


def name(stamp: str) -> str:
    return parities.name_for("rn50-v1b-imagenet", "mxnet", stamp, 8)


def result_doc(framework: str, version: str, precision: str = "fp32") -> dict:
    return {"recipe": "rn50-v1b-imagenet", "framework": framework,
            "workload": {"precision": precision}, "cases": [],
            "env": {"framework_version": version, "device_type": "cpu", "device_names": [],
                    "cpu_model": "AMD EPYC"}}


def test_a_comparison_states_each_frameworks_parity_or_that_none_was_measured():
    docs = [result_doc("torch", "2.13.0"), result_doc("mxnet", "1.9.1")]
    lines = parity_lines(docs)
    assert lines == [
        "- torch 2.13.0: native parity not measured: no record of torch on rn50-v1b-imagenet "
        "in fp32 on AMD EPYC with this version (`python benchmarks/native_parity.py "
        "--frameworks torch`)",
        "- mxnet 1.9.1: native parity not measured: no record of mxnet on rn50-v1b-imagenet "
        "in fp32 on AMD EPYC with this version (`python benchmarks/native_parity.py "
        "--frameworks mxnet`)"]
    parities.put(name("other-version"), record(framework_version="1.8.0", median_ratio=0.5, t=300.0))
    parities.put(name("other-device"), record(device_name="Intel Xeon", median_ratio=0.5, t=300.0))
    parities.put(name("other-precision"), record(precision="bf16", median_ratio=0.6, t=300.0))
    parities.put(name("older"), record(median_ratio=0.5, t=50.0))
    parities.put(name("newest"), record())
    (parities.registry() / "rn50-v1b-imagenet-mxnet-broken.json").write_text("{")
    line = parity_lines(docs)[1]
    assert line == ("- mxnet 1.9.1: 0.981 of its native step (gluon model zoo resnet50_v1; "
                    "median of 3 pairs, 0.970-0.990; batch 8, 2 threads), measured "
                    f"{time.strftime('%Y-%m-%d', time.localtime(100))}: `/r/parity.json`")
    assert "0.600 of its native step" in parity_lines([result_doc("mxnet", "1.9.1", "bf16")])[0]
    assert "not measured" in parity_lines([result_doc("mxnet", "1.9.1", "fp16")])[0]
    text = render_report(docs)
    assert "Native parity (`benchmarks/native_parity.py`)" in text
    assert "- mxnet 1.9.1: 0.981 of its native step" in text
    assert "- torch 2.13.0: native parity not measured" in text
    # one framework alone is no comparison between frameworks
    assert "Native parity" not in render_report([docs[0], result_doc("torch", "2.13.0")])


# -- the real thing, at a tiny size --------------------------------------------------------------

@pytest.mark.slow
def test_the_driver_measures_torch_and_mxnet_against_their_own_steps(tmp_path, mxnet_python):
    out = tmp_path / "record"
    proc = subprocess.run(
        [sys.executable, str(DRIVER), "--frameworks", "torch,mxnet", "--case", "rn50:2",
         "--input-size", "32", "--pairs", "1", "--iters", "2", "--warmup", "1",
         "--threads", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "parity.json").read_text())
    assert doc["schema"] == parity.SCHEMA and doc["threads"] == 1 and doc["input_size"] == 32
    for row in doc["rows"]:
        (pair,) = row["pairs"]
        assert pair["ratio"] == pytest.approx(pair["trainperf"] / pair["native"])
        assert pair["trainperf"] > 0 and pair["native"] > 0
        # both sides ran the same shapes and threads
        assert pair["native_detail"]["input_size"] == 32
        assert pair["native_detail"]["threads"] == 1
        assert pair["trainperf_detail"]["threads"] == 1
        assert pair["native_settings"]["zoo"]
        version = pair["trainperf_detail"]["versions"]["framework_version"]
        found = parities.find("rn50-v1b-imagenet", row["framework"], version, "cpu", None,
                              "fp32")
        assert found and found["median_ratio"] == pytest.approx(pair["ratio"])
        assert found["input_size"] == 32 and found["batch"] == 2
    assert [r["framework"] for r in doc["rows"]] == ["torch", "mxnet"]
    md = (out / "parity.md").read_text()
    assert "ResNet50 at 32x32" in md and md.count("| rn50 | 2 | **") == 2
