"""`trainperf data` and `trainperf run --data` end to end on CPU: a synthetic RecordIO dataset
through the tiny recipe on 1 and 2 ranks, beside its synthetic twin; disjoint samples per rank
and epoch; the input-bound verdict; bad datasets as one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainperf import results
from trainperf.cli import main

pytestmark = pytest.mark.slow

IMAGES = 16 * 8  # identities x images per identity


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "faces")
    assert main(["data", "synth", "--identities", "16", "--images-per-identity", "8",
                 "--out", prefix]) == 0
    return prefix


@pytest.fixture(scope="module")
def real_run(dataset, tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("real")
    out, trace = base / "run", base / "trace"
    trace.mkdir()
    os.environ["TRAINPERF_DATA_TRACE"] = str(trace)
    try:
        rc = main(["run", "tiny-arcface", "--data", dataset, "--devices", "1,2", "--runs", "1",
                   "--iters", "12", "--warmup", "4", "--device", "cpu", "--loader-workers", "1",
                   "--out", str(out)])
    finally:
        del os.environ["TRAINPERF_DATA_TRACE"]
    assert rc == 0
    return out, trace


def test_real_and_synthetic_results_side_by_side(real_run, dataset):
    out, _ = real_run
    real, synth = results.load(out / "real"), results.load(out / "synthetic")
    assert synth["data"] == {"source": "synthetic", "role": "synthetic baseline"}
    data = real["data"]
    assert data["source"] == "recordio" and data["role"] == "real"
    assert data["prefix"] == str(Path(dataset).resolve())
    assert data["layout"] == "face" and data["images"] == IMAGES and data["num_classes"] == 16
    assert data["loader_workers"] == 1 and data["decoder"] in ("simplejpeg", "opencv", "pillow")
    for case in real["cases"]:
        (run,) = case["runs"]
        assert run["status"] == "ok", run["error"]
        assert len(run["data_wait_s"]) == 8 and all(w >= 0 for w in run["data_wait_s"])
        assert len(run["data_wait_window_s_per_rank"]) == case["world_size"]
        assert 0 <= case["data_wait_share"] < 1
        assert case["settings"]["input"]["steps_per_epoch"] == IMAGES // case["world_size"] // 8
    assert all(c["data_wait_share"] is None for c in synth["cases"])


def test_ranks_see_disjoint_samples_each_epoch(real_run):
    _, trace = real_run
    for world in (1, 2):
        seen = {}
        for rank in range(world):
            lines = (trace / f"w{world}_rank{rank}.txt").read_text().split("\n")
            pairs = [tuple(map(int, ln.split())) for ln in lines if ln]
            assert len(pairs) == 12 * 8  # every step's batch, warm-up included
            seen[rank] = pairs
        for epoch in (0, 1):
            parts = [[i for e, i in seen[r] if e == epoch] for r in range(world)]
            assert all(len(set(p)) == len(p) for p in parts)  # no sample twice in an epoch
            if world == 2:
                assert not set(parts[0]) & set(parts[1])
                if epoch == 0:  # 8 steps of 8 per rank make one whole epoch of the 128
                    assert set(parts[0]) | set(parts[1]) == set(range(IMAGES))
                else:
                    assert len(parts[0]) == len(parts[1]) == 4 * 8


def test_report_says_whether_the_input_limits(real_run):
    out, _ = real_run
    report = (out / "report.md").read_text()
    assert "## Input pipeline" in report
    section = report.split("## Input pipeline")[1]
    for case in ("1n1g b8", "1n2g b8"):
        line = next(ln for ln in section.splitlines() if ln.startswith(f"- {case}:"))
        assert "input-bound" in line or "slower by" in line
        assert "1 loader process per rank" in line
    assert "real-data samples/s" in section


def test_bad_datasets_are_one_line_errors(dataset, tmp_path, capsys):
    rec, idx = Path(dataset + ".rec"), Path(dataset + ".idx")
    bad = tmp_path / "bad"
    last = max(int(line.split("\t")[1]) for line in idx.read_text().splitlines())
    (tmp_path / "bad.rec").write_bytes(rec.read_bytes()[:last + 12])  # the last record cut
    (tmp_path / "bad.idx").write_text(idx.read_text())
    rc = main(["run", "tiny-arcface", "--data", str(bad), "--device", "cpu", "--runs", "1",
               "--iters", "3", "--warmup", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "bad.rec: truncated at byte" in err[0]
    rc = main(["run", "tiny-arcface", "--data", str(tmp_path / "none"), "--device", "cpu",
               "--out", str(tmp_path / "run2")])
    assert rc == 2 and "none.rec: no such record file" in capsys.readouterr().err
    rc = main(["run", "tiny-arcface", "--data", dataset, "--framework", "mxnet",
               "--decoder", "dali", "--out", str(tmp_path / "run3")])
    assert rc == 2 and "--decoder dali feeds torch only" in capsys.readouterr().err


def test_data_bench_measures_each_worker_count(dataset, tmp_path):
    rc = main(["data", "bench", dataset, "--workers", "0,1", "--recipe", "tiny-arcface",
               "--batches", "4", "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "data_bench.json").read_text())
    assert doc["dataset"]["images"] == IMAGES
    assert [f["workers"] for f in doc["figures"]] == [0, 1]
    assert all(f["images_per_s"] > 0 and f["batches"] == 4 for f in doc["figures"])


def test_every_plan_is_checked_before_the_first_run(dataset, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "real").mkdir(parents=True)
    (out / "real" / "events.jsonl").write_text("")  # an earlier run's folder
    rc = main(["run", "tiny-arcface", "--data", dataset, "--device", "cpu", "--runs", "1",
               "--iters", "3", "--warmup", "1", "--out", str(out)])
    assert rc == 2 and "already holds a run" in capsys.readouterr().err
    assert not (out / "synthetic" / "runs").exists()  # the twin did not start either
