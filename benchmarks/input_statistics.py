"""Does the step's speed depend on what the pixels hold? One process, one TrainStep, batches of
three kinds taking turns step by step (so a slow spell of the machine falls on all alike):

- ``noise``: the synthetic twin's batch (per-pixel standard normal, what ``run`` uses);
- ``smooth noise``: the same noise box-filtered 9 x 9, scaled and clipped to [-1, 1];
- ``real``: synthetic-face JPEGs through the input pipeline (decoded beforehand, so the loader
  costs nothing here).

    python benchmarks/input_statistics.py [--recipe tiny-arcface] [--batch-size 32]
        [--steps 150] [--repeats 3] [--out benchmarks/results/input_statistics-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from trainperf.backends.torch.data import synthetic_batch
from trainperf.backends.torch.dist import DistContext
from trainperf.backends.torch.step import TrainStep
from trainperf.config import Tuning
from trainperf.data.pipeline import open_feed
from trainperf.data.synth import synthesize
from trainperf.env import host_env
from trainperf.recipes import get_recipe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="tiny-arcface")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=150, help="steps per repeat, all kinds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/input_statistics-cpu.json")
    args = parser.parse_args()
    workload = get_recipe(args.recipe).workload.replace(batch_size=args.batch_size)
    ctx = DistContext()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "faces")
        synthesize(prefix, 100, 10)
        feed, _ = open_feed(prefix, task=workload.task, size=workload.input_size,
                            num_classes=workload.num_classes, batch_size=args.batch_size,
                            rank=0, world=1, local_world=1, seed=0, device=ctx.device,
                            workers=0)
        real = [next(feed) for _ in range(4)]
        feed.close()
    noise = synthetic_batch(workload, ctx)
    smooth = ((torch.nn.functional.avg_pool2d(noise[0], 9, 1, 4) * 3).clamp(-1, 1), noise[1])
    kinds = {"noise": [noise], "smooth noise": [smooth], "real": real}
    rows = []
    for repeat in range(args.repeats):
        step = TrainStep(workload, ctx, Tuning())
        for _ in range(5):
            step(*noise)
        seconds = {k: 0.0 for k in kinds}
        steps = {k: 0 for k in kinds}
        for i in range(args.steps):
            name = list(kinds)[i % len(kinds)]
            batch = kinds[name][(i // len(kinds)) % len(kinds[name])]
            begin = time.perf_counter()
            step(*batch)
            seconds[name] += time.perf_counter() - begin
            steps[name] += 1
        rates = {k: steps[k] * args.batch_size / seconds[k] for k in kinds}
        rows.append(rates)
        print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items())
              + " samples/s")
    doc = {"recipe": args.recipe, "batch_size": args.batch_size, "steps": args.steps,
           "threads": torch.get_num_threads(), "env": host_env(), "samples_per_s": rows,
           "ratio_to_noise": [{k: r[k] / r["noise"] for k in r} for r in rows]}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
