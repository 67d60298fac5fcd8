"""Real data in every framework: each trains its tiny recipe from a ``.rec`` written by
``trainperf data synth``, in one ``trainperf run --framework ...`` command, through the
framework-neutral feed (loader processes handing over uint8 batches); each run's waits, feed
and the input section of the comparison report are there. A truncated file is a one-line error
naming it in every framework, before anything runs; a record that is no image, met mid-run,
fails that run in one line; no process is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainperf import results
from trainperf.cli import main

from run_util import left_behind
from test_feed import corrupt_record

pytestmark = pytest.mark.slow

ITERS, WARMUP = 4, 1


@pytest.fixture(scope="module")
def frameworks(mxnet_python, paddle_python, jax_python, tf_python, request) -> list[str]:
    names = ["torch", "mxnet", "paddle", "jax", "tf"]
    try:
        request.getfixturevalue("oneflow_python")
        names.append("oneflow")
    except pytest.skip.Exception:
        pass  # no Python 3.8-3.10 here: OneFlow cannot exist (its fixture says why)
    return names


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "faces")
    assert main(["data", "synth", "--identities", "16", "--images-per-identity", "4",
                 "--val-pairs", "0", "--out", prefix]) == 0
    return prefix


def run(frameworks: list[str], prefix: str, out: Path) -> int:
    # Each framework in its default mode: what is checked here is the feed, and a mode probe
    # (--mode best, the default of a comparison) would only add launches (test_modes.py).
    return main(["run", "tiny-arcface", "--framework", ",".join(frameworks), "--data", prefix,
                 "--mode", "default",
                 "--devices", "1", "--runs", "1", "--iters", str(ITERS), "--warmup",
                 str(WARMUP), "--device", "cpu", "--loader-workers", "1",
                 "--no-synthetic-baseline", "--out", str(out)])


def test_every_framework_trains_from_a_rec_file(frameworks, dataset, tmp_path):
    out = tmp_path / "all"
    assert run(frameworks, dataset, out) == 0
    for name in frameworks:
        doc = results.load(out / name / "real")
        assert doc["data"]["source"] == "recordio" and doc["data"]["images"] == 64
        (case,) = doc["cases"]
        (one,) = case["runs"]
        assert one["status"] == "ok", (name, one["error"])
        assert len(one["data_wait_s"]) == ITERS - WARMUP and all(w >= 0 for w in one["data_wait_s"])
        assert len(one["data_wait_window_s_per_rank"]) == 1
        feed = case["settings"]["input"]
        if name != "torch":
            assert feed["feed"] == "loader processes (numpy)", name
        assert feed["decoder"] in ("simplejpeg", "opencv", "pillow")
    section = (out / "report.md").read_text().split("## Input pipeline")[1]
    for name in frameworks:
        assert f"| {name} | 1n1g |" in section
    assert not left_behind(out)


def test_a_truncated_file_is_one_line_in_every_framework(frameworks, dataset, tmp_path,
                                                         capsys):
    cut = tmp_path / "cut"
    rec = Path(dataset + ".rec").read_bytes()
    cut.with_suffix(".rec").write_bytes(rec[:len(rec) // 2])
    cut.with_suffix(".idx").write_text(Path(dataset + ".idx").read_text())
    for name in frameworks:
        assert run([name], str(cut), tmp_path / name) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{cut}.idx" in err[0] and "past the end" in err[0], (name, err)
        assert not (tmp_path / name).exists()  # refused before anything ran


def test_a_bad_record_met_mid_run_is_one_line_and_leaves_nothing(dataset, tmp_path):
    """Past the up-front check: a record that is no image, met by a loader process of the
    shared feed inside a run, fails that run with one line naming the file and the record."""
    bad = corrupt_record(dataset, tmp_path, key=3)
    out = tmp_path / "bad"
    assert run(["mxnet"], bad, out) != 0
    (case,) = results.load(out / "real")["cases"]
    (one,) = case["runs"]
    assert one["status"] == "failed"
    assert "\n" not in one["error"] and f"{bad}.rec record 3" in one["error"], one["error"]
    assert "not an image" in one["error"], one["error"]
    assert not left_behind(out)
