"""What limits a run's time, in words for the report's header: the stall limit each run ran
under (``trainperf.stall``) beside the timeout."""

from __future__ import annotations

from ..config import STALL_FLOOR_S
from ..stall import STEP_MULTIPLE


def stall_line(doc: dict) -> str | None:
    """``Stall timeout: 300 s (sized from ...)``, from the measure and the limits the runs
    recorded; None where no run recorded one (results made before runs did)."""
    runs = [r for c in doc.get("cases", []) for r in c.get("runs", [])]
    if not any("stall_timeout_s" in r for r in runs):
        return None
    m = doc.get("measure") or {}
    timeout = m.get("timeout_s")
    before = f", before its {timeout:g} s timeout" if timeout else ""
    if m.get("stall_timeout_s") is not None:
        how = "fixed by --stall-timeout"
    elif m.get("stall_auto") is False:
        return (f"Stall timeout: off; only the {timeout:g} s timeout stops a hung run."
                if timeout else "Stall timeout: off.")
    else:
        floor = m.get("stall_floor_s", STALL_FLOOR_S)
        how = (f"sized from the case's step times: {STEP_MULTIPLE:g}x the median step, at "
               f"least {floor:g} s")
    limits = sorted({r["stall_timeout_s"] for r in runs if r.get("stall_timeout_s") is not None})
    if not limits:
        return f"Stall timeout: {how}; none applied to these runs (training, or profiled)."
    span = f"{limits[0]:g} s" if len(limits) == 1 else f"{limits[0]:g} to {limits[-1]:g} s"
    return (f"Stall timeout: {span} ({how}): a run that goes that long without a step is "
            f"stopped as hung{before}.")
