"""Which GPU paths of the support matrix (``matrix.ROWS``) each stage runs, and in which
framework, read from what the stage is made of (its cases, searches, parity rows, peers) rather
than kept beside it: the matrix's part column comes from here, so moving a stage to another
part moves its rows with it.
"""

from __future__ import annotations

from ..recipes import get_recipe
from . import capacity, cases, native, peers, realdata
from .plan import STAGES, Stage

Covered = tuple[str, str]
"""(framework, the matrix row's key)."""


def case_keys(case: cases.Case) -> set[str]:
    """The rows one case runs: its precision, and its head (or classification)."""
    workload = get_recipe(case.recipe).workload
    head = ("classification" if workload.task == "classification"
            else case.changes.get("fc", workload.fc))
    return {case.precision, head}


def _parity_keys() -> set[str]:
    keys = {"parity", native.SETTINGS["gpu"].precision}
    for model, _ in native.ROWS["gpu"]:
        # trainperf's side of a pair is a training step of its own, the face one with dp
        keys.add("classification" if model == "rn50" else "dp")
    return keys


def stage_paths(stage: Stage) -> set[Covered]:
    """Every (framework, row) ``stage`` runs on a GPU."""
    if stage.kind == "cases":
        out = set()
        for case in cases.CASES_GPU[stage.id]:
            keys = case_keys(case)
            if case.label in cases.BREAKDOWN_CASES:
                keys.add("breakdown")
            out |= {("torch", k) for k in keys}
        return out
    if stage.kind == "correctness":
        return {("torch", "correctness")}
    if stage.kind == "parity":
        return {(native.FRAMEWORK[stage.id], k) for k in _parity_keys()}
    if stage.kind == "capacity":
        keys = {"capacity"}.union(*(case_keys(c) for _, c in capacity.SEARCHES["gpu"]))
        return {("torch", k) for k in keys}
    if stage.kind == "peers":
        return {("jax", k) for c in peers.JAX_CASES for k in case_keys(c)}
    if stage.kind == "realdata":
        return {("torch", k) for k in {"realdata"} | case_keys(realdata.CASE["gpu"])}
    return set()  # the machine ceiling runs no training path


def first_parts() -> dict[Covered, int]:
    """The first part whose stages run each (framework, row)."""
    out: dict[Covered, int] = {}
    for stage in STAGES:
        for covered in stage_paths(stage):
            out[covered] = min(out.get(covered, stage.part), stage.part)
    return out
