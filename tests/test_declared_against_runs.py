"""What a run records is what its framework's row of the framework table declares. The runs are
the suite's own: each framework's run file holds its module's run against its row
(``declarations.assert_runs_as_declared``: torch in test_cli_run.py, torch and MXNet in
test_mxnet_runs.py, Paddle, JAX, TensorFlow and OneFlow in their test_*_runs.py). Here, without
a run: the table's cells read back as the declarations, and the one layout (NHWC) of JAX's and
TensorFlow's backbones declared, asked for, refused where another is asked for, and recorded
whoever made the plan."""

from __future__ import annotations

import pytest

from declarations import Declared, declared, table_rows
from trainperf.backends import BACKENDS
from trainperf.backends.base import DEVICE_KINDS
from trainperf.backends.workerkit import FrameworkRun
from trainperf.cli import main
from trainperf.config import Measure, Topology, Tuning
from trainperf.plans import layout_for
from trainperf.protocol import RunSpec, Start
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_the_table_says_each_declaration(name):
    """The cells the runs are held against (layout, modes with the default first, precisions,
    speed settings) are the backend's ``Capabilities``, device kind by device kind."""
    assert set(table_rows()) == set(BACKENDS)
    backend = BACKENDS[name]
    caps = backend.capabilities
    for kind in DEVICE_KINDS:
        assert declared(name, kind) == Declared(
            backend.default_layout(kind) == "channels_last", backend.modes_on(kind),
            caps.precisions.get(kind, ()), tuple(caps.tuning)), (name, kind)


NHWC_ONLY = sorted(n for n, b in BACKENDS.items() if not b.capabilities.channels_first)


def test_the_frameworks_written_in_nhwc_alone_say_so():
    assert NHWC_ONLY == ["jax", "tf"]  # jax/models.py, tf/models.py


@pytest.mark.parametrize("name", NHWC_ONLY)
def test_an_nhwc_only_framework_runs_its_layout_and_refuses_the_other(name, tmp_path, capsys):
    """Its backbones are NHWC on every device: ``auto`` resolves to it, channels-last is what
    it runs anyway, and channels-first, which would run NHWC under an NCHW label, is refused in
    one line before anything starts."""
    assert layout_for(name, "auto", "cpu") is layout_for(name, "auto", "cuda") is True
    backend, face = BACKENDS[name], get_recipe("tiny-arcface").workload
    asked = Tuning(memory_format="channels_last")
    assert backend.refusal(face.replace(channels_last=True), Topology(), asked, "cpu") is None
    out = tmp_path / "out"
    code = main(["run", "tiny-arcface", "--framework", name, "--device", "cpu",
                 "--memory-format", "channels_first", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("trainperf: error:") and "\n" not in err
    assert f"the {name} backend's backbones are NHWC only" in err, err
    assert not out.exists()


@pytest.mark.parametrize("name", NHWC_ONLY)
def test_its_worker_records_nhwc_whoever_made_the_spec(name):
    """An alignment's or a check's plan is made without the declaration (the recipe's
    workload, channels-first): the worker's start event still says what it computes in."""
    class Run(FrameworkRun):
        backend = BACKENDS[name]

    spec = RunSpec(get_recipe("tiny-arcface").workload, Measure(runs=1, iters=3, warmup=1))
    assert spec.workload.channels_last is False
    assert Run(spec).spec.workload.channels_last is True
    torch_run = type("TorchRun", (FrameworkRun,), {"backend": BACKENDS["torch"]})
    assert torch_run(spec).spec is spec  # a framework with both layouts runs what it is asked


def test_the_results_record_the_layout_the_workers_ran(tmp_path):
    workload = get_recipe("tiny-arcface").workload
    plan = Plan("tiny-arcface", workload, Measure(runs=1, iters=3, warmup=1),
                [Case(Topology(device="cpu"), workload.batch_size)], tmp_path / "out")
    runner = Runner(plan)
    plan.out_dir.mkdir()
    ran = workload.replace(channels_last=True).to_dict()
    runner.start_events[("1n1g", workload.batch_size)] = Start(
        world_size=1, global_batch=workload.batch_size, device="cpu", env={}, workload=ran)
    assert runner.write_results()["workload"]["channels_last"] is True
