"""OneFlow's two execution modes: ``eager`` and ``graph`` (one ``oneflow.nn.Graph`` with the
graph's own optimizer, clipping and schedule, global tensors on several ranks;
``backends/oneflow/graph_step.py``).

A graph run on 1 and 2 ranks reaches the worker and is recorded in that mode, its graph compiled
once, inside step 0 (its compile time, timed around ``nn.Graph._compile``, part of that step's
time; each step's count 1), never in the window; an eager run compiles nothing (0.0, no count).
Its losses are eager mode's (the same start; the sharded head, whose
collectives run on 2 ranks). In one process, each head's and classification's steps are eager
mode's through a change of the rate and with clipping acting, and a schedule one step late is
seen. What graph mode cannot run is refused in one line: sampling ``pfc`` up front, and a
float64 alignment run by the worker (OneFlow 0.9's graph has no float64 update). The runs go
through the runner (``Plan``/``Runner``), each mode's two cases in one plan shared by the
module's tests.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainperf.backends import get_backend
from trainperf.backends.oneflow.backend import GRAPH_FLOAT64
from trainperf.config import Measure, Topology, Tuning
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, check_plan
from mode_runs import assert_learned_in, records, run_in, starts, step_compiles
from run_util import left_behind

pytestmark = pytest.mark.slow
MODES = ("graph", "eager")
FLOAT32_ROUNDING = 1e-6
"""Relative: one loss computed by the same kernels in either mode (measured: bit-identical on
1 rank, 1.2e-7 apart on 2)."""
CLIP_ROUNDING = 5e-4
"""Relative, once clipping has acted: each mode sums the gradient's squares for its norm in
float32 in its own order (eager OneFlow's ``clip_grad_norm_`` 2.2e-5 below the float64 norm of
the same gradients, the graph's clip 5.2e-5 below, measured on tiny-arcface), and the step
after it carries that difference (measured: 1e-5 to 7e-5 over three steps). A rate applied one
step late moves the third loss by more than 100 times this."""


ITERS, WARMUP = 3, 1


@pytest.fixture(scope="module")
def runs(tmp_path_factory, oneflow_python) -> dict[str, tuple[Path, dict]]:
    folder = tmp_path_factory.mktemp("oneflow_modes")
    return {mode: (folder / mode, run_in("oneflow", mode, folder / mode, ITERS, WARMUP))
            for mode in MODES}




def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ------------------------------------------------------------- declaration and refusals

def test_both_modes_are_declared_on_both_devices():
    backend = get_backend("oneflow")
    for kind in ("cpu", "cuda"):
        assert backend.modes_on(kind) == ("eager", "graph")  # eager the default
        assert backend.resolve_mode("default", kind) == "eager"
    assert "nn.Graph" in backend.capabilities.mode_words["graph"]


def test_sampling_pfc_is_refused_in_graph_mode_in_one_line(tmp_path):
    """pfc with sampling runs eager only, and the runner refuses it in graph mode before
    anything starts; at ratio 1 (mp), in eager mode and under ``best`` it runs."""
    backend = get_backend("oneflow")
    pfc = get_recipe("tiny-arcface").workload.replace(fc="pfc", sample_ratio=0.1)
    two = Topology(devices_per_node=2, device="cpu")
    why = backend.refusal(pfc, two, Tuning(mode="graph"), "cpu")
    assert why and "\n" not in why and "--mode eager only" in why
    plan = Plan("tiny-arcface", pfc, Measure(runs=1, iters=2, warmup=1), [Case(two, 8)],
                tmp_path, tuning=Tuning(mode="graph"), framework="oneflow")
    with pytest.raises(ValueError, match="pfc with sampling"):
        check_plan(plan)
    for mode in ("eager", "best", "default"):
        assert backend.refusal(pfc, two, Tuning(mode=mode), "cpu") is None
    assert backend.refusal(pfc.replace(sample_ratio=1.0), two, Tuning(mode="graph"), "cpu") is None
    rising = pfc.replace(sample_ratio=1.0, lr_steps=(10,), lr_scales=(2.0,))
    assert "ConstantLR" in backend.refusal(rising, two, Tuning(mode="graph"), "cpu")


# ---------------------------------------------------------------------- runs, both modes

def test_a_graph_run_on_one_and_two_ranks_is_recorded(runs):
    out, doc = runs["graph"]
    for run in records(doc):
        assert_learned_in(run, "graph", ITERS)
        # Compiled once, by the graph's first call in step 0 (so inside that step's time),
        # and never again inside the window.
        assert run["recompiles_in_window"] == 0
        assert 0 < run["compile_s"] <= run["first_step_s"], run
        assert run["compile_measure"].startswith("oneflow.nn.Graph._compile")
    compiles = step_compiles(out)
    assert len(compiles) == 2 and all(c == [1] * ITERS for c in compiles.values()), compiles
    for start in starts(out):
        settings = start["settings"]
        assert settings["mode"] == "graph"
        assert "compile_s" not in settings
        assert settings["oneflow_graph"]["module"] == "oneflow.nn.Graph"
        assert settings["oneflow_graph"]["clip"].startswith("backbone group clip_grad_max_norm")
        assert settings["head"] == "global split(0) class matrix"
    assert left_behind(out) == []


def test_an_eager_run_compiles_nothing(runs):
    out, doc = runs["eager"]
    for run in records(doc):
        assert run["status"] == "ok" and run["mode"] == "eager"
        assert run["recompiles_in_window"] is None  # nothing is compiled to count
        assert run["compile_s"] == 0.0
        assert run["compile_measure"].startswith("eager: nothing is compiled")
    compiles = step_compiles(out)
    assert len(compiles) == 2 and all(c == [None] * ITERS for c in compiles.values()), compiles


def test_graph_starts_where_eager_does_and_follows_it(runs):
    """Same start: the first loss of each case is eager mode's to float32 rounding, on 1 rank
    and on 2 (the sharded softmax over ranks, the gradient through the gathered embeddings);
    the next ones follow it to the clip's rounding."""
    graph, eager = (records(runs[mode][1]) for mode in MODES)
    for g, e in zip(graph, eager):
        assert rel(g["losses"][0], e["losses"][0]) <= FLOAT32_ROUNDING, (g["losses"],
                                                                          e["losses"])
        for a, b in zip(g["losses"][1:], e["losses"][1:]):
            assert rel(a, b) <= CLIP_ROUNDING, (g["losses"], e["losses"])


# ------------------------------------------------- the training rule, step by step, 1 rank

RULE = r"""
import json, sys
from trainperf.config import Workload
from trainperf.recipes import get_recipe
from trainperf.backends.oneflow.dist import dist_from_env
from trainperf.backends.oneflow.graph_step import GraphTrainStep
from trainperf.backends.oneflow.step import TrainStep, synthetic_batch

STEPS = 3
tiny = get_recipe("tiny-arcface").workload.replace(dropout=0.0, lr_steps=(1,), lr_scales=(0.1,))
CASES = {
    "dp": tiny,
    "dp_unclipped": tiny.replace(clip_grad_norm=None),
    "classification": Workload(backbone="resnet_v1b_tiny", task="classification",
                               num_classes=10, batch_size=4, input_size=32, loss="softmax",
                               weight_decay=1e-4, clip_grad_norm=None, lr_steps=(1,),
                               lr_scales=(0.1,)),
}
dist = dist_from_env("cpu")


def losses(step_class, workload):
    step = step_class(workload, dist)
    images, labels = synthetic_batch(workload, dist)
    if step_class is GraphTrainStep:
        images, labels = step.place(images, labels)
    got, timed = [], []
    for _ in range(STEPS):
        got.append(float(step(images, labels).numpy()))
        timed.append(getattr(step, "compile_s", None))
    return got, getattr(step, "compiles", None), timed


out = {}
for name, workload in CASES.items():
    out[name] = {"eager": losses(TrainStep, workload)[0]}
    out[name]["graph"], out[name]["compiles"], out[name]["compile_s"] = losses(GraphTrainStep,
                                                                             workload)
# The control: the graph's schedule one step late.
out["late"] = losses(GraphTrainStep, tiny.replace(lr_steps=(2,)))[0]
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def rule(tmp_path_factory, oneflow_python) -> dict:
    """``RULE``'s losses, run in OneFlow's environment with trainperf's source on its path."""
    from trainperf.backends.oneflow.backend import library_path

    folder = tmp_path_factory.mktemp("oneflow_graph_rule")
    (folder / "rule.py").write_text(RULE)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"),
               OMP_NUM_THREADS="1", LD_LIBRARY_PATH=library_path(oneflow_python),
               GLOG_minloglevel="2")
    proc = subprocess.run([oneflow_python, str(folder / "rule.py"), str(folder / "rule.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((folder / "rule.json").read_text())


def test_graph_trains_by_eager_modes_rule(rule):
    """Three steps across the rate's change: without clipping the graph's optimizer, weight
    decay, momentum and schedule give eager mode's losses to float32 rounding (the ``dp``
    head, and classification's cross-entropy); with clipping acting, to the clip's rounding.
    Each graph compiled once, its compile time taken at its first call and never added to."""
    for name, tol in (("dp_unclipped", FLOAT32_ROUNDING), ("classification", FLOAT32_ROUNDING),
                      ("dp", CLIP_ROUNDING)):
        got = rule[name]
        assert got["compiles"] == 1
        first, *later = got["compile_s"]
        assert first > 0 and later == [first] * len(later), got["compile_s"]
        assert rel(got["graph"][0], got["eager"][0]) <= FLOAT32_ROUNDING, (name, got)
        for a, b in zip(got["graph"], got["eager"]):
            assert rel(a, b) <= tol, (name, got)


def test_a_schedule_one_step_late_is_seen(rule):
    late, eager = rule["late"], rule["dp"]["eager"]
    assert late[:2] == pytest.approx(eager[:2], rel=CLIP_ROUNDING)
    assert rel(late[2], eager[2]) > 100 * CLIP_ROUNDING, (late, eager)


# ----------------------------------------------------------------------- alignment

def test_float64_alignment_is_refused_in_graph_mode(tmp_path, capsys):
    """OneFlow 0.9's graph cannot train float64 parameters (``graph_step.py``): the backend
    declares the mode float32-only, and `trainperf align` refuses it in one line before
    torch's side runs (the graph's float32 equivalence with eager is tested above)."""
    from trainperf.cli import main

    code = main(["align", "tiny-arcface", "--framework", "oneflow", "--mode", "graph",
                 "--devices", "1", "--fc", "dp", "--out", str(tmp_path / "align")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"trainperf: error: {GRAPH_FLOAT64}"]
    assert not (tmp_path / "align").exists()
