"""The stages, their time caps and the parts they are grouped in.

A lent GPU machine runs one command of at most 10 minutes and is lent for about 30: the caps of
every stage add up to 25 minutes at most on one H100 or H200, and each part to 9 at most, so
``make gpu-check PART=1``, ``PART=2``... run back to back within the lease. The stages come in
order of value: what a borrowed machine must bring back first comes first. A stage may also
use what the stages before it in the same run left of their caps, so a run never takes longer
than the sum of its stages' caps.
"""

from __future__ import annotations

from dataclasses import dataclass

TOTAL_CAP_S = 25 * 60
PART_CAP_S = 9 * 60


@dataclass(frozen=True)
class Stage:
    id: str
    title: str
    part: int
    cap_s: float
    """Wall-clock limit on a GPU; past it the stage's processes are stopped and what it wrote
    is kept."""
    cpu_cap_s: float
    """The same for the CPU mode's tiny sizes."""

    def cap(self, mode: str, scale: float = 1.0) -> float:
        return (self.cap_s if mode == "gpu" else self.cpu_cap_s) * scale


STAGES: tuple[Stage, ...] = (
    Stage("1", "Machine ceiling", 1, 60, 30),
    Stage("2", "GPU correctness", 1, 150, 90),
    Stage("3a", "Seeds' table: fp32", 1, 300, 90),
    Stage("3b", "Seeds' table: fp16 and bf16", 2, 300, 90),
    Stage("3c", "Seeds' table: glint360k Partial FC, ResNet50 channels-last", 2, 120, 60),
    Stage("7", "Native parity: torch and JAX", 2, 120, 120),
    Stage("4", "Capacity", 3, 210, 120),
    Stage("5", "Peers", 3, 150, 120),
    Stage("6", "Real data", 3, 90, 60),
)

PARTS = tuple(sorted({s.part for s in STAGES}))


def get_stage(stage_id: str) -> Stage:
    for s in STAGES:
        if s.id == stage_id:
            return s
    raise ValueError(f"unknown gpucheck stage {stage_id!r}; stages: "
                     f"{', '.join(s.id for s in STAGES)}")


def stages_of(part: int | None) -> list[Stage]:
    """A part's stages in order; every stage for ``None`` (the whole check)."""
    if part is None:
        return list(STAGES)
    if part not in PARTS:
        raise ValueError(f"--part must be one of {', '.join(map(str, PARTS))}, got {part}")
    return [s for s in STAGES if s.part == part]


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
