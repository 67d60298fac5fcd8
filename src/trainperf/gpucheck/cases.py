"""What each stage runs, at the GPU's sizes and at the CPU mode's tiny ones.

The CPU mode keeps every case's shape (head mode, precision, loss, memory format) and shrinks
its size: the face recipes become ``tiny-arcface`` at 32x32 (CosFace and the FC block for
glint360k), MobileFaceNet keeps its 112-pixel input at batch 2 and 1,000 classes, ResNet50 runs
at 32x32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import Measure

GPU_MEASURE = Measure(runs=2, iters=40, warmup=10, timeout_s=180)
"""2 runs of 40 iterations, the first 10 not counted: a lent machine's minutes go to more cases
rather than more runs of each (the full protocol is ``trainperf run``'s)."""
CPU_MEASURE = Measure(runs=1, iters=6, warmup=3, timeout_s=120)
"""Three warm-up steps: fp16's loss scale, starting at 2^16, skips its first steps."""
ONE_RUN_STAGES = ("11",)
"""Case stages that run each case once: a compiled mode's run holds its compilation, which a
lent machine's minutes cannot pay twice (its speed is set against stage 4's two eager runs)."""


@dataclass(frozen=True)
class Case:
    label: str
    recipe: str
    changes: dict = field(default_factory=dict)
    """Workload fields changed from the recipe's."""
    tuning: dict = field(default_factory=dict)
    """Speed settings changed from trainperf's defaults (``config.Tuning``)."""

    @property
    def name(self) -> str:
        """A folder name."""
        return "".join(c if c.isalnum() or c in "-_." else "-" for c in self.label.lower())

    @property
    def precision(self) -> str:
        return self.changes.get("precision", "fp32")


def _face(label: str, recipe: str, fc: str, precision: str, **more) -> Case:
    changes = {"fc": fc, "precision": precision, **more}
    if fc == "pfc":
        changes.setdefault("sample_ratio", 0.1)
    return Case(label, recipe, changes)


def _r100(fc: str, precision: str) -> Case:
    ratio = " 0.1" if fc == "pfc" else ""
    return _face(f"R100 emore {fc}{ratio} {precision}", "r100-arcface-emore", fc, precision)


CASES_GPU: dict[str, list[Case]] = {
    # Part 1: the headline cases, in the default layout (channels-last for torch on a GPU),
    # eager; then the same in torch.compile (issue 43: JAX's ResNet50 ran 1.41x torch eager's
    # on the H200, and whether torch's own compiler closes that had not been measured).
    "4": [_r100("pfc", "bf16"), _r100("mp", "bf16"),
          Case("RN50 v1b bf16", "rn50-v1b-imagenet", {"precision": "bf16"})],
    "11": [Case("R100 emore pfc 0.1 bf16, torch.compile", "r100-arcface-emore",
                {"fc": "pfc", "sample_ratio": 0.1, "precision": "bf16"}, {"mode": "compile"}),
           Case("RN50 v1b bf16, torch.compile", "rn50-v1b-imagenet", {"precision": "bf16"},
                {"mode": "compile"})],
    # Part 5: the headline in fp32.
    "12": [_r100("pfc", "fp32"), _r100("mp", "fp32")],
    # Part 2: the rest of the seeds' table (on one device, dp runs at mp's speed: the H200
    # record has 1,188.5 against 1,179.7 in bf16, 1,037.6 against 1,062.6 in fp32).
    "6": [_r100(fc, "fp16") for fc in ("pfc", "mp", "dp")]
         + [_face("Y1 emore dp fp32", "y1-arcface-emore", "dp", "fp32"),
            _face("R100 glint360k pfc 0.1 bf16", "r100-cosface-glint360k", "pfc", "bf16"),
            Case("RN50 v1b fp32", "rn50-v1b-imagenet", {"precision": "fp32"})],
    # Part 3: what cuDNN's autotuning holds in memory and buys in speed in fp32 (the memory
    # model's fp32 term), and where the step's time goes.
    "8": [_r100("dp", "fp32"),
          Case("R100 emore dp fp32, no cuDNN autotuning", "r100-arcface-emore",
               {"fc": "dp", "precision": "fp32"}, {"cudnn_benchmark": False})],
}
"""Each case stage's cases on a GPU, in order of value."""


BREAKDOWN_CASES = ("R100 emore dp fp32",)
"""Cases that also get a profiled run (``run --breakdown``) on a GPU: where their step's time
goes. The CPU mode leaves it out (its tiny steps say nothing a GPU's would)."""
BREAKDOWN_STEPS = 10


def tiny(case: Case) -> Case:
    """The CPU mode's stand-in for a GPU case: the same shape at a size a CPU runs in
    seconds."""
    ch = dict(case.changes)
    label = f"{case.label} (tiny)"
    if case.recipe.startswith("r100"):
        if "glint360k" in case.recipe:
            ch.update(loss="cosface", output_block="FC")
        # 32 pixels, as the real-data stage's: the same layers and head, a step about 6x
        # cheaper than at 112 on a CPU (in fp16, which a CPU emulates, the most).
        return Case(label, "tiny-arcface", {"input_size": 32, **ch}, case.tuning)
    if case.recipe.startswith("y1"):
        return Case(label, case.recipe, {**ch, "batch_size": 2, "num_classes": 1000},
                    case.tuning)
    if case.recipe.startswith("rn50"):
        return Case(label, case.recipe, {**ch, "batch_size": 2, "input_size": 32},
                    case.tuning)
    return case


CPU_PICKS = {"4": (2,), "11": (0,), "6": (0, 3, 4, 5), "8": (0,), "12": (1,)}
"""The cases of each case stage that the CPU mode runs: every model, recipe, precision and
sampling head at least once (R100 mp fp32 and both RN50 precisions among them, which the
peers are set against), not every combination: the CPU mode checks the machinery, and each run
is a process of its own in the suite's time. Stage 4 runs RN50 alone: its R100 pfc 0.1 bf16
is stage 6's glint360k case without CosFace, and stage 11 compiles it."""


def stage_cases(stage_id: str, mode: str) -> list[Case]:
    cases = CASES_GPU[stage_id]
    return cases if mode == "gpu" else [tiny(cases[i]) for i in CPU_PICKS[stage_id]]


def measure(mode: str, stage_id: str = "") -> Measure:
    if mode != "gpu":
        return CPU_MEASURE
    return GPU_MEASURE.__class__(**{**GPU_MEASURE.to_dict(), "runs": 1}) \
        if stage_id in ONE_RUN_STAGES else GPU_MEASURE


def device(mode: str) -> str:
    return "cuda" if mode == "gpu" else "cpu"
