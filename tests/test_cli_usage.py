"""Usage errors: a clear one-line message and exit status 2, nothing started."""

from __future__ import annotations

import pytest

from trainperf.bench import bench_arguments
from trainperf.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["run", "no-such-recipe"], "unknown recipe"),
    (["run", "tiny-arcface", "--devices", "1,x"], "--devices"),
    (["run", "tiny-arcface", "--iters", "10", "--warmup", "10"], "--iters"),
    (["run", "tiny-arcface", "--fc", "mp", "--sample-ratio", "0.5"], "sample-ratio"),
    (["run", "tiny-arcface", "--memory-limit", "lots"], "size"),
    (["report", "/nonexistent/folder"], "no such folder"),
    (["run", "tiny-arcface", "--framework", "caffe"], "unknown framework 'caffe'"),
    (["run", "tiny-arcface", "--framework", "torch,torch"], "twice"),
    (["run", "tiny-arcface", "--framework", "mxnet", "--nnodes", "2", "--node-rank", "2"],
     "--node-rank must be in [0, 2)"),
    (["run", "tiny-arcface", "--framework", "mxnet", "--mxnet-kvstore", "device", "--nnodes",
      "2", "--rdzv", "127.0.0.1:29400"], "one node"),
    (["align", "tiny-arcface", "--framework", "torch"], "another framework"),
    (["env", "create", "caffe"], "unknown framework"),
])
def test_usage_errors(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.startswith("trainperf: error:") and "\n" not in err


def test_corrupt_results_file(tmp_path, capsys):
    (tmp_path / "results.json").write_text("{not json")
    assert main(["report", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_list_names_every_recipe(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("r100-arcface-emore", "r100-cosface-glint360k", "y1-arcface-emore",
                 "r50-arcface-plsc", "rn50-v1b-imagenet", "tiny-arcface"):
        assert name in out


def test_bench_is_sized_to_the_machine():
    assert "r100-arcface-emore" in bench_arguments(8, "o") and "1,8" in bench_arguments(8, "o")
    cpu = bench_arguments(0, "o")
    assert "tiny-arcface" in cpu and "1,2" in cpu and "cpu" in cpu
