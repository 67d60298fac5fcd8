"""What a benchmark runs, and running it: the plans of a throughput matrix (one per framework,
and a real-data plan with its synthetic twin), opening a dataset for them, and running several
plans under one progress display. The command line turns its flags into the arguments here;
tests and scripts call the same functions. Imports no framework.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from .backends import get_backend
from .config import (FC_MODES, MODE_BEST, MODE_DEFAULT, PFC_DEFAULT_RATIO, DataSpec, Measure,
                     Topology, Tuning, parse_int_list, parse_list)
from .procs import interrupt_on_sigterm
from .recipes import get_recipe
from .results import default_folder, has_events
from .runner import (Plan, Runner, check_plan, device_kind, interleave, plan_cases,
                     shared_choices)


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


def parse_modes(text: str, frameworks: list[str]) -> list[str]:
    """The modes of a ``--mode`` list, none twice; ``default`` and ``best`` stand alone. Each
    framework must run each mode named (checked with the plans, on the device)."""
    modes = parse_list(text)
    if not modes:
        raise ValueError("--mode needs a mode's name")
    if len(set(modes)) != len(modes):
        raise ValueError(f"--mode names a mode twice: {text!r}")
    alone = {MODE_DEFAULT, MODE_BEST} & set(modes)
    if alone and len(modes) > 1:
        raise ValueError(f"--mode {'/'.join(sorted(alone))} stands alone, not in a list")
    return modes


def plan_modes(modes: list[str] | None, frameworks: list[str]) -> list[str]:
    """What each framework runs in: the modes asked for, else ``best`` where frameworks are
    compared (each at its fastest, chosen by measurement) and each one's fixed default where
    one runs alone."""
    if modes:
        return modes
    return [MODE_BEST if len(frameworks) > 1 else MODE_DEFAULT]


def layout_for(framework: str, memory_format: str, device: str) -> bool:
    """Whether ``framework``'s backbones run channels-last: as forced, or (``auto``) its
    default on the device the runs go to."""
    if memory_format != "auto":
        return memory_format == "channels_last"
    return get_backend(framework).default_layout(device_kind(device)) == "channels_last"


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


def parse_num_classes(text: str) -> list[int]:
    """The class counts of a ``--num-classes`` list, each a count a head can split, none twice
    (each becomes a folder of its own)."""
    counts = parse_int_list(text, "--num-classes")
    for n in counts:
        if n < 2:
            raise ValueError(f"--num-classes takes counts of 2 or more, got {n}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"--num-classes names a count twice: {text!r}")
    return counts


def parse_fcs(text: str) -> list[str]:
    """The head modes of an ``--fc`` list."""
    fcs = parse_list(text)
    bad = [fc for fc in fcs if fc not in FC_MODES]
    if bad or not fcs:
        raise ValueError(f"--fc takes {', '.join(FC_MODES)} (a list sweeps them), got {text!r}")
    return fcs


def parse_ratios(text: str) -> list[float]:
    """The ratios of a ``--sample-ratio`` list (the workload checks their range)."""
    try:
        ratios = [float(part) for part in parse_list(text)]
    except ValueError:
        raise ValueError(f"--sample-ratio takes comma-separated numbers, got {text!r}") from None
    if not ratios:
        raise ValueError("--sample-ratio needs at least one value")
    return ratios


def head_modes(fcs: list[str], ratios: list[float] | None) -> list[tuple[str, float]]:
    """Every (head mode, ratio) of an ``--fc`` and ``--sample-ratio`` sweep: the ratios are
    ``pfc``'s (the other modes take every class whatever they are), and ``pfc`` at ratio 1 is
    left out when ``mp`` is there (the same arithmetic). Without ``ratios``, ``pfc`` samples
    0.1. Ratios below 1 with no ``pfc`` to take them are refused, never dropped."""
    if ratios and "pfc" not in fcs and any(r < 1.0 for r in ratios):
        raise ValueError(f"--fc {','.join(fcs)} with --sample-ratio "
                         f"{','.join(f'{r:g}' for r in ratios)}: a ratio below 1 needs --fc pfc")
    heads = []
    for fc in fcs:
        for ratio in (ratios or [PFC_DEFAULT_RATIO]) if fc == "pfc" else [1.0]:
            if fc == "pfc" and ratio == 1.0 and "mp" in fcs:
                continue
            if (fc, ratio) not in heads:
                heads.append((fc, ratio))
    return heads


def head_label(fc: str, sample_ratio: float) -> str:
    return f"pfc{sample_ratio:g}" if fc == "pfc" else fc


def sweep_points(num_classes: list[int] | None, fcs: list[str] | None,
                 ratios: list[float] | None, recipe_fc: str) -> list[dict] | None:
    """The workload changes of each point of a class and head sweep, classes outermost; None
    when every list holds at most one value (one point: the plain changes say it). A sweep of
    classes alone leaves the head as a single run would have it."""
    if max(len(values or []) for values in (num_classes, fcs, ratios)) <= 1:
        return None
    heads: list[dict] = [{}]
    if len(fcs or []) > 1 or len(ratios or []) > 1:
        heads = [{"fc": fc, "sample_ratio": r}
                 for fc, r in head_modes(fcs or [recipe_fc], ratios)]
    return [{**({"num_classes": n} if n is not None else {}), **head}
            for n in (num_classes or [None]) for head in heads]


def point_names(points: list[dict], workloads: list) -> list[list[str]]:
    """What tells each sweep point apart, as words (``c1000``, ``pfc0.1``): only the settings
    that vary across the points."""
    classes = len({w.num_classes for w in workloads}) > 1
    heads = len({(w.fc, w.sample_ratio) for w in workloads}) > 1
    return [[*([f"c{w.num_classes}"] if classes else []),
             *([head_label(w.fc, w.sample_ratio)] if heads else [])] for w in workloads]


def open_data(prefix: str, decoder: str, loader_workers: int | None,
              frameworks: tuple[str, ...] | list[str] = ("torch",)):
    """The dataset at ``prefix`` (checked readable) and what the runs are told of it, with the
    decoder checked for ``frameworks``."""
    from .data.dali_feed import choose_decoder
    from .data.layout import open_dataset

    if decoder == "dali" and set(frameworks) - {"torch"}:
        raise ValueError("--decoder dali feeds torch only; the other frameworks' loader "
                         "processes decode with simplejpeg, opencv or pillow")
    choose_decoder(decoder)
    dataset = open_dataset(prefix)
    return dataset, DataSpec(str(Path(dataset.prefix).resolve()), decoder, loader_workers)


def throughput_plans(recipe_name: str, changes: dict, batch_sizes: list[int] | None,
                     devices: list[int], measure: Measure, tuning: Tuning, base: Topology,
                     frameworks: list[str], out: Path | None, data=None,
                     synthetic_baseline: bool = True,
                     sweep: list[dict] | None = None,
                     modes: list[str] | None = None) -> list[Plan]:
    """The plans of ``trainperf run``: every (batch, devices) case of the recipe with
    ``changes``, one plan per framework. With ``data`` (``open_data``'s pair) a real-data
    plan (``OUT/real``) and, unless ``synthetic_baseline`` is off, its synthetic twin
    (``OUT/synthetic``) first, so that the compute-only figure is there to compare with. One
    framework writes into ``out`` itself; several each into a folder of their own, and the
    report beside them compares them. ``sweep`` (``sweep_points``) makes a plan per point
    and framework, each in a folder named after what varies (``OUT/c1000-mp``,
    ``OUT/torch-c1000-mp``): a plan's workload is one, so its speedups stay within its class
    count and head. ``modes`` (``--mode``; None: ``plan_modes``'s choice) sweep like the
    points, each in a folder named after it where there are several. Each framework's
    backbones run in the layout ``tuning.memory_format`` resolves to for it. Each plan is
    checked against its backend here."""
    recipe = get_recipe(recipe_name)
    workloads = [recipe.workload.replace(**{**changes, **point}) for point in sweep or [{}]]
    batches = batch_sizes or [workloads[0].batch_size]
    for workload in workloads:
        for b in batches:
            workload.replace(batch_size=b)  # Workload checks each value on construction
    workloads = [w.replace(batch_size=batches[0]) for w in workloads]
    cases = plan_cases(devices, batches, base)
    out = out or default_folder(recipe.name)
    names = point_names(sweep, workloads) if sweep else [[]]
    modes = plan_modes(modes, frameworks)
    plans = []
    for framework in frameworks:
        channels_last = layout_for(framework, tuning.memory_format, base.device)
        for workload, words in zip(workloads, names):
            for mode in modes:
                labels = words + ([mode] if len(modes) > 1 else [])
                parts = ([framework] if len(frameworks) > 1 else []) + labels
                plans.append(Plan(recipe.name, workload.replace(channels_last=channels_last),
                                  measure, cases, out / "-".join(parts) if parts else out,
                                  replace(tuning, mode=mode), recipe.reference_model,
                                  framework, variant=" ".join(labels) or None))
    if data is not None:
        if sweep:
            raise ValueError("--data takes one --num-classes (the dataset's labels fix it) "
                             "and one head mode (--fc, --sample-ratio)")
        dataset, spec = data
        dataset.check_classes(workloads[0].num_classes)
        # Each plan's real-data runs beside its own synthetic twin, in the folder the plan
        # would have had (``OUT/real``, ``OUT/synthetic``; ``OUT/<framework>/...`` for several
        # frameworks, ``OUT/<mode>/...`` for several modes).
        paired = []
        for plan in plans:
            home = plan.out_dir
            # One probe for the pair: its ratio is the data's overhead, within one mode.
            real = replace(plan, out_dir=home / "real", data=spec, data_role="real",
                           mode_group=str(home))
            paired += [real] if not synthetic_baseline else [
                replace(plan, out_dir=home / "synthetic", data_role="synthetic baseline",
                        mode_group=str(home)), real]
        plans = paired
    for plan in plans:
        check_plan(plan)
    check_own_folders(plans)
    return plans


def check_own_folders(plans: list[Plan]) -> None:
    """Every plan writes a folder of its own: two plans in one folder would take each other's
    records for their own (the second refuses the first's, or resumes them)."""
    seen: dict[Path, Plan] = {}
    for plan in plans:
        other = seen.setdefault(plan.out_dir, plan)
        if other is not plan:
            first = other.variant or other.framework
            second = plan.variant or plan.framework
            raise ValueError(f"two plans would write {plan.out_dir} ({first} and {second}); "
                             "this is a bug in trainperf's plans, please report it")


def run_plans(plans: list[Plan], resume: bool, take_turns: bool = False) -> list[dict]:
    """Run every plan under one progress display (with ``take_turns``, one run of each in
    turn); their results documents. ``resume`` finishes the folders that hold runs."""
    from .progress import make_progress

    # Every plan checked before any run; the plans of a mode group share one decision.
    runners = [Runner(plan, shared=shared) for plan, shared in zip(plans, shared_choices(plans))]
    interrupt_on_sigterm()
    progress = make_progress()
    try:
        resumes = []
        for runner in runners:
            runner.progress = progress
            resumes.append(resume and has_events(runner.out))
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
    return Path(os.path.commonpath([str(p.out_dir) for p in plans]))


def take_decided_modes(source: str | Path, plans: list[Plan], root: Path) -> None:
    """``--mode-from SOURCE``: each ``--mode best`` plan takes the mode the probe of its own
    earlier run chose (``Plan.decided_mode``), found in SOURCE at the plan's place below
    ``root`` (``torch``, ``jax/real``): SOURCE as ``run`` wrote it, or a multi-node step's
    folder, whose node folder with the measurements holds it. ValueError, in one line, where
    a plan asks for no probe, or SOURCE holds no probe of the same plan."""
    from .result_files import RESULTS, role_of

    source = Path(source)
    for plan in plans:
        if plan.tuning.mode != MODE_BEST:
            raise ValueError(f"--mode-from takes the choice of a --mode best probe; this run's "
                             f"mode is {plan.tuning.mode!r}")
        rel = plan.out_dir.relative_to(root)
        places = [source / rel] + [node / rel for node in sorted(source.glob("node-*"))]
        found = [p for p in places if role_of(p / RESULTS) == "leader"]
        if not found:
            what = "the plan" if rel == Path() else rel.as_posix()
            raise ValueError(f"--mode-from {source}: no results of {what} there (looked in "
                             f"{places[0]} and its node folders)")
        folder = found[0]
        doc = json.loads((folder / RESULTS).read_text(encoding="utf-8"))
        probe = doc.get("mode_probe")
        if not probe:
            raise ValueError(f"--mode-from: {folder} holds no --mode best probe")
        if not probe.get("chosen"):
            raise ValueError(f"--mode-from: {folder}'s probe chose no mode ({probe['why']})")
        old = json.loads((folder / "plan.json").read_text(encoding="utf-8"))
        new = json.loads(json.dumps(plan.settings()))
        # A node sweep's counts differ in their nodes and their cases, nothing else.
        differ = sorted(k for k in old.keys() | new.keys()
                        if k not in ("nnodes", "cases") and old.get(k) != new.get(k))
        if differ:
            raise ValueError(f"--mode-from: {folder} ran another plan (differs in "
                             f"{', '.join(differ)}); its mode is not this plan's")
        plan.decided_mode = {**probe, "probed_in": str(folder.resolve())}
