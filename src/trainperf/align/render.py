"""An alignment outcome (``align.json``) as markdown: the verdict, each (fc, ranks) pair, every
step's figures, the alignment table item by item and the negative controls."""

from __future__ import annotations

from typing import Any


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _e(value: Any) -> str:
    return "-" if value is None else f"{value:.1e}"


def _f(value: Any) -> str:
    return "-" if value is None else f"{value:.6g}"


def _worst(w: dict[str, Any] | None) -> str:
    if not w or w.get("tensor") is None:
        return "-"
    where = "start" if w.get("step") == -1 else f"step {w.get('step')}"
    return f"{w['error']:.1e} `{w['tensor']}` ({where}, rank {w.get('rank')})"


def render_table(outcome: dict[str, Any]) -> str:
    other = outcome["framework"]
    verdict = "ALIGNED" if outcome["aligned"] else "NOT ALIGNED"
    tol = outcome["tolerance"]
    w = outcome["workload"]
    moved = (f", the rate x{w['lr_scales'][0]:g} from step {w['lr_steps'][0]}"
             if w.get("lr_steps") else "")
    lines = [f"{other} vs torch on {outcome['recipe']} ({outcome['steps']} steps in "
             f"{outcome['dtype']} on {'a GPU' if outcome.get('device') == 'cuda' else 'the CPU'}"
             f", dropout off{moved}): {verdict}",
             f"tolerance: every tensor's update {tol['update']:g}, loss / gradient norm / rate "
             f"{tol['scalar']:g} (relative), or more where torch's witness (every weight moved "
             f"by {tol.get('witness_shift', 0):g}) shows rounding going further at that step: "
             f"{tol['why']}", ""]
    rows = []
    for c in outcome["checks"]:
        scalars = c.get("worst_scalar") or {}
        rows.append([c["fc"], str(c["ranks"]), str(c["params"]["torch"]),
                     str(c["params"]["other"]), str(c.get("tensors_compared", 0)),
                     _worst(c.get("worst_update")), _worst(c.get("worst_start")),
                     _e((scalars.get("loss") or {}).get("error")),
                     _e((scalars.get("grad_norm") or {}).get("error")),
                     "aligned" if c["aligned"] else "; ".join(c["problems"])])
    lines += _table(["fc", "ranks", "params torch", f"params {other}", "tensors",
                     "worst update", "worst start value", "worst loss", "worst grad norm",
                     "verdict"], rows)
    lines += ["", "Every step (rank 0):", ""]
    rows = []
    for c in outcome["checks"]:
        for s in c.get("steps", []):
            if s["rank"] != 0:
                continue
            loss, norm, lr = s.get("loss") or {}, s.get("grad_norm") or {}, s.get("lr") or {}
            limits = c.get("tolerance_by_step") or []
            rows.append([c["fc"], str(c["ranks"]), str(s["step"]), _f(lr.get("torch")),
                         _f(loss.get("torch")), _f(loss.get("other")), _f(norm.get("torch")),
                         _f(norm.get("other")), _worst(s.get("worst_update")),
                         _e(limits[s["step"]]) if s["step"] < len(limits) else "-"])
    lines += _table(["fc", "ranks", "step", "rate", "loss torch", f"loss {other}",
                     "grad norm torch", f"grad norm {other}", "worst update",
                     "largest tolerance"], rows)
    declared = [(c["fc"], c["ranks"], d) for c in outcome["checks"] for d in c.get("declared", [])]
    if declared:
        lines += ["", f"Declared differences of {other}'s own kernels from torch's rule "
                      "(measured, not counted in the verdict):", ""]
        lines += _table(["fc", "ranks", "tensor", "worst update difference", "why"],
                        [[fc, str(n), f"`{d['tensor']}`", _e(d["error"]), d["why"]]
                         for fc, n, d in declared])
    lines += ["", "The alignment table:", ""]
    lines += _table(["item", "recipe", "status", "how"],
                    [[r["item"], r["value"], r["status"], r["how"]] for r in outcome["checklist"]])
    if outcome.get("controls"):
        caught = "every one caught" if outcome.get("controls_caught") else "NOT ALL CAUGHT"
        lines += ["", f"Negative controls (one rule broken in {other}; each must fail the check): "
                      f"{caught}", ""]
        lines += _table(["control", "what", "verdict"],
                        [[name, c["what"], c["verdict"]]
                         for name, c in outcome["controls"].items()])
    return "\n".join(lines)
