"""One stage in a process of its own: ``python -m trainperf.gpucheck.stage ID --mode M --work DIR``.

The orchestrator stops the process at the stage's cap; everything it measured is already in
``DIR/stage-ID.json``. An exception ends the stage with one line saying what failed; the
items written before it stay.

``TRAINPERF_GPUCHECK_FAULT`` (tests) makes stages fail on purpose: ``ID:hang`` or ``ID:crash``,
comma-separated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from .plan import Stage, get_stage
from .record import StageLog

FAULT_ENV = "TRAINPERF_GPUCHECK_FAULT"


def fault_for(stage_id: str) -> str | None:
    for part in os.environ.get(FAULT_ENV, "").split(","):
        sid, _, what = part.strip().partition(":")
        if sid == stage_id:
            return what
    return None


def dispatch(stage: Stage, log: StageLog, mode: str, work: Path) -> None:
    # Each stage's module is imported only when it runs: the first ones import torch, the
    # summary's process none.
    if stage.kind == "ceiling":
        from . import ceiling
        ceiling.run(log, mode)
    elif stage.kind == "correctness":
        from . import correctness
        correctness.run(log, mode, work)
    elif stage.kind == "parity":
        from . import native
        native.run(log, mode, work, stage.id)
    elif stage.kind == "cases":
        from . import seeds
        seeds.run(log, mode, work, stage.id)
    elif stage.kind == "capacity":
        from . import capacity
        capacity.run(log, mode, work)
    elif stage.kind == "peers":
        from . import peers
        peers.run(log, mode, work)
    elif stage.kind == "realdata":
        from . import realdata
        realdata.run(log, mode, work)
    else:
        raise AssertionError(f"stage {stage.id} ({stage.kind}) has no implementation")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("stage")
    p.add_argument("--mode", choices=["gpu", "cpu"], required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args(argv)
    stage = get_stage(args.stage)
    work = Path(args.work)
    log = StageLog(work, stage.id, stage.title, args.mode)
    fault = fault_for(stage.id)
    try:
        if fault == "hang":
            time.sleep(10 ** 6)
        if fault == "crash":
            raise RuntimeError("injected crash (TRAINPERF_GPUCHECK_FAULT)")
        dispatch(stage, log, args.mode, work)
    except BaseException as exc:  # noqa: BLE001 - the stage's end is recorded, whatever it was
        traceback.print_exc()
        log.set(error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                      [:400])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
