"""Frameworks side by side: torch and MXNet on the same recipes, 1 and 2 ranks.

Each (recipe, fc) pair is one ``trainperf run --framework torch,mxnet`` into
benchmarks/results/framework_compare-<device>/<recipe>-<fc>/, whose report.md holds the
comparison table (samples/s per framework, speedups, the MXNet / torch ratio). Sizes default to
what a 2-core CPU finishes in minutes; on a GPU pass the recipes' own batch sizes.

    python benchmarks/framework_compare.py [--device cpu] [--runs 3] [--iters 12] [--warmup 4]
        [--case tiny-arcface:dp:8] [--case r50-arcface-plsc:mp:4] ...

A case is RECIPE:FC:BATCH[:CLASSES] (CLASSES: override the recipe's class count).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from trainperf import results
from trainperf.cli import main as trainperf

CPU_CASES = ["tiny-arcface:dp:8", "tiny-arcface:mp:8", "r50-arcface-plsc:mp:4"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", default="1,2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--case", action="append", help="RECIPE:FC:BATCH[:CLASSES]")
    parser.add_argument("--out", help="default benchmarks/results/framework_compare-<device>")
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).parent / "results" / f"framework_compare-{args.device}")
    summary = {}
    for case in args.case or CPU_CASES:
        recipe, fc, batch, *classes = case.split(":")
        folder = out / f"{recipe}-{fc}"
        shutil.rmtree(folder, ignore_errors=True)
        argv = ["run", recipe, "--framework", "torch,mxnet", "--devices", args.devices,
                "--device", args.device, "--fc", fc, "--batch-size", batch,
                "--runs", str(args.runs), "--iters", str(args.iters),
                "--warmup", str(args.warmup), "--out", str(folder)]
        if classes:
            argv += ["--num-classes", classes[0]]
        print("trainperf " + " ".join(argv), file=sys.stderr, flush=True)
        trainperf(argv)
        for name in ("torch", "mxnet"):
            # Per-run specs and worker logs stay out of the record; results and events remain.
            shutil.rmtree(folder / name / "runs", ignore_errors=True)
        summary[case] = {name: {c["case"]: c["median_samples_per_s"]
                                for c in results.load(folder / name)["cases"]}
                         for name in ("torch", "mxnet")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
