"""The input pipeline on this machine: loader images/s per decoder and worker count, and
real-data against synthetic (compute-only) training throughput.

1. Writes two datasets under the output folder: synthetic faces (112 x 112, insightface's
   layout) and ImageNet-sized photos-like images (500 x 375, im2rec's flat layout).
2. ``trainperf data bench`` on each, every installed decoder, the worker counts asked for.
3. ``trainperf run RECIPE --data faces`` for each loader-worker count asked for (and DALI with
   one thread where it is importable): every run folder holds the real-data results, the
   synthetic twin, and a report with the verdict.

DALI is found where it is installed, or through ``PYTHONPATH`` (the test suite keeps a copy in
``~/.cache/trainperf/envs/dali-site``).

    python benchmarks/input_pipeline.py [--workers 0,1,2] [--run-workers 0,1]
        [--recipe tiny-arcface] [--device cpu] [--runs 3] [--iters 40] [--warmup 10]
        [--out benchmarks/results/input_pipeline-cpu]
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from trainperf.cli import main as trainperf
from trainperf.data import dali_feed
from trainperf.data.recordio import IRHeader, RecordWriter, pack


def photos(prefix: Path, count: int, classes: int, seed: int = 0) -> None:
    """``count`` 500 x 375 JPEGs (smooth colour fields with noise, about a photo's size on
    disk), flat layout, labels round robin."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:375, 0:500].astype(np.float32)
    with RecordWriter(prefix) as writer:
        for key in range(count):
            f = rng.uniform(0.005, 0.05, size=(3, 2))
            phase = rng.uniform(0, 6.3, size=3)
            chans = [127 + 100 * np.sin(f[c, 0] * xx + f[c, 1] * yy + phase[c]) for c in range(3)]
            img = np.stack(chans, -1) + rng.normal(0, 12, size=(375, 500, 3))
            buf = io.BytesIO()
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
            writer.write(key, pack(IRHeader(0, float(key % classes), key, 0), buf.getvalue()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="0,1,2", help="data bench loader processes")
    parser.add_argument("--run-workers", default="0,1",
                        help="loader processes per rank of the training runs")
    parser.add_argument("--recipe", default="tiny-arcface")
    parser.add_argument("--batch-size", default="32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", default="3")
    parser.add_argument("--iters", default="40")
    parser.add_argument("--warmup", default="10")
    parser.add_argument("--out", default="benchmarks/results/input_pipeline-cpu")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    data = out / "datasets"  # rebuilt by this script; not kept with the results
    began = time.time()
    faces = data / "faces"
    trainperf(["data", "synth", "--identities", "200", "--images-per-identity", "20",
               "--out", str(faces)])
    photos(data / "photos", 600, 100)
    codes = [trainperf(["data", "bench", str(faces), "--decoder", "all", "--workers",
                        args.workers, "--recipe", "r100-arcface-emore", "--batches", "40",
                        "--out", str(out / "bench-faces")]),
             trainperf(["data", "bench", str(data / "photos"), "--decoder", "all", "--workers",
                        args.workers, "--recipe", "rn50-v1b-imagenet", "--batch-size", "32",
                        "--batches", "15", "--out", str(out / "bench-photos")])]
    runs = [("auto", n) for n in args.run_workers.split(",")]
    if dali_feed.available():
        runs.append(("dali", "1"))
    for decoder, n in runs:
        name = f"run-w{n}" if decoder == "auto" else f"run-{decoder}-w{n}"
        codes.append(trainperf([
            "run", args.recipe, "--data", str(faces), "--decoder", decoder,
            "--loader-workers", n, "--batch-size", args.batch_size, "--device", args.device,
            "--runs", args.runs, "--iters", args.iters, "--warmup", args.warmup,
            "--out", str(out / name)]))
    shutil.rmtree(data)
    print(f"input_pipeline: {time.time() - began:.0f} s, exit codes {codes}", file=sys.stderr)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
