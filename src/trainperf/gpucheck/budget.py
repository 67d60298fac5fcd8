"""What each stage is expected to take on one H100, from what the same work took on the H200
record (``benchmarks/results/gpu-h200-2026-11-26/``): its process starts, compilations and
step times, the steps made 1.3x slower (an H100 has the H200's compute and 70% of its memory
bandwidth). The suite holds every stage's estimate under its cap, so that a case added to a
part that cannot hold it fails there and not on a lent machine.

The stages' own settings (cases, steps, probes) are read from their modules, so the estimate
follows any change to them.
"""

from __future__ import annotations

from . import cases
from .plan import INSTALL_S, SUMMARY_S, Stage, stages_of

H100_STEP_FACTOR = 1.3
TORCH_START_S = 9.5
"""A torch run's start to its worker's first step (the slowest seen: R100 fp32)."""
FIRST_STEP_S = 3.0
"""A run's first step: cuDNN's autotuning, the libraries' first calls (R100 fp32: 2.9 s)."""
COLD_S = 10.0
"""A stage's first GPU process loads the libraries' kernels from a cold disk: RN50 bf16's and
fp16's first step took 9.1-9.8 s in the first run of their stage, under 3 s after."""
JAX_START_S = {"rn50": 16.0, "face": 25.0, "r100": 30.0}
"""A JAX worker's start with its compilation (ResNet50 15.6 s, R100 29.2 s; IResNet-50 lies
between them and is given more than half way)."""
STEP_S = {("r100", "fp32"): 0.060, ("r100", "bf16"): 0.054, ("r100", "fp16"): 0.054,
          ("y1", "fp32"): 0.046, ("rn50", "fp32"): 0.060, ("rn50", "bf16"): 0.045,
          ("face", "bf16"): 0.031, ("tiny", "fp16"): 0.016, ("tiny", "bf16"): 0.016}
"""Seconds a step on the H200, from the record's samples/s at each case's batch and its step
events; ResNet50 bf16 in NCHW (only its channels-last step, 0.030 s, was measured) is given
1.5x that."""
COMPILE_S = {"r100": 75.0, "rn50": 50.0}
"""torch.compile's compilation of a training step (inductor, forward and backward) on a GPU
machine: not yet measured; assumed from its usual order (about a minute for a ResNet-sized
model, more for 100 layers). Stage 11's run records what it took (``compile_s``)."""
NO_AUTOTUNE_FACTOR = 2.0
"""cuDNN's heuristic choice instead of its measured one: not yet measured; assumed at most 2x."""
ALIGN_RUN_S = 9.5
"""One alignment run (5 steps of the tiny recipe), on the CPU or the GPU."""
PROBE_S = 16.0
"""One capacity probe (171 s for 11 probes)."""
TIMM_START_S = 10.0
REALDATA_SYNTH_S = 10.0
CEILING_S = 8.0
"""Stage 1 took 6 s with twice the repetitions."""


def model_key(case: cases.Case) -> str:
    for prefix in ("r100", "y1", "rn50", "tiny"):
        if case.recipe.startswith(prefix):
            return prefix
    raise ValueError(f"no step time for {case.recipe}")


def step_s(model: str, precision: str) -> float:
    return STEP_S[(model, precision)] * H100_STEP_FACTOR


def torch_run_s(steps: int, step: float) -> float:
    return TORCH_START_S + FIRST_STEP_S + (steps - 1) * step


def case_s(case: cases.Case, stage_id: str = "") -> float:
    m = cases.measure("gpu", stage_id)
    step = step_s(model_key(case), case.precision)
    if case.tuning.get("cudnn_benchmark") is False:
        step *= NO_AUTOTUNE_FACTOR
    compile_s = COMPILE_S[model_key(case)] if case.tuning.get("mode", "").startswith(
        "compile") else 0.0
    total = m.runs * (torch_run_s(m.iters, step) + compile_s)
    if case.label in cases.BREAKDOWN_CASES:
        total += torch_run_s(m.warmup + cases.BREAKDOWN_STEPS, step)
    return total


def parity_s(stage_id: str) -> float:
    from .native import FRAMEWORK, ROWS, SETTINGS

    s = SETTINGS["gpu"]
    steps = s.iters + s.warmup
    framework = FRAMEWORK[stage_id]
    total = 0.0
    for model, _ in ROWS["gpu"]:
        step = step_s(model, s.precision)
        start = JAX_START_S[model] if framework == "jax" else TORCH_START_S + FIRST_STEP_S
        total += 2 * (start + steps * step)  # trainperf's side and the native one
    return total


def correctness_s() -> float:
    from .correctness import ALIGN_HEADS, PRECISION_MEASURE

    m = PRECISION_MEASURE["gpu"]
    aligns = (1 + len(ALIGN_HEADS["gpu"])) * ALIGN_RUN_S
    return aligns + sum(torch_run_s(m.iters, step_s("tiny", p)) for p in ("fp16", "bf16"))


def capacity_s() -> float:
    from .capacity import MAX_PROBES, SEARCHES

    return len(SEARCHES["gpu"]) * MAX_PROBES["gpu"] * PROBE_S


def peers_s() -> float:
    from .peers import JAX_CASES, JAX_MEASURE, TIMM_CASES, TIMM_STEPS

    iters, _ = TIMM_STEPS["gpu"]
    timm = sum(TIMM_START_S + FIRST_STEP_S + iters * step_s("rn50", p)
               for _, p, _, _, _ in TIMM_CASES["gpu"])
    jax = sum(JAX_START_S[model_key(c)] + JAX_MEASURE["gpu"].iters
              * step_s(model_key(c), c.precision) for c in JAX_CASES)
    return timm + jax


def realdata_s() -> float:
    from .realdata import CASE, MEASURE

    m = MEASURE["gpu"]
    step = step_s(model_key(CASE["gpu"]), "fp32")
    # The synthetic twin and the real set take turns; DALI, where installed, makes a third.
    return REALDATA_SYNTH_S + 3 * m.runs * torch_run_s(m.iters, step)


def work_s(stage: Stage) -> float:
    if stage.kind == "ceiling":
        return CEILING_S
    if stage.kind == "cases":
        return sum(case_s(c, stage.id) for c in cases.CASES_GPU[stage.id])
    if stage.kind == "parity":
        return parity_s(stage.id)
    return {"correctness": correctness_s, "capacity": capacity_s, "peers": peers_s,
            "realdata": realdata_s}[stage.kind]()


def estimates_s(part: int) -> dict[str, float]:
    """Each of a part's stages' expected seconds on one H100. The part's first stage that
    trains also loads the libraries' kernels from a cold disk (capacity's probe time is an
    average that holds it already)."""
    out, cold = {}, True
    for s in stages_of(part):
        out[s.id] = work_s(s)
        if cold and s.kind != "ceiling":
            out[s.id] += 0.0 if s.kind == "capacity" else COLD_S
            cold = False
    return out


def estimate_s(stage: Stage) -> float:
    return estimates_s(stage.part)[stage.id]


def part_estimate_s(part: int) -> float:
    """A part's expected seconds in one call: the install, its stages and the summary."""
    return INSTALL_S + sum(estimates_s(part).values()) + SUMMARY_S


def plan_table() -> str:
    """Every part's stages with their caps and expected times, and each part's total against
    its budget (the install and the summary included), as a markdown table."""
    from .plan import PART_BUDGET_S, PARTS, part_cap_s

    lines = ["| part | stage | cap on a GPU | expected on one H100 |", "|---|---|---|---|"]
    for part in PARTS:
        expected = estimates_s(part)
        for s in stages_of(part):
            lines.append(f"| {part} | {s.id}. {s.title} | {s.cap_s:.0f} s | "
                         f"{expected[s.id]:.0f} s |")
        lines.append(f"| **{part}** | **the call**, with the install ({INSTALL_S:.0f} s) and "
                     f"the summary ({SUMMARY_S:.0f} s): budget {PART_BUDGET_S[part]:.0f} s | "
                     f"**{part_cap_s(part):.0f} s** | **{part_estimate_s(part):.0f} s** |")
    return "\n".join(lines) + "\n"


def parts_list() -> str:
    """Every part with its stages, what each runs (a case stage: its cases) and the part's
    budget, as a markdown list: the GPU check's page holds it."""
    from .plan import PART_BUDGET_S, PARTS

    lines = []
    for part in PARTS:
        lines.append(f"- **Part {part}**, one call of at most {PART_BUDGET_S[part] / 60:g} "
                     f"minutes:")
        for s in stages_of(part):
            what = s.about or "its cases " + ", ".join(
                f"`{c.label}`" for c in cases.CASES_GPU.get(s.id, []))
            lines.append(f"    - stage {s.id}, *{s.title}*: {what}.")
    return "\n".join(lines) + "\n"
