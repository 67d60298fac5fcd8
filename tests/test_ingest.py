"""Ingesting logs of older tools: per-format figures computed by hand, the DLPerf seed figures
reproduced, the two methods compared, and a report mixing sources."""

from __future__ import annotations

import json
import statistics

import pytest

import log_fixtures as fx
from trainperf import results
from trainperf.cli import main
from trainperf.ingest import ingest_logdir
from trainperf.ingest.formats import FORMATS, detect

# MXNet InsightFace r100, batch 64, fp32: the per-run values and aggregates DLPerf printed.
SEED_RUNS = {
    "1n1g": [233.94, 231.46, 233.52, 233.88, 238.78],
    "1n2g": [448.18, 451.18, 450.4, 451.56, 449.54],
    "1n4g": [639.06, 658.46, 661.08, 649.76, 651.44],
    "1n8g": [765.7, 749.12, 739.02, 763.2, 756.96],
}
SEED_AGG = {"1n1g": (233.88, 234.32, 1.0), "1n2g": (450.4, 450.17, 1.93),
            "1n4g": (651.44, 651.96, 2.79), "1n8g": (756.96, 754.8, 3.24)}


@pytest.fixture
def mxnet_seed_dir(tmp_path):
    root = tmp_path / "logs" / "insightface" / "arcface"
    for case, values in SEED_RUNS.items():
        for run, value in enumerate(values, start=1):
            # Five steady windows in batches 21-120 that carry exactly the run's value.
            fx.write_run(root, 64, case, "r100", "fp32", run, fx.speedometer([value] * 5))
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
    assert sorted(r["samples_per_s"] for r in one["runs"]) == pytest.approx(
        sorted(SEED_RUNS["1n1g"]))


def test_steady_logs_agree_jittery_logs_differ(tmp_path):
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 1, fx.speedometer([250.0] * 5))
    fx.write_run(tmp_path, 64, "1n1g", "r100", "fp32", 2,
                 fx.speedometer([100.0, 300.0, 100.0, 300.0, 200.0]))
    doc = ingest_logdir(tmp_path, "mxnet-speedometer").docs[("r100", "fp32")]
    steady, jitter = doc["cases"][0]["runs"]
    assert steady["samples_per_s_exact"] == pytest.approx(250.0)
    assert steady["samples_per_s_dlperf"] == pytest.approx(250.0)
    # 5 windows of 20 batches x 64 samples: total time = sum(1280 / rate).
    exact = 5 * 1280 / sum(1280 / r for r in (100, 300, 100, 300, 200))
    assert jitter["samples_per_s_exact"] == pytest.approx(exact)  # 1500/9 = 166.67
    assert jitter["samples_per_s_dlperf"] == pytest.approx(200.0)
    assert jitter["samples_per_s"] == jitter["samples_per_s_exact"]  # exact is the default
    assert jitter["window"] == {"first_index": 40, "last_index": 120, "prints": 5}


def test_mxnet_rate_is_per_node(tmp_path):
    fx.write_run(tmp_path, 64, "2n8g", "r100", "fp32", 1,
                 fx.speedometer([700.0] * 5, iter_style=True))
    run = ingest_logdir(tmp_path, "mxnet-speedometer").docs[("r100", "fp32")]["cases"][0]["runs"][0]
    assert run["samples_per_s_dlperf"] == pytest.approx(1400.0)
    assert run["samples_per_s_exact"] == pytest.approx(1400.0)


def test_partialfc_total_and_window(tmp_path):
    totals = [999.0, 1600.0, 1700.0, 1600.0, 1700.0, 1650.0, 5.0]  # iters 20..140
    fx.write_run(tmp_path, 64, "1n8g", "r100", "fp16", 1, fx.partialfc(totals, 8))
    run = ingest_logdir(tmp_path, "mxnet-partialfc").docs[("r100", "fp16")]["cases"][0]["runs"][0]
    window = [1600.0, 1700.0, 1600.0, 1700.0, 1650.0]  # iters 40..120
    assert run["samples_per_s_dlperf"] == pytest.approx(statistics.mean(window))
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean(window))


def test_oneflow_skips_five_takes_hundred(tmp_path):
    rates = [10.0] * 5 + [5000.0, 5100.0] * 50 + [1.0] * 10
    fx.write_run(tmp_path, 64, "1n8g", "r100", "fp32", 1, fx.oneflow(rates))
    run = ingest_logdir(tmp_path, "oneflow-face").docs[("r100", "fp32")]["cases"][0]["runs"][0]
    assert run["window"]["prints"] == 100
    assert run["samples_per_s_dlperf"] == pytest.approx(5050.0)
    assert run["samples_per_s_exact"] == pytest.approx(statistics.harmonic_mean([5000.0, 5100.0]))


def test_plsc_batches_51_to_150(tmp_path):
    qps = {b: (100.0 if b <= 50 or b > 150 else 390.0 + (b % 20)) for b in range(10, 200, 10)}
    fx.write_run(tmp_path, 128, "1n1g", "r50", "fp32", 1, fx.plsc(qps))
    run = ingest_logdir(tmp_path, "plsc").docs[("r50", "fp32")]["cases"][0]["runs"][0]
    window = [qps[b] for b in range(60, 151, 10)]
    assert run["samples_per_s_dlperf"] == pytest.approx(statistics.mean(window))
    assert "compute time only" in run["method_note"]


def test_plsc_newer_lines_are_read():
    fmt = FORMATS["plsc"]
    prints = fmt.parse([
        "[2021/03/12 10:00:00] root INFO: step: 100, eta: 1.23 hours, throughput: 2545.30 imgs/sec",
        "[Train][Epoch 1/20][Iter: 110/5000]lr: 0.1, loss: 40.1, batch_cost: 0.40s, "
        "reader_cost: 0.001, ips: 2545.3 images/sec, eta: 1:00:00",
    ])
    assert [(p.index, p.rate) for p in prints] == [(100, 2545.30), (110, 2545.3)]
    assert prints[1].loss == 40.1


def test_arcface_torch_speed_and_clamped_loss(tmp_path):
    speeds = {g: 4.5 for g in range(10, 141, 10)}
    fx.write_run(tmp_path, 16, "1n1g", "r100", "fp32", 1, fx.arcface_torch(speeds, 69.0776))
    case = ingest_logdir(tmp_path, "arcface-torch").docs[("r100", "fp32")]["cases"][0]
    run = case["runs"][0]
    assert run["samples_per_s_dlperf"] == pytest.approx(4.5)
    assert run["flags"] == ["loss_clamped"]
    assert case["median_samples_per_s"] is None  # a diverged run is no figure to publish


def test_timehistory_uses_printed_seconds(tmp_path):
    entries = [(80.0, 160.0, 0, 100), (39.13, 327.08, 100, 200), (41.0, 312.2, 200, 300)]
    fx.write_run(tmp_path, 128, "1n1g", "resnet50", "fp32", 1, fx.timehistory(entries))
    run = ingest_logdir(tmp_path, "tf-timehistory").docs[("resnet50", "fp32")]["cases"][0]["runs"][0]
    assert run["samples_per_s_dlperf"] == pytest.approx((327.08 + 312.2) / 2)
    expected = (327.08 * 39.13 + 312.2 * 41.0) / (39.13 + 41.0)
    assert run["samples_per_s_exact"] == pytest.approx(expected)


def test_dllogger_exact_from_timestamps(tmp_path):
    seconds = [1.0] * 20 + [0.25, 0.75] * 50 + [3.0] * 5  # iterations 21-120 alternate
    fx.write_run(tmp_path, 256, "1n1g", "resnet50", "amp", 1, fx.dllogger(seconds))
    run = ingest_logdir(tmp_path, "dllogger").docs[("resnet50", "amp")]["cases"][0]["runs"][0]
    assert run["samples_per_s_dlperf"] == pytest.approx(812.3)
    # From the print at iteration 21 to the one at 120: 99 iterations in 49.75 s.
    assert run["samples_per_s_exact"] == pytest.approx(99 * 256 / (0.75 + 49 * 1.0))


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
        fx.write_run(of_root, 64, "1n1g", "r100", "fp32", run, fx.oneflow([245.0] * 110))
        fx.write_run(of_root, 64, "1n2g", "r100", "fp32", run, fx.oneflow([480.0] * 110))
    assert main(["ingest", str(mxnet_seed_dir), "--format", "mxnet-speedometer",
                 "--out", str(tmp_path / "mx")]) == 0
    assert main(["ingest", str(of_root), "--out", str(tmp_path / "of")]) == 0
    assert main(["run", "tiny-arcface", "--devices", "1", "--runs", "1", "--iters", "6",
                 "--warmup", "2", "--device", "cpu", "--out", str(tmp_path / "tp")]) == 0
    rep = tmp_path / "rep"
    assert main(["report", str(tmp_path / "mx"), str(tmp_path / "of"), str(tmp_path / "tp"),
                 "--out", str(rep)]) == 0
    text = (rep / "report.md").read_text()
    comparison = text.split("## Comparison")[1].split("\n## ")[0]
    assert "mxnet r100 fp32 samples/s" in comparison and "oneflow r100 fp32 samples/s" in comparison
    assert "pytorch tiny-arcface fp32 fc=dp samples/s" in comparison
    assert "| 1 | 8 | 64 | 756.96 | 3.24 | - | - | - | - |" in comparison
    assert "| 1 | 2 | 64 | 450.40 | 1.93 | 480.00 | 1.96 |" in comparison
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
