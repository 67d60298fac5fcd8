"""Native parity for torch and JAX, on the device, in bf16 (``trainperf.parity``).

One interleaved pair per row: trainperf's worker against the framework's own step in
``benchmarks/native/`` (torch: torchvision's ResNet50 in a plain eager loop; JAX: flax.linen
modules in the ImageNet example's layout under ``jax.jit``), ResNet50 v1b, then the IResNet-50
ArcFace step. JAX's rows come first: its committed BatchNorm has not run on a GPU yet, while
torch's rows are proven on the H200 record. A row is started only while the stage's cap leaves
time for a pair; every finished pair is in the stage's record and in the registry that reports
read. The CPU mode runs torch's ResNet50 row at batch 2 and 32x32.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .. import parity
from .peers import jax_interpreter
from .record import StageLog

CAP_ENV = "TRAINPERF_GPUCHECK_CAP_S"
"""The stage's cap with what earlier stages left of theirs, set by the orchestrator."""
FRAMEWORK = {"3": "jax", "5": "torch"}
"""Each parity stage's framework: JAX's in part 1, torch's in part 2."""
ROWS = {"gpu": [("rn50", 128), ("face", 128)], "cpu": [("rn50", 2)]}
CPU_FRAMEWORKS = ("torch",)
"""The CPU mode keeps to torch: its pass is the stage's plumbing, which ``make test`` runs, and
JAX's two compilations would add half a minute to it (tests/test_parity.py runs the driver with
a second framework)."""
SETTINGS = {"gpu": parity.Settings(device="cuda", precision="bf16", iters=30, warmup=5,
                                   timeout_s=120),
            "cpu": parity.Settings(device="cpu", iters=2, warmup=1, timeout_s=120,
                                   input_size=32)}
PAIR_S = {"gpu": 25.0, "cpu": 60.0}
"""About the shortest pair on a GPU (torch's two starts): no row starts with less than this
left of the cap, and one that then runs past the cap is stopped there."""


def run(log: StageLog, mode: str, work: Path, stage_id: str) -> None:
    started = time.monotonic()
    cap = float(os.environ.get(CAP_ENV) or 0) or None
    fw = FRAMEWORK[stage_id]
    if mode != "gpu" and fw not in CPU_FRAMEWORKS:
        log.not_run(f"native parity: {fw}", f"the CPU mode runs {', '.join(CPU_FRAMEWORKS)}'s "
                    f"rows only; {fw}'s pass through the same driver is tests/test_parity.py's")
        return
    try:
        parity.check_frameworks([fw])
    except ValueError as exc:
        for model, batch in ROWS[mode]:
            log.not_run(f"native parity: {fw} {model} b{batch}", str(exc))
        return
    if fw == "jax":
        python, where = jax_interpreter(mode)
        if python is None:
            for model, batch in ROWS[mode]:
                log.not_run(f"native parity: jax {model} b{batch}", f"no JAX here ({where})")
            return
    rows = [parity.Row(fw, model, batch) for model, batch in ROWS[mode]]
    budget = None if cap is None else max(0.0, cap - PAIR_S[mode] - (time.monotonic() - started))

    def keep(row: dict, pair: dict) -> None:
        log.add("parity", framework=row["framework"], model=row["model"], batch=row["batch"],
                recipe=parity.RECIPES[row["model"]], ratio=pair.get("ratio"),
                trainperf_samples_per_s=pair.get("trainperf"),
                native_samples_per_s=pair.get("native"), order=pair["order"],
                native_step=(pair.get("native_settings") or {}).get("zoo"),
                error=pair.get("error"))
        print(f"parity {row['framework']} {row['model']} b{row['batch']}: "
              + (f"{pair['ratio']:.3f}" if pair.get("ratio") else pair["error"]), flush=True)

    doc = parity.campaign(rows, SETTINGS[mode], work / f"parity-{fw}", pairs=1,
                          budget_s=budget, work=work / "runs" / f"parity-{fw}", on_pair=keep)
    for rec in doc["rows"]:
        if rec.get("not_started"):
            log.not_run(f"native parity: {rec['framework']} {rec['model']} b{rec['batch']}",
                        "the stage's cap left no time for another pair")
