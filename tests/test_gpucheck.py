"""``make gpu-check``: its CPU mode end to end (the same stages at tiny sizes, through the
Makefile's offline install path), stage failures and hangs as results, the caps against the
lending rules, and the arithmetic the summary derives (power, MFU, the memory model's refit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

import nvml_standin
from run_util import left_behind
from trainperf import envs, parities
from trainperf.backends.torch.memory_model import DeviceConstants, combine
from trainperf.cli import build_parser, main
from trainperf.cli.common import plan_from_args
from trainperf.config import Tuning
from trainperf.devices import effective_peak, mfu_peak
from trainperf.gpucheck import budget, capacity, cases as gpu_cases, plan, power, summary
from trainperf.gpucheck.stage import FAULT_ENV

REPO = Path(__file__).resolve().parents[1]
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


# -- the lending rules ------------------------------------------------------------------------

def test_caps_fit_a_borrowed_machine():
    """Part 1 in one call of 6 minutes on one H100, install included; every later part in 5;
    every stage's expected time under its cap, on a GPU, and the CPU mode's parts under
    theirs."""
    assert plan.PART_BUDGET_S == {1: 360, 2: 300, 3: 300, 4: 300, 5: 300}
    for part in plan.PARTS:
        assert plan.part_cap_s(part) <= plan.PART_BUDGET_S[part]
        assert budget.part_estimate_s(part) <= plan.part_cap_s(part)
        assert plan.part_cap_s(part, "cpu") <= plan.CPU_PART_BUDGET_S
    for s in plan.STAGES:
        assert 0 < budget.estimate_s(s) <= s.cap_s, s
    assert plan.PARTS == tuple(range(1, len(plan.PARTS) + 1))
    assert [s.id for s in plan.stages_of(None)] == [s.id for s in plan.STAGES]
    # The stages come in order of value, part by part.
    assert [s.part for s in plan.STAGES] == sorted(s.part for s in plan.STAGES)


def test_stage_selection_errors():
    with pytest.raises(ValueError, match="--part must be one of"):
        plan.stages_of(9)
    with pytest.raises(ValueError, match="unknown gpucheck stage"):
        plan.select(1, ["13"])
    with pytest.raises(ValueError, match="not in part 1"):
        plan.select(1, ["5"])
    assert [s.id for s in plan.select(3, ["8", "7"])] == ["7", "8"]


def test_the_estimate_grows_with_what_a_stage_runs(monkeypatch):
    """A case added to part 1 is what the estimate sees, and the suite would refuse it."""
    before = budget.part_estimate_s(1)
    more = dict(gpu_cases.CASES_GPU)
    more["4"] = more["4"] + [gpu_cases.CASES_GPU["6"][0]]
    monkeypatch.setattr(gpu_cases, "CASES_GPU", more)
    assert budget.part_estimate_s(1) > plan.part_cap_s(1) > before
    no_tuning = gpu_cases.CASES_GPU["8"][1]
    assert no_tuning.tuning == {"cudnn_benchmark": False}
    assert budget.case_s(no_tuning) > budget.case_s(replace(no_tuning, tuning={}))
    # A compiled mode pays its compilation, once: stage 11 runs each case once.
    compiled = gpu_cases.CASES_GPU["11"][0]
    assert compiled.tuning == {"mode": "compile"} and gpu_cases.measure("gpu", "11").runs == 1
    assert budget.case_s(compiled, "11") == pytest.approx(
        budget.case_s(replace(compiled, tuning={}), "11") + budget.COMPILE_S["r100"])


# -- the CPU mode, end to end -----------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    """``make gpu-check`` with this Python (which has torch): the offline install path a lent
    GPU machine takes, then every stage in the CPU mode."""
    root = tmp_path_factory.mktemp("gpucheck")
    out, work = root / "out", root / "work"
    started = time.monotonic()
    # The peers' JAX worker compiles its steps with test_jax_runs.py's fast XLA flags (the same
    # arithmetic, rounded differently in places): only that it runs and its ratio are checked.
    env = dict(os.environ, XLA_FLAGS=FAST_COMPILE)
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check",
                           f"PYTHON={sys.executable}", f"GPUCHECK_OUT={out}",
                           f"GPUCHECK_WORK={work}"],
                          cwd=REPO, capture_output=True, text=True, env=env,
                          # every stage is stopped at its cap: the whole cannot take longer
                          timeout=sum(s.cpu_cap_s for s in plan.STAGES) + 120)
    took = time.monotonic() - started
    doc = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() \
        else None
    return proc, doc, out, work, took


def stage(doc: dict, sid: str) -> dict:
    return next(s for s in doc["stages"] if s["stage"] == sid)


def items(s: dict, kind: str) -> list[dict]:
    return [i for i in s["items"] if i["kind"] == kind]


def checks(s: dict) -> dict[str, dict]:
    return {c["name"]: c for c in items(s, "check")}


@pytest.mark.slow
def test_cpu_mode_runs_every_stage(cpu_check):
    proc, doc, out, work, took = cpu_check
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert doc["mode"] == "cpu" and doc["part"] is None
    assert [s["stage"] for s in doc["stages"]] == [s.id for s in plan.STAGES]
    for s in doc["stages"]:
        assert s["status"] == "ok", (s["stage"], s.get("why"))
        assert s["elapsed_s"] <= s["cap_s"]
    text = (out / "summary.md").read_text()
    for s in plan.STAGES:
        assert f"## Stage {s.id}: {s.title}" in text
    assert "CPU mode: the stages ran at tiny sizes" in text
    assert left_behind(work) == []
    print(f"make gpu-check (CPU mode) took {took:.0f} s")


@pytest.mark.slow
def test_cpu_mode_folder_comes_back_whole(cpu_check):
    _, doc, out, work, _ = cpu_check
    found = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir())  # nothing deeper than the folder itself
    assert len(found) <= 8
    assert sorted(doc["files"]) == found
    assert {"summary.md", "summary.json", "gpucheck-all.tar.gz"} <= set(found)
    assert {"ceiling.png", "seeds.png", "capacity.png"} <= set(found)  # matplotlib: test extra
    with tarfile.open(out / "gpucheck-all.tar.gz") as tar:
        names = tar.getnames()
    base = work.name
    for s in plan.STAGES:
        assert f"{base}/stage-{s.id}.json" in names
        assert f"{base}/logs/stage-{s.id}.log" in names
    assert any(n.endswith("/results.json") for n in names)
    assert not any(n.endswith((".rec", ".idx")) for n in names)


@pytest.mark.slow
def test_cpu_mode_correctness_stage(cpu_check):
    _, doc, _, _, _ = cpu_check
    found = checks(stage(doc, "2"))
    assert not any(name.startswith(("mp", "pfc")) for name in found)  # the GPU's only
    for fc in ("dp",):
        c = found[f"{fc}: losses on cpu match the CPU's"]
        assert c["status"] == "pass", c["detail"]
        # Both sides ran on the CPU from one start: the same arithmetic, the same numbers.
        assert c["numbers"]["max_loss_rel_diff"] <= 1e-6
        assert len(c["numbers"]["losses_cpu"]) == 5
    for p in ("fp16", "bf16"):
        assert found[f"{p} on cpu: losses finite"]["status"] == "pass"
    assert found["fp16 on cpu: losses finite"]["numbers"]["final_loss_scale"] > 0
    timing = found["window: CUDA events vs host clock"]
    assert timing["status"] == "not run" and "only on a GPU" in timing["detail"]
    memory = [c for name, c in found.items() if name.startswith("peak memory vs model")]
    assert len(memory) == 3  # the alignment's run and the two half precisions'
    assert all(c["status"] == "recorded" and c["numbers"]["peak_bytes"] > 0 for c in memory)


@pytest.mark.slow
def test_cpu_mode_ceiling_and_seeds(cpu_check):
    _, doc, _, _, _ = cpu_check
    ceiling = {c["format"]: c for c in items(stage(doc, "1"), "ceiling")}
    assert ceiling["fp32"]["flops_per_s"] > 0 and ceiling["bf16"]["flops_per_s"] > 0
    assert ceiling["tf32"]["status"] == "not run"
    assert items(stage(doc, "1"), "copy")[0]["bytes_per_s"] > 0
    assert set(doc["ceiling"]["measured"]) == {"bf16", "fp16", "fp32"}
    cases = [c for s in plan.of_kind("cases") for c in items(stage(doc, s.id), "case")]
    assert [c["label"] for c in cases] == [
        gpu_cases.tiny(gpu_cases.CASES_GPU[sid][i]).label
        for sid, picked in gpu_cases.CPU_PICKS.items() for i in picked]
    assert {c["precision"] for c in cases} == {"fp32", "bf16", "fp16"}
    for c in cases:
        assert c["label"].endswith("(tiny)")
        assert c["runs"] and c["runs"][0]["status"] == "ok", c
        assert c["samples_per_j"] is None  # no GPU power on a CPU
        # Both windows come from the host clock on a CPU: the figure is there, the check is
        # the GPU's (stage 2).
        assert c["runs"][0]["timing_gap"] is not None
        assert c["peak_memory_bytes"] > 0 and c["predicted_peak_bytes"] > 0
    fp32 = [c for c in cases if c["precision"] == "fp32"]
    assert all(c["median_samples_per_s"] > 0 for c in fp32)
    # MFU against the CPU's own measured ceiling (a small matmul on a shared CPU: not a true
    # ceiling, so only the arithmetic is checked); none against a datasheet it is not in.
    measured = doc["ceiling"]["measured"]
    for c in fp32:
        peak, _ = effective_peak(measured, "fp32", c["train_flops_by_op"], None, None)
        assert c["mfu_measured"] == pytest.approx(c["model_flops_per_s"] / peak)
    assert all(c["mfu_datasheet"] is None for c in cases)


@pytest.mark.slow
def test_cpu_mode_capacity_and_refit(cpu_check):
    _, doc, _, _, _ = cpu_check
    s = stage(doc, "7")
    searches = {x["search"]: x for x in items(s, "search")}
    assert set(searches) == {"max-batch", "max-classes"}
    for x in searches.values():
        by_value = {p["value"]: p for p in x["probes"]}
        assert by_value[x["answer"]]["status"] == "ok"
        assert by_value[x["smallest_fail"]]["status"] == "oom"
        assert x["peak_bytes_at_answer"] > 0 and x["model_error_at_answer"] is not None
    refit = items(s, "refit")[0]
    assert refit["device_type"] == "cpu" and refit["points"] >= 3
    assert refit["new_error"] <= refit["old_error"]
    published = doc["published_capacity"]
    assert {p["batch"] for p in published["max-batch"]} == {115, 96}
    assert {p["classes"] for p in published["max-classes"]} == {2_000_000, 1_800_000}


@pytest.mark.slow
def test_cpu_mode_peers_and_real_data(cpu_check):
    _, doc, _, _, _ = cpu_check
    s5 = stage(doc, "9")
    peers = items(s5, "peer")
    if envs.state("jax").state in ("ready", "external"):
        jax = [p for p in peers if p["peer"] == "jax"]
        assert [p["label"] for p in jax] == ["R100 emore mp fp32 (tiny)", "RN50 v1b fp32 (tiny)"]
        assert all(p["median_samples_per_s"] > 0 for p in jax)
        assert all(p["trainperf_over_peer"] > 0 for p in jax)
    else:
        assert any(c["name"].startswith("JAX worker") and c["status"] == "not run"
                   for c in items(s5, "check"))
    timm = checks(s5).get("timm ResNet50 step")
    if timm is not None:
        assert timm["status"] == "not run" and "timm is not installed" in timm["detail"]
    real = items(stage(doc, "10"), "realdata")
    assert real and real[0]["real_samples_per_s"] > 0 and real[0]["synthetic_samples_per_s"] > 0
    assert real[0]["verdict"] and isinstance(real[0]["input_bound"], bool)
    assert real[0]["loader_workers"] >= 1 and real[0]["data_wait_share"] is not None
    assert checks(stage(doc, "10"))["DALI mixed decoder"]["status"] == "not run"


@pytest.mark.slow
def test_cpu_mode_native_parity(cpu_check):
    """Stage 5 times torch's worker against torch's own step (tiny: ResNet50 at batch 2 and
    32x32), keeps the pair and files the ratio where reports look for it; stage 3's JAX rows
    are the GPU's."""
    _, doc, out, work, _ = cpu_check
    jax_rows = checks(stage(doc, "3"))
    assert [c["status"] for c in jax_rows.values()] == ["not run"]
    assert "tests/test_parity.py" in next(iter(jax_rows.values()))["detail"]
    s5 = stage(doc, "5")
    got = items(s5, "parity")
    assert [(p["framework"], p["model"]) for p in got] == [("torch", "rn50")]
    record = json.loads((work / "parity-torch" / "parity.json").read_text())
    for p, row in zip(got, record["rows"]):
        assert p["ratio"] == pytest.approx(p["trainperf_samples_per_s"]
                                           / p["native_samples_per_s"])
        assert p["error"] is None and p["native_step"]
        (pair,) = row["pairs"]
        assert pair["native_detail"]["input_size"] == 32 and row["batch"] == 2
        filed = parities.find("rn50-v1b-imagenet", p["framework"], None, "cpu", None, "fp32",
                              32)
        assert filed and filed["parity_json"] == str(work / "parity-torch" / "parity.json")
    text = (out / "summary.md").read_text()
    assert "## Stage 5: Native parity: torch, bf16" in text
    assert "| torch | rn50 (rn50-v1b-imagenet) | 2 |" in text


# -- failures are results ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_hung_and_a_crashed_stage_are_recorded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "1:hang,2:crash")
    out, work = tmp_path / "out", tmp_path / "work"
    started = time.monotonic()
    rc = main(["gpucheck", "--mode", "cpu", "--part", "1", "--stages", "1,2", "--cap-scale",
               "0.1", "--out", str(out), "--work", str(work)])
    assert rc == 1
    assert time.monotonic() - started < 60
    doc = json.loads((out / "summary.json").read_text())
    s1, s2 = stage(doc, "1"), stage(doc, "2")
    assert s1["status"] == "timeout" and "cap of 3 s" in s1["why"]
    assert s2["status"] == "failed" and "injected crash" in s2["why"]
    assert stage(doc, "4")["status"] == "not run" and "not chosen" in stage(doc, "4")["why"]
    assert stage(doc, "7")["why"].startswith("in part 3")
    text = (out / "summary.md").read_text()
    assert "timeout in" in text and "not run: in part 2" in text
    assert left_behind(work) == []


def test_out_folder_must_be_new_or_empty(tmp_path, capsys):
    (tmp_path / "x").write_text("old")
    assert main(["gpucheck", "--mode", "cpu", "--out", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err


# -- what the summary derives -----------------------------------------------------------------

def test_energy_from_the_counter_or_the_power_readings():
    times = [10.0, 10.1, 10.2, 10.3, 10.4, 10.5]
    watts = [100, 300, 300, 300, 300, 100]
    counter = [0.0, 30_000.0, 60_000.0, 90_000.0, 120_000.0, 150_000.0]  # mJ: 300 W
    e = power.energy_in(times, watts, counter, 10.05, 10.45, "nvml")
    assert e.method == "nvml energy counter"
    assert e.mean_w == pytest.approx(300.0) and e.joules == pytest.approx(300.0 * 0.4)
    e = power.energy_in(times, watts, [None] * 6, 10.05, 10.45, "nvidia-smi")
    assert e.method == "nvidia-smi power readings" and e.samples == 4
    assert e.joules == pytest.approx(300.0 * 0.4)
    assert power.energy_in(times, watts, counter, 10.05, 10.15, "nvml") is None  # 1 reading


def test_mfu_against_a_measured_ceiling():
    flops = {"conv": 9e9, "matmul": 1e9}
    measured = {"bf16": 600e12, "fp16": 610e12, "tf32": 300e12, "fp32": 50e12}
    peak, basis = effective_peak(measured, "fp32", flops, tf32_conv=True, tf32_matmul=False)
    assert peak == pytest.approx(10e9 / (9e9 / 300e12 + 1e9 / 50e12))
    assert "conv 90.0% at TF32 300" in basis and "matmul 10.0% at FP32 50" in basis
    # The datasheet table goes through the same arithmetic.
    assert mfu_peak("NVIDIA H100 80GB HBM3", "bf16", flops)[0] == pytest.approx(989e12)
    # No TF32 measured (a V100): fp32 work counts at the fp32 rate.
    v100 = {"fp16": 100e12, "fp32": 14e12, "tf32": None}
    assert effective_peak(v100, "fp32", flops, True, True)[0] == pytest.approx(14e12)


def test_summary_derives_ratios_and_mfu():
    cases = [{"label": "RN50 v1b fp32", "precision": "fp32", "median_samples_per_s": 1000.0,
              "world_size": 1, "train_flops_by_op": {"conv": 1e10, "matmul": 0},
              "model_flops_per_s": 1e13, "tf32_conv": True, "tf32_matmul": False,
              "dlperf": {"samples_per_s": 400.0}}]
    summary.derive_cases(cases, {"tf32": 100e12, "fp32": 20e12})
    assert cases[0]["mfu_measured"] == pytest.approx(0.1)
    assert cases[0]["ratio_to_v100"] == pytest.approx(2.5)
    peers = [{"peer": "timm", "label": "RN50 v1b fp32", "samples_per_s": 800.0}]
    summary.peer_ratios(peers, cases)
    assert peers[0]["trainperf_over_peer"] == pytest.approx(1.25)


def test_earlier_parts_record_is_found_on_the_same_device(tmp_path):
    old, here = tmp_path / "a-part1", tmp_path / "b-part3"
    old.mkdir()
    here.mkdir()
    rec = {"stage": "1", "device": "GPU X", "started": time.time(), "items": [
        {"kind": "ceiling", "format": "bf16", "flops_per_s": 5e14}]}
    (old / "stage-1.json").write_text(json.dumps(rec))
    found = summary.find_record(here, "1", "GPU X", {})
    assert found["found_in"] == str(old)
    assert summary.find_record(here, "1", "GPU Y", {}) is None
    rec["started"] = time.time() - 2 * summary.FRESH_S
    (old / "stage-1.json").write_text(json.dumps(rec))
    assert summary.find_record(here, "1", "GPU X", {}) is None


def _points(constants: DeviceConstants) -> list[dict]:
    """Probes as the memory model's components and a peak the given constants predict."""
    points = []
    for batch in (16, 32, 64, 128):
        parts = {"backbone_static_bytes": 200 * 2**20, "activation_bytes": batch * 8 * 2**20,
                 "input_bytes": batch * 150_000, "head_static_bytes": 300 * 2**20,
                 "head_step_bytes": 64 * 2**20}
        points.append({"parts": parts, "baseline": 2**20,
                       "peak": 2**20 + combine(parts, constants)})
    return points


def test_refit_recovers_the_constants_that_made_the_peaks():
    truth = DeviceConstants(2.1, 700 * 2**20, "")
    points = _points(truth)
    new = capacity.fit(points)
    assert new.backward_factor == pytest.approx(2.1)
    assert new.runtime_bytes == pytest.approx(truth.runtime_bytes, rel=1e-6)
    assert capacity.model_error(points, new) < 1e-6
    assert capacity.model_error(points, DeviceConstants(1.5, 0, "")) > 0.1
    assert capacity.leave_one_out(points) < 1e-6
    assert capacity.fit(points[:1]) is None


# -- what gpucheck needs from the rest --------------------------------------------------------

def test_an_interpreter_that_already_has_the_framework(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.python_override_var("jax"), sys.executable)
    st = envs.state("jax")
    assert st.state == "external" and envs.interpreter("jax") == sys.executable
    assert envs.create("jax").state == "external"  # nothing to build
    monkeypatch.setenv(envs.python_override_var("jax"), str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="TRAINPERF_JAX_PYTHON names no interpreter"):
        envs.interpreter("jax")


def test_tf32_setting_is_checked_and_recorded(tmp_path, capsys):
    with pytest.raises(SystemExit):  # argparse's choices
        main(["run", "tiny-arcface", "--tf32", "maybe"])

    args = build_parser().parse_args(["run", "tiny-arcface", "--tf32", "off", "--device", "cpu",
                                      "--out", str(tmp_path / "r")])
    plan_ = plan_from_args(args)[0]
    assert plan_.settings()["tuning"]["tf32"] == "off"
    with pytest.raises(ValueError, match="--tf32 must be one of"):
        Tuning(tf32="maybe")


def test_each_seed_case_meets_its_published_row():
    from trainperf.gpucheck.seeds import published

    flops = {"conv": 3 * 24.2e9, "matmul": 3 * 0.1e9}
    by_label = {c.label: c for cs in gpu_cases.CASES_GPU.values() for c in cs}
    dp = published(by_label["R100 emore dp fp32"], flops, sum(flops.values()))
    assert (dp["framework"], dp["samples_per_s"], dp["same_precision"]) == ("oneflow", 245, True)
    assert dp["mfu"] == pytest.approx(245 * sum(flops.values()) / 15.7e12)
    pfc = published(by_label["R100 emore pfc 0.1 fp32"], flops, sum(flops.values()))
    assert pfc["samples_per_s"] == 246.45 and "sample_ratio=0.1" in pfc["mode"]
    # DLPerf published no bf16 row for glint360k: its fp32 row stands beside, said so.
    glint = published(by_label["R100 glint360k pfc 0.1 bf16"], flops, sum(flops.values()))
    assert glint["precision"] == "fp32" and not glint["same_precision"]
    assert glint["samples_per_s"] == 245.12


def test_summary_shows_the_probes_of_a_search_cut_at_its_cap(tmp_path):
    meta = {"mode": "gpu", "part": 3, "name": "part3", "device": "GPU X", "started": 0,
            "elapsed_s": 210.0, "notes": [], "env": {"host": "h"}, "work": str(tmp_path)}
    cut = {"stage": "7", "title": "Capacity", "part": 3, "status": "timeout",
           "why": "stopped at its cap of 210 s; what it measured before is kept",
           "elapsed_s": 210.0, "cap_s": 210.0, "device_memory_bytes": 80 * 2**30,
           "items": [{"kind": "probe", "search": "max-batch", "value": 512, "status": "ok",
                      "peak_bytes": 70 * 2**30, "predicted_bytes": 66 * 2**30, "error": None}]}
    doc = summary.build(tmp_path, meta, [cut])
    text = summary.render(doc, ["summary.md"], [])
    assert "### max-batch: stopped before its end" in text and "| 512 | ok | 70.00 GiB |" in text
    assert "timeout in 210 s" in text
    assert "## Stage 1: Machine ceiling\n\nnot run: in part 1" in text


@pytest.mark.slow
def test_ctrl_c_keeps_what_was_measured(tmp_path):
    import os
    import signal

    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-m", "trainperf.cli", "gpucheck", "--mode", "cpu",
                             "--part", "1", "--stages", "1,2", "--out", str(out), "--work",
                             str(work)], env={**os.environ, FAULT_ENV: "1:hang"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            # pytest-xdist's workers ignore SIGINT, and a child inherits that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (work / "stage-1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, text
    doc = json.loads((out / "summary.json").read_text())
    assert stage(doc, "1")["status"] == "interrupted"
    assert stage(doc, "2")["why"].startswith("not reached")
    assert doc["notes"][0].startswith("interrupted")
    assert left_behind(work) == []


# -- power and the mode, against stand-ins for the driver's tools -----------------------------

FAKE_SMI = """#!/bin/sh
case "$*" in
  *power.draw*) while true; do echo 250.5; sleep 0.05; done ;;
  *-L*) echo "GPU 0: Fake GPU (UUID: GPU-0)" ;;
  *query-gpu=name*) echo "Fake GPU, 999.99, 81559 MiB" ;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    script = tmp_path / "bin" / "nvidia-smi"
    script.parent.mkdir()
    script.write_text(FAKE_SMI)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{__import__('os').environ['PATH']}")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # NVML absent: nvidia-smi is read
    return script


def test_power_read_through_nvidia_smi(fake_smi):
    assert power.source() == "nvidia-smi"
    with power.PowerSampler(interval_s=0.05) as sampler:
        time.sleep(0.6)
    assert sampler.error is None and len(sampler.times) >= power.MIN_SAMPLES
    got = sampler.window(sampler.times[-1], sampler.times[-1] - sampler.times[0])
    assert got.method == "nvidia-smi power readings" and got.mean_w == pytest.approx(250.5)


def test_power_read_through_nvml(tmp_path, monkeypatch):
    """Through trainperf's one NVML reader (``trainperf.energy``), against a stand-in NVML (no
    GPU here): the board ``CUDA_VISIBLE_DEVICES`` names first, by a UUID's prefix as CUDA
    takes it, read alone."""
    standin = nvml_standin.install(monkeypatch, tmp_path / "nvml")
    board = nvml_standin.BOARDS[2]  # 400 W, listed third
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{board['uuid'][:8]},0")
    assert power.source() == "nvml"
    with power.PowerSampler(interval_s=0.02) as sampler:
        time.sleep(0.4)
    assert sampler.method == "nvml" and sampler.error is None
    got = sampler.window(sampler.times[-1], sampler.times[-1] - sampler.times[0])
    assert got.method == "nvml energy counter" and got.mean_w == pytest.approx(400.0, rel=0.01)
    assert set(standin.READS) == {board["uuid"]}


def test_the_runners_own_energy_record_comes_before_the_samplers(tmp_path):
    """A run whose record holds the runner's joules (``run_energy``) takes them: the sampler's
    readings are for the runs the runner could not read."""
    from trainperf.gpucheck.runs import summarise

    run = {"run": 1, "status": "ok", "samples_per_s": 100.0, "window_s": 4.0,
           "window_samples": 400, "energy_j": 800.0,
           "energy_method": "NVML energy counter, read every 0.05 s"}
    doc = {"cases": [{"runs": [run], "world_size": 1, "batch_size_per_device": 8,
                      "precision": "fp32", "median_samples_per_s": 100.0}]}
    (got,) = summarise(doc, tmp_path, sampler=None)["runs"]
    assert got["energy_j"] == 800.0 and got["mean_power_w"] == 200.0
    assert got["samples_per_j"] == 0.5
    assert got["power_method"] == "runner: NVML energy counter, read every 0.05 s"


def test_a_gpu_torch_cannot_use_runs_the_cpu_mode_and_says_so(fake_smi):
    from trainperf.gpucheck.orchestrate import detect_mode

    mode, note = detect_mode("auto")
    assert mode == "cpu" and "nvidia-smi lists 1 GPU(s)" in note and "cannot use CUDA" in note
    assert detect_mode("gpu") == ("gpu", None)


# -- the GPU sizes, as far as they go without a GPU -------------------------------------------

def test_every_gpu_case_makes_a_valid_plan(tmp_path):
    from trainperf.gpucheck import peers, realdata
    from trainperf.gpucheck.runs import plan_for

    staged = [c for s in plan.of_kind("cases") for c in gpu_cases.stage_cases(s.id, "gpu")]
    every = staged + [c for _, c in capacity.SEARCHES["gpu"]] + peers.JAX_CASES
    every += [realdata.CASE["gpu"]]
    for case in every:
        plan_ = plan_for(case, tmp_path, gpu_cases.measure("gpu"), "cuda", Tuning(**case.tuning))
        assert plan_.tuning.cudnn_benchmark is case.tuning.get("cudnn_benchmark", True)
        w = plan_.workload
        assert plan_.cases[0].topology.device == "cuda"
        assert w.precision == case.precision
        if w.fc == "pfc":
            assert w.sample_ratio == 0.1
    labels = [c.label for c in staged]
    assert len(set(labels)) == len(labels) == 15  # the summary keys cases by label
    assert gpu_cases.measure("gpu") == gpu_cases.GPU_MEASURE
    assert (gpu_cases.GPU_MEASURE.runs, gpu_cases.GPU_MEASURE.iters,
            gpu_cases.GPU_MEASURE.warmup) == (2, 40, 10)


def test_gpu_searches_start_under_where_the_model_fills_the_device():
    from trainperf.backends.torch.memory_model import estimate
    from trainperf.recipes import get_recipe

    limit = 80 * 2**30
    for kind, case in capacity.SEARCHES["gpu"]:
        start = capacity.model_start(kind, case, limit)
        field = {"max-batch": "batch_size", "max-classes": "num_classes"}[kind]
        w = get_recipe(case.recipe).workload.replace(**case.changes)
        fills = int(start / capacity.AIM)
        predicted = estimate(w.replace(**{field: fills}), 1, device_type="cuda",
                             limit_bytes=limit).total_bytes
        assert predicted == pytest.approx(limit, rel=0.02)
        # The step itself needs less; fp32's elastic workspace takes what is left.
        assert estimate(w.replace(**{field: start}), 1, device_type="cuda",
                        limit_bytes=limit).total_bytes <= limit
    # The seeds' one-V100 figures sit below what 80 GiB holds.
    assert capacity.model_start("max-batch", capacity.SEARCHES["gpu"][0][1], limit) > 115
    assert capacity.model_start("max-classes", capacity.SEARCHES["gpu"][1][1], limit) > 2e6


def test_timm_step_is_timed_by_trainperfs_loop(monkeypatch):
    """timm is not installed here: a stand-in module whose resnet50 is trainperf's own ResNet50
    v1b runs the peer's step through the measured loop, on the CPU at the CPU mode's size."""
    import types

    from trainperf.backends.torch.backbones import build_backbone
    from trainperf.gpucheck import peers

    made = []

    def create_model(name, num_classes):
        made.append((name, num_classes))
        return build_backbone("resnet50_v1b", num_classes=num_classes, input_size=32)

    monkeypatch.setitem(sys.modules, "timm", types.SimpleNamespace(
        create_model=create_model, __version__="stand-in"))
    got = peers.timm_step_rate("cpu", "bf16", True, 2, 32)
    assert made == [("resnet50", 1000)]
    iters, warmup = peers.TIMM_STEPS["cpu"]
    assert got["samples_per_s"] == pytest.approx(2 * (iters - warmup) / got["window_s"])
    assert got["timm_version"] == "stand-in"
