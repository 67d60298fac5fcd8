"""Strict alignment: does another framework train the same numbers as PyTorch?

DLPerf aligned frameworks by hand, with a table of initialisers, optimisers and learning rates.
Here it is checked: torch's initial weights, one class matrix and one batch per rank go into an
``.npz``; each framework's worker starts from that file (``RunSpec.init``) and trains
``steps`` SGD steps on the same batch; the parameter count and every step's loss are compared.
Dropout is off (random masks cannot match across frameworks); everything else is the recipe's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from . import results
from .config import Measure, Topology, Tuning, Workload
from .progress import NullProgress
from .runner import Case, Plan, Runner

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


def request(recipe_name: str, framework: str, devices: list[int], fc_modes: list[str],
            steps: int, timeout_s: float, out: Path | None, batch_size: int | None = None,
            num_classes: int | None = None) -> AlignRequest:
    """The alignment check of ``framework`` on the recipe, with its batch and class count
    changed where given; ``out`` None: a new folder under ``results/``."""
    from .backends import get_backend
    from .recipes import get_recipe

    recipe = get_recipe(recipe_name)
    workload = recipe.workload
    if batch_size:
        workload = workload.replace(batch_size=batch_size)
    if num_classes:
        workload = workload.replace(num_classes=num_classes)
    framework = get_backend(framework).name
    if framework == "torch":
        raise ValueError("align compares another framework with torch: pass --framework mxnet")
    out = out or results.default_folder(f"align-{recipe.name}-{framework}")
    return AlignRequest(recipe.name, workload, framework, devices, fc_modes, steps, timeout_s,
                        out)


def run_from_start(recipe: str, workload: Workload, init: Path, out: Path, steps: int,
                   timeout_s: float, framework: str = "torch", devices: int = 1,
                   device: str = "auto", tuning: Tuning = Tuning()) -> tuple[dict, int | None]:
    """One run of ``steps`` steps from the start file ``init``; (its run record, the worker's
    backbone parameter count)."""
    measure = Measure(runs=1, iters=steps, warmup=0, timeout_s=timeout_s)
    case = Case(Topology(devices_per_node=devices, device=device), workload.batch_size)
    plan = Plan(recipe, workload, measure, [case], out, tuning, framework=framework,
                init=str(init))
    runner = Runner(plan, NullProgress())
    doc = runner.run()
    record = doc["cases"][0]["runs"][0] if doc["cases"] else {"status": "failed", "error": None}
    start = next(iter(runner.start_events.values()), None)
    return record, start.backbone_params if start else None


def _run(req: AlignRequest, workload: Workload, framework: str, devices: int, init: Path,
         out: Path) -> tuple[dict, int | None]:
    return run_from_start(req.recipe, workload, init, out, req.steps, req.timeout_s, framework,
                          devices)


CACHE_ENV = "TRAINPERF_ALIGN_CACHE"
"""A folder where torch's side of each check is kept and reused by later checks from the same
start (tests set it, so that every framework's alignment shares one torch run per case)."""


def _reference_key(workload: Workload, devices: int, steps: int, init: Path) -> str:
    import torch  # the reference side runs torch; its version is part of what it computed

    h = hashlib.sha256(json.dumps([workload.to_dict(), devices, steps, torch.__version__],
                                  sort_keys=True).encode())
    import numpy as np

    with np.load(init) as arrays:  # the contents: the zip's own bytes carry timestamps
        for name in sorted(arrays.files):
            h.update(name.encode())
            h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()[:32]


def _torch_reference(req: AlignRequest, workload: Workload, devices: int, init: Path,
                     out: Path) -> tuple[dict, int | None]:
    """torch's run of one check, reused from ``$TRAINPERF_ALIGN_CACHE`` when the same workload,
    ranks, steps, torch and start file ran before (only successful runs are kept)."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return _run(req, workload, "torch", devices, init, out)
    path = Path(folder) / f"{_reference_key(workload, devices, req.steps, init)}.json"
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        return kept["record"], kept["params"]
    except (OSError, ValueError, KeyError):
        pass
    record, params = _run(req, workload, "torch", devices, init, out)
    if record.get("status") == "ok":
        path.parent.mkdir(parents=True, exist_ok=True)
        results.write_json_atomic(path, {"record": record, "params": params})
    return record, params


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(a))


def compare(torch_losses: list[float] | None, other_losses: list[float] | None,
            torch_params: int | None, other_params: int | None) -> dict:
    """The verdict of one (fc, ranks) pair from both sides' figures."""
    check = {"params": {"torch": torch_params, "other": other_params},
             "losses": {"torch": torch_losses, "other": other_losses},
             "first_loss_rel_diff": None, "max_loss_rel_diff": None, "problems": []}
    if torch_params != other_params:
        check["problems"].append(f"parameter counts differ ({torch_params} vs {other_params})")
    if not torch_losses or not other_losses or len(torch_losses) != len(other_losses):
        check["problems"].append("a side has no losses to compare")
    elif not all(math.isfinite(v) for v in torch_losses + other_losses):
        check["problems"].append("a loss is not finite")
    else:
        first = _rel(torch_losses[0], other_losses[0])
        worst = max(_rel(a, b) for a, b in zip(torch_losses, other_losses))
        check["first_loss_rel_diff"], check["max_loss_rel_diff"] = first, worst
        if first > FIRST_LOSS_RTOL:
            check["problems"].append(f"first loss differs by {first:.2e} (> {FIRST_LOSS_RTOL})")
        if worst > LATER_LOSS_RTOL:
            check["problems"].append(f"a loss differs by {worst:.2e} (> {LATER_LOSS_RTOL})")
    check["aligned"] = not check["problems"]
    return check


def run_alignment(req: AlignRequest) -> dict:
    """Run both sides for every (fc, ranks) pair; writes and returns ``align.json``."""
    from .backends.torch.alignment import write_start  # torch only on this side

    base = req.workload.replace(dropout=0.0)
    modes = ["dp"] if base.task == "classification" else req.fc_modes
    init = req.out / "start.npz"
    write_start(base, max(req.devices), init)
    checks = []
    for fc in modes:
        workload = base.replace(fc=fc)
        for devices in req.devices:
            where = req.out / "runs" / f"{fc}_{devices}r"
            t_rec, t_params = _torch_reference(req, workload, devices, init, where / "torch")
            o_rec, o_params = _run(req, workload, req.framework, devices, init,
                                   where / f"candidate-{req.framework}")
            check = compare(t_rec.get("losses"), o_rec.get("losses"), t_params, o_params)
            for name, rec in (("torch", t_rec), (req.framework, o_rec)):
                if rec.get("status") != "ok":
                    check["problems"].insert(0, f"{name} run {rec.get('status')}: "
                                                f"{(rec.get('error') or '')[:200]}")
                    check["aligned"] = False
            checks.append({"fc": fc, "ranks": devices, **check})
    outcome = {"recipe": req.recipe, "framework": req.framework, "workload": base.to_dict(),
               "steps": req.steps,
               "tolerance": {"first_loss_rtol": FIRST_LOSS_RTOL,
                             "later_loss_rtol": LATER_LOSS_RTOL},
               "checks": checks, "aligned": all(c["aligned"] for c in checks)}
    results.write_json_atomic(req.out / "align.json", outcome)
    return outcome


def render_table(outcome: dict) -> str:
    """Both sides, side by side, as a markdown table."""
    other = outcome["framework"]
    header = ["fc", "ranks", "params torch", f"params {other}", "step", "loss torch",
              f"loss {other}", "rel diff", "verdict"]
    rows = []
    for c in outcome["checks"]:
        t, o = c["losses"]["torch"] or [], c["losses"]["other"] or []
        verdict = "aligned" if c["aligned"] else "; ".join(c["problems"])
        for i in range(max(len(t), len(o), 1)):
            a = t[i] if i < len(t) else None
            b = o[i] if i < len(o) else None
            diff = f"{_rel(a, b):.1e}" if a is not None and b is not None else "-"
            rows.append([c["fc"], str(c["ranks"]), str(c["params"]["torch"]),
                         str(c["params"]["other"]), str(i), "-" if a is None else f"{a:.6f}",
                         "-" if b is None else f"{b:.6f}", diff, verdict if i == 0 else ""])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    verdict = "ALIGNED" if outcome["aligned"] else "NOT ALIGNED"
    tol = outcome["tolerance"]
    return (f"{outcome['framework']} vs torch on {outcome['recipe']} ({outcome['steps']} steps, "
            f"dropout off): {verdict}\n"
            f"tolerance: first loss {tol['first_loss_rtol']:g}, later losses "
            f"{tol['later_loss_rtol']:g} (relative, on |loss| >= 1)\n\n" + "\n".join(lines))
