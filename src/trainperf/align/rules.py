"""The training rule an alignment check holds two frameworks to, item by item as DLPerf's
alignment table lists it, and the negative controls that prove the check sees each item.

``checklist`` says, for each item, whether this check compared it by measurement (and how
much the item moved what was compared, read off torch's own dumps), whether these steps did
not exercise it, or whether this method cannot check it at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..config import Workload
from .tensors import Tolerance, dump_path

CHECKED, NOT_EXERCISED, NOT_CHECKABLE = "checked", "not exercised", "not checkable"


def check_workload(workload: Workload, steps: int) -> Workload:
    """The recipe's workload as the check trains it: dropout off (random masks cannot match
    across frameworks) and the rate's first step moved to ``steps // 2``, so that a few steps
    cross one boundary of the schedule (the recipe's own first scale, 0.1 where it has none)."""
    scale = workload.lr_scales[0] if workload.lr_scales else 0.1
    boundary = max(1, steps // 2)
    return workload.replace(dropout=0.0, lr_steps=(boundary,) if steps > 1 else (),
                            lr_scales=(scale,) if steps > 1 else ())


@dataclass(frozen=True)
class Control:
    """A rule broken on purpose in the candidate: the check must fail on it."""

    name: str
    what: str
    change: Callable[[Workload], Workload] | None = None
    """The candidate's workload with the rule changed; None: a ``breaks`` item of the worker."""
    breaks: tuple[str, ...] = ()


def _shift_schedule(w: Workload) -> Workload:
    return w.replace(lr_steps=tuple(s + 1 for s in w.lr_steps))


CONTROLS: tuple[Control, ...] = (
    Control("no_weight_decay", "weight decay removed", lambda w: w.replace(weight_decay=0.0)),
    Control("momentum", "momentum 0.8 instead of the recipe's",
            lambda w: w.replace(momentum=0.8 if w.momentum != 0.8 else 0.7)),
    Control("no_clip", "gradient clipping off", lambda w: w.replace(clip_grad_norm=None)),
    Control("lr_schedule", "the rate's step one step late", _shift_schedule),
    Control("straight_through", "the margin's gradient passed straight through (derivative 1)",
            breaks=("margin_straight_through",)),
)


def control(name: str) -> Control:
    for c in CONTROLS:
        if c.name == name:
            return c
    raise ValueError(f"unknown control {name!r}; known: {', '.join(c.name for c in CONTROLS)}")


def margin_has_slope(workload: Workload) -> bool:
    """Whether the margin's derivative differs from 1 (ArcFace's angle); CosFace's and plain
    softmax's target logit is ``cos - m3``, whose derivative is 1 anyway."""
    m1, m2, _ = workload.resolved_margins
    return workload.task == "face" and not (m1 == 1.0 and m2 == 0.0)


def why_not_applicable(c: Control, workload: Workload, steps: int,
                       ref: "TorchFigures") -> str | None:
    """Why control ``c`` cannot show anything on this check, or None where it can."""
    if c.name == "no_weight_decay" and workload.weight_decay == 0:
        return "the recipe has no weight decay"
    if c.name == "momentum" and (workload.momentum == 0 or steps < 2):
        return "momentum acts from the second step on" if steps < 2 else "no momentum"
    if c.name == "no_clip":
        if workload.clip_grad_norm is None:
            return "the recipe does not clip"
        if not ref.clip_active(workload.clip_grad_norm):
            return (f"torch's gradient norm stayed under {workload.clip_grad_norm:g} in these "
                    "steps, so clipping never acted")
    if c.name == "lr_schedule" and not any(0 < s < steps for s in workload.lr_steps):
        return "no step of the rate falls within the checked steps"
    if c.name == "straight_through" and not margin_has_slope(workload):
        return "the margin's derivative is 1 already (no angular margin)"
    return None


class TorchFigures:
    """What torch's own dumps (rank 0) say of the run: its gradient norms and rates, its
    BatchNorm statistics, and how much weight decay and momentum moved its updates."""

    def __init__(self, folder: Path, steps: int) -> None:
        self.folder, self.steps = folder, steps
        self.grad_norms: list[float] = []
        self.rates: list[float] = []
        self.bn_statistics = 0
        paths = [dump_path(folder, step, 0) for step in range(-1, steps)]
        self.complete = all(p.is_file() for p in paths)
        if not self.complete:
            return
        with np.load(paths[0]) as f:
            names = [k for k in f.files if "/" in k]
        self.names = names
        self.bn_statistics = sum(k.endswith(("running_mean", "running_var")) for k in names)
        for path in paths[1:]:
            with np.load(path) as f:
                self.grad_norms.append(float(f["grad_norm"]))
                self.rates.append(float(f["lr"]))

    def clip_active(self, max_norm: float) -> bool:
        return any(n > max_norm for n in self.grad_norms if math.isfinite(n))

    def shares(self, workload: Workload) -> tuple[float, float]:
        """The largest share of one parameter's update that weight decay makes at step 0
        (``lr * wd * |w|``) and that momentum carries over from the update before (``m *
        lr_i / lr_(i-1)`` times it), read one tensor at a time."""
        if not self.complete:
            return 0.0, 0.0
        wd_share = mom_share = 0.0
        files = [np.load(dump_path(self.folder, step, 0)) for step in range(-1, self.steps)]
        try:
            for name in self.names:
                if name.endswith(("running_mean", "running_var")):
                    continue  # statistics, not parameters: no decay, no momentum
                values = [np.asarray(f[name], np.float64) for f in files]
                norms = [float(np.linalg.norm(values[i + 1] - values[i]))
                         for i in range(self.steps)]
                if norms[0] > 0:
                    wd_share = max(wd_share, self.rates[0] * workload.weight_decay
                                   * float(np.linalg.norm(values[0])) / norms[0])
                for i in range(1, self.steps):
                    if norms[i] > 0 and self.rates[i - 1] > 0:
                        carried = (workload.momentum * self.rates[i] / self.rates[i - 1]
                                   * norms[i - 1])
                        mom_share = max(mom_share, carried / norms[i])
        finally:
            for f in files:
                f.close()
        return wd_share, mom_share


def checklist(workload: Workload, steps: int, tol: Tolerance, ref: TorchFigures,
              controls: dict[str, dict[str, Any]], declared: dict[str, str] | None = None
              ) -> list[dict[str, Any]]:
    """DLPerf's alignment table, item by item: the recipe's value, and whether and how this
    check compared it. ``controls``: the negative controls' outcomes by name, cited where one
    backs an item; ``declared``: the candidate's declared differences of rule."""
    wd_share, mom_share = ref.shares(workload)
    m1, m2, m3 = workload.resolved_margins
    rows: list[dict[str, Any]] = []

    def row(item: str, value: str, status: str, how: str, backed_by: str | None = None) -> None:
        if backed_by and backed_by in controls:
            how += f"; control `{backed_by}`: {controls[backed_by]['verdict']}"
        rows.append({"item": item, "value": value, "status": status, "how": how})

    row("kernel initializer", "torch's (kaiming / the backbone's own)", NOT_CHECKABLE,
        "every weight comes from the start file, so each framework's own initializer is not "
        "compared; the start as each side loaded it is compared value by value")
    row("head initializer", "normal(0, 0.01)", CHECKED,
        "the class matrix as each side loaded it from the start file, value by value "
        "(a head drawn by the framework itself differs there)")
    row("optimizer", "SGD", CHECKED, "every tensor's update at every step")
    if steps < 2 or workload.momentum == 0:
        row("momentum", f"{workload.momentum:g}", NOT_EXERCISED,
            "momentum acts from the second step on" if workload.momentum else "none")
    else:
        row("momentum", f"{workload.momentum:g}", CHECKED,
            f"every update from step 1 on, where the momentum carried over is up to "
            f"{100 * mom_share:.3g}% of a tensor's update (tolerance {tol.update:g})", "momentum")
    if workload.weight_decay == 0:
        row("weight decay", "0", NOT_EXERCISED, "the recipe has none")
    else:
        row("weight decay", f"{workload.weight_decay:g}", CHECKED,
            f"every tensor's update, of which weight decay is up to {100 * wd_share:.3g}% at "
            f"step 0 (tolerance {tol.update:g})", "no_weight_decay")
    if workload.clip_grad_norm is None:
        row("gradient clipping", "none", CHECKED if ref.grad_norms else NOT_EXERCISED,
            "neither side may clip: a clipped update would differ")
    elif ref.clip_active(workload.clip_grad_norm):
        active = sum(n > workload.clip_grad_norm for n in ref.grad_norms)
        row("gradient clipping", f"L2 norm {workload.clip_grad_norm:g}", CHECKED,
            f"the gradient norm before clipping at every step, and the clipped updates "
            f"({active} of {steps} steps clipped)", "no_clip")
    else:
        row("gradient clipping", f"L2 norm {workload.clip_grad_norm:g}", NOT_EXERCISED,
            f"the gradient norm before clipping is compared, but it stayed under "
            f"{workload.clip_grad_norm:g} (largest {max(ref.grad_norms, default=0):.3g}), so "
            f"clipping never acted")
    boundary = [s for s in workload.lr_steps if 0 < s < steps]
    row("lr schedule", f"{workload.lr:g}, x{workload.lr_scales[0]:g} at step "
        f"{workload.lr_steps[0]}" if workload.lr_steps else f"{workload.lr:g} constant",
        CHECKED if boundary else NOT_EXERCISED,
        ("each step's rate as the framework's own schedule gave it, and the updates across "
         f"the step at {boundary[0]} (moved there from the recipe's first step)")
        if boundary else "no step of the rate within the checked steps", "lr_schedule")
    if workload.task == "face":
        row("margin", f"(m1, m2, m3) = ({m1:g}, {m2:g}, {m3:g})", CHECKED,
            "the loss at every step, and the margin's derivative in every update"
            + ("" if margin_has_slope(workload) else " (it is 1 here)"),
            "straight_through" if margin_has_slope(workload) else None)
        row("scale", f"{workload.scale:g}", CHECKED, "the loss at every step")
    row("loss", workload.loss, CHECKED, "the loss at every step")
    row("dropout", f"{workload.dropout:g} (off for the check)", NOT_CHECKABLE,
        "random masks cannot match across frameworks, so both sides run without it")
    if ref.bn_statistics:
        own = [f"`{k}`: {why}" for k, why in (declared or {}).items()
               if k.endswith(("running_mean", "running_var"))]
        row("BN momentum", "torch 0.1 (MXNet's 0.9)", CHECKED,
            f"the update of every running mean and variance ({ref.bn_statistics} tensors)"
            + (f", but for the framework's declared difference ({'; '.join(own)}), measured "
               "and shown, not judged" if own else ""))
        row("BN eps", "the backbone's", CHECKED,
            "every normalisation of the forward: the loss and every update")
    return rows
