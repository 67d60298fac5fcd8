"""The stages, their time caps and the parts they are grouped in.

A lent GPU machine gives a task 15 minutes of device time in all (its start, every command and
every idle wait count) and one command at most 10. So part 1 holds what no GPU has proven yet
and fits one call of 6 minutes on one H100, install included; every later part fits 5, and
they come in order of value: whoever has time left runs ``PART=2``, then ``PART=3``...

Each stage has a cap: past it the stage's processes are stopped, what it measured is kept and
the next stage still runs. A stage may also use what the stages before it in the same run left
of their caps, so a part never takes longer than the sum of its stages' caps. What each stage
is expected to take is estimated in ``budget.py`` from the H200 record; the suite keeps every
estimate under its cap and every part's caps under its budget.
"""

from __future__ import annotations

from dataclasses import dataclass

PART_BUDGET_S = {1: 6 * 60, 2: 5 * 60, 3: 5 * 60, 4: 5 * 60, 5: 5 * 60}
"""What one call may take, part by part, on a GPU."""
INSTALL_S = 10.0
"""``make gpu-check``'s offline install (``pip install --no-deps -e .``) before the stages."""
SUMMARY_S = 5.0
"""The summary, its plots and the archive after them."""
CPU_PART_BUDGET_S = 8 * 60
"""The same for the CPU mode's tiny sizes, which ``make test`` runs."""


@dataclass(frozen=True)
class Stage:
    id: str
    title: str
    part: int
    kind: str
    """What runs: ceiling, correctness, parity, cases, capacity, peers or realdata."""
    cap_s: float
    """Wall-clock limit on a GPU; past it the stage's processes are stopped and what it wrote
    is kept."""
    cpu_cap_s: float
    """The same for the CPU mode's tiny sizes."""
    about: str = ""
    """What it runs, for the GPU check's page, where its title does not say it all (a case
    stage's cases are listed from ``cases.py`` instead)."""

    def cap(self, mode: str, scale: float = 1.0) -> float:
        return (self.cap_s if mode == "gpu" else self.cpu_cap_s) * scale


STAGES: tuple[Stage, ...] = (
    # Part 1: what no GPU has proven yet, the headline in each framework's best mode first.
    Stage("1", "Machine ceiling", 1, "ceiling", 15, 30,
          "bf16, fp16, TF32 and fp32 matmul and the copy rate: the measured ceiling that MFU "
          "is also given against"),
    Stage("2", "GPU correctness", 1, "correctness", 75, 90,
          "`dp`, `mp` and `pfc` 1.0 on CUDA against the CPU's losses, fp16 and bf16 finite, "
          "CUDA events against the host clock"),
    Stage("4", "Headline cases: R100 pfc 0.1 and mp, RN50, bf16, eager", 1, "cases", 95, 90),
    Stage("11", "Execution modes: torch.compile on R100 pfc 0.1 and RN50, bf16", 1, "cases",
          160, 60),
    # Part 2: torch's parity (proven on the H200) and the rest of the seeds' table.
    Stage("5", "Native parity: torch, bf16", 2, "parity", 70, 120,
          "trainperf's worker against torchvision's ResNet50 and a plain IResNet-50 ArcFace "
          "step, interleaved"),
    Stage("6", "The rest of the seeds' table: fp16, Y1, glint360k, RN50 fp32", 2, "cases",
          215, 120),
    # Part 3: memory.
    Stage("7", "Capacity", 3, "capacity", 200, 120,
          "max batch of R100 `mp` fp32, max classes of R100 `pfc 0.1` fp16, the memory "
          "model's error and its refit"),
    Stage("8", "cuDNN autotuning: its memory and its speed, R100 fp32", 3, "cases", 85, 60),
    # Part 4: against other implementations, and real data.
    Stage("9", "Peers: timm, JAX on R100 and ResNet50", 4, "peers", 110, 120,
          "timm's ResNet50 step timed as trainperf times its own; trainperf's JAX worker on "
          "R100 `mp` fp32 and RN50 fp32"),
    Stage("10", "Real data", 4, "realdata", 110, 60,
          "`data synth`, then R100 `dp` fp32 on it and on its synthetic twin, DALI's nvJPEG "
          "where installed"),
    # Part 5: JAX's parity in bf16 and the headline in fp32, moved out of part 1 for the modes.
    Stage("3", "Native parity: JAX, bf16", 5, "parity", 105, 30,
          "trainperf's JAX worker against flax modules in the ImageNet example's layout, "
          "ResNet50 v1b and IResNet-50 ArcFace, with its committed BatchNorm"),
    Stage("12", "Headline cases in fp32: R100 pfc 0.1 and mp, eager", 5, "cases", 70, 45),
)

PARTS = tuple(sorted({s.part for s in STAGES}))


def get_stage(stage_id: str) -> Stage:
    for s in STAGES:
        if s.id == stage_id:
            return s
    raise ValueError(f"unknown gpucheck stage {stage_id!r}; stages: "
                     f"{', '.join(s.id for s in STAGES)}")


def of_kind(kind: str) -> list[Stage]:
    return [s for s in STAGES if s.kind == kind]


def stages_of(part: int | None) -> list[Stage]:
    """A part's stages in order; every stage for ``None`` (the whole check)."""
    if part is None:
        return list(STAGES)
    if part not in PARTS:
        raise ValueError(f"--part must be one of {', '.join(map(str, PARTS))}, got {part}")
    return [s for s in STAGES if s.part == part]


def part_cap_s(part: int, mode: str = "gpu") -> float:
    """The longest a part's call takes: its stages' caps, the install and the summary."""
    return sum(s.cap(mode) for s in stages_of(part)) + INSTALL_S + SUMMARY_S


def select(part: int | None, only: list[str] | None) -> list[Stage]:
    """The stages to run: a part's (or all), narrowed to ``only`` when given."""
    chosen = stages_of(part)
    if only:
        wanted = [get_stage(i) for i in only]
        missing = [s.id for s in wanted if s not in chosen]
        if missing:
            raise ValueError(f"stage(s) {', '.join(missing)} are not in part {part}")
        chosen = [s for s in chosen if s in wanted]
    return chosen
