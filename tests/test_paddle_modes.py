"""Paddle's two execution modes: ``dygraph`` and ``static`` (its backbone turned into a static
program by ``paddle.jit.to_static``; ``backends/paddle/step.py``).

A static run on 1 and 2 ranks reaches the worker and is recorded in that mode, with its one
program built inside step 0 (the build's time, timed where dy2static builds, part of that
step's; each step's count 1) and none inside the window; a dygraph run builds nothing (0.0, no
count). A static run's first loss is dygraph's (the same operations on the same start), and it
aligns with torch in float64 on 2 ranks. In the worker's own environment: how many programs
static mode builds (``compile_count``) and that each build adds its time (``compile_seconds``).
The two modes run the same cases: no head or rank count is refused in either; a mode Paddle
lacks is, in one line. The runs go through the runner (``Plan``/``Runner``), each mode's two
cases in one plan shared by the module's tests.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from trainperf.backends import get_backend
from align_checks import align, assert_strictly_aligned
from mode_runs import assert_learned_in, records, run_in, starts, step_compiles
from run_util import left_behind

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MODES = ("static", "dygraph")
ITERS, WARMUP = 4, 1
FLOAT32_ROUNDING = 1e-6
"""Relative: two float32 computations of one loss by the same operations (both modes run the
same kernels; on this CPU their losses have been bit-identical)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, paddle_python) -> dict[str, tuple[Path, dict]]:
    folder = tmp_path_factory.mktemp("paddle_modes")
    return {mode: (folder / mode, run_in("paddle", mode, folder / mode, ITERS, WARMUP))
            for mode in MODES}




def test_both_modes_are_declared_on_both_devices():
    backend = get_backend("paddle")
    for kind in ("cpu", "cuda"):
        assert backend.modes_on(kind) == ("dygraph", "static")  # dygraph the default
        assert backend.resolve_mode("default", kind) == "dygraph"
    assert "to_static" in backend.capabilities.mode_words["static"]


def test_a_mode_paddle_lacks_is_refused_in_one_line():
    why = get_backend("paddle").mode_refusal("compile", "cpu")
    assert why is not None and "\n" not in why and "dygraph, static" in why


PADDLE_SIDE = r"""
import json
import paddle
from trainperf.recipes import get_recipe
from trainperf.backends.paddle.comm import Comm
from trainperf.backends.paddle.step import TrainStep, synthetic_batch

workload = get_recipe("tiny-arcface").workload.replace(batch_size=4)
out = {}
for mode in ("static", "dygraph"):
    step = TrainStep(workload, Comm(), mode=mode)
    images, labels = synthetic_batch(workload, 0)
    counts, seconds = [step.compile_count()], [step.compile_seconds()]
    # Batch 4, again, 2 (a new shape), 4 again (its program is kept).
    for n in (4, 4, 2, 4):
        step(images[:n], labels[:n])
        counts.append(step.compile_count())
        seconds.append(step.compile_seconds())
    out[mode] = {"counts": counts, "seconds": seconds}
print(json.dumps(out))
"""


def test_compile_count_is_the_programs_built(paddle_python):
    """In the worker's environment: static builds the backbone's program at its first step and
    one more for a new batch shape, none for a shape it has seen, each build adding its time;
    dygraph builds nothing."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    env.pop("TRAINPERF_FAULT", None)
    proc = subprocess.run([paddle_python, "-c", PADDLE_SIDE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    assert built["static"]["counts"] == [0, 1, 1, 2, 2]
    none, first, same, second, again = built["static"]["seconds"]
    assert none == 0.0 and 0 < first == same < second == again, built["static"]["seconds"]
    assert built["dygraph"] == {"counts": [None] * 5, "seconds": [0.0] * 5}


def test_a_static_run_on_one_and_two_ranks_is_recorded(runs):
    out, doc = runs["static"]
    for run in records(doc):
        assert_learned_in(run, "static", ITERS)
        # The backbone's program is built in the first step (so inside its time), and never
        # again in the window.
        assert run["recompiles_in_window"] == 0
        assert 0 < run["compile_s"] <= run["first_step_s"], run
        assert run["compile_measure"].startswith("paddle.jit.to_static program builds")
    compiles = step_compiles(out)
    assert compiles == {"1n1g": [1] * ITERS, "1n2g": [1] * ITERS}, compiles
    for start in starts(out):
        assert start["settings"]["mode"] == "static"
        assert "compile_s" not in start["settings"]
        assert "to_static" in start["settings"]["graph"]
        assert start["settings"]["static_executor"]["serial_run"] is False
    assert left_behind(out) == []


def test_a_dygraph_run_compiles_nothing(runs):
    out, doc = runs["dygraph"]
    for run in records(doc):
        assert run["status"] == "ok" and run["mode"] == "dygraph"
        assert run["recompiles_in_window"] is None  # nothing is compiled to count
        assert run["compile_s"] == 0.0
        assert run["compile_measure"].startswith("dygraph: nothing is compiled")
    compiles = step_compiles(out)
    assert compiles == {"1n1g": [None] * ITERS, "1n2g": [None] * ITERS}, compiles


def test_static_starts_where_dygraph_does(runs):
    """Same start, same operations: the first loss of each case is dygraph's to float32
    rounding, on 1 rank and on 2 (the sharded softmax over ranks)."""
    static, dygraph = (records(runs[mode][1]) for mode in ("static", "dygraph"))
    for s, d in zip(static, dygraph):
        assert math.isclose(s["losses"][0], d["losses"][0], rel_tol=FLOAT32_ROUNDING), \
            (s["losses"], d["losses"])


def test_static_aligns_with_torch_in_float64(tmp_path, paddle_python, capsys):
    """The static program computes in float64 (the stand-ins of ``alignment.py`` inside it):
    ``mp`` on 2 ranks (the backbone's program, its summed gradients and the sharded head),
    every tensor within float64's tolerance of torch's. torch's side is the one
    ``test_paddle_runs.py`` checks dygraph against (shared in a session)."""
    code, outcome = align("paddle", tmp_path / "align", "2", "mp", "--mode", "static")
    table = capsys.readouterr().out
    assert code == 0, table
    assert outcome["aligned"] and outcome["dtype"] == "float64", table
    assert outcome["mode"] == "static"
    assert [(c["fc"], c["ranks"]) for c in outcome["checks"]] == [("mp", 2)]
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
    assert left_behind(tmp_path) == []
