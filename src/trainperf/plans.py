"""What a benchmark runs, and running it: the plans of a throughput matrix (one per framework,
and a real-data plan with its synthetic twin), opening a dataset for them, and running several
plans under one progress display. The command line turns its flags into the arguments here;
tests and scripts call the same functions. Imports no framework.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from .backends import get_backend
from .config import PFC_DEFAULT_RATIO, DataSpec, Measure, Topology, Tuning, parse_list
from .procs import interrupt_on_sigterm
from .recipes import get_recipe
from .results import default_folder
from .runner import Plan, Runner, check_plan, interleave, plan_cases


def parse_frameworks(text: str) -> list[str]:
    """The names of a ``--framework`` list, each a known backend, none twice."""
    names = parse_list(text)
    if not names:
        raise ValueError("--framework needs at least one name")
    if len(set(names)) != len(names):
        raise ValueError(f"--framework names a framework twice: {text!r}")
    for name in names:
        get_backend(name)
    return names


def workload_changes(fc: str | None, sample_ratio: float | None, **given: Any) -> dict:
    """The recipe's workload fields a command changes: the ones given (None: the recipe's),
    and Partial FC's usual ratio where ``--fc pfc`` comes without one."""
    changes = {k: v for k, v in given.items() if v is not None}
    if fc is not None:
        changes["fc"] = fc
    if sample_ratio is not None:
        changes["sample_ratio"] = sample_ratio
    elif fc == "pfc":
        changes["sample_ratio"] = PFC_DEFAULT_RATIO
    return changes


def open_data(prefix: str, decoder: str, loader_workers: int | None):
    """The dataset at ``prefix`` (checked readable) and what the runs are told of it, with the
    decoder checked."""
    from .data.dali_feed import choose_decoder
    from .data.layout import open_dataset

    choose_decoder(decoder)
    dataset = open_dataset(prefix)
    return dataset, DataSpec(str(Path(dataset.prefix).resolve()), decoder, loader_workers)


def throughput_plans(recipe_name: str, changes: dict, batch_sizes: list[int] | None,
                     devices: list[int], measure: Measure, tuning: Tuning, base: Topology,
                     frameworks: list[str], out: Path | None, data=None,
                     synthetic_baseline: bool = True) -> list[Plan]:
    """The plans of ``trainperf run``: every (batch, devices) case of the recipe with
    ``changes``, one plan per framework. With ``data`` (``open_data``'s pair) a real-data
    plan (``OUT/real``) and, unless ``synthetic_baseline`` is off, its synthetic twin
    (``OUT/synthetic``) first, so that the compute-only figure is there to compare with. One
    framework writes into ``out`` itself; several each into a folder of their own, and the
    report beside them compares them. Each plan is checked against its backend here."""
    recipe = get_recipe(recipe_name)
    workload = recipe.workload.replace(**changes)
    batches = batch_sizes or [workload.batch_size]
    for b in batches[1:]:
        workload.replace(batch_size=b)  # Workload checks each value on construction
    workload = workload.replace(batch_size=batches[0])
    cases = plan_cases(devices, batches, base)
    out = out or default_folder(recipe.name)
    plans = [Plan(recipe.name, workload, measure, cases,
                  out if len(frameworks) == 1 else out / name, tuning, recipe.reference_model,
                  name) for name in frameworks]
    if data is not None:
        if len(frameworks) > 1:
            raise ValueError("--data takes one --framework: each framework's real-data runs "
                             "are compared with their own synthetic twin")
        dataset, spec = data
        dataset.check_classes(workload.num_classes)
        real = replace(plans[0], out_dir=out / "real", data=spec, data_role="real")
        plans = [real] if not synthetic_baseline else [
            replace(plans[0], out_dir=out / "synthetic", data_role="synthetic baseline"), real]
    for plan in plans:
        check_plan(plan)
    return plans


def run_plans(plans: list[Plan], resume: bool, take_turns: bool = False) -> list[dict]:
    """Run every plan under one progress display (with ``take_turns``, one run of each in
    turn); their results documents. ``resume`` finishes the folders that hold runs."""
    from .progress import make_progress

    runners = [Runner(plan) for plan in plans]  # every plan checked before any run
    interrupt_on_sigterm()
    progress = make_progress()
    try:
        resumes = []
        for runner in runners:
            runner.progress = progress
            resumes.append(resume and (runner.out / "events.jsonl").exists())
        if take_turns:
            return interleave(runners, resumes)
        return [runner.run(resume=again) for runner, again in zip(runners, resumes)]
    finally:
        close = getattr(progress, "close", None)
        if close:
            close()


def report_dir(plans: list[Plan], resume: str | None) -> Path:
    """Where the report of a set of plans goes: the plan's own folder, or the folder above
    several plans' folders."""
    if len(plans) == 1:
        return Path(resume or plans[0].out_dir)
    return plans[0].out_dir.parent
