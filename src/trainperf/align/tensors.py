"""Two training runs compared step by step, tensor by tensor, from their dumps
(``trainperf.backends.workerkit.write_dump``).

What is compared, for every rank and every step:

- each tensor's **update** (its value after the step less its value before, each side its
  own): ``|d_cand - d_ref| / max(|d_ref|, |d_cand|)`` in the L2 norm, with the floors below. An update
  isolates the step's rule (weight decay adds ``lr * wd * w`` to it, momentum the last update
  times ``m``) where the weights themselves would bury it under their own size. BatchNorm's
  running statistics are tensors like any other: their update is the BN momentum's rule.
- the start, as each side loaded it, value by value: a head or a statistic not taken from the
  start shows here.
- the loss, the backbone's gradient norm before clipping and the rate, as relative
  differences.

Two floors keep a tensor whose update is nearly nothing from dividing rounding by nothing: an
update is measured at least against ``Tolerance.floor * |w|`` (the size below which the dumps'
own rounding of ``w`` would show) and against ``STEP_FLOOR`` times the whole step's update (a
zero-initialised bias that feeds a BatchNorm gets a gradient of pure rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

SCALARS = ("loss", "grad_norm", "lr")
STEP_FLOOR = 1e-6
"""A tensor whose update is under this share of the whole step's update (all tensors' updates
as one vector) is measured against that share: a bias that feeds a BatchNorm has a true
gradient of zero, and what each framework computes for it is rounding alone."""


@dataclass(frozen=True)
class Tolerance:
    """The largest difference that rounding alone can explain: a base for one dtype, raised
    step by step and tensor by tensor to what torch's rounding witness shows (``witness``)."""

    dtype: str
    update: float
    """Relative error of a tensor's update (and of the start's values)."""
    scalar: float
    """Relative difference of a loss, a gradient norm or a rate."""
    why: str
    witness: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    """Step -> tensor (or scalar) name -> how far torch's witness run went from torch's own
    there (``trainperf.align.witnessed``)."""

    def update_at(self, step: int, name: str) -> float:
        return max(self.update, self.witness.get(step, {}).get(name, 0.0))

    def scalar_at(self, step: int, name: str) -> float:
        return max(self.scalar, self.witness.get(step, {}).get(name, 0.0))

    def largest(self, step: int) -> float:
        """The largest tolerance of any tensor at ``step``."""
        return max([self.update, *self.witness.get(step, {}).values()])

    @property
    def floor(self) -> float:
        """Smallest update (relative to the tensor) that is measured as itself: below it, the
        difference of two weights rounded to ``dtype`` would reach the base tolerance."""
        return 4 * float(np.finfo(self.dtype).eps) / self.update


FLOAT64 = Tolerance(
    "float64", update=1e-8, scalar=1e-8,
    why="float64 rounding is 1.1e-16 per operation; five frameworks' updates of the tiny "
        "recipe agree with torch's within 7e-10 over 3 steps on 1 and 2 ranks, and where the "
        "dynamics amplify rounding (BatchNorm over two samples, hard clipping) the witness "
        "raises the tolerance to what rounding does there; each control's broken rule moves "
        "an update by 9e-2 or more")


def dump_path(folder: Path, step: int, rank: int) -> Path:
    # The same names as workerkit.dump_name (this side may not import a worker module).
    return folder / (f"start-rank-{rank}.npz" if step < 0 else f"step-{step:04d}-rank-{rank}.npz")


def _norm(a: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, dtype=np.float64).ravel()))


def _rel_scalar(a: float, b: float) -> float:
    if a == b:  # both zero, or both the same infinity
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def update_norms(prev_ref: np.ndarray, cur_ref: np.ndarray, prev_cand: np.ndarray,
                 cur_cand: np.ndarray) -> tuple[float, float, float, float]:
    """(|d_cand - d_ref|, |d_ref|, |d_cand|, |w|) of one tensor's update on both sides."""
    d_ref = np.asarray(cur_ref, np.float64) - np.asarray(prev_ref, np.float64)
    d_cand = np.asarray(cur_cand, np.float64) - np.asarray(prev_cand, np.float64)
    if not (np.all(np.isfinite(d_ref)) and np.all(np.isfinite(d_cand))):
        return math.inf, _norm(d_ref), _norm(d_cand), _norm(prev_ref)
    return _norm(d_cand - d_ref), _norm(d_ref), _norm(d_cand), _norm(prev_ref)


def update_error(norms: tuple[float, float, float, float], step_norm: float, floor: float
                 ) -> float:
    """The relative error of the candidate's update against the reference's (module doc):
    measured against the larger update, but never against less than ``floor`` times the
    tensor or ``STEP_FLOOR`` times the whole step's update (``step_norm``)."""
    diff, d_ref, d_cand, w = norms
    if diff == 0.0:
        return 0.0
    return diff / max(d_ref, d_cand, floor * w, STEP_FLOOR * step_norm, 1e-300)


def value_error(ref: np.ndarray, cand: np.ndarray) -> float:
    diff = _norm(np.asarray(cand, np.float64) - np.asarray(ref, np.float64))
    if diff == 0.0:
        return 0.0
    return diff / max(_norm(ref), _norm(cand), 1e-300)


class _Dumps:
    """The open dump files of one side (the start and each step, for one rank)."""

    def __init__(self, folder: Path, steps: int, rank: int) -> None:
        self.files: dict[int, Any] = {}
        missing = []
        for step in range(-1, steps):
            path = dump_path(folder, step, rank)
            if path.is_file():
                self.files[step] = np.load(path)
            else:
                missing.append(path.name)
        self.missing = missing

    def names(self, step: int) -> set[str]:
        return {k for k in self.files[step].files if k not in SCALARS}

    def scalar(self, step: int, name: str) -> float:
        return float(self.files[step][name])

    def close(self) -> None:
        for f in self.files.values():
            f.close()


@dataclass
class Worst:
    """The largest error seen, measured in tolerances (``error / tolerance``)."""

    error: float = 0.0
    tolerance: float = 1.0
    tensor: str | None = None
    step: int | None = None
    rank: int | None = None

    def see(self, error: float, tolerance: float, tensor: str, step: int, rank: int) -> None:
        ratio = error / tolerance
        if self.tensor is None or not ratio <= self.error / self.tolerance:
            self.error, self.tolerance = error, tolerance
            self.tensor, self.step, self.rank = tensor, step, rank

    @property
    def within(self) -> bool:
        return self.tensor is None or self.error <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.error, "tolerance": self.tolerance, "tensor": self.tensor,
                "step": self.step, "rank": self.rank}


def compare_runs(ref_dir: Path, cand_dir: Path, steps: int, ranks: int, tol: Tolerance,
                 dtype: str, declared: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Compare the candidate's dumps with the reference's: every tensor, scalar and dtype, for
    every rank and step. Returns ``problems`` (empty when aligned), the worst update and the
    worst start value, each scalar's worst difference, every step's figures and each tensor's
    worst error (``all_errors``, largest first) and every error by step and name over the
    ranks (``errors_by_step``: what a witness's comparison gives ``Tolerance.witness``).

    ``declared``: the candidate's own declared differences of rule (``Capabilities.
    rule_differences``: a tensor-name ending -> why). Those tensors' updates are measured and
    returned (``declared``) but decide nothing; their start values still must agree."""
    declared = dict(declared or {})
    by_step: dict[int, dict[str, float]] = {}
    problems: list[str] = []
    worst_update, worst_start = Worst(), Worst()
    worst_scalar = {name: Worst() for name in SCALARS}
    per_tensor: dict[str, float] = {}
    per_step: list[dict[str, Any]] = []
    for rank in range(ranks):
        ref, cand = _Dumps(ref_dir, steps, rank), _Dumps(cand_dir, steps, rank)
        try:
            if ref.missing:
                problems.append(f"torch's dump lacks {_few(ref.missing)}")
            if cand.missing:
                problems.append(f"the candidate's dump lacks {_few(cand.missing)}")
            if ref.missing or cand.missing:
                continue
            common = _structure(ref, cand, rank, dtype, problems)
            for name in common:
                worst_start.see(value_error(ref.files[-1][name], cand.files[-1][name]),
                                tol.update, name, -1, rank)
            for step in range(steps):
                per_step.append(_step(ref, cand, step, rank, common, tol, worst_update,
                                      worst_scalar, per_tensor, declared, by_step))
        finally:
            ref.close()
            cand.close()
    if not worst_start.within:
        problems.append(f"the start differs as loaded: {worst_start.tensor} on rank "
                        f"{worst_start.rank} by {worst_start.error:.2e} "
                        f"(> {worst_start.tolerance:g})")
    first = first_difference(per_step)
    if first is not None:
        problems.append(first)
    if not worst_update.within:
        problems.append(f"worst: {worst_update.tensor}'s update differs by "
                        f"{worst_update.error:.2e} (> {worst_update.tolerance:g}) at step "
                        f"{worst_update.step} on rank {worst_update.rank}")
    for name, w in worst_scalar.items():
        if not w.within:
            problems.append(f"the {name.replace('_', ' ')} differs by {w.error:.2e} "
                            f"(> {w.tolerance:g}) at step {w.step} on rank {w.rank}")
    ordered = sorted(per_tensor.items(), key=lambda kv: -kv[1])
    own = [{"tensor": k, "error": v, "why": declared[_declared_key(k, declared)]}
           for k, v in ordered if _declared_key(k, declared)]
    return {"problems": problems, "tensors_compared": len(per_tensor), "declared": own,
            "worst_update": worst_update.to_dict(), "worst_start": worst_start.to_dict(),
            "worst_scalar": {k: w.to_dict() for k, w in worst_scalar.items()},
            "all_errors": [{"tensor": k, "error": v} for k, v in ordered],
            "errors_by_step": by_step, "steps": per_step}


def first_difference(per_step: list[dict[str, Any]]) -> str | None:
    """Where the two runs first part: the earliest step at which a tensor's update or a
    scalar is past its tolerance on some rank, and what is furthest off there. Later steps
    inherit the difference, so this names the rule that differs."""
    for step in sorted({row["step"] for row in per_step}):
        off = []
        for row in (r for r in per_step if r["step"] == step):
            w = row["worst_update"]
            if w["tensor"] is not None and not w["error"] <= w["tolerance"]:
                off.append((w["error"] / w["tolerance"],
                            f"{w['tensor']}'s update by {w['error']:.2e} (> {w['tolerance']:g}) "
                            f"on rank {row['rank']}"))
            for name in SCALARS:
                v = row.get(name)
                if v and not v["error"] <= v["tolerance"]:
                    off.append((v["error"] / v["tolerance"],
                                f"the {name.replace('_', ' ')} by {v['error']:.2e} "
                                f"(> {v['tolerance']:g}) on rank {row['rank']}"))
        if off:
            return f"first differs at step {step}: " + max(off)[1]
    return None


def _keep(by_step: dict[int, dict[str, float]], step: int, name: str, error: float) -> None:
    row = by_step.setdefault(step, {})
    row[name] = max(row.get(name, 0.0), error)


def _declared_key(name: str, declared: Mapping[str, str]) -> str | None:
    return next((k for k in declared if name.endswith(k)), None)


def _step(ref: _Dumps, cand: _Dumps, step: int, rank: int, names: list[str], tol: Tolerance,
          worst_update: Worst, worst_scalar: dict[str, Worst], per_tensor: dict[str, float],
          declared: Mapping[str, str], by_step: dict[int, dict[str, float]]) -> dict[str, Any]:
    """One step of one rank: its scalars and every tensor's update (a declared difference's
    measured, not judged)."""
    row: dict[str, Any] = {"step": step, "rank": rank}
    for name in SCALARS:
        a, b = ref.scalar(step, name), cand.scalar(step, name)
        if name == "grad_norm" and math.isnan(a) and math.isnan(b):
            row[name] = None  # neither side clipped, so neither computed it
            continue
        err = math.inf if math.isnan(a) or math.isnan(b) else _rel_scalar(a, b)
        limit = tol.scalar_at(step, name)
        row[name] = {"torch": a, "other": b, "error": err, "tolerance": limit}
        worst_scalar[name].see(err, limit, name, step, rank)
        _keep(by_step, step, name, err)
    step_worst = Worst()
    norms = {name: update_norms(ref.files[step - 1][name], ref.files[step][name],
                                cand.files[step - 1][name], cand.files[step][name])
             for name in names}
    step_norm = math.sqrt(sum(n[1] ** 2 for n in norms.values()))
    for name in names:
        err = update_error(norms[name], step_norm, tol.floor)
        per_tensor[name] = max(per_tensor.get(name, 0.0), err)
        _keep(by_step, step, name, err)
        if _declared_key(name, declared) is None:
            limit = tol.update_at(step, name)
            step_worst.see(err, limit, name, step, rank)
            worst_update.see(err, limit, name, step, rank)
    row["worst_update"] = step_worst.to_dict()
    return row


def _structure(ref: _Dumps, cand: _Dumps, rank: int, dtype: str, problems: list[str]
               ) -> list[str]:
    """Every tensor torch holds, the candidate must hold in the same shape and in ``dtype``,
    at the start and after every step; returns the names both hold alike."""
    names_ref, names_cand = ref.names(-1), cand.names(-1)
    missing = sorted(names_ref - names_cand)
    extra = sorted(names_cand - names_ref)
    if missing:
        problems.append(f"rank {rank}: the candidate's dump lacks {_few(missing)}")
    if extra:
        problems.append(f"rank {rank}: the candidate's dump has tensors torch has not: "
                        f"{_few(extra)}")
    for step in ref.files:
        if ref.names(step) != names_ref or cand.names(step) != names_cand:
            problems.append(f"rank {rank}: the tensors dumped change at step {step}")
            break
    shapes, dtypes, common = [], [], []
    for name in sorted(names_ref & names_cand):
        a, b = ref.files[-1][name], cand.files[-1][name]
        if a.shape != b.shape:
            shapes.append(f"{name} {tuple(b.shape)} (torch {tuple(a.shape)})")
        else:
            common.append(name)
        if b.dtype != np.dtype(dtype):
            dtypes.append(f"{name} in {b.dtype}")
    if shapes:
        problems.append(f"rank {rank}: shapes differ: {_few(shapes)}")
    if dtypes:
        problems.append(f"rank {rank}: asked for {dtype}, the candidate holds {_few(dtypes)}")
    return [n for n in common if all(n in ref.names(s) and n in cand.names(s)
                                     for s in ref.files)]


def _few(items: list[str], n: int = 4) -> str:
    more = len(items) - n
    return ", ".join(items[:n]) + (f" and {more} more" if more > 0 else "")
