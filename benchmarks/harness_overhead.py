"""How much the measuring harness adds to a bare training loop of the same step.

Two measurements. Both loops run the same TrainStep in one process, interleaved (bare, harness,
bare, ...), so drift in machine speed hits both alike; on a noisy machine their ratio cannot
resolve a sub-1% effect. So the harness's own work per step is also timed around a trivial step,
over thousands of iterations, and given as a fraction of the real step. The harness loop is the worker's: per-step timer marks
and one JSON line per step appended to an events file. The result goes to
benchmarks/results/harness_overhead-<device>.json.

    python benchmarks/harness_overhead.py [--recipe tiny-arcface] [--device cpu] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainperf.backends.torch.data import synthetic_batch
from trainperf.backends.torch.dist import DistContext, resolve_device
from trainperf.backends.torch.env import framework_env
from trainperf.backends.torch.step import TrainStep
from trainperf.backends.torch.timing import make_timer, timed_loop
from trainperf.protocol import EventWriter, Step
from trainperf.recipes import get_recipe


def synchronize(device) -> None:
    make_timer(device).sync()


def bare(step, images, labels, steps: int, device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(images, labels)
    synchronize(device)
    return (time.perf_counter() - t0) / steps


def harness(step, images, labels, steps: int, device, events: EventWriter) -> float:
    def on_steps(done):
        for index, seconds in done:
            events.emit(Step(index=index, seconds=seconds, samples=images.shape[0],
                             warmup=False))

    window_s, _ = timed_loop(lambda: step(images, labels), steps + 1, 1, make_timer(device),
                             on_steps)
    return window_s / steps


def harness_cost_per_step(device, events: EventWriter, steps: int = 3000) -> float:
    """The harness's own work per step (timer mark, drain, one JSON line), measured around a
    trivial step so that the training step's noise does not hide it."""
    trivial = torch.zeros((), device=device)

    def loop_bare() -> float:
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            trivial.add_(1)
        synchronize(device)
        return time.perf_counter() - t0

    def on_steps(done):
        for index, seconds in done:
            events.emit(Step(index=index, seconds=seconds, samples=1, warmup=False))

    bare_s = min(loop_bare() for _ in range(3))
    harness_s = min(timed_loop(lambda: trivial.add_(1), steps + 1, 1, make_timer(device),
                               on_steps)[0] for _ in range(3))
    return (harness_s - bare_s) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tiny-arcface")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    device = resolve_device(args.device)
    workload = get_recipe(args.recipe).workload
    if args.batch_size:
        workload = workload.replace(batch_size=args.batch_size)
    ctx = DistContext(device=device)
    step = TrainStep(workload, ctx)
    images, labels = synthetic_batch(workload, ctx)
    bare(step, images, labels, 10, device)  # warm up: allocator, kernels, autotuning
    with tempfile.TemporaryDirectory() as tmp:
        events = EventWriter(os.path.join(tmp, "events.jsonl"), 0)
        bare_s, harness_s = [], []
        for _ in range(args.repeats):
            bare_s.append(bare(step, images, labels, args.steps, device))
            harness_s.append(harness(step, images, labels, args.steps, device, events))
        cost_s = harness_cost_per_step(device, events)
    ratio = statistics.median(harness_s) / statistics.median(bare_s)
    pairwise = [h / b for h, b in zip(harness_s, bare_s)]
    result = {
        "recipe": args.recipe, "batch_size": workload.batch_size, "steps": args.steps,
        "repeats": args.repeats, "device": str(device),
        "bare_step_s_median": statistics.median(bare_s),
        "harness_step_s_median": statistics.median(harness_s),
        "overhead_ratio": ratio,
        "harness_cost_per_step_s": cost_s,
        "harness_cost_fraction_of_step": cost_s / statistics.median(bare_s),
        "pairwise_ratio_min_median_max": [min(pairwise), statistics.median(pairwise),
                                          max(pairwise)],
        "bare_step_s": bare_s, "harness_step_s": harness_s,
        "env": {**framework_env(device), "host": platform.node(),
                "cpu_threads": torch.get_num_threads()},
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    out = Path(__file__).parent / "results" / f"harness_overhead-{device.type}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"bare {result['bare_step_s_median'] * 1e3:.2f} ms/step, harness "
          f"{result['harness_step_s_median'] * 1e3:.2f} ms/step, ratio {ratio:.4f} "
          f"(pairwise median {result['pairwise_ratio_min_median_max'][1]:.4f}); harness's own "
          f"work {cost_s * 1e6:.1f} us/step = {100 * result['harness_cost_fraction_of_step']:.3f}% "
          f"of a step -> {out}")


if __name__ == "__main__":
    main()
