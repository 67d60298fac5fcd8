"""TensorFlow's execution modes: ``function`` (``tf.function``, jit_compile off, its default) and
``xla`` (``jit_compile=True``, the whole step one XLA program).

- A run in each mode through the runner (tiny-arcface, dp, one rank, dropout off so that the
  two modes start from the same computation): the record names the mode, the losses are
  finite, the first loss of ``xla`` is ``function``'s within float32 rounding (the same
  weights and batch, the arithmetic only fused and reordered by XLA), and the step compiled
  once, before the window.
- The cases ``xla`` cannot run are refused up front, in one line: several CPU ranks (TensorFlow
  compiles no collective for CPU devices inside ``jit_compile``) and a sampling pfc (its sample
  grows on the device, a shape XLA cannot compile). ``--mode best`` probes ``xla`` only where
  it is not refused.
- Strict alignment with torch in float64 under ``xla`` (XLA on a CPU computes in float64),
  dp and mp on one rank.

Each TensorFlow run costs seconds of start-up and XLA's compilation: two runs in one module
fixture, one alignment."""

from __future__ import annotations

import math

import pytest

from align_checks import align, assert_strictly_aligned
from run_util import left_behind
from trainperf.backends import get_backend
from trainperf.cli import main
from trainperf.config import Measure, Topology, Tuning
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner

pytestmark = pytest.mark.slow
MODES = ("function", "xla")
ITERS, WARMUP = 4, 1
FLOAT32_ROUNDING = 1e-5
"""Relative: the first loss (about 50, a sum over 1000 classes after a network of a few dozen
layers) in float32, whose unit roundoff is 6e-8, computed in another order by XLA; seen: 1.5e-7."""
TWO_CPU_RANKS = "runs --mode xla on one CPU rank only"
SAMPLING_PFC = "runs --fc pfc with sampling (--sample-ratio below 1) in --mode function only"


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory, tf_python):
    """mode -> (results document, output folder) of one run of tiny-arcface in that mode."""
    root = tmp_path_factory.mktemp("tf_modes")
    workload = get_recipe("tiny-arcface").workload.replace(dropout=0.0)
    docs = {}
    for mode in MODES:
        plan = Plan("tiny-arcface", workload, Measure(runs=1, iters=ITERS, warmup=WARMUP),
                    [Case(Topology(devices_per_node=1, device="cpu"), workload.batch_size)],
                    root / mode, Tuning(mode=mode), framework="tf")
        docs[mode] = Runner(plan).run(), root / mode
    return docs


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_runs_and_is_recorded(mode_runs, mode):
    doc, out = mode_runs[mode]
    [case] = doc["cases"]
    [run] = case["runs"]
    assert run["status"] == "ok", run["error"]
    assert run["mode"] == case["settings"]["mode"] == mode
    assert case["settings"]["graph"] == get_backend("tf").capabilities.mode_words[mode]
    assert len(run["losses"]) == ITERS and all(math.isfinite(v) for v in run["losses"])
    assert run["losses"][-1] < run["losses"][0]
    # Traced (and, under XLA, compiled) once, at step 0 in the warm-up; not again.
    assert run["compile_s"] > 0 and run["recompiles_in_window"] == 0
    assert left_behind(out) == []


def test_xla_starts_from_the_same_loss_as_function(mode_runs):
    first = {mode: mode_runs[mode][0]["cases"][0]["runs"][0]["loss_first"] for mode in MODES}
    assert first["xla"] == pytest.approx(first["function"], rel=FLOAT32_ROUNDING)


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "1,2"], TWO_CPU_RANKS),
    (["--fc", "pfc", "--sample-ratio", "0.5"], SAMPLING_PFC),
])
def test_what_xla_cannot_compile_is_refused_up_front(tmp_path, capsys, argv, needle):
    out = tmp_path / "r"
    code = main(["run", "tiny-arcface", "--framework", "tf", "--mode", "xla", "--device", "cpu",
                 *argv, "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("trainperf: error:") and "\n" not in err
    assert needle in err, err
    assert not out.exists(), "refused before anything starts"


def test_only_xla_is_refused_and_only_where_it_cannot_compile():
    """The same cases in ``function`` (and ``default``, ``best``, which probes only the modes
    not refused) run; ``xla`` runs a pfc without sampling (it is mp) and, on GPUs, several
    ranks (NCCL collectives compile inside ``jit_compile``)."""
    tf = get_backend("tf")
    face = get_recipe("tiny-arcface").workload
    sampling = face.replace(fc="pfc", sample_ratio=0.5)

    def why(workload, ranks, mode, device="cpu"):
        return tf.refusal(workload, Topology(devices_per_node=ranks, device=device),
                          Tuning(mode=mode), device)

    for mode in ("function", "default", "best"):
        assert why(face, 2, mode) is None and why(sampling, 2, mode) is None
    assert TWO_CPU_RANKS in why(face, 2, "xla")
    assert SAMPLING_PFC in why(sampling, 1, "xla")
    assert why(face, 1, "xla") is None
    assert why(face.replace(fc="pfc"), 1, "xla") is None
    assert why(face, 2, "xla", "cuda") is None


def test_xla_aligned_in_float64(tmp_path, tf_python):
    """torch's weights and batches, three SGD steps in float64 compiled by XLA, dp and mp on one
    rank: every tensor's update within 1e-8 of torch's."""
    code, outcome = align("tf", tmp_path / "align", "1", "dp,mp", "--mode", "xla")
    assert code == 0, [c["problems"] for c in outcome["checks"]]
    assert outcome["aligned"] and outcome["dtype"] == "float64" and outcome["mode"] == "xla"
    assert [(c["fc"], c["ranks"]) for c in outcome["checks"]] == [("dp", 1), ("mp", 1)]
    for check in outcome["checks"]:
        assert_strictly_aligned(check)
    assert left_behind(tmp_path) == []
