"""Strict alignment: does another framework train the same numbers as PyTorch?

DLPerf aligned frameworks by hand, with a table of initialisers, optimisers and learning rates.
Here it is measured. torch's initial weights, one class matrix and one batch per rank go into
an ``.npz``; torch and the candidate each start from it (``AlignSpec``), train ``steps`` SGD
steps on the same batch in float64, and write their state after every step:
every parameter and BatchNorm statistic in torch's names and layouts, the loss, the gradient
norm before clipping and the rate. ``tensors.compare_runs`` compares every tensor's update,
so that a difference in any part of the rule fails the check however little it moves the loss.

What rounding can do is measured, not assumed: torch also runs from a witness start, every
weight moved by a relative ``WITNESS_SHIFT``, and how far that run parts from torch's own at
each step, tensor by tensor, is the tolerance there wherever it is above the base one
(``witnessed``). On a well-conditioned step the base holds; where the dynamics amplify
rounding (BatchNorm over two samples, with the gradient clipped hard) the tolerance follows
them, and a rule difference still shows at the step where it starts.

Dropout is off and the rate's first step is moved into the checked steps
(``rules.check_workload``); everything else is the recipe's. ``--controls`` then breaks one rule
at a time in the candidate (``rules.CONTROLS``) and shows that the check fails on each.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import alignments, results
from ..backends import get_backend
from ..backends.base import DEVICE_KINDS, require
from ..config import AlignSpec, Measure, Topology, Tuning, Workload
from ..progress import NullProgress
from ..runner import Case, Plan, Runner
from .render import render_table  # noqa: F401 - the command line prints with it
from .rules import (CONTROLS, Control, TorchFigures, check_workload, checklist, control,
                    why_not_applicable)
from .tensors import FLOAT64, Tolerance, compare_runs

WITNESS_SHIFT = 1e-13
"""The witness start's relative shift of every weight: about 450 float64 ulps. Measured on Y1 at
batch 2, where each step multiplies rounding by about 100, the witness parted from torch 100 to
160 times further than JAX's float64 run did, at every one of 5 steps; on the tiny recipe it
stays under the base tolerance."""

DTYPE = "float64"
"""What both sides compute in. Every framework's worker runs float64 on a CPU, and only float64
keeps rounding far under every difference of rule: in float32, OneFlow's kernels were measured
30 to 140 times further from the exact step than torch's, and one TensorFlow activation rounded
to the other side of a PReLU's kink moved every earlier layer's gradient by 1e-3."""

# The loss-level comparison that `gpucheck` uses between a CPU and a GPU in float32.
FIRST_LOSS_RTOL = 1e-4
"""The first loss is one forward pass from identical weights: float32 rounding only."""
LATER_LOSS_RTOL = 2e-3
"""Later losses carry the rounding of every earlier update (different kernels sum in different
orders), which SGD at the recipe's rate amplifies a little each step."""


@dataclass(frozen=True)
class AlignRequest:
    recipe: str
    workload: Workload
    framework: str
    devices: list[int]
    fc_modes: list[str]
    steps: int
    timeout_s: float
    out: Path
    controls: tuple[str, ...] = ()
    """Negative controls (``rules.CONTROLS`` names) to run on the first (fc, ranks) pair."""
    keep_dumps: bool = False
    candidate_breaks: tuple[str, ...] = ()
    candidate_changes: dict[str, Any] = field(default_factory=dict)
    """A candidate made to differ on purpose (tests): worker rule breaks, workload fields."""
    mode: str = "default"
    """The candidate's execution mode (``Capabilities.modes``); torch's side runs eager."""
    device: str = "cpu"
    """Where both sides run: ``cpu`` (the default, where every worker computes float64) or
    ``cuda``, for a framework whose worker declares float64 there
    (``Capabilities.float64_on``)."""


def request(recipe_name: str, framework: str, devices: list[int], fc_modes: list[str],
            steps: int, timeout_s: float, out: Path | None, batch_size: int | None = None,
            num_classes: int | None = None, controls: list[str] | None = None,
            keep_dumps: bool = False, mode: str = "default",
            device: str = "cpu") -> AlignRequest:
    """The alignment check of ``framework`` on the recipe, with its batch and class count
    changed where given; ``controls``: negative controls by name (``["all"]``: every one);
    ``out`` None: a new folder under ``results/``; ``mode``: the candidate's execution mode
    (torch itself is a candidate in a mode other than eager, against its eager reference);
    ``device``: ``cpu`` or ``cuda``, where both sides run (never ``auto``: a GPU machine would
    otherwise check a GPU's float64, which not every worker computes)."""
    from ..recipes import get_recipe

    recipe = get_recipe(recipe_name)
    workload = recipe.workload
    if batch_size:
        workload = workload.replace(batch_size=batch_size)
    if num_classes:
        workload = workload.replace(num_classes=num_classes)
    backend = get_backend(framework)
    if device not in DEVICE_KINDS:
        raise ValueError(f"align runs on {' or '.join(DEVICE_KINDS)}, not --device {device}")
    for side in (get_backend("torch"), backend):  # torch is the reference, on the same device
        require(side.float64_refusal(device))
    if device == "cuda":
        from ..env import gpu_count

        if not gpu_count():  # said now, not as every run's failure and a verdict filed
            raise ValueError("--device cuda: this machine has no CUDA device")
    if mode == "best":
        raise ValueError("align checks one mode at a time: name it (--mode "
                         f"{', '.join(backend.modes_on(device))})")
    require(backend.mode_refusal(mode, device))
    require(backend.capabilities.float32_modes.get(backend.resolve_mode(mode, device)))
    if backend.name == "torch" and backend.resolve_mode(mode, device) == "eager":
        raise ValueError("align compares another framework, or torch in another mode, with "
                         "torch eager: pass --framework mxnet or --mode compile")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    names = [c.name for c in CONTROLS] if controls == ["all"] else [
        control(name).name for name in controls or []]
    out = out or results.default_folder(f"align-{recipe.name}-{backend.name}")
    return AlignRequest(recipe.name, workload, backend.name, devices, fc_modes, steps,
                        timeout_s, out, tuple(names), keep_dumps, mode=mode, device=device)


@dataclass
class Side:
    """One run of a check: its record, what its worker said of itself, and its dumps."""

    record: dict[str, Any]
    params: int | None
    version: str | None
    dump: Path

    @property
    def ok(self) -> bool:
        return self.record.get("status") == "ok"


def run_from_start(recipe: str, workload: Workload, align: AlignSpec, out: Path, steps: int,
                   timeout_s: float, framework: str = "torch", devices: int = 1,
                   device: str = "auto", tuning: Tuning = Tuning()) -> Side:
    """One run of ``steps`` steps from ``align``'s start file."""
    measure = Measure(runs=1, iters=steps, warmup=0, timeout_s=timeout_s)
    case = Case(Topology(devices_per_node=devices, device=device), workload.batch_size)
    plan = Plan(recipe, workload, measure, [case], out, tuning, framework=framework,
                align=align)
    runner = Runner(plan, NullProgress())
    doc = runner.run()
    record = doc["cases"][0]["runs"][0] if doc["cases"] else {"status": "failed", "error": None}
    start = next(iter(runner.start_events.values()), None)
    return Side(record, start.backbone_params if start else None,
                start.env.get("framework_version") if start else None,
                Path(align.dump) if align.dump else out)


CACHE_ENV = "TRAINPERF_ALIGN_CACHE"
"""A folder where torch's side of each check is kept and reused by later checks from the same
start (tests set it, so that every framework's alignment shares one torch run per case)."""


def _reference_key(workload: Workload, devices: int, steps: int, start: Path,
                   device: str = "cpu") -> str:
    import numpy as np
    import torch  # the reference side runs torch; its version is part of what it computed

    # A GPU's kernels round otherwise: its torch runs are kept apart (the CPU's key as before).
    where = [] if device == "cpu" else [device]
    h = hashlib.sha256(json.dumps([workload.to_dict(), devices, steps, DTYPE, torch.__version__,
                                   *where], sort_keys=True).encode())
    with np.load(start) as arrays:  # the contents: the zip's own bytes carry timestamps
        for name in sorted(arrays.files):
            h.update(name.encode())
            h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()[:32]


def torch_side(req: AlignRequest, workload: Workload, devices: int, start: Path, out: Path
               ) -> Side:
    """torch's run of one check, reused from ``$TRAINPERF_ALIGN_CACHE`` when the same workload,
    ranks, steps, torch and start file ran before (only successful runs are kept)."""
    align = AlignSpec(str(start), DTYPE, str(out / "dump"))
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return run_from_start(req.recipe, workload, align, out, req.steps, req.timeout_s,
                              "torch", devices, req.device)
    entry = Path(folder) / _reference_key(workload, devices, req.steps, start, req.device)
    try:
        kept = json.loads((entry / "side.json").read_text(encoding="utf-8"))
        return Side(kept["record"], kept["params"], kept["version"], entry / "dump")
    except (OSError, ValueError, KeyError):
        pass
    side = run_from_start(req.recipe, workload, align, out, req.steps, req.timeout_s, "torch",
                          devices, req.device)
    if side.ok:
        tmp = Path(folder) / f".{entry.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copytree(side.dump, tmp / "dump")
        results.write_json_atomic(tmp / "side.json", {"record": side.record,
                                                      "params": side.params,
                                                      "version": side.version})
        try:
            os.replace(tmp, entry)
        except OSError:  # another process filed the same run first
            shutil.rmtree(tmp, ignore_errors=True)
        if entry.is_dir():
            shutil.rmtree(side.dump, ignore_errors=True)  # one copy is enough
            side = Side(side.record, side.params, side.version, entry / "dump")
    return side


def witness_start(start: Path) -> Path:
    """``start`` with every weight (not the BatchNorm statistics, not the batches) moved by a
    relative ``WITNESS_SHIFT``, drawn from a fixed seed; beside it as ``start-witness.npz``."""
    import numpy as np

    path = start.with_name("start-witness.npz")
    rng = np.random.default_rng(20261126)
    with np.load(start) as f:
        arrays = {k: f[k] for k in f.files}
    for name, value in arrays.items():
        if name.startswith(("backbone/", "head/")) and value.dtype.kind == "f" \
                and not name.endswith(("running_mean", "running_var")):
            shift = WITNESS_SHIFT * rng.standard_normal(value.shape)
            arrays[name] = value.astype(np.float64) * (1.0 + shift)
    np.savez(path, **arrays)
    return path


def witnessed(ref: Side, witness: Side, steps: int, ranks: int) -> tuple[Tolerance, str | None]:
    """The tolerance raised, step by step and tensor by tensor, to how far the witness went
    from torch's own run (``FLOAT64`` where it went less far); with a note where there is no
    witness to read."""
    if not (ref.ok and witness.ok):
        return FLOAT64, (f"torch's witness run {witness.record.get('status')}: the base "
                         "tolerance holds at every step")
    seen = compare_runs(ref.dump, witness.dump, steps, ranks, FLOAT64, DTYPE)
    return replace(FLOAT64, witness=seen["errors_by_step"]), None


def _check_pair(req: AlignRequest, workload: Workload, devices: int, start: Path,
                witness: Path, where: Path) -> tuple[dict[str, Any], Side, Tolerance]:
    """One (fc, ranks) pair: torch, its witness and the candidate, and the comparison of the
    candidate's dumps with torch's."""
    ref = torch_side(req, workload, devices, start, where / "torch")
    tol, note = witnessed(ref, torch_side(req, workload, devices, witness, where / "witness"),
                          req.steps, devices)
    cand = candidate_side(req, workload.replace(**req.candidate_changes), devices, start,
                          where / f"candidate-{req.framework}", req.candidate_breaks)
    check = judge(ref, cand, req.steps, devices, tol, declared_by(req.framework))
    check["tolerance_by_step"] = [tol.largest(step) for step in range(req.steps)]
    check["notes"] = [note] if note else []
    return check, ref, tol


def candidate_side(req: AlignRequest, workload: Workload, devices: int, start: Path, out: Path,
                   breaks: tuple[str, ...] = ()) -> Side:
    align = AlignSpec(str(start), DTYPE, str(out / "dump"), breaks)
    return run_from_start(req.recipe, workload, align, out, req.steps, req.timeout_s,
                          req.framework, devices, req.device, tuning=Tuning(mode=req.mode))


def judge(ref: Side, cand: Side, steps: int, ranks: int, tol: Tolerance,
          declared: dict[str, str]) -> dict[str, Any]:
    """The verdict of one pair of runs: both ran, count the same parameters, and their dumps
    agree (``compare_runs``) but for the candidate's ``declared`` differences."""
    problems = []
    for name, side in (("torch", ref), ("the candidate", cand)):
        if not side.ok:
            problems.append(f"{name}'s run {side.record.get('status')}: "
                            f"{(side.record.get('error') or '')[:200]}")
    if ref.params != cand.params:
        problems.append(f"parameter counts differ ({ref.params} vs {cand.params})")
    compared: dict[str, Any] = {"tensors_compared": 0}
    if ref.ok and cand.ok:
        compared = compare_runs(ref.dump, cand.dump, steps, ranks, tol, DTYPE, declared)
        problems += compared.pop("problems")
        compared.pop("errors_by_step")
    losses = {"torch": ref.record.get("losses"), "other": cand.record.get("losses")}
    return {"params": {"torch": ref.params, "other": cand.params},
            "versions": {"torch": ref.version, "other": cand.version}, "losses": losses,
            **compared, "problems": problems, "aligned": not problems}


def declared_by(framework: str) -> dict[str, str]:

    return get_backend(framework).capabilities.rule_differences


def run_alignment(req: AlignRequest) -> dict:
    """Run both sides for every (fc, ranks) pair, then the controls; writes and returns
    ``align.json`` and files the verdict (``trainperf.alignments``)."""
    from ..backends.torch.alignment import write_start  # torch only on this side

    base = check_workload(req.workload, req.steps)
    modes = ["dp"] if base.task == "classification" else req.fc_modes
    start = req.out / "start.npz"
    write_start(base, max(req.devices), start)
    witness = witness_start(start)
    checks, first = [], None
    for fc in modes:
        workload = base.replace(fc=fc)
        for devices in req.devices:
            where = req.out / "runs" / f"{fc}_{devices}r"
            check, ref, tol = _check_pair(req, workload, devices, start, witness, where)
            checks.append({"fc": fc, "ranks": devices, **check})
            if first is None:
                first = (workload, devices, ref, tol, where)
            _discard_dumps(req, where, keep=first[2].dump)  # a full R100 holds GBs a step
    workload, devices, ref, tol, where = first
    controls = (run_controls(req, workload, devices, start, ref, tol, where) if req.controls
                else {})
    figures = TorchFigures(ref.dump, req.steps)
    versions = {"torch": next((c["versions"]["torch"] for c in checks
                               if c["versions"]["torch"]), None),
                req.framework: next((c["versions"]["other"] for c in checks
                                     if c["versions"]["other"]), None)}
    aligned = all(c["aligned"] for c in checks)
    controls_ok = all(c["caught"] or c["applicable"] is not True for c in controls.values())
    mode = get_backend(req.framework).resolve_mode(req.mode, req.device)
    outcome = {"recipe": req.recipe, "framework": req.framework, "mode": mode,
               "workload": base.to_dict(),
               "steps": req.steps, "dtype": DTYPE, "device": req.device, "versions": versions,
               "tolerance": {"update": FLOAT64.update, "scalar": FLOAT64.scalar,
                             "why": FLOAT64.why, "witness_shift": WITNESS_SHIFT},
               "checks": checks, "controls": controls,
               "rule_differences": declared_by(req.framework),
               "checklist": checklist(base, req.steps, FLOAT64, figures, controls,
                                      declared_by(req.framework)),
               "aligned": aligned, "controls_caught": controls_ok if controls else None}
    results.write_json_atomic(req.out / "align.json", outcome)
    if not req.candidate_breaks and not req.candidate_changes:
        alignments.keep({"recipe": req.recipe, "framework": req.framework, "mode": mode,
                         "versions": versions, "device": req.device,
                         "dtype": DTYPE, "aligned": aligned, "t": time.time(),
                         "checked": [[c["fc"], c["ranks"]] for c in checks],
                         "worst_update": max((c.get("worst_update", {}).get("error") or 0.0
                                              for c in checks), default=None),
                         "align_json": str((req.out / "align.json").resolve())})
    _discard_dumps(req, req.out / "runs")
    return outcome


def _discard_dumps(req: AlignRequest, folder: Path, keep: Path | None = None) -> None:
    """Every dump under ``folder`` but ``keep`` (the first pair's torch run, which the controls
    and the alignment table still read), unless the request keeps them."""
    if req.keep_dumps:
        return
    for path in folder.glob("**/dump"):
        if keep is None or path.resolve() != keep.resolve():
            shutil.rmtree(path, ignore_errors=True)


def run_controls(req: AlignRequest, workload: Workload, devices: int, start: Path, ref: Side,
                 tol: Tolerance, where: Path) -> dict[str, dict[str, Any]]:
    """Each control on one (fc, ranks) pair: the candidate with one rule broken, against the
    same torch run. A control is caught when the comparison fails on a tensor or a scalar
    while both runs ran to their end."""
    figures = TorchFigures(ref.dump, req.steps)
    out: dict[str, dict[str, Any]] = {}
    for c in (control(name) for name in req.controls):
        why = why_not_applicable(c, workload, req.steps, figures)
        if why:
            out[c.name] = {"what": c.what, "applicable": False, "caught": False,
                           "verdict": f"not applicable: {why}"}
            continue
        cand = candidate_side(req, _changed(c, workload), devices, start,
                              where / f"control-{c.name}", c.breaks)
        check = judge(ref, cand, req.steps, devices, tol, declared_by(req.framework))
        _discard_dumps(req, where / f"control-{c.name}")
        caught = cand.ok and bool(check["problems"])
        verdict = (f"caught: {check['problems'][0]}" if caught else
                   f"control run {cand.record.get('status')}: "
                   f"{(cand.record.get('error') or '')[:200]}" if not cand.ok else
                   "MISSED: the check passed with this rule broken")
        out[c.name] = {"what": c.what, "applicable": True, "caught": caught, "verdict": verdict,
                       "problems": check["problems"], "worst_update": check.get("worst_update"),
                       "worst_scalar": check.get("worst_scalar")}
    return out


def _changed(c: Control, workload: Workload) -> Workload:
    return c.change(workload) if c.change else workload


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(a))


def compare_losses(ref_losses: list[float] | None, other_losses: list[float] | None,
                   ref_params: int | None, other_params: int | None) -> dict:
    """The loss-level verdict `gpucheck` gives a GPU run against a CPU run in float32 (where
    rounding differs by device, so that only the losses are held to a bound)."""
    check = {"params": {"torch": ref_params, "other": other_params},
             "losses": {"torch": ref_losses, "other": other_losses},
             "first_loss_rel_diff": None, "max_loss_rel_diff": None, "problems": []}
    if ref_params != other_params:
        check["problems"].append(f"parameter counts differ ({ref_params} vs {other_params})")
    if not ref_losses or not other_losses or len(ref_losses) != len(other_losses):
        check["problems"].append("a side has no losses to compare")
    elif not all(math.isfinite(v) for v in ref_losses + other_losses):
        check["problems"].append("a loss is not finite")
    else:
        first = _rel(ref_losses[0], other_losses[0])
        worst = max(_rel(a, b) for a, b in zip(ref_losses, other_losses))
        check["first_loss_rel_diff"], check["max_loss_rel_diff"] = first, worst
        if first > FIRST_LOSS_RTOL:
            check["problems"].append(f"first loss differs by {first:.2e} (> {FIRST_LOSS_RTOL})")
        if worst > LATER_LOSS_RTOL:
            check["problems"].append(f"a loss differs by {worst:.2e} (> {LATER_LOSS_RTOL})")
    check["aligned"] = not check["problems"]
    return check

