"""Time to accuracy on this machine: the same target, four choices (mp against Partial FC 0.1,
fp32 against bf16), side by side.

1. ``trainperf data synth``: a synthetic face set and a verification set of held-out
   identities (``--identities`` x ``--images`` at ``--size`` pixels, ``--pairs`` pairs).
2. ``trainperf train tiny-arcface --fc mp,pfc --sample-ratio 1.0,0.1 --precision fp32,bf16``
   to ``--target`` on ``--devices`` ranks; the output folder holds each variant's results,
   their checkpoints and one report (``report.md``, accuracy against time and steps).

    python benchmarks/time_to_accuracy.py [--target 80%] [--devices 1] [--max-steps 800]
        [--eval-every 25] [--runs 1] [--out benchmarks/results/time_to_accuracy-cpu]

On a GPU pass a real recipe and real data instead (``trainperf train r100-arcface-emore
--data faces_emore/train --val lfw.bin,cfp_fp.bin,agedb_30.bin ...``); this script's synthetic
set is for machines without one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from trainperf.cli import main as trainperf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--identities", type=int, default=100)
    p.add_argument("--images", type=int, default=20, help="images per identity")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--pairs", type=int, default=600)
    # The synthetic set's untrained model verifies about half its pairs; 80% is reached within
    # the 800 steps here (95% was met at once on the easier set it had before, and not at all
    # on this one).
    p.add_argument("--target", default="80%")
    p.add_argument("--devices", default="1")
    p.add_argument("--batch-size", default="16")
    p.add_argument("--max-steps", default="800")
    p.add_argument("--eval-every", default="25")
    p.add_argument("--runs", default="1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="benchmarks/results/time_to_accuracy-cpu")
    args = p.parse_args(argv)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    data = out / "data"
    data.mkdir(parents=True)
    prefix = data / "faces"
    code = trainperf(["data", "synth", "--identities", str(args.identities),
                      "--images-per-identity", str(args.images), "--size", str(args.size),
                      "--val-pairs", str(args.pairs), "--out", str(prefix)])
    if code:
        return code
    code = trainperf(["train", "tiny-arcface", "--data", str(prefix),
                      "--val", f"{prefix}.val.bin", "--target", args.target,
                      "--fc", "mp,pfc", "--sample-ratio", "1.0,0.1",
                      "--precision", "fp32,bf16", "--devices", args.devices,
                      "--batch-size", args.batch_size, "--max-steps", args.max_steps,
                      "--eval-every", args.eval_every, "--runs", args.runs,
                      "--loader-workers", "1", "--device", args.device, "--out", str(out)])
    # The data and checkpoints are rebuilt by the command above; the results need neither.
    shutil.rmtree(data, ignore_errors=True)
    for ckpt in out.glob("*/runs/*/checkpoints"):
        shutil.rmtree(ckpt, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
