"""Native parity: each framework's trainperf worker against that framework's own training step.

Each framework's own step is ``benchmarks/native/<fw>_native.py``; ``trainperf.parity`` times it
against trainperf's runner in interleaved pairs on the same shapes, precision and threads (see
that module for the method).

    python benchmarks/native_parity.py [--device cpu] [--frameworks torch,jax,...]
        [--case rn50:8] [--case face:8] [--pairs 3] [--iters 6] [--warmup 2] [--threads 2]
        [--precision fp32] [--channels-last] [--input-size 224] [--out DIR] [--budget-s S]
        [--modes default|all|MODE,...]

A case is MODEL:BATCH, MODEL ``rn50`` (ResNet50 v1b, 224x224 unless --input-size, 1000 classes)
or ``face`` (IResNet-50 ArcFace, PLSC's recipe, 112x112, 85,742 classes). The record goes to
``benchmarks/results/native_parity-<device>/``: ``parity.json`` (every pair, both sides'
settings and versions) and ``parity.md`` (median ratio, spread, the pairs). Each row's ratio is
also filed where trainperf's reports look for it (``trainperf.parities``). With ``--modes all``
every framework gets a row per execution mode it declares, both sides in that mode.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trainperf import parity

HERE = Path(__file__).resolve().parent
DEFAULT_CASES = {"cpu": ["rn50:8", "rn50:2", "face:8"], "cuda": ["rn50:128", "face:128"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--frameworks", default=",".join(parity.FRAMEWORKS))
    p.add_argument("--case", action="append", help="MODEL:BATCH, MODEL rn50 or face")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--iters", type=int, default=6, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2, help="steps before each side's window")
    p.add_argument("--threads", type=int, help="threads per process on CPU (default: cores)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--modes", default="default",
                   help="execution modes per framework: default (each one's first on the "
                        "device), all (every mode it declares: a row each) or a list of names")
    p.add_argument("--input-size", type=int, help="ResNet50's input side (default 224)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per side")
    p.add_argument("--budget-s", type=float, help="start no new pair after this many seconds")
    p.add_argument("--out", help="default benchmarks/results/native_parity-<device>")
    a = p.parse_args(argv)
    if a.pairs < 1 or a.iters < 1 or a.warmup < 0 or (a.threads is not None and a.threads < 1):
        p.error("--pairs, --iters and --threads must be >= 1, --warmup >= 0")
    if a.input_size is not None and a.input_size < 32:
        p.error("--input-size must be >= 32")
    if a.device == "cpu" and a.threads is None:
        a.threads = os.cpu_count() or 1
    frameworks = [f for f in a.frameworks.split(",") if f]
    try:
        parity.check_frameworks(frameworks)
        cases = [parity.parse_case(c) for c in a.case or DEFAULT_CASES[a.device]]
        modes = {f: parity.row_modes(f, a.device, a.modes) for f in frameworks}
    except ValueError as exc:
        p.error(str(exc))
    settings = parity.Settings(device=a.device, precision=a.precision,
                               channels_last=a.channels_last, threads=a.threads,
                               iters=a.iters, warmup=a.warmup, timeout_s=a.timeout,
                               input_size=a.input_size)
    rows = [parity.Row(f, m, b, mode) for m, b in cases for f in frameworks for mode in modes[f]]
    out = Path(a.out or HERE / "results" / f"native_parity-{a.device}")

    def tell(row: dict, pair: dict) -> None:
        print(f"{row['framework']} {row.get('mode') or ''} {row['model']} b{row['batch']} pair "
              f"{len(row['pairs']) - 1}: "
              + (f"{pair['ratio']:.3f} ({pair['trainperf']:.2f} / {pair['native']:.2f})"
                 if "ratio" in pair else pair["error"]), file=sys.stderr, flush=True)

    doc = parity.campaign(rows, settings, out, pairs=a.pairs, budget_s=a.budget_s, on_pair=tell)
    print(parity.markdown(doc))
    return 0 if all(r["summary"].get("pairs_ok") for r in doc["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
