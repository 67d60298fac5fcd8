"""Time to accuracy (``trainperf train``): the matrix of training variants and their plans.

Each variant (head mode and sample ratio, precision, framework) trains the same recipe on the
same data to the same target; the runner runs each as a plan of its own, in its own folder,
and the report sets their times to target side by side. Imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .config import Workload

PFC_DEFAULT_RATIO = 0.1  # DLPerf's and the Partial FC paper's


@dataclass(frozen=True)
class Variant:
    fc: str
    sample_ratio: float
    precision: str
    framework: str = "torch"

    def label(self, with_framework: bool = False) -> str:
        head = f"pfc{self.sample_ratio:g}" if self.fc == "pfc" else self.fc
        return " ".join([*([self.framework] if with_framework else []), head, self.precision])

    def apply(self, workload: Workload) -> Workload:
        return workload.replace(fc=self.fc, sample_ratio=self.sample_ratio,
                                precision=self.precision)


def variants(fcs: list[str], ratios: list[float] | None, precisions: list[str],
             frameworks: list[str]) -> list[Variant]:
    """Every combination that means something: a ratio below 1 only with ``pfc``, and ``pfc``
    at ratio 1 left out when ``mp`` is there (the same arithmetic). Without ``ratios``, ``pfc``
    samples 0.1 and the other modes take every class."""
    heads = []
    for fc in fcs:
        for ratio in ratios or [PFC_DEFAULT_RATIO if fc == "pfc" else 1.0]:
            if ratio < 1.0 and fc != "pfc":
                continue
            if fc == "pfc" and ratio == 1.0 and "mp" in fcs:
                continue
            if (fc, ratio) not in heads:
                heads.append((fc, ratio))
    if not heads:
        raise ValueError(f"--fc {','.join(fcs)} with --sample-ratio "
                         f"{','.join(f'{r:g}' for r in ratios or [])} leaves nothing to train: "
                         "a ratio below 1 needs --fc pfc")
    return [Variant(fc, ratio, precision, framework) for framework in frameworks
            for fc, ratio in heads for precision in precisions]


def variant_dirs(out: Path, chosen: list[Variant]) -> list[Path]:
    """One variant writes into ``out`` itself; several each into a folder named after it."""
    if len(chosen) == 1:
        return [out]
    several = len({v.framework for v in chosen}) > 1
    return [out / v.label(several).replace(" ", "-") for v in chosen]


def plans(base, chosen: list[Variant]) -> list:
    """The runner's plan of each variant, from ``base`` (a ``runner.Plan`` with the training
    spec, data and cases that every variant shares)."""
    several = len({v.framework for v in chosen}) > 1
    return [replace(base, workload=v.apply(base.workload), framework=v.framework,
                    out_dir=out, variant=v.label(several))
            for v, out in zip(chosen, variant_dirs(base.out_dir, chosen))]
