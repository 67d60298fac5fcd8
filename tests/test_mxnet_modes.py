"""MXNet's two execution modes (``backends/mxnet/backend.py``'s ``MODES``): ``hybrid``, the
default and the seeds' MXNet (the backbone hybridized with ``static_alloc`` and ``static_shape``,
one cached graph), and ``imperative`` (the same Gluon blocks, not hybridized, each operator run
as it is called under ``autograd.record()``).

Through the runner (``Plan``/``Runner``): tiny-arcface with the sharded head on 1 and 2 CPU
ranks in each mode, recorded in the mode that ran, the imperative one starting from the loss
the hybrid one starts from; the hybrid graph's build timed where Gluon builds it, inside step 0
(``compile_s``), and each step's count of builds. In the worker's own environment: how often
the hybrid graph is built (``compile_count``) and that every build adds to its time, and the
float64 BatchNorm stand-in still leaving what MXNet's own kernel leaves when nothing is
hybridized. ``trainperf align --mode imperative``: float64
alignment with torch, mp on 2 ranks. No case is refused for its mode; a mode MXNet
does not have is, in one line, before anything starts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from trainperf.backends import get_backend
from trainperf.config import Measure, Topology, Tuning
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner
from align_checks import align, assert_strictly_aligned
from mode_runs import RANKS, assert_learned_in, records, run_in, starts, step_compiles
from run_util import left_behind

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
FLOAT32_ROUNDING = 1e-6
"""Relative: one loss computed twice in float32 by the same operators, in another order (seen:
one float32 ulp apart at the first step, 7e-8 of the loss)."""


ITERS, WARMUP = 4, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mxnet_python) -> dict[str, tuple[Path, dict]]:
    """Each mode's two cases; the hybrid one asked for as ``default``."""
    folder = tmp_path_factory.mktemp("mxnet_modes")
    return {name: (folder / name, run_in("mxnet", mode, folder / name, ITERS, WARMUP))
            for name, mode in (("hybrid", "default"), ("imperative", "imperative"))}




def test_hybrid_first_then_imperative_on_both_devices():
    backend = get_backend("mxnet")
    for kind in ("cpu", "cuda"):
        assert backend.modes_on(kind) == ("hybrid", "imperative")
        assert backend.resolve_mode("default", kind) == "hybrid"
    words = backend.capabilities.mode_words
    assert "hybridize(static_alloc=True, static_shape=True)" in words["hybrid"]
    assert "no hybridize" in words["imperative"]


def test_an_imperative_run_on_one_and_two_ranks_is_recorded(runs):
    out, doc = runs["imperative"]
    for run in records(doc):
        assert_learned_in(run, "imperative", ITERS)
        assert run["recompiles_in_window"] is None  # no graph: nothing is built to count
        assert run["startup_s"] > 0
        assert run["compile_s"] == 0.0
        assert run["compile_measure"].startswith("imperative: nothing is compiled")
    for start in starts(out):
        assert start["settings"]["mode"] == "imperative"
        assert start["settings"]["hybridize"] is None
        assert "compile_s" not in start["settings"]
    compiles = step_compiles(out)
    assert len(compiles) == 2 and all(c == [None] * ITERS for c in compiles.values()), compiles
    assert left_behind(out) == []


def test_the_default_runs_hybridized_and_builds_its_graph_before_the_window(runs):
    """The graph is built once, by Gluon inside step 0's call of the network: its build time is
    part of that step's time (a timer anywhere else could exceed it), and the count the step
    events carry is 1 from step 0 on."""
    out, doc = runs["hybrid"]
    for run in records(doc):
        assert run["status"] == "ok" and run["mode"] == "hybrid"
        assert run["recompiles_in_window"] == 0
        assert 0 < run["compile_s"] <= run["first_step_s"], run
        assert run["compile_measure"].startswith("Gluon HybridBlock._build_cache")
        assert "not the static_alloc shape inference and memory planning" in \
            run["compile_measure"]
    for start in starts(out):
        assert start["settings"]["mode"] == "hybrid"
        assert start["settings"]["hybridize"] == {"static_alloc": True, "static_shape": True}
        assert "compile_s" not in start["settings"]
    compiles = step_compiles(out)
    assert len(compiles) == 2 and all(c == [1] * ITERS for c in compiles.values()), compiles


def test_imperative_starts_from_hybrids_loss(runs):
    """Same start, same operators: each case's first loss (1 rank; 2 ranks, the loss over the
    gathered batch) is the hybrid run's to float32 rounding."""
    imperative, hybrid = (records(runs[name][1]) for name in ("imperative", "hybrid"))
    for i, h in zip(imperative, hybrid):
        assert math.isclose(i["losses"][0], h["losses"][0], rel_tol=FLOAT32_ROUNDING), \
            (i["losses"], h["losses"])


def test_a_mode_mxnet_lacks_is_refused_before_anything_runs(tmp_path):
    recipe = get_recipe("tiny-arcface")
    plan = Plan(recipe.name, recipe.workload, Measure(runs=1, iters=2, warmup=1),
                [Case(Topology(device="cpu"), 8)], tmp_path / "r", tuning=Tuning(mode="eager"),
                framework="mxnet")
    with pytest.raises(ValueError) as err:
        Runner(plan)
    assert str(err.value).startswith("the mxnet backend runs --mode hybrid, imperative on a CPU")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "r").exists()


def test_no_case_is_refused_for_its_mode():
    """What the backend runs hybridized it runs imperative: every head on 1 and 2 ranks over
    Horovod and dist_sync, dp over kvstore device, on either device; the one refusal is the
    kvstore's."""
    backend = get_backend("mxnet")
    face = get_recipe("tiny-arcface").workload
    for kind in ("cpu", "cuda"):
        for fc in ("dp", "mp", "pfc"):
            for kvstore in ("horovod", "dist_sync", "device"):
                for ranks in RANKS:
                    topology = Topology(devices_per_node=ranks, device=kind)
                    answers = {mode: backend.refusal(face.replace(fc=fc), topology,
                                                     Tuning(mode=mode, mxnet_kvstore=kvstore),
                                                     kind)
                               for mode in ("hybrid", "imperative")}
                    assert answers["hybrid"] == answers["imperative"], (kind, fc, kvstore, ranks)
                    sharded_in_one_process = kvstore == "device" and ranks > 1 and fc != "dp"
                    assert (answers["imperative"] is None) != sharded_in_one_process, answers


# ---- In the worker's environment: the graph count, and the BatchNorm stand-in imperative.
MXNET_SIDE = r"""
import json, sys
import mxnet as mx
import numpy as np
from mxnet import autograd
from trainperf.config import Workload
from trainperf.backends.mxnet import models
from trainperf.backends.mxnet.alignment import MXNetRunningStatistics
from trainperf.backends.mxnet.comm import Comm
from trainperf.backends.mxnet.step import TrainStep, synthetic_batch

out = {}
# How many times the hybrid graph is ready to run: built at the first step, planned again for a
# new batch shape (and back), built again after a hybridize clears it.
w = Workload(backbone="iresnet_tiny", num_classes=50, batch_size=4, embedding_size=16)
# The build's seconds alongside: each build adds to them, a step that builds nothing does not.
counts, seconds = {}, {}
for mode in ("hybrid", "imperative"):
    step = TrainStep(w, Comm(), mode=mode)
    four, two = ([synthetic_batch(w.replace(batch_size=b), 0, mx.cpu())] for b in (4, 2))
    seen, timed = [step.compile_count()], [step.compile_seconds()]
    for batches in (four, four, two, two, four):
        step(batches).wait_to_read()
        seen.append(step.compile_count())
        timed.append(step.compile_seconds())
    if mode == "hybrid":
        step.net.hybridize(static_alloc=True, static_shape=True)
        step(four).wait_to_read()
        seen.append(step.compile_count())
        timed.append(step.compile_seconds())
    counts[mode], seconds[mode] = seen, timed
out["counts"], out["seconds"] = counts, seconds

# The float64 BatchNorm stand-in, not hybridized, against MXNet's own kernel in float32 (where
# that kernel is exact): three training passes of iresnet_tiny each way.
def passes(standin):
    mx.random.seed(3)
    net = models.build_backbone("iresnet_tiny", embedding_size=8, input_size=16)
    net.initialize()
    rs = np.random.RandomState(1)  # statistics away from their start values
    for name, p in sorted(net.collect_params().items()):
        if name.endswith("running_var"):
            p.set_data(rs.uniform(0.5, 2.0, p.shape))
        elif name.endswith(("running_mean", "beta")):
            p.set_data(rs.normal(0, 0.5, p.shape))
    stats = MXNetRunningStatistics(net) if standin else None
    rs = np.random.RandomState(5)
    got = {}
    for i in range(3):
        x = mx.nd.array(rs.normal(0.3, 1.5, (4, 3, 16, 16)), dtype="float32")
        x.attach_grad()
        r = mx.nd.array(rs.normal(size=(4, 8)), dtype="float32")
        with autograd.record():
            objective = (net(x) * r).sum()
        objective.backward()
        if stats is not None:
            stats.update()
        mx.nd.waitall()
        got[f"{i}/x_grad"] = x.grad.asnumpy()
        for name, p in models.torch_names(net).items():
            if name.endswith(("running_mean", "running_var")):
                got[f"{i}/state/{name}"] = p.data().asnumpy()
            elif p.grad_req != "null":
                got[f"{i}/grad/{name}"] = p.grad().asnumpy()
    return got

native, standin = passes(False), passes(True)
out["bn_states"] = sum(1 for k in native if "/state/" in k)
out["bn_unequal"] = sorted(k for k in native if "/state/" not in k
                           and not np.array_equal(native[k], standin[k]))
out["bn_worst_state"] = max(float(np.abs(standin[k] - native[k]).max() / np.abs(native[k]).max())
                            for k in native if "/state/" in k)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def worker_side(mxnet_python) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop("TRAINPERF_FAULT", None)
    proc = subprocess.run([mxnet_python, "-c", MXNET_SIDE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_compile_count_is_the_hybrid_graphs_builds_and_plans(worker_side):
    counts = worker_side["counts"]
    # Built at the first step; planned again at each change of batch shape; built again after
    # hybridize() cleared it.
    assert counts["hybrid"] == [0, 1, 1, 2, 2, 3, 4]
    assert counts["imperative"] == [None] * 6


def test_every_build_adds_to_the_compile_time_and_nothing_else_does(worker_side):
    """The timer sits around Gluon's build alone: it grows at the first step and after
    hybridize() cleared the graph, and at no other step, re-plans for a new batch shape
    included (MXNet plans inside the CachedOp's call, which the measure says it leaves out).
    Imperative: 0.0 throughout."""
    hybrid = worker_side["seconds"]["hybrid"]
    assert hybrid[0] == 0.0 and hybrid[1] > 0.0
    assert hybrid[1] == hybrid[2] == hybrid[3] == hybrid[4] == hybrid[5] < hybrid[6]
    assert worker_side["seconds"]["imperative"] == [0.0] * 6


def test_the_batchnorm_stand_in_holds_imperative(worker_side):
    """Not hybridized, the stand-in leaves what MXNet's own BatchNorm leaves: the same gradients,
    bit for bit, and the running statistics within 1e-6 of their largest entry after three
    passes (the native 1 - 0.9f = 0.10000002 against the stand-in's 0.1, and a rounding per
    product and sum each pass)."""
    assert worker_side["bn_states"] == 3 * 2 * 19  # three passes, every BatchNorm's two arrays
    assert worker_side["bn_unequal"] == []
    assert worker_side["bn_worst_state"] <= 1e-6


def test_imperative_aligns_with_torch_in_float64(tmp_path, mxnet_python, capsys):
    """mp on two ranks (one process per rank over Horovod: the backbone's gradients summed
    over ranks, the gathered embeddings and the sharded softmax; torch's side is the one
    ``test_mxnet_align`` uses): every tensor within float64's tolerance of torch's, the
    running variances set apart as the backend's declared rule. The mode changes only the
    backbone's execution, which this case runs whole; dp and one rank add no other code of it."""
    code, outcome = align("mxnet", tmp_path / "align", "2", "mp", "--mode", "imperative")
    table = capsys.readouterr().out
    assert code == 0, table
    assert outcome["aligned"] and outcome["dtype"] == "float64", table
    assert outcome["mode"] == "imperative"
    assert [(c["fc"], c["ranks"]) for c in outcome["checks"]] == [("mp", 2)]
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
        assert {d["tensor"].rsplit(".", 1)[1] for d in check["declared"]} == {"running_var"}
    assert left_behind(tmp_path) == []
