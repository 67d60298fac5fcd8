"""`run --breakdown`: the phase clock, the profiled torch step (the same math as the timed one),
the summary of a profiled run, the report's verdicts, and torch end to end on 1 and 2 ranks with
a delay put in one phase."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from dist_util import run_ranks
from run_util import (BREAKDOWN, PHASE_DELAY_S, assert_delay_lands,
                      assert_timed_runs_unprofiled)
from trainperf import breakdown, results
from trainperf.backends.phases import (NO_COMM, PhaseClock, check_phase, delays_from_env,
                                       label)
from trainperf.backends.torch.dist import DistContext
from trainperf.backends.torch.step import TrainStep
from trainperf.cli import main
from trainperf.report.breakdown import breakdown_section
from trainperf.scale.bottleneck import analyse, analyser
from test_step import BATCH, global_batch, prepared, tiny


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_clock_times_phases_and_leaves_the_rest_to_other():
    t = FakeTime()
    clock = PhaseClock(t)
    with clock.step():
        t.now += 1.0  # before any phase: other
        with clock.phase("backbone_forward"):
            t.now += 2.0
        with clock.phase("optimizer"):
            t.now += 0.5
        t.now += 0.25
        with clock.phase("optimizer"):  # a phase that runs twice adds up
            t.now += 0.5
    with clock.step(NO_COMM):
        with clock.phase("backward"):
            t.now += 3.0
    first, second = clock.records()
    assert first == {"seconds": 4.25, "variant": "",
                     "phases": {"backbone_forward": 2.0, "optimizer": 1.0, "other": 1.25}}
    assert second["variant"] == NO_COMM and second["phases"]["other"] == 0.0


def test_phase_names_and_the_delay_hook_are_checked():
    check_phase("backbone_forward+head+backward")
    for bad in ("forward", "other", "head+head", ""):
        with pytest.raises(ValueError):
            check_phase(bad)
    assert delays_from_env("head=0.5, data=1") == {"head": 0.5, "data": 1.0}
    with pytest.raises(ValueError):
        delays_from_env("heads=0.5")
    assert label("backbone_forward+head") == "backbone forward + head"
    assert label("grad_comm") == "gradient communication not hidden"
    assert label("backward+grad_comm") == "backward + gradient communication"
    t = FakeTime()
    clock = PhaseClock(t, delays={"head": 0.01, "data": 0.01})
    with clock.step():
        with clock.phase("backward"):
            pass
    with pytest.raises(ValueError, match="names data, head, none of which"):
        clock.check_delays()
    with clock.step():
        with clock.phase("head"):
            pass
    clock.check_delays()  # head ran: data may be another case's
    with pytest.raises(RuntimeError):
        with PhaseClock(FakeTime()).phase("head"):
            pass


def _steps(backward: list[float], quiet: list[float]) -> list[dict]:
    steps = []
    for b in backward:
        steps.append({"seconds": 1.0 + b, "variant": "",
                      "phases": {"backbone_forward": 0.5, "head": 0.3, "backward": b,
                                 "optimizer": 0.1, "other": 0.1}})
    for b in quiet:
        steps.append({"seconds": 1.0 + b, "variant": NO_COMM,
                      "phases": {"backbone_forward": 0.5, "head": 0.3, "backward": b,
                                 "optimizer": 0.1, "other": 0.1}})
    return steps


def test_the_summary_takes_medians_and_the_exposed_communication():
    record = {"status": "ok"}
    bd = breakdown.summarize({"method": "m", "steps": _steps([1.2, 1.4, 1.3], [1.0, 0.9, 1.1])},
                             record)
    assert bd["steps"] == 3 and bd["no_comm_steps"] == 3
    assert bd["step_s"] == pytest.approx(2.3)
    # median backward 1.3, without the all-reduce 1.0: 0.3 s of it is not hidden
    assert bd["phases_s"]["grad_comm"] == pytest.approx(0.3)
    assert bd["phases_s"]["backward"] == pytest.approx(1.0)
    assert list(bd["phases_s"]) == ["backbone_forward", "head", "backward", "grad_comm",
                                    "optimizer", "other"]
    assert bd["sum_s"] == pytest.approx(bd["step_s"])
    assert bd["step_s_range"] == [pytest.approx(2.2), pytest.approx(2.4)]
    assert sum(bd["shares"].values()) == pytest.approx(1.0)
    # One process: nothing to subtract, no grad_comm invented.
    alone = breakdown.summarize({"method": "m", "steps": _steps([1.0, 1.2], [])}, record)
    assert "grad_comm" not in alone["phases_s"] and not alone["hidden_comm_measured"]
    failed = breakdown.summarize({}, {"status": "oom", "error": "out of memory"})
    assert failed["status"] == "oom" and "phases_s" not in failed
    silent = breakdown.summarize({}, {"status": "ok"})
    assert silent["status"] == "failed" and "no phases" in silent["error"]


def _case(world: int, phases: dict[str, float], fc: str = "mp", classes: int = 1000,
          head_has_backward: bool = True, matmul: float | None = 1e11) -> dict:
    step = sum(phases.values())
    return {"case": f"1n{world}g", "nodes": 1, "devices_per_node": world, "world_size": world,
            "batch_size_per_device": 8, "precision": "fp32", "num_classes": classes, "fc": fc,
            "median_samples_per_s": 8 * world / step, "runs": [],
            "breakdown": {"status": "ok", "method": "test", "merged": {}, "step_s": step,
                          "phases_s": phases, "head_has_backward": head_has_backward,
                          "shares": {k: v / step for k, v in phases.items()},
                          "sum_s": step, "matmul_flops_per_s": matmul,
                          "matmul_what": "test GEMM"}}


def _doc(fc: str = "mp", classes: int = 1000) -> dict:
    w = tiny(fc=fc).replace(num_classes=classes).to_dict()
    return {"workload": w, "framework": "torch", "cases": []}


def test_verdicts_name_what_bounds_the_case():
    doc = _doc()
    data = analyse(doc, _case(1, {"data": 0.4, "backbone_forward": 0.3, "backward": 0.3}), None)
    assert data["verdict"].startswith("input-bound: 40% of the step")
    comm = analyse(doc, _case(2, {"backbone_forward": 0.3, "backward": 0.5, "grad_comm": 0.2}))
    assert comm["verdict"].startswith("communication: 20%") and "at 2 ranks" in comm["verdict"]
    head = analyse(_doc(classes=100_000), _case(1, {"backbone_forward": 0.2, "head": 0.6,
                                                    "backward": 0.2}, classes=100_000))
    # 0.6 s over 100,000 rows; pfc 0.1 computes 10,000 of them: about 0.06 s
    assert head["verdict"].startswith("bound by the head: 60% of the step")
    assert "`pfc 0.1` would cut the head to about 60.0 ms" in head["verdict"]
    assert "step from 1.00 s to about 460.0 ms" in head["verdict"]
    compute = analyse(doc, _case(1, {"backbone_forward": 0.3, "head": 0.1, "backward": 0.6}))
    assert compute["verdict"].startswith("compute-bound in the backbone")
    assert "matmul rate" in compute["verdict"]
    job = compute["job"]
    fwd = job.backbone_fwd_flops * 8
    assert compute["rates"]["backbone_forward"] == pytest.approx(fwd / 0.3)
    assert compute["rates"]["backward"] == pytest.approx(2 * fwd / 0.6)
    assert compute["rates"]["head"] == pytest.approx(6 * 8 * 1000 * job.embedding_size / 0.1)


def test_the_report_section_has_a_table_the_verdicts_and_a_chart(tmp_path):
    pytest.importorskip("matplotlib")
    doc = _doc()
    doc["cases"] = [_case(1, {"backbone_forward": 0.3, "head": 0.1, "backward": 0.6}),
                    _case(2, {"backbone_forward": 0.3, "head": 0.1, "backward": 0.5,
                              "grad_comm": 0.3})]
    failed = _case(4, {"backward": 1.0})
    failed["breakdown"] = {"status": "oom", "error": "out of memory"}
    doc["cases"].append(failed)
    text = breakdown_section([doc], ["torch"], tmp_path, analyser())
    assert "| torch | 1n1g | 8 | 300.0 ms (30%) | 100.0 ms (10%) | 600.0 ms (60%) | - |" in text
    assert "communication: 25%" in text
    assert "no breakdown (out of memory)" in text
    assert "no fabric given" in text
    png = tmp_path / "breakdown-b8-mp-fp32.png"
    assert png.stat().st_size > 1000 and f"![{png.name}]({png.name})" in text
    assert breakdown_section([_doc()], ["torch"], tmp_path) is None


def _train(ctx: DistContext, fc: str, profiled: bool, steps: int = 2):
    step = prepared(TrainStep(tiny(fc=fc).replace(batch_size=BATCH), ctx))
    images, labels = global_batch(step.workload, ctx.world_size)
    sl = slice(ctx.rank * BATCH, (ctx.rank + 1) * BATCH)
    clock = PhaseClock(lambda: 0.0)
    losses = []
    for i in range(steps):
        if profiled:
            with clock.step(NO_COMM if i == steps - 1 and ctx.distributed else ""):
                losses.append(step.profiled(images[sl], labels[sl], clock))
        else:
            losses.append(step(images[sl], labels[sl]))
    return {"losses": torch.stack(losses),
            "params": [p.detach().clone() for p in step.model.parameters()],
            "phases": [sorted(r["phases"]) for r in clock.records()]}


@pytest.mark.parametrize("fc", ["dp", "mp", "pfc"])
def test_the_profiled_step_is_the_same_step(fc):
    plain = _train(DistContext(), fc, False)
    split = _train(DistContext(), fc, True)
    torch.testing.assert_close(split["losses"], plain["losses"], rtol=1e-6, atol=0)
    for a, b in zip(split["params"], plain["params"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert split["phases"][0] == ["backbone_forward", "backward", "head", "optimizer", "other"]


@pytest.mark.slow
@pytest.mark.parametrize("fc", ["dp", "mp"])
def test_the_profiled_step_under_ddp_is_the_same_step(fc, tmp_path):
    # Only the first of two steps: the second skips the all-reduce (NO_COMM) on purpose.
    plain = run_ranks(_train, 2, fc, False, 1)
    split = run_ranks(_train, 2, fc, True, 1)
    for a, b in zip(split, plain):
        torch.testing.assert_close(a["losses"], b["losses"], rtol=1e-6, atol=0)
        for x, y in zip(a["params"], b["params"]):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


PROFILED = ["run", "tiny-arcface", "--devices", "1,2", "--fc", "mp", "--batch-size", "8",
            "--runs", "1", "--iters", "4", "--warmup", "1", "--device", "cpu", "--threads", "1",
            *BREAKDOWN, "--trace"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("breakdown") / "torch"
    os.environ["TRAINPERF_PHASE_DELAY"] = f"head={PHASE_DELAY_S}"
    try:
        code = main([*PROFILED, "--out", str(out)])
    finally:
        del os.environ["TRAINPERF_PHASE_DELAY"]
    return code, out


def test_a_phases_event_survives_the_protocol():
    from trainperf.protocol import Phases, decode, encode

    event = Phases(method="m", steps=_steps([1.0], [0.5]), merged={"head+backward": "why"},
                   head_has_backward=True, matmul_flops_per_s=1e9, matmul_what="gemm",
                   collectives={"head": ["c10d::allreduce_"]})
    assert decode(json.loads(encode(event))) == event


@pytest.mark.slow
def test_a_delay_in_the_head_lands_in_the_head_and_never_in_a_timed_run(profiled):
    code, out = profiled
    assert code == 0
    assert_timed_runs_unprofiled(out)
    doc = results.load(out)
    for case in doc["cases"]:
        bd = assert_delay_lands(case, "head")
        assert bd["head_has_backward"] is True and bd["merged"] == {}
        assert "torch.profiler" in bd["method"]
        # The statistics are the timed runs' alone: one run, its own rate.
        assert len(case["runs"]) == 1
        assert case["median_samples_per_s"] == case["runs"][0]["samples_per_s"]
        assert (out / bd["trace"]).exists()
    one, two = doc["cases"]
    assert "grad_comm" not in one["breakdown"]["phases_s"]
    assert two["breakdown"]["hidden_comm_measured"] and "grad_comm" in two["breakdown"]["phases_s"]
    assert two["breakdown"]["steps"] == 2 and two["breakdown"]["no_comm_steps"] == 2


@pytest.mark.slow
def test_the_heads_collectives_show_inside_the_head_on_two_ranks(profiled):
    _, out = profiled
    collectives = results.load(out)["cases"][1]["breakdown"]["collectives"]
    # mp: the embeddings are gathered and the softmax statistics all-reduced in the head;
    # the backbone's gradients are all-reduced in the backward.
    assert "c10d::_allgather_base_" in collectives["head"] or \
        "c10d::allgather_" in collectives["head"]
    assert "c10d::allreduce_" in collectives["head"]
    assert "c10d::allreduce_" in collectives["backward"]
    assert "optimizer" not in collectives


@pytest.mark.slow
def test_the_report_shows_the_breakdown(profiled):
    _, out = profiled
    report = (out / "report.md").read_text()
    assert "## Where the time goes" in report
    assert "bound by the head" in report  # the 0.4 s delay makes it so
    trace = json.loads((out / results.load(out)["cases"][0]["breakdown"]["trace"]).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"trainperf/head", "trainperf/backward"} <= names
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    ends = [e for e in events if e["event"] == "profile_end"]
    assert [e["case"] for e in ends] == ["1n1g", "1n2g"]
    assert statistics.median(
        s["seconds"] for e in events if e["event"] == "phases"
        for s in e["steps"] if not s["variant"]) >= PHASE_DELAY_S


@pytest.mark.slow
def test_resuming_keeps_the_breakdowns_and_profiles_nothing_again(profiled, capsys):
    _, out = profiled
    before = results.load(out)
    assert main([*PROFILED, "--resume", str(out)]) == 0
    after = results.load(out)
    assert [c["breakdown"] for c in after["cases"]] == [c["breakdown"] for c in before["cases"]]
    events = (out / "events.jsonl").read_text().splitlines()
    assert sum('"profile_end"' in line for line in events) == 2


def test_the_gpu_check_summary_tells_where_the_profiled_cases_time_went():
    from trainperf.gpucheck.summary import breakdown_lines

    case = _case(1, {"backbone_forward": 0.01, "head": 0.002, "backward": 0.02})
    stage = {"items": [{"kind": "case", "label": "R100 emore mp fp32",
                        "breakdown": case["breakdown"]},
                       {"kind": "case", "label": "RN50 v1b fp32",
                        "breakdown": {"status": "timeout", "error": None}},
                       {"kind": "case", "label": "Y1 emore dp fp32", "breakdown": None}]}
    lines = breakdown_lines(stage)
    assert ("- R100 emore mp fp32: profiled step 32.0 ms: backbone forward 10.0 ms (31.2%), "
            "head 2.0 ms (6.2%), backward 20.0 ms (62.5%)") in lines
    assert "- RN50 v1b fp32: no breakdown (timeout)" in lines
    assert not any("Y1" in line for line in lines)
    assert breakdown_lines({"items": []}) == []
