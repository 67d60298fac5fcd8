"""What each backend runs is declared once (``Backend.capabilities``): the runner refuses the
rest from it before anything starts, in one line; `trainperf list --frameworks` prints it; and
the README's framework table is that output (``cli.pages`` keeps it so: tests/test_docs.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from trainperf.backends import BACKENDS, catalog
from trainperf.backends.capabilities import markdown_table
from trainperf.cli import main
from trainperf.config import TUNING_SETTINGS, Topology, Tuning
from trainperf.recipes import get_recipe



@pytest.mark.parametrize("argv,needle", [
    (["--framework", "mxnet", "--precision", "fp16"],
     "the mxnet backend runs --precision fp32 on a CPU; fp16 needs a GPU"),
    (["--framework", "mxnet", "--precision", "bf16"],
     "the mxnet backend runs --precision fp32 on a CPU"),
    (["--framework", "oneflow", "--precision", "fp16"],
     "the oneflow backend runs --precision fp32 on a CPU"),
    (["--framework", "paddle", "--memory-format", "channels_last"], "channels-first only"),
    (["--framework", "torch", "--mode", "graph"],
     "the torch backend runs --mode eager"),
    (["--framework", "torch,mxnet", "--devices", "2", "--mxnet-kvstore", "device", "--fc",
      "mp"], "kvstore device runs data parallel only"),
])
def test_the_runner_refuses_what_a_backend_does_not_declare(tmp_path, capsys, argv, needle):
    out = tmp_path / "out"
    code = main(["run", "tiny-arcface", "--device", "cpu", "--runs", "1", "--iters", "3",
                 "--warmup", "1", "--out", str(out), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("trainperf: error:") and "\n" not in err
    assert needle in err, err
    assert not out.exists(), "refused before anything starts"


def test_a_backbone_outside_the_declared_families_is_refused(tmp_path, capsys, monkeypatch):
    # Every framework builds every family now: a stand-in declares IResNet alone.
    oneflow = BACKENDS["oneflow"]
    monkeypatch.setitem(BACKENDS, "oneflow", replace(oneflow, capabilities=replace(
        oneflow.capabilities, families=("iresnet",))))
    code = main(["run", "rn50-v1b-imagenet", "--framework", "oneflow", "--device", "cpu",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "the oneflow backend has no backbone 'resnet50_v1b'" in err


def test_each_case_is_checked_with_its_own_layout():
    """kvstore ``device`` drives several devices of one process; one device runs ``local``."""
    mxnet = BACKENDS["mxnet"]
    mp = get_recipe("tiny-arcface").workload.replace(fc="mp")
    tuning = Tuning(mxnet_kvstore="device")
    assert mxnet.refusal(mp, Topology(devices_per_node=1), tuning, "cpu") is None
    assert "data parallel only" in mxnet.refusal(mp, Topology(devices_per_node=2), tuning, "cpu")
    assert "one node" in mxnet.refusal(mp.replace(fc="dp"), Topology(nnodes=2), tuning, "cpu")


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_refuses_a_rank_without_classes(name):
    """``mp`` and ``pfc`` give each rank its own classes: fewer classes than ranks is refused
    in one line, before a run starts, in every backend alike; ``dp`` and enough classes run."""
    backend = BACKENDS[name]
    face = get_recipe("tiny-arcface").workload
    four = Topology(devices_per_node=2, nnodes=2, node_rank=0, master_addr="127.0.0.1",
                    master_port=29500)
    for fc in ("mp", "pfc"):
        why = backend.refusal(face.replace(fc=fc, num_classes=3), four, Tuning(), "cpu")
        assert why == (f"--fc {fc} splits the 3 classes over 4 ranks, leaving 1 of them "
                       f"without a class: use --num-classes 4 or more, fewer ranks, or --fc dp")
        assert backend.refusal(face.replace(fc=fc, num_classes=4), four, Tuning(), "cpu") is None
    assert backend.refusal(face.replace(fc="dp", num_classes=3), four, Tuning(), "cpu") is None


def test_precisions_are_declared_per_device_kind():
    fp16 = get_recipe("tiny-arcface").workload.replace(precision="fp16")
    for name, backend in BACKENDS.items():
        for kind in ("cpu", "cuda"):
            why = backend.work_refusal(fp16, kind)
            assert (why is None) == ("fp16" in backend.capabilities.precisions[kind]), (name, kind)


def test_every_backend_builds_whole_families_of_the_catalogue():
    for backend in BACKENDS.values():
        names = backend.capabilities.backbones
        assert names == catalog.names(backend.capabilities.families)
        assert all(catalog.lookup(n).family in backend.capabilities.families for n in names)
    # Issue 43: every framework builds every family of the catalogue.
    assert all(set(b.capabilities.families) == set(catalog.FAMILIES) for b in BACKENDS.values())


def test_list_frameworks_prints_every_backend(capsys):
    assert main(["list", "--frameworks"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BACKENDS)
    # Each framework's modes on a CPU and on a GPU, in the terminal too (the default bold).
    assert "modes CPU" in out and "modes GPU" in out and "**" not in out
    torch_row = next(line for line in out.splitlines() if "torch" in line)
    assert "eager, compile" in torch_row and "compile-cudagraphs" in out
    for backend in BACKENDS.values():
        assert all(mode in out for kind in ("cpu", "cuda") for mode in backend.modes_on(kind))
    assert main(["list", "--frameworks", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == markdown_table()


def test_a_setting_without_a_switch_of_its_own_is_refused_in_one_line(tmp_path, capsys,
                                                                      monkeypatch):
    torch = BACKENDS["torch"]
    monkeypatch.setitem(BACKENDS, "torch", replace(torch, capabilities=replace(
        torch.capabilities, tuning={"cudnn_benchmark": "torch.backends.cudnn.benchmark"})))
    out = tmp_path / "out"
    code = main(["run", "tiny-arcface", "--device", "cpu", "--runs", "1", "--out", str(out),
                 "--ddp-bucket-mb", "16", "--no-ddp-static-graph"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and not out.exists()
    assert ("the torch backend has no switch that honours --ddp-bucket-mb 16.0, "
            "--no-ddp-static-graph (it honours: cudnn_benchmark;") in err


def test_what_is_refused_is_the_backends_own_to_refuse():
    """Another framework's setting is not torch's to refuse, nor a GPU setting on a CPU; a
    setting left at its default is never refused."""
    bare = replace(BACKENDS["torch"], capabilities=replace(BACKENDS["torch"].capabilities,
                                                           tuning={}))
    assert bare.tuning_refusal(Tuning(), "cuda") is None
    assert bare.tuning_refusal(Tuning(mxnet_kvstore="device", tf_onednn=True), "cuda") is None
    assert bare.tuning_refusal(Tuning(cudnn_benchmark=False, tf32="off"), "cpu") is None
    assert "--no-cudnn-benchmark, --tf32 off" in bare.tuning_refusal(
        Tuning(cudnn_benchmark=False, tf32="off"), "cuda")
    mxnet = replace(BACKENDS["mxnet"], capabilities=replace(BACKENDS["mxnet"].capabilities,
                                                            tuning={}))
    assert "--mxnet-kvstore device" in mxnet.tuning_refusal(Tuning(mxnet_kvstore="device"),
                                                             "cpu")


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_framework_declares_how_it_honours_tf32(name):
    """One rule for fp32 on a GPU (``Tuning.tf32``) reaches all six, each by its own switch;
    a declared setting names that switch."""
    tuning = BACKENDS[name].capabilities.tuning
    assert set(tuning) <= set(TUNING_SETTINGS)
    assert "tf32" in tuning and all(tuning.values())
