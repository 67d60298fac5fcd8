"""Time to accuracy (``trainperf train``): the matrix of training variants and their plans.

Each variant (head mode and sample ratio, precision, framework) trains the same recipe on the
same data to the same target; the runner runs each as a plan of its own, in its own folder,
and the report sets their times to target side by side. Imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .config import Measure, Topology, TrainSpec, Tuning, Workload
from .results import default_folder


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
    """Every head that means something (``plans.head_modes``) in every precision and
    framework."""
    from .plans import head_modes

    return [Variant(fc, ratio, precision, framework) for framework in frameworks
            for fc, ratio in head_modes(fcs, ratios) for precision in precisions]


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


def training_plans(recipe_name: str, *, frameworks: list[str], fcs: list[str] | None,
                   ratios: list[float] | None, precisions: list[str] | None, changes: dict,
                   data, vals: list[str], target: float, max_steps: int, eval_every: int,
                   checkpoint_every: int | None, runs: int, warmup: int, timeout_s: float,
                   devices: list[int], base: Topology, tuning: Tuning,
                   out: Path | None) -> list:
    """The plans of ``trainperf train``: every variant of the recipe with ``changes`` trains on
    ``data`` (``plans.open_data``'s pair) to ``target`` on the first of ``vals``. The class
    count defaults to the identities the dataset announces, and faces train at the size their
    images were aligned to (insightface's 112 for its sets): resizing every image to the
    recipe's side would train another model."""
    from .data.binset import read_bin
    from .data.pipeline import first_image_size
    from .recipes import get_recipe
    from .plans import layout_for
    from .runner import Plan, check_plan, plan_cases

    recipe = get_recipe(recipe_name)
    chosen = variants(fcs or [recipe.workload.fc], ratios,
                      precisions or [recipe.workload.precision], frameworks)
    dataset, spec = data
    changes = dict(changes)
    changes["num_classes"] = (changes.get("num_classes") or dataset.num_classes
                              or recipe.workload.num_classes)
    if recipe.workload.task == "face":
        side, width = first_image_size(dataset)
        if side == width and side != recipe.workload.input_size:
            changes["input_size"] = side
    workload = recipe.workload.replace(**changes)
    for v in chosen:
        v.apply(workload)  # Workload checks every variant's settings now
    dataset.check_classes(workload.num_classes)
    names = [read_bin(p).name for p in vals]  # a bad file fails here, not mid-run
    if len(set(names)) != len(names):
        raise ValueError(f"--val names two sets alike ({', '.join(names)}): results key them "
                         "by file name")
    train = TrainSpec(tuple(str(Path(p).resolve()) for p in vals), target, max_steps,
                      eval_every, checkpoint_every)
    # Training's throughput counts the steps after each attempt's warm-up.
    measure = Measure(runs=runs, iters=max(max_steps, warmup + 1), warmup=warmup,
                      timeout_s=timeout_s)
    cases = plan_cases(devices, [workload.batch_size], base)
    base_plan = Plan(recipe.name, workload, measure, cases,
                     out or default_folder(f"train-{recipe.name}"), tuning,
                     recipe.reference_model, data=spec, data_role="real", train=train)
    chosen_plans = plans(base_plan, chosen)
    for plan in chosen_plans:
        plan.workload = plan.workload.replace(
            channels_last=layout_for(plan.framework, tuning.memory_format, base.device))
        check_plan(plan)  # before any output: what a backend cannot train is refused now
    return chosen_plans
