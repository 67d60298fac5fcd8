"""Strict alignment, independent of any other framework: the tensor-by-tensor comparison of two
runs' dumps, the rule the check trains by, torch's own float64 step, the negative controls
(torch standing in as the candidate) and the reuse of torch's side.

Each framework's own alignment with torch is tested beside its backend (``test_<fw>_*``)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from trainperf import align, alignments
from trainperf.align import AlignRequest, Side, compare_losses, run_alignment
from trainperf.align.rules import NOT_CHECKABLE, NOT_EXERCISED, check_workload
from trainperf.align.tensors import FLOAT64, compare_runs
from trainperf.backends.workerkit import StepState, write_dump
from trainperf.cli import main
from trainperf.recipes import get_recipe

TINY = get_recipe("tiny-arcface").workload


# -- the comparison of dumps ---------------------------------------------------------------

def _trajectory(seed: int = 0, steps: int = 3) -> list[dict[str, np.ndarray]]:
    """A made-up run: a start and ``steps`` updates of a few tensors, one of them a bias that
    starts at zero and gets a zero update (a bias that feeds a BatchNorm)."""
    rng = np.random.default_rng(seed)
    state = {"backbone/conv.weight": rng.standard_normal((4, 3, 3, 3)),
             "backbone/bn.running_mean": np.zeros(4), "backbone/fc.bias": np.zeros(4),
             "head/weight": rng.standard_normal((10, 4)) * 0.01}
    out = [dict(state)]
    for _ in range(steps):
        state = {k: v + (0.0 if k == "backbone/fc.bias" else 1e-2 * rng.standard_normal(v.shape))
                 for k, v in state.items()}
        out.append(dict(state))
    return out


def _dump(folder: Path, states: list[dict[str, np.ndarray]], dtype: str = "float64",
          scalars: dict[str, list[float]] | None = None, rank: int = 0) -> Path:
    scalars = scalars or {}
    for step, arrays in enumerate(states, start=-1):
        i = max(step, 0)
        write_dump(str(folder), step, rank,
                   StepState({k: v.astype(dtype) for k, v in arrays.items()},
                             scalars.get("grad_norm", [3.0, 2.0, 1.0])[i],
                             scalars.get("lr", [0.1, 0.1, 0.01])[i]),
                   scalars.get("loss", [40.0, 20.0, 10.0])[i] if step >= 0 else math.nan)
    return folder


def test_identical_runs_agree_and_every_tensor_is_compared(tmp_path):
    run = _trajectory()
    got = compare_runs(_dump(tmp_path / "a", run), _dump(tmp_path / "b", run), 3, 1, FLOAT64,
                       "float64")
    assert got["problems"] == []
    assert got["tensors_compared"] == 4
    assert got["worst_update"]["error"] == 0.0 and got["worst_start"]["error"] == 0.0
    assert len(got["steps"]) == 3


def test_rounding_passes_and_a_rule_sized_difference_is_named_where_it_starts(tmp_path):
    ref = _trajectory()
    rounded = [{k: v * (1 + 1e-14) for k, v in s.items()} for s in ref]
    # At step 1 the conv weight's update moves by 1e-4 of itself: about what weight decay
    # (lr * wd * w) makes of an update.
    ruled = [dict(s) for s in ref]
    delta = ref[2]["backbone/conv.weight"] - ref[1]["backbone/conv.weight"]
    for later in ruled[2:]:
        later["backbone/conv.weight"] = later["backbone/conv.weight"] + 1e-4 * delta
    a = _dump(tmp_path / "ref", ref)
    assert compare_runs(a, _dump(tmp_path / "rounded", rounded), 3, 1, FLOAT64,
                        "float64")["problems"] == []
    got = compare_runs(a, _dump(tmp_path / "ruled", ruled), 3, 1, FLOAT64, "float64")
    assert got["problems"][0].startswith("first differs at step 1: backbone/conv.weight's "
                                         "update by 1.00e-04")
    assert got["worst_update"]["tensor"] == "backbone/conv.weight"


def test_a_zero_gradient_made_of_rounding_is_not_a_difference(tmp_path):
    """The bias that feeds a BatchNorm: its true update is zero, each framework computes
    1e-17-sized noise for it. Against the whole step's update that is rounding."""
    ref = _trajectory()
    noisy = [dict(s) for s in ref]
    for i, s in enumerate(noisy[1:], start=1):
        s["backbone/fc.bias"] = np.full(4, 1e-17 * i)
    got = compare_runs(_dump(tmp_path / "a", ref), _dump(tmp_path / "b", noisy), 3, 1, FLOAT64,
                       "float64")
    assert got["problems"] == []


@pytest.mark.parametrize("spoil,problem", [
    (lambda s: s.pop("head/weight"), "the candidate's dump lacks head/weight"),
    (lambda s: s.update({"backbone/extra": np.ones(2)}), "has tensors torch has not"),
    (lambda s: s.update({"head/weight": np.ones((5, 4))}), "shapes differ: head/weight (5, 4)"),
])
def test_what_a_side_holds_is_checked(tmp_path, spoil, problem):
    ref = _trajectory()
    other = [dict(s) for s in ref]
    for s in other:
        spoil(s)
    got = compare_runs(_dump(tmp_path / "a", ref), _dump(tmp_path / "b", other), 3, 1, FLOAT64,
                       "float64")
    assert any(problem in p for p in got["problems"]), got["problems"]


def test_where_the_witness_shows_rounding_growing_the_tolerance_follows_it(tmp_path):
    """At step 2 rounding has grown past the base tolerance (as at batch 2, BatchNorm over two
    samples): the witness, parted from torch by 1e-5 there, lets a 1e-6 difference pass at
    that step and no other."""
    from dataclasses import replace as with_

    ref = _trajectory()
    other = [dict(s) for s in ref]
    delta = ref[3]["backbone/conv.weight"] - ref[2]["backbone/conv.weight"]
    other[3]["backbone/conv.weight"] = other[3]["backbone/conv.weight"] + 1e-6 * delta
    a, b = _dump(tmp_path / "a", ref), _dump(tmp_path / "b", other)
    assert compare_runs(a, b, 3, 1, FLOAT64, "float64")["problems"]
    witnessed = with_(FLOAT64, witness={2: {"backbone/conv.weight": 1e-5}})
    assert witnessed.update_at(2, "backbone/conv.weight") == 1e-5
    assert witnessed.update_at(1, "backbone/conv.weight") == FLOAT64.update
    assert compare_runs(a, b, 3, 1, witnessed, "float64")["problems"] == []
    early = with_(FLOAT64, witness={1: {"backbone/conv.weight": 1e-5}})
    assert compare_runs(a, b, 3, 1, early, "float64")["problems"]


def test_the_witness_start_moves_every_weight_by_rounding_size_and_nothing_else(tmp_path):
    from trainperf.backends.torch.alignment import write_start

    start = tmp_path / "start.npz"
    write_start(TINY, 2, start)
    path = align.witness_start(start)
    with np.load(start) as a, np.load(path) as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            x, y = a[name].astype(np.float64), b[name]
            if name.startswith(("images/", "labels/")) or "running" in name:
                assert np.array_equal(x, y), name
            elif np.any(x):
                rel = np.abs(y - x).max() / np.abs(x).max()
                assert 1e-15 < rel < 1e-11 and y.dtype == np.float64, name


def test_a_declared_difference_of_rule_is_measured_and_shown_but_not_judged(tmp_path):
    """Paddle's kernel moves a BatchNorm's running variance by the biased batch variance: a
    framework's own rule, declared by its backend. Undeclared, the same difference fails."""
    ref = _trajectory()
    other = [dict(s) for s in ref]
    for s in other[1:]:
        s["backbone/bn.running_mean"] = s["backbone/bn.running_mean"] * 1.01
    a, b = _dump(tmp_path / "a", ref), _dump(tmp_path / "b", other)
    assert compare_runs(a, b, 3, 1, FLOAT64, "float64")["problems"]
    got = compare_runs(a, b, 3, 1, FLOAT64, "float64", {"running_mean": "the framework's own"})
    assert got["problems"] == []
    assert got["declared"][0]["tensor"] == "backbone/bn.running_mean"
    assert got["declared"][0]["error"] > 1e-3 and got["declared"][0]["why"] == "the framework's own"
    assert got["worst_update"]["tensor"] != "backbone/bn.running_mean"


def test_a_candidate_that_computes_in_float32_when_asked_for_float64_fails(tmp_path):
    run = _trajectory()
    got = compare_runs(_dump(tmp_path / "a", run), _dump(tmp_path / "b", run, "float32"), 3, 1,
                       FLOAT64, "float64")
    assert any("asked for float64, the candidate holds" in p and "float32" in p
               for p in got["problems"])


def test_a_start_loaded_differently_fails(tmp_path):
    ref = _trajectory()
    other = [dict(s) for s in ref]
    other[0]["head/weight"] = other[0]["head/weight"] * 1.001  # a head drawn, not loaded
    got = compare_runs(_dump(tmp_path / "a", ref), _dump(tmp_path / "b", other), 3, 1, FLOAT64,
                       "float64")
    assert any(p.startswith("the start differs as loaded: head/weight") for p in got["problems"])


@pytest.mark.parametrize("name,theirs,problem", [
    ("grad_norm", [3.0, 2.0 * (1 + 1e-6), 1.0], "the grad norm differs"),
    ("lr", [0.1, 0.01, 0.01], "the lr differs"),
    ("loss", [40.0, 20.0, 10.0 * (1 + 1e-7)], "the loss differs"),
    ("grad_norm", [3.0, math.nan, 1.0], "the grad norm differs"),
])
def test_each_scalar_is_compared(tmp_path, name, theirs, problem):
    run = _trajectory()
    got = compare_runs(_dump(tmp_path / "a", run), _dump(tmp_path / "b", run,
                                                         scalars={name: theirs}),
                       3, 1, FLOAT64, "float64")
    assert any(p.startswith(problem) for p in got["problems"]), got["problems"]


def test_a_missing_step_is_a_problem_not_a_crash(tmp_path):
    run = _trajectory()
    b = _dump(tmp_path / "b", run)
    (b / "step-0002-rank-0.npz").unlink()
    got = compare_runs(_dump(tmp_path / "a", run), b, 3, 1, FLOAT64, "float64")
    assert got["problems"] == ["the candidate's dump lacks step-0002-rank-0.npz"]


def test_the_check_crosses_one_step_of_the_rate_with_dropout_off():
    w = check_workload(get_recipe("r100-arcface-emore").workload, 5)
    assert (w.dropout, w.lr_steps, w.lr_scales) == (0.0, (2,), (0.1,))
    assert [w.lr_at(i) for i in range(5)] == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.01])
    assert check_workload(TINY, 1).lr_steps == ()  # one step crosses nothing


# -- torch against itself: the whole check, its controls and its table ------------------------

@pytest.fixture(scope="module")
def torch_against_itself(tmp_path_factory):
    """torch as the candidate, in float64 with every control: what the check does for any
    framework, without needing one."""
    out = tmp_path_factory.mktemp("self")
    req = AlignRequest("tiny-arcface", TINY, "torch", [1], ["dp"], 3, 300.0, out,
                       tuple(c.name for c in align.rules.CONTROLS))
    return run_alignment(req), out


def test_torch_is_aligned_with_itself_in_float64(torch_against_itself):
    outcome, out = torch_against_itself
    check = outcome["checks"][0]
    assert outcome["aligned"] and outcome["dtype"] == "float64"
    assert check["tensors_compared"] > 40 and check["worst_update"]["error"] == 0.0
    assert [s["lr"]["torch"] for s in check["steps"]] == pytest.approx([0.1, 0.01, 0.01])
    assert all(s["grad_norm"]["torch"] > 0 for s in check["steps"])
    assert json.loads((out / "align.json").read_text())["aligned"]
    assert not list((out / "runs").glob("**/dump"))  # dumps are gone unless kept


def test_both_sides_run_on_the_cpu_unless_told(torch_against_itself, tmp_path):
    """The page's promise, float64 on the CPU, holds on a GPU machine too: the command's
    request says cpu, never auto, and every run of a check was specified for the CPU."""
    from trainperf.cli import build_parser
    from trainperf.cli.env import align_request

    args = build_parser().parse_args(["align", "tiny-arcface", "--framework", "paddle",
                                      "--out", str(tmp_path / "a")])
    assert args.device == "cpu" and align_request(args).device == "cpu"
    outcome, out = torch_against_itself
    specs = [json.loads(p.read_text()) for p in (out / "runs").glob("**/spec.json")]
    assert len(specs) >= 3  # torch, its witness, the candidate and the controls
    assert {s["device"] for s in specs} == {"cpu"}
    assert outcome["device"] == "cpu"
    assert "in float64 on the CPU" in align.render_table(outcome)


@pytest.mark.parametrize("framework", ["mxnet", "paddle", "tf", "oneflow"])
def test_a_worker_without_float64_on_a_gpu_is_refused_there(framework, tmp_path, capsys):
    from trainperf.backends import get_backend

    assert main(["align", "tiny-arcface", "--framework", framework, "--device", "cuda",
                 "--out", str(tmp_path / "a")]) == 2
    why = get_backend(framework).capabilities.why_not["float64"]
    assert capsys.readouterr().err.strip() == (
        f"trainperf: error: the {framework} backend's worker computes an alignment's float64 "
        f"on a CPU only, not on a GPU ({why})")
    assert not (tmp_path / "a").exists()


def test_a_gpu_check_needs_a_gpu(tmp_path, capsys):
    from trainperf.env import gpu_count

    if gpu_count():
        pytest.skip("this machine has a GPU")
    assert main(["align", "tiny-arcface", "--framework", "torch", "--mode", "compile",
                 "--device", "cuda", "--out", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.strip() == (
        "trainperf: error: --device cuda: this machine has no CUDA device")


def test_every_control_is_caught_and_names_where(torch_against_itself):
    outcome, _ = torch_against_itself
    assert outcome["controls_caught"] is True
    for name, c in outcome["controls"].items():
        assert c["applicable"] and c["caught"], (name, c["verdict"])
        assert c["verdict"].startswith("caught: first differs at step "), c["verdict"]
    # Momentum acts from the second step; a rate changed late shows at the boundary (step 1).
    assert "at step 1" in outcome["controls"]["momentum"]["verdict"]
    assert "at step 0" in outcome["controls"]["no_weight_decay"]["verdict"]
    assert "at step 1" in outcome["controls"]["lr_schedule"]["verdict"]


def test_the_table_says_what_was_checked(torch_against_itself):
    outcome, _ = torch_against_itself
    table = {r["item"]: r for r in outcome["checklist"]}
    assert table["kernel initializer"]["status"] == NOT_CHECKABLE
    assert table["dropout"]["status"] == NOT_CHECKABLE
    for item in ("optimizer", "momentum", "weight decay", "gradient clipping", "lr schedule",
                 "margin", "scale", "BN momentum", "BN eps", "head initializer"):
        assert table[item]["status"] == "checked", item
    assert "control `no_weight_decay`: caught" in table["weight decay"]["how"]
    rendered = align.render_table(outcome)
    assert "ALIGNED" in rendered and "every one caught" in rendered


def test_a_one_step_check_says_momentum_was_not_exercised(tmp_path):
    req = AlignRequest("tiny-arcface", TINY, "torch", [1], ["dp"], 1, 300.0, tmp_path,
                       ("momentum",))
    outcome = run_alignment(req)
    table = {r["item"]: r for r in outcome["checklist"]}
    assert table["momentum"]["status"] == NOT_EXERCISED
    assert table["lr schedule"]["status"] == NOT_EXERCISED
    assert outcome["controls"]["momentum"]["applicable"] is False
    assert outcome["controls_caught"] is True  # nothing applicable was missed


def test_a_verdict_is_filed_for_reports_to_find(torch_against_itself):
    outcome, out = torch_against_itself
    found = alignments.find("tiny-arcface", "torch", outcome["versions"], "float64")
    assert found and found["aligned"] and found["dtype"] == "float64"
    filed = [json.loads(p.read_text()) for p in alignments.registry().glob("tiny-arcface-*")]
    mine = [r for r in filed if r["align_json"] == str((out / "align.json").resolve())]
    assert len(mine) == 1 and mine[0]["checked"] == [["dp", 1]]
    assert alignments.find("tiny-arcface", "torch", {**outcome["versions"],
                                                      "torch": "0.0"}) is None


def test_a_comparison_names_the_alignment_it_rests_on(tmp_path, monkeypatch):
    from trainperf.report.markdown import alignment_lines

    monkeypatch.setenv(alignments.REGISTRY_ENV, str(tmp_path / "registry"))
    docs = [{"recipe": "tiny-arcface", "framework": "torch",
             "env": {"framework_version": "2.13.0"}},
            {"recipe": "tiny-arcface", "framework": "mxnet",
             "env": {"framework_version": "1.9.1"}}]
    assert alignment_lines(docs) == [
        "- mxnet 1.9.1: not aligned: no alignment check of mxnet on tiny-arcface with these "
        "versions (`trainperf align tiny-arcface --framework mxnet`)"]
    record = {"recipe": "tiny-arcface", "framework": "mxnet", "dtype": "float64",
              "versions": {"torch": "2.13.0", "mxnet": "1.9.1"}, "aligned": True,
              "checked": [["dp", 1], ["mp", 2]], "worst_update": 3e-13, "t": 1.0,
              "align_json": "/x/align.json"}
    alignments.keep({**record, "versions": {"torch": "2.12.0", "mxnet": "1.9.1"}})
    assert "not aligned" in alignment_lines(docs)[0]  # another torch: not this comparison's
    alignments.keep(record)
    line = alignment_lines(docs)[0]
    assert line.startswith("- mxnet 1.9.1: aligned with torch in float64 (dp on 1, mp on 2; "
                           "worst update error 3.0e-13)") and "`/x/align.json`" in line
    alignments.keep({**record, "aligned": False, "t": 2.0})  # a newer check failed
    assert "NOT ALIGNED: the last check" in alignment_lines(docs)[0]


# -- torch's side reused --------------------------------------------------------------------

def test_torchs_side_is_run_once_per_start_and_reused(tmp_path, monkeypatch):
    """With TRAINPERF_ALIGN_CACHE set, a check from the same start, workload, ranks, steps and
    reuses torch's earlier run and its dumps; any change (here the start's contents or the
    steps) runs torch again, and a failed torch run is never kept."""
    from trainperf.backends.torch.alignment import write_start

    calls = []

    def fake_run(recipe, workload, spec, out, steps, timeout_s, framework="torch", devices=1,
                 device="auto", tuning=None):
        calls.append(out)
        Path(spec.dump).mkdir(parents=True)
        (Path(spec.dump) / "start-rank-0.npz").write_bytes(b"x")
        status = "failed" if workload.lr == 0.5 else "ok"
        return Side({"status": status, "losses": [1.0, 0.5]}, 42, "2.x", Path(spec.dump))

    monkeypatch.setattr(align, "run_from_start", fake_run)
    monkeypatch.setenv(align.CACHE_ENV, str(tmp_path / "cache"))
    workload = check_workload(TINY, 3)
    start = tmp_path / "start.npz"
    write_start(workload, 2, start)
    req = AlignRequest("tiny-arcface", workload, "paddle", [2], ["mp"], 3, 60.0, tmp_path)
    first = align.torch_side(req, workload, 2, start, tmp_path / "a")
    again = align.torch_side(req, workload, 2, start, tmp_path / "b")
    assert first == again and len(calls) == 1
    assert (first.dump / "start-rank-0.npz").read_bytes() == b"x"  # the cache's own copy
    assert not (tmp_path / "a" / "dump").exists()  # kept once, in the cache
    align.torch_side(replace(req, steps=4), workload, 2, start, tmp_path / "c")
    assert len(calls) == 2
    write_start(workload.replace(seed=1), 2, start)  # other weights: torch runs again
    align.torch_side(req, workload, 2, start, tmp_path / "d")
    assert len(calls) == 3
    failing = workload.replace(lr=0.5)
    for name in "ef":
        align.torch_side(req, failing, 2, start, tmp_path / name)
    assert len(calls) == 5


# -- the loss-level verdict gpucheck gives a GPU against a CPU ---------------------------------

@pytest.mark.parametrize("torch_losses,other_losses,params,problem", [
    ([50.0, 20.0], [50.0, 20.0], (10, 10), None),
    ([50.0, 20.0], [50.0, 20.0], (10, 11), "parameter counts differ"),
    ([50.0, 20.0], [50.01, 20.0], (10, 10), "first loss differs"),
    ([50.0, 20.0], [50.0, 20.1], (10, 10), "a loss differs"),
    ([0.5, 0.2], [0.5, 0.2015], (10, 10), None),  # below 1 the difference is absolute
    ([50.0, float("nan")], [50.0, float("nan")], (10, 10), "not finite"),
    ([50.0, 20.0], None, (10, 10), "no losses"),
])
def test_the_loss_level_verdict(torch_losses, other_losses, params, problem):
    check = compare_losses(torch_losses, other_losses, *params)
    assert check["aligned"] == (problem is None)
    if problem:
        assert any(problem in p for p in check["problems"])
