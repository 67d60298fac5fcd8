"""Ingesting logs of older tools: each format's dlperf figure against DLPerf's script arithmetic
redone here, the DLPerf seed figures reproduced, exact from timestamps, printed seconds or rates,
short logs, and a report mixing sources."""

from __future__ import annotations

import json
import re
import statistics
from datetime import datetime, timedelta

import numpy as np
import pytest

import log_fixtures as fx
from trainperf import results
from trainperf.cli import main
from trainperf.ingest import ingest_logdir
from trainperf.ingest.formats import FORMATS, detect, numpy_mean_2dp
from trainperf.ingest.prints import line_timestamp

# MXNet InsightFace r100, batch 64, fp32: the per-run values and aggregates DLPerf printed.
SEED_RUNS = {
    "1n1g": [233.94, 231.46, 233.52, 233.88, 238.78],
    "1n2g": [448.18, 451.18, 450.4, 451.56, 449.54],
    "1n4g": [639.06, 658.46, 661.08, 649.76, 651.44],
    "1n8g": [765.7, 749.12, 739.02, 763.2, 756.96],
}
SEED_AGG = {"1n1g": (233.88, 234.32, 1.0), "1n2g": (450.4, 450.17, 1.93),
            "1n4g": (651.44, 651.96, 2.79), "1n8g": (756.96, 754.8, 3.24)}


# --- DLPerf's scripts, redone from their text (not from trainperf's code) ----------------------
# Each returns the values the script collects, in file order; ``script_mean`` applies its slice
# and rounding: round(np.mean(values[lo:hi]), 2).

def script_mean(values: list[float], lo: int, hi: int | None) -> float:
    return float(round(np.mean(values[lo:hi]), 2))


def tight_script_mean(values: list[float], lo: int, hi: int | None) -> float:
    """The script's figure, checking that the window shifted by one print either way gives
    another: an off-by-one in trainperf cannot pass."""
    figure = script_mean(values, lo, hi)
    for shift in (-1, 1):
        assert script_mean(values, lo + shift, None if hi is None else hi + shift) != figure
    return figure


def mxnet_speeds(text: str, nodes: int) -> list[float]:
    speeds = []
    for line in text.splitlines():
        if "INFO:root:Epoch[0] Batch" in line or "INFO:root:Iter[0] Batch" in line:
            speed = float(re.findall(r"Speed: (\d+\.\d+) samples/sec", line)[0])
            speeds.append(round(speed, 1) * nodes)
    return speeds


def partialfc_totals(text: str) -> list[float]:
    return [round(float(re.findall(r"Total:(\d+\.\d+) it/sec", line)[0]), 1)
            for line in text.splitlines() if "Rank:" in line and "Total:" in line]


def oneflow_figure(text: str, shift_start: int = 0, shift_end: int = 0) -> float:
    kept, counted = [], 0
    for line in text.splitlines():
        if "train: iter" in line and int(re.findall(r"train: iter (.*), loss", line)[0]) > 5:
            counted += 1
            if counted >= 20 + shift_start:
                kept.append(float(re.findall(r"throughput: (.*)", line)[0]))
                if counted == 120 + shift_end:
                    return float(round(np.mean(kept), 2))
    return 0.0


def plsc_qps(text: str) -> list[float]:
    return [float(re.findall(r" qps:([0-9]+\.[0-9]+)", line)[0])
            for line in text.splitlines() if "Pass:0 batch:" in line]


def timehistory_rates(text: str) -> list[float]:
    return [float(re.findall(r"\, (\d+.\d+) examples/second ", line)[0])
            for line in text.splitlines() if "TimeHistory" in line]


def dllogger_figure(text: str, global_batch: int, start: int = 20, end: int = 120) -> float:
    times, counted = {}, 0
    for line in text.splitlines():
        if "Iteration: " in line and int(re.findall(r"Iteration: (.*)  train.loss :", line)[0]) > 5:
            counted += 1
            stamp = re.findall(r"(\d{4}-\d{1,2}-\d{1,2}\s\d{1,2}:\d{1,2}:\d{1,2}.\d{1,6})", line)[0]
            times[counted] = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f")
    if end not in times:
        return 0.0
    cost = (times[end] - times[start]).total_seconds()
    return round(float(global_batch) / (cost / 100), 2)


def only_run(root, fmt: str, model: str, precision: str, method: str = "exact") -> dict:
    return ingest_logdir(root, fmt, method).docs[(model, precision)]["cases"][0]["runs"][0]


# --- MXNet Speedometer ---------------------------------------------------------------------------

@pytest.fixture
def mxnet_seed_dir(tmp_path):
    root = tmp_path / "logs" / "insightface" / "arcface"
    for case, values in SEED_RUNS.items():
        for run, value in enumerate(values, start=1):
            # Five one-decimal speeds in batches 21-120 whose mean is the run's value.
            fx.write_run(root, 64, case, "r100", "fp32", run,
                         fx.speedometer(fx.speeds_with_mean(value)))
    return root


def test_dlperf_seed_figures_reproduced(mxnet_seed_dir):
    got = ingest_logdir(mxnet_seed_dir, "mxnet-speedometer", "dlperf")
    doc = got.docs[("r100", "fp32")]
    assert got.skipped == []
    exported = results.export_dlperf(doc)["r100"]
    for case, (med, avg, speedup) in SEED_AGG.items():
        assert exported[case] == {"average_speed": avg, "median_speed": med, "speedup": speedup,
                                  "batch_size_per_device": 64}
    one = next(c for c in doc["cases"] if c["case"] == "1n1g")
    assert sorted(r["samples_per_s"] for r in one["runs"]) == sorted(SEED_RUNS["1n1g"])


def test_mxnet_speedometer_matches_script(tmp_path):
    # Two-decimal speeds, so the script's rounding to one decimal matters; two nodes.
    text = fx.speedometer([233.95, 240.04, 229.96, 251.25, 236.65], warmup_rate=50.0,
                          after=(5000.0, 4000.0))
    fx.write_run(tmp_path, 64, "2n8g", "r100", "fp32", 1, text)
    run = only_run(tmp_path, "mxnet-speedometer", "r100", "fp32")
    assert run["samples_per_s_dlperf"] == tight_script_mean(mxnet_speeds(text, 2), 1, 6)
    assert run["window"] == {"first_index": 40, "last_index": 120, "prints": 5,
                             "previous_index": 20}
    assert "harmonic" in run["method_note"] and "one node's rate" in run["method_note"]


def test_mxnet_other_epochs_not_counted(tmp_path):
    # Epoch 0 ends after four prints; epoch 1's lines are not the script's.
    text = (fx.speedometer([300.0, 310.0, 320.0], after=())
            + fx.speedometer([6000.0] * 5, epoch=1))
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 1, text)
    run = only_run(tmp_path, "mxnet-speedometer", "r100", "fp32", "dlperf")
    assert run["samples_per_s"] == script_mean(mxnet_speeds(text, 1), 1, 6) == 310.0
    assert "(3 of 5 epoch-0 speedometer prints)" in run["method_note"]
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean([300, 310, 320]))


def test_steady_logs_agree_jittery_logs_differ(tmp_path):
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 1, fx.speedometer([250.0] * 5))
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 2,
                 fx.speedometer([100.0, 300.0, 100.0, 300.0, 200.0]))
    doc = ingest_logdir(tmp_path, "mxnet-speedometer").docs[("r100", "fp32")]
    steady, jitter = doc["cases"][0]["runs"]
    assert steady["samples_per_s_exact"] == pytest.approx(250.0)
    assert steady["samples_per_s_dlperf"] == 250.0
    # 5 windows of 20 batches x 64 samples: total time = sum(1280 / rate).
    exact = 5 * 1280 / sum(1280 / r for r in (100, 300, 100, 300, 200))
    assert jitter["samples_per_s_exact"] == pytest.approx(exact)  # 157.89
    assert jitter["samples_per_s_dlperf"] == 200.0
    assert jitter["samples_per_s"] == jitter["samples_per_s_exact"]  # exact is the default


def test_mxnet_rate_is_per_node(tmp_path):
    fx.write_run(tmp_path, 64, "2n8g", "r100", "fp32", 1,
                 fx.speedometer([700.0] * 5, iter_style=True))
    run = only_run(tmp_path, "mxnet-speedometer", "r100", "fp32")
    assert run["samples_per_s_dlperf"] == 1400.0
    assert run["samples_per_s_exact"] == pytest.approx(1400.0)


# --- MXNet Partial FC ----------------------------------------------------------------------------

def test_partialfc_matches_script(tmp_path):
    # Every iteration, 1-120: start-up, a slow 19th print, then two-decimal Totals that vary.
    totals = [999.0] * 18 + [5.0] + [1600.25 + 13.37 * (i % 7) for i in range(101)]
    text = fx.partialfc(totals, 8)
    fx.write_run(tmp_path, 64, "1n8g", "r100", "fp16", 1, text)
    run = only_run(tmp_path, "mxnet-partialfc", "r100", "fp16")
    assert run["samples_per_s_dlperf"] == tight_script_mean(partialfc_totals(text), 19, None)
    assert run["window"]["first_index"] == 20 and run["window"]["prints"] == 101
    printed = [float(f"{t:.2f}") for t in totals[19:]]
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean(printed))
    assert "rank 0's rate times the world size" in run["method_note"]


def test_partialfc_too_short(tmp_path):
    fx.write_run(tmp_path, 64, "1n8g", "r100", "fp16", 1, fx.partialfc([1600.0] * 19, 8))
    run = only_run(tmp_path, "mxnet-partialfc", "r100", "fp16", "dlperf")
    assert run["samples_per_s"] is None and run["status"] == "failed"
    assert "fewer than 20 Total prints" in run["error"]


# --- OneFlow -------------------------------------------------------------------------------------

def test_oneflow_matches_script(tmp_path):
    # Iterations 0-129: counted line k is iteration k + 5, so the window is iterations 25-125.
    rates = [10.0] * 24 + [20.0] + [5000.0, 5100.0] * 50 + [5000.0] + [1.0] * 4
    text = fx.oneflow(rates)
    fx.write_run(tmp_path, 64, "1n8g", "r100", "fp32", 1, text)
    run = only_run(tmp_path, "oneflow-face", "r100", "fp32")
    figure = oneflow_figure(text)
    assert {oneflow_figure(text, s, s) for s in (-1, 1)}.isdisjoint({figure})
    assert run["samples_per_s_dlperf"] == figure == 5049.5
    assert run["window"] == {"first_index": 25, "last_index": 125, "prints": 101,
                             "previous_index": 24}
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean(rates[25:126]))


def test_oneflow_short_log_has_no_dlperf_figure(tmp_path):
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 1, fx.oneflow([245.0] * 110))
    run = only_run(tmp_path, "oneflow-face", "r100", "fp32", "dlperf")
    assert oneflow_figure(fx.oneflow([245.0] * 110)) == 0.0  # what the script prints
    assert run["samples_per_s"] is None and run["status"] == "failed"
    assert run["samples_per_s_exact"] == pytest.approx(245.0)  # over the prints present
    short = [line for line in run["method_note"].splitlines() if "window is complete" in line]
    assert len(short) == 1 and "104 of 120" in short[0] and run["error"] == short[0]


# --- PLSC ----------------------------------------------------------------------------------------

def plsc_rates(outside: float = 9000.0) -> dict[int, float]:
    """Batch 0-150 every 10: start-up, a slow print at 40, varied qps for 50-140, a fast 150."""
    qps = {b: 100.0 for b in range(0, 40, 10)}
    qps[40] = 10.0
    qps.update({b: 390.0 + (b * 7) % 23 for b in range(50, 150, 10)})
    qps[150] = outside
    return qps


def test_plsc_batches_50_to_140(tmp_path):
    qps = plsc_rates()
    text = fx.plsc(qps)
    fx.write_run(tmp_path, 128, "1n1g", "r50", "fp32", 1, text)
    run = only_run(tmp_path, "plsc", "r50", "fp32")
    figure = tight_script_mean(plsc_qps(text), 5, 15)
    assert run["samples_per_s_dlperf"] == figure
    assert figure != round(statistics.mean(qps[b] for b in range(60, 151, 10)), 2)  # the old bug
    assert (run["window"]["first_index"], run["window"]["last_index"]) == (50, 140)
    window = [qps[b] for b in range(50, 150, 10)]
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean(window))
    assert "compute time only" in run["method_note"]


def test_plsc_two_nodes_doubles_the_slice(tmp_path):
    qps = {b: (q, q + 3.0) for b, q in plsc_rates().items()}
    text = fx.plsc(qps, nodes=2)
    fx.write_run(tmp_path, 128, "2n8g", "r50", "fp32", 1, text)
    run = only_run(tmp_path, "plsc", "r50", "fp32", "dlperf")
    figure = tight_script_mean(plsc_qps(text), 10, 30)
    assert run["samples_per_s"] == figure != script_mean(plsc_qps(text), 5, 15)
    assert run["window"]["prints"] == 20
    both = [q for b in range(50, 150, 10) for q in qps[b]]
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean(both))
    # With line times, each batch's second line advances no steps: batches 40 to 140 at 0.5 s
    # a batch, 2 x 8 x 128 samples a batch.
    fx.write_run(tmp_path, 128, "2n8g", "r50", "fp32", 1, fx.plsc(qps, 2, seconds_per_batch=0.5))
    run = only_run(tmp_path, "plsc", "r50", "fp32")
    assert run["samples_per_s_exact"] == pytest.approx(100 * 2048 / 50.0)
    assert "wall-clock span" in run["method_note"] and "compute time only" in run["method_note"]


def test_plsc_newer_lines_are_read():
    fmt = FORMATS["plsc"]
    prints = fmt.parse([
        "[2021/03/12 10:00:00] root INFO: step: 100, eta: 1.23 hours, throughput: 2545.30 imgs/sec",
        "[Train][Epoch 1/20][Iter: 110/5000]lr: 0.1, loss: 40.1, batch_cost: 0.40s, "
        "reader_cost: 0.001, ips: 2545.3 images/sec, eta: 1:00:00",
    ])
    assert [(p.index, p.rate) for p in prints] == [(100, 2545.30), (110, 2545.3)]
    assert prints[1].loss == 40.1
    assert not any(p.counted_by_dlperf for p in prints)


def test_plsc_newer_lines_get_exact_but_no_dlperf(tmp_path):
    lines = [f"[Train][Epoch 1/20][Iter: {b}/5000]lr: 0.1, loss: 40.1, batch_cost: 0.40s, "
             f"reader_cost: 0.001, ips: {q:.1f} images/sec, eta: 1:00:00\n"
             for b, q in plsc_rates().items()]
    fx.write_run(tmp_path, 128, "1n8g", "r50", "fp32", 1, "".join(lines))
    run = only_run(tmp_path, "plsc", "r50", "fp32")
    assert run["samples_per_s_dlperf"] is None and run["status"] == "ok"
    assert "reads only 'Pass:0 batch:' lines" in run["method_note"]
    window = [plsc_rates()[b] for b in range(50, 150, 10)]
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean(window))


# --- arcface_torch (no DLPerf script) ------------------------------------------------------------

def test_arcface_torch_speed_and_clamped_loss(tmp_path):
    speeds = {g: 4.5 for g in range(10, 141, 10)}
    fx.write_run(tmp_path, 16, "1n1g", "r100", "fp32", 1, fx.arcface_torch(speeds, 69.0776))
    case = ingest_logdir(tmp_path, "arcface-torch").docs[("r100", "fp32")]["cases"][0]
    run = case["runs"][0]
    assert run["samples_per_s_dlperf"] == 4.5
    assert run["flags"] == ["loss_clamped"]
    assert case["median_samples_per_s"] is None  # a diverged run is no figure to publish


def test_arcface_torch_by_analogy_and_timestamps(tmp_path):
    speeds = {10: 100.0, 20: 1.0, **{g: 700.0 + g for g in range(30, 121, 10)}, 130: 9999.0}
    fx.write_run(tmp_path, 16, "1n8g", "r100", "fp32", 1, fx.arcface_torch(speeds, 40.5, 128))
    doc = ingest_logdir(tmp_path, "arcface-torch").docs[("r100", "fp32")]
    run = doc["cases"][0]["runs"][0]
    window = [speeds[g] for g in range(30, 121, 10)]
    assert run["samples_per_s_dlperf"] == float(round(np.mean(window), 2))
    assert "no DLPerf script exists" in doc["source"]["dlperf_rule"]
    # The asctime advances at the printed Speed (to the millisecond): a wall-clock span.
    assert "wall-clock span" in run["method_note"]
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean(window), rel=1e-4)


# --- TensorFlow TimeHistory ----------------------------------------------------------------------

TF_SECONDS = [80.0, 39.13, 41.0, 40.2, 38.77, 39.9, 2.0, 2.0]  # steps 0-100, ..., 700-800


def tf_entries(seconds: list[float] = TF_SECONDS, batch: int = 128) -> list[tuple]:
    return [(s, 100 * batch / s, 100 * i, 100 * (i + 1)) for i, s in enumerate(seconds)]


def test_timehistory_matches_script_and_exact_uses_timestamps(tmp_path):
    text = fx.timehistory(tf_entries(), logging_s=0.05)
    fx.write_run(tmp_path, 128, "1n1g", "rn50", "fp32", 1, text)
    run = only_run(tmp_path, "tf-timehistory", "rn50", "fp32")
    rates = timehistory_rates(text)
    assert run["samples_per_s_dlperf"] == tight_script_mean(rates, 1, 6)
    assert run["samples_per_s_dlperf"] != round(statistics.mean(rates[1:]), 2)  # the old rule
    # From the 1st line's timestamp to the 6th's: 500 steps in the printed seconds of lines
    # 2-6 plus 5 x 0.05 s of logging.
    expected = 500 * 128 / (sum(TF_SECONDS[1:6]) + 5 * 0.05)
    assert run["samples_per_s_exact"] == pytest.approx(expected, rel=1e-6)
    assert "wall-clock span between the line timestamps at steps 100 and 600" in run["method_note"]


def test_exact_fallback_order(tmp_path):
    printed_seconds = 500 * 128 / sum(TF_SECONDS[1:6])

    def tf_exact(text: str) -> tuple[float, str]:
        fx.write_run(tmp_path, 128, "1n1g", "rn50", "fp32", 1, text)
        run = only_run(tmp_path, "tf-timehistory", "rn50", "fp32")
        return run["samples_per_s_exact"], run["method_note"]

    stamped = fx.timehistory(tf_entries(), logging_s=0.05)
    value, note = tf_exact(stamped)
    assert value < printed_seconds and "wall-clock span" in note
    # No timestamps: the printed seconds.
    value, note = tf_exact(fx.timehistory(tf_entries(), stamped=False))
    assert value == pytest.approx(printed_seconds) and "seconds the log printed" in note
    # One print involved (the one before the window) stamped to the whole second: seconds.
    first, rest = stamped.split("\n", 1)
    value, note = tf_exact(re.sub(r"(\d\d:\d\d:\d\d)\.\d+", r"\1", first) + "\n" + rest)
    assert value == pytest.approx(printed_seconds) and "seconds the log printed" in note
    # absl times carry no year: across New Year the span is not positive, so fall back.
    new_year = fx.timehistory(tf_entries(), start=datetime(2020, 12, 31, 23, 58, 0))
    value, note = tf_exact(new_year)
    assert value == pytest.approx(printed_seconds) and "no positive span" in note
    # Neither timestamps nor seconds: the printed rates (MXNet Speedometer).
    fx.write_run(tmp_path / "mx", 64, "1n1g", "r100", "fp32", 1,
                 fx.speedometer([100.0, 300.0, 100.0, 300.0, 200.0]))
    run = only_run(tmp_path / "mx", "mxnet-speedometer", "r100", "fp32")
    assert run["samples_per_s_exact"] == pytest.approx(
        statistics.harmonic_mean([100.0, 300.0, 100.0, 300.0, 200.0]))
    assert "harmonic mean" in run["method_note"]


def test_exact_from_python_logging_times(tmp_path):
    # MXNet lines behind Python logging's asctime (milliseconds): print 1 opens the window.
    gaps = [5.0, 4.0, 6.0, 5.5, 4.5, 5.0, 1.0]
    times = [fx.START]
    for gap in gaps[1:]:
        times.append(times[-1] + timedelta(seconds=gap))
    text = fx.speedometer([250.0] * 5, times=times)
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 1, text)
    run = only_run(tmp_path, "mxnet-speedometer", "r100", "fp32")
    span = (times[5] - times[0]).total_seconds()  # 4 + 6 + 5.5 + 4.5 + 5 = 25 s
    assert span == 25.0
    assert run["samples_per_s_exact"] == pytest.approx(100 * 64 / span)
    assert run["samples_per_s_dlperf"] == 250.0


def test_timehistory_short_logs(tmp_path):
    four_lines = fx.timehistory(tf_entries(TF_SECONDS[:4]))
    fx.write_run(tmp_path, 128, "1n1g", "rn50", "fp32", 1, four_lines)
    fx.write_run(tmp_path, 128, "1n1g", "rn50", "fp32", 2,
                 fx.timehistory(tf_entries(TF_SECONDS[:1])))
    doc = ingest_logdir(tmp_path, "tf-timehistory", "dlperf").docs[("rn50", "fp32")]
    partial, single = doc["cases"][0]["runs"]
    # The script's slice [1:6] of four lines is lines 2-4: it prints their mean.
    assert partial["samples_per_s"] == script_mean(timehistory_rates(four_lines), 1, 6)
    assert "(3 of 5 TimeHistory prints)" in partial["method_note"]
    # One line: an empty slice, numpy's nan: no figure.
    assert single["samples_per_s"] is None and "would print nan" in single["error"]
    assert single["samples_per_s_exact"] is None


# --- NGC DLLogger --------------------------------------------------------------------------------

def dll_seconds() -> list[float]:
    """Iterations 1-130: the gaps into iterations 25 and 126 are slow, 26-125 alternate."""
    return [1.0] * 24 + [3.0] + [0.25, 0.75] * 50 + [3.0] * 5


def test_dllogger_matches_script(tmp_path):
    seconds = dll_seconds()
    text = fx.dllogger(seconds, ips=[256 / s for s in seconds])
    fx.write_run(tmp_path, 256, "1n1g", "rn50", "amp", 1, text)
    run = only_run(tmp_path, "dllogger", "rn50", "amp", "dlperf")
    figure = dllogger_figure(text, 256)
    shifted = {dllogger_figure(text, 256, 20 + s, 120 + s) for s in (-1, 1)}
    assert run["samples_per_s"] == figure == 512.0 and figure not in shifted
    assert figure != round(statistics.mean(256 / s for s in seconds[25:125]), 2)  # mean of ips
    # Counted line 20 is iteration 25: its time opens the window of iterations 26-125.
    assert run["window"] == {"first_index": 26, "last_index": 125, "prints": 100,
                             "previous_index": 25}
    assert run["samples_per_s_exact"] == pytest.approx(100 * 256 / 50.0)


def test_dllogger_short_log(tmp_path):
    seconds = dll_seconds()[:110]
    fx.write_run(tmp_path, 256, "1n1g", "rn50", "amp", 1, fx.dllogger(seconds))
    run = only_run(tmp_path, "dllogger", "rn50", "amp", "dlperf")
    assert dllogger_figure(fx.dllogger(seconds), 256) == 0.0
    assert run["samples_per_s"] is None and "the script prints 0" in run["error"]
    assert run["samples_per_s_exact"] == pytest.approx(85 * 256 / (sum(seconds[25:110])))


# --- Parsing, layout, CLI ------------------------------------------------------------------------

def test_line_timestamps():
    assert line_timestamp("DLL 2020-09-15 14:29:16.161849 - ") == datetime(
        2020, 9, 15, 14, 29, 16, 161849)
    assert line_timestamp("Training: 2021-05-12 10:21:57,154-") == datetime(
        2021, 5, 12, 10, 21, 57, 154000)
    assert line_timestamp("I0915 14:29:16.161849 139871 keras_utils.py:119] ") == datetime(
        2000, 9, 15, 14, 29, 16, 161849)
    assert line_timestamp("[1,0]<stderr>:I0229 00:00:01.5 1 a.py:1] ") == datetime(
        2000, 2, 29, 0, 0, 1, 500000)
    for no_time in ("2021-05-12 10:21:57 INFO ", "INFO:root:", "2021-13-12 10:21:57.1 "):
        assert line_timestamp(no_time) is None


def test_numpy_rounding_as_the_scripts():
    assert round(4072.505, 2) == 4072.51  # Python's round
    assert numpy_mean_2dp([4072.505]) == 4072.5  # the scripts' round(np.mean(...), 2)
    assert numpy_mean_2dp([]) is None


def test_layout_tolerance_and_skipped_files(tmp_path, capsys):
    fx.write_run(tmp_path, 64, "10n8g", "r100", "fp32", 1, fx.speedometer([7000.0] * 5))
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 1, fx.speedometer([230.0] * 5))
    (tmp_path / "bz64" / "1n1g" / "notes.txt").write_text("hello")
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 2, "garbage only\n")
    out = tmp_path / "out"
    assert main(["ingest", str(tmp_path) + "/", "--format", "auto", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "format: mxnet-speedometer (detected)" in err
    assert "notes.txt" in err and "r100_b64_fp32_2.log" in err
    doc = results.load(out)
    ten = next(c for c in doc["cases"] if c["nodes"] == 10)
    assert ten["world_size"] == 80 and ten["runs"][0]["samples_per_s"] == pytest.approx(70000.0)
    assert doc["source"]["format"] == "mxnet-speedometer" and doc["source"]["method"] == "exact"


def test_detect_each_format():
    samples = {
        "mxnet-speedometer": fx.speedometer([1.0]), "mxnet-partialfc": fx.partialfc([1.0], 1),
        "oneflow-face": fx.oneflow([1.0]), "plsc": fx.plsc({10: 1.0}),
        "arcface-torch": fx.arcface_torch({10: 1.0}),
        "tf-timehistory": fx.timehistory([(1.0, 1.0, 0, 1)]), "dllogger": fx.dllogger([1.0]),
    }
    for name, text in samples.items():
        assert detect(text.splitlines())[0].name == name
    with pytest.raises(ValueError, match="no line matches"):
        detect(["nothing here"])


def test_bad_inputs(tmp_path, capsys):
    assert main(["ingest", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 1, fx.speedometer([1.0]))
    assert main(["ingest", str(tmp_path), "--format", "nope"]) == 2
    assert "unknown log format 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # argparse's own usage error
        main(["ingest", str(tmp_path), "--method", "mean"])
    assert exc.value.code == 2


def test_report_mixes_ingested_and_measured(tmp_path, mxnet_seed_dir):
    of_root = tmp_path / "oneflow"
    for run in (1, 2):
        fx.write_run(of_root, 64, "1n1g", "r100", "fp32", run, fx.oneflow([245.0] * 130))
        fx.write_run(of_root, 64, "1n2g", "r100", "fp32", run, fx.oneflow([480.0] * 130))
    assert main(["ingest", str(mxnet_seed_dir), "--format", "mxnet-speedometer",
                 "--out", str(tmp_path / "mx")]) == 0
    assert main(["ingest", str(of_root), "--out", str(tmp_path / "of")]) == 0
    assert main(["run", "tiny-arcface", "--devices", "1", "--runs", "1", "--iters", "6",
                 "--warmup", "2", "--device", "cpu", "--out", str(tmp_path / "tp")]) == 0
    rep = tmp_path / "rep"
    assert main(["report", str(tmp_path / "mx"), str(tmp_path / "of"), str(tmp_path / "tp"),
                 "--out", str(rep)]) == 0
    text = (rep / "report.md").read_text()
    comparison = text.split("## Comparison: fp32")[1].split("\n## ")[0]  # what all share
    assert "mxnet r100 samples/s" in comparison and "oneflow r100 samples/s" in comparison
    assert "pytorch tiny-arcface fc=dp samples/s" in comparison
    assert "| oneflow r100 / mxnet r100 | pytorch tiny-arcface fc=dp / mxnet r100 |" in comparison
    # Logs say no mode ("-"); the measured run says the one it ran in.
    assert "| 1 | 8 | 64 | - | 756.96 | 3.24 | - | - | - | - | - | - | - | - |" in comparison
    assert "| 1 | 1 | 8 | - | - | - | - | - | - | eager | " in comparison
    # 480.00 / 450.40: OneFlow against MXNet, as the seeds put them
    # (MXNet's five runs against OneFlow's two, from their logged step times: a tight interval)
    assert ("| 1 | 2 | 64 | - | 450.40 | 1.93 | - | 480.00 | 1.96 | - | - | - | "
            "1.066 (1.063-1.071) | - |" in comparison)
    assert (rep / "throughput.png").stat().st_size > 1000
    json.loads((tmp_path / "of" / "results.json").read_text())


def test_references_load_and_match():
    from trainperf.references import load_max_classes, load_throughput, matching

    refs = load_throughput()
    assert len(refs) > 250
    mx = matching("r100", "dataset=face_emore;loss=arcface", "dp", 1.0, "fp32", 64, 8, refs)
    assert [(r.framework, r.samples_per_s) for r in mx] == [("oneflow", 1836.8), ("mxnet", 650.8)]
    pfc = matching("r100", "dataset=glint360k;loss=cosface", "pfc", 0.1, "fp32", 64, 8, refs)
    assert [(r.framework, r.samples_per_s) for r in pfc] == [("oneflow", 1858.57),
                                                             ("mxnet", 1359.2)]
    assert matching("r100", "", "dp", None, "fp32", 64, 3, refs) == []
    assert max(c.max_num_classes for c in load_max_classes()) == 13_500_000


def test_report_with_references(tmp_path, mxnet_seed_dir):
    assert main(["ingest", str(mxnet_seed_dir), "--out", str(tmp_path / "mx")]) == 0
    assert main(["report", str(tmp_path / "mx"), "--references", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "Published DLPerf figures beside" in text
    # Our ingested 1n8g figure (756.96) beside MXNet's own published row for the same case.
    assert "| 1 | 8 | 64 | 756.96 | 94.62 | - | mxnet | face_emore model_parallel | 756.96 |" in text
