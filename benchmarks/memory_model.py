"""The memory model against measured peaks, across batch sizes and class counts (CPU or GPU).

Each point is a real `trainperf run` (1 run, a few steps) of a recipe; the table compares the
model's prediction with the measured peak, both net of the process baseline (on the CPU, the
interpreter and libraries' resident memory before the model is built). Writes
benchmarks/results/memory_model-<device>.json.

    python benchmarks/memory_model.py [--recipe tiny-arcface] [--device cpu] [--devices 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from trainperf import results
from trainperf.cli import main as trainperf

POINTS_CPU = {"batch": [8, 32, 96], "classes": [1000, 200_000, 1_000_000],
              "fc": ["mp", "pfc"]}


def measure_point(recipe: str, device: str, devices: int, batch: int, classes: int, fc: str,
                  tmp: Path) -> dict:
    out = tmp / f"b{batch}_c{classes}_{fc}_{devices}"
    rc = trainperf(["run", recipe, "--device", device, "--devices", str(devices),
                    "--batch-size", str(batch), "--num-classes", str(classes), "--fc", fc,
                    "--runs", "1", "--iters", "4", "--warmup", "1", "--out", str(out)])
    run = results.load(out)["cases"][0]["runs"][0]
    base = run["baseline_memory_bytes"] or 0
    measured = run["peak_memory_bytes"] - base if run["peak_memory_bytes"] else None
    predicted = run["predicted_peak_bytes"] - base
    return {"batch": batch, "num_classes": classes, "fc": fc, "devices": devices,
            "status": run["status"], "exit": rc, "baseline_bytes": base,
            "measured_net_bytes": measured, "predicted_net_bytes": predicted,
            "error": (predicted - measured) / measured if measured else None,
            "error_of_total_peak": (run["predicted_peak_bytes"] - run["peak_memory_bytes"])
            / run["peak_memory_bytes"] if run["peak_memory_bytes"] else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="tiny-arcface")
    p.add_argument("--device", default="cpu")
    p.add_argument("--devices", type=int, default=1)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch, classes, fc in itertools.product(*POINTS_CPU.values()):
            row = measure_point(args.recipe, args.device, args.devices, batch, classes, fc,
                                Path(tmp))
            rows.append(row)
            print(f"b{batch:<4} c{classes:<8} {fc:<4} measured {row['measured_net_bytes'] / 2**20:8.1f}"
                  f" MiB  predicted {row['predicted_net_bytes'] / 2**20:8.1f} MiB  "
                  f"error {100 * row['error']:+.1f}%", flush=True)
    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    summary = {"recipe": args.recipe, "device": args.device, "devices": args.devices,
               "max_abs_error": max(errors),
               "max_abs_error_of_total_peak": max(abs(r["error_of_total_peak"]) for r in rows
                                                  if r["error_of_total_peak"] is not None),
               "within_25_percent": sum(e <= 0.25 for e in errors), "points": rows,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out = Path(__file__).parent / "results" / f"memory_model-{args.device}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"max |error| {100 * max(errors):.1f}% over {len(errors)} points -> {out}")


if __name__ == "__main__":
    main()
