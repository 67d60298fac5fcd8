"""What is made from the GPU records under ``benchmarks/results/gpu-*``: the memory model's GPU
constants (held to their fit on the H200 record, and their error per precision to the table on
docs/capacity.md), the README's GPU support matrix (held to what the records show) and the GPU
check's plan on docs/gpu-check.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainperf.backends.torch.memory_model import (
    CONSTANTS, DeviceConstants, combine, constants_for)
from trainperf.backends import get_backend
from trainperf.cli import pages
from trainperf.gpucheck import budget, cases, coverage, matrix, memfit

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
H200 = RESULTS / "gpu-h200-2026-11-26"
GIB = 2**30


@pytest.fixture(scope="module")
def fitted():
    return memfit.fit_record(H200)


def test_committed_gpu_constants_are_the_h200_records_fit(fitted):
    half, fp32 = CONSTANTS["cuda"], CONSTANTS["cuda-fp32"]
    assert fitted["half_points"] == 17 and fitted["fp32_points_fitted"] == 8
    assert half.backward_factor == fp32.backward_factor == fitted["backward_factor"] == 1.02
    assert half.runtime_bytes == fp32.runtime_bytes == 0
    assert (fp32.workspace_bytes, fp32.workspace_per_activation) == (
        fitted["workspace_bytes"], fitted["workspace_per_activation"])
    assert half.workspace(10 * GIB) == 0
    # The probes the autotuner had no room for are not fitted; MobileFaceNet is not either.
    assert not any("1266" in w or "1301" in w or "y1" in w for w in fitted["fp32_fitted"])
    assert constants_for("cuda", "bf16") is half and constants_for("cuda", "fp32") is fp32
    assert constants_for("cpu", "bf16") is CONSTANTS["cpu"]


def test_capacity_page_gives_the_models_error_per_precision_on_the_record(fitted):
    rows = memfit.errors(fitted["points"], memfit.committed)
    old = memfit.errors(fitted["points"], lambda _: memfit.OLD)

    def mean(rs, pick):
        vals = [abs(r["error"]) for r in rs if pick(r)]
        return f"{100 * sum(vals) / len(vals):.1f}%", f"{100 * max(vals):.1f}%", len(vals)

    page = (REPO / "docs" / "capacity.md").read_text()
    groups = {"fp16, bf16": lambda r: r["precision"] != "fp32",
              "fp32 (R100, ResNet50)": lambda r: r["precision"] == "fp32"
              and not r["backbone"].startswith("mobilefacenet"),
              "fp32, MobileFaceNet (depthwise)": lambda r: r["precision"] == "fp32"
              and r["backbone"].startswith("mobilefacenet")}
    for label, pick in groups.items():
        now, largest, n = mean(rows, pick)
        before, _, _ = mean(old, pick)
        assert f"| {label} | {n} | {before} | {now} | {largest} |" in page, label
    # What the record's own table says, made by benchmarks/memory_model_gpu.py.
    doc = json.loads((H200 / "memory_model.json").read_text())
    assert doc["new"]["fp16/bf16"]["mean_abs_error"] == pytest.approx(
        sum(abs(r["error"]) for r in rows if r["precision"] != "fp32") / 17)


def test_the_fp32_workspace_fills_only_what_is_free():
    c = DeviceConstants(1.02, 0, "", workspace_bytes=4 * GIB, workspace_per_activation=0.1)
    parts = {"backbone_static_bytes": GIB, "activation_bytes": 10 * GIB, "input_bytes": 0,
             "head_static_bytes": 0, "head_step_bytes": 0}
    need = GIB + 10 * GIB + int(0.02 * 10 * GIB)
    assert combine(parts, c) == need + 5 * GIB
    assert combine(parts, c, 100 * GIB) == need + 5 * GIB
    assert combine(parts, c, need + GIB) == need + GIB  # the workspace took what was left
    assert combine(parts, c, need - GIB) == need  # it never decides whether a step fits


def test_made_tables_are_what_the_plan_and_the_records_say(capsys):
    front = (REPO / "README.md").read_text()
    assert pages.block_of(front, "gpu-matrix") == matrix.render(RESULTS)
    plan_page = (REPO / "docs" / "gpu-check.md").read_text()
    assert pages.block_of(plan_page, "gpu-plan") == budget.plan_table()
    assert pages.main(["--root", str(REPO), "--check", "--only", "gpu-matrix,gpu-plan"]) == 0
    from trainperf.cli import main

    assert main(["gpucheck", "--plan"]) == 0
    assert capsys.readouterr().out == budget.plan_table()


def _results(framework: str, precision: str, fc: str, device: str = "NVIDIA H100 80GB HBM3",
             role: str | None = None, version: str | None = None) -> dict:
    return {"framework": framework, "env": {"device_type": "cuda", "device_names": [device],
                                            "framework_version": version},
            "workload": {"task": "face", "fc": fc}, "data": {"role": role} if role else None,
            "cases": [{"precision": precision, "world_size": 1,
                       "runs": [{"status": "ok"}]}]}


def test_matrix_takes_each_paths_latest_gpu(tmp_path, capsys):
    old, new = tmp_path / "gpu-h200-2026-11-26", tmp_path / "gpu-h100-2026-12-03"
    (old / "a").mkdir(parents=True)
    (new / "b").mkdir(parents=True)
    (tmp_path / "gpu-notes").mkdir()  # no date: not a record
    (old / "a" / "results.json").write_text(json.dumps(
        _results("torch", "bf16", "pfc", "NVIDIA H200")))
    (new / "b" / "results.json").write_text(json.dumps(_results("jax", "bf16", "mp",
                                                                 role="real", version="0.11.2")))
    cpu = _results("paddle", "fp32", "dp")
    cpu["env"]["device_type"] = "cpu"
    (new / "b" / "cpu").mkdir()
    (new / "b" / "cpu" / "results.json").write_text(json.dumps(cpu))
    last = matrix.latest(matrix.observations(tmp_path))
    assert last[("torch", "pfc")]["device"] == "H200"
    assert last[("jax", "bf16")] == {"framework": "jax", "key": "bf16", "device": "H100 80GB HBM3",
                                     "date": "2026-12-03", "record": new.name,
                                     "version": "0.11.2"}
    # The release that ran, where it is not the one `env create` pins, is named as such.
    status = matrix.status(tmp_path)
    pinned = get_backend("jax").env.packages[0].partition("==")[2]
    assert f"JAX 0.11.2, the lent machine's own, not the {pinned}" in status
    assert "torch (" in status and "torch None" not in status
    assert ("jax", "realdata") in last and ("paddle", "dp") not in last
    text = matrix.render(tmp_path)
    assert "| training step, bf16 | H200, 2026-11-26 | H100 80GB HBM3, 2026-12-03 | " \
           f"{matrix.NOT_YET} |" in text
    # Part 2 runs torch's fp16, dp and parity rows, none of them recorded here: the most.
    assert "then `make gpu-check PART=2`" in text
    # Each table lives in its own file: the matrix on the front page, the plan on its page.
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    front, plan_page = root / "README.md", root / "docs" / "gpu-check.md"
    (m_begin, m_end), (p_begin, p_end) = pages.markers("gpu-matrix"), pages.markers("gpu-plan")
    front.write_text(f"x\n{m_begin}\nold\n{m_end}\ny\n")
    plan_page.write_text(f"p\n{p_begin}\n{budget.plan_table()}{p_end}\nq\n")
    argv = ["--root", str(root), "--results", str(tmp_path), "--only", "gpu-matrix,gpu-plan"]
    assert pages.main([*argv, "--check"]) == 1
    err = capsys.readouterr().err
    assert "README.md: gpu-matrix out of date" in err and "gpu-plan" not in err
    assert err.count("\n") == 1 and "--write --root" in err
    assert pages.main([*argv, "--write"]) == 0
    assert pages.main([*argv, "--check"]) == 0
    written = front.read_text()
    assert written.startswith("x\n") and written.endswith(f"{m_end}\ny\n")
    assert pages.block_of(written, "gpu-matrix") == text
    assert plan_page.read_text() == f"p\n{p_begin}\n{budget.plan_table()}{p_end}\nq\n"
    # A page that lost its markers is named, not passed over.
    plan_page.write_text("p\n")
    assert pages.main([*argv, "--check"]) == 1
    assert "docs/gpu-check.md: gpu-plan out of date" in capsys.readouterr().err
    assert pages.main([*argv, "--write"]) == 2
    assert "docs/gpu-check.md: no <!-- gpu-plan:begin -->" in capsys.readouterr().err


def test_a_gpu_run_keeps_its_windows_own_peak(monkeypatch):
    """On a GPU the allocator's peaks are read before the window and counted afresh in it: the
    run's peak is the larger, the window's is its own (no CUDA here: the allocator's counters
    are stood in for)."""
    import torch

    from trainperf.backends.torch import runtime

    counters = {"allocated": 12 * GIB, "reserved": 14 * GIB}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: counters["reserved"])

    def reset(d):
        counters.update(allocated=0, reserved=0)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    # Device-wide: every process's memory and the allocator's cache, apart from the peak.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (100 * GIB, 141 * GIB))
    used = {"device_used_bytes": 41 * GIB}
    cuda = torch.device("cuda", 0)
    before = runtime.start_window_peak(cuda)
    assert before == (12 * GIB, 14 * GIB) and counters["allocated"] == 0
    counters.update(allocated=8 * GIB, reserved=9 * GIB)  # the steady state holds less
    assert runtime.peak_memory(cuda, before) == {
        "peak_memory_bytes": 12 * GIB, "peak_reserved_bytes": 14 * GIB,
        "window_peak_memory_bytes": 8 * GIB, **used}
    assert runtime.peak_memory(cuda) == {"peak_memory_bytes": 8 * GIB,
                                         "peak_reserved_bytes": 9 * GIB, **used}
    cpu = torch.device("cpu")
    assert runtime.start_window_peak(cpu) is None
    assert set(runtime.peak_memory(cpu, None)) == {"peak_memory_bytes"}


def test_the_matrix_part_column_is_read_from_the_stages(monkeypatch, tmp_path):
    """Which part runs a path comes from what each stage runs: JAX's parity stage moved from
    part 1 to part 5, and its rows (parity, bf16, dp) moved with it; moved again, they follow."""
    from dataclasses import replace as moved

    from trainperf.gpucheck import native, plan

    jax_parity = next(s for s in plan.STAGES if native.FRAMEWORK.get(s.id) == "jax")
    first = coverage.first_parts()
    assert {first[("jax", k)] for k in ("parity", "bf16", "dp")} == {jax_parity.part}
    # torch's fp32 first runs in part 2's RN50 fp32 case, not in part 5's headline
    assert first[("torch", "fp32")] == 2 and ("jax", "pfc") not in first
    assert first[("torch", "breakdown")] == next(s.part for s in plan.STAGES if any(
        c.label in cases.BREAKDOWN_CASES for c in cases.CASES_GPU.get(s.id, [])))
    stages = tuple(moved(s, part=3) if s is jax_parity else s for s in plan.STAGES)
    monkeypatch.setattr(coverage, "STAGES", stages)
    text = matrix.render(tmp_path)
    parity_row = next(line for line in text.splitlines() if line.startswith("| native parity"))
    assert parity_row.endswith(f"| {coverage.first_parts()[('torch', 'parity')]} / 3 |")


def test_the_gpu_status_line_says_which_frameworks_ran_from_the_records(tmp_path):
    record = tmp_path / "gpu-h100-2026-12-03" / "a"
    record.mkdir(parents=True)
    (record / "results.json").write_text(json.dumps(_results("paddle", "fp16", "mp")))
    text = matrix.status(tmp_path)
    assert "Paddle (2 of the 13 paths; latest on H100 80GB HBM3, 2026-12-03)" in text
    assert "Not yet run on a GPU: torch, JAX, MXNet, TensorFlow and OneFlow." in text
    empty = tmp_path / "none"
    empty.mkdir()
    assert matrix.status(empty).startswith("Not yet run on a GPU: torch, JAX, MXNet, Paddle,")
