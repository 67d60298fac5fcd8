"""The memory model's GPU constants, fitted to a GPU record, and the model's error per
precision before and after (``trainperf.gpucheck.memfit``). Reads only what the record holds;
writes ``memory_model.json`` and ``memory_model.md`` into the record's folder.

    python benchmarks/memory_model_gpu.py benchmarks/results/gpu-h200-2026-11-26
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainperf.gpucheck import memfit


def by_precision(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        group = "fp32" if r["precision"] == "fp32" else "fp16/bf16"
        if r["backbone"].startswith(memfit.DEPTHWISE):
            group += " (depthwise)"
        out.setdefault(group, []).append(abs(r["error"]))
    return {g: {"points": len(v), "mean_abs_error": sum(v) / len(v), "max_abs_error": max(v)}
            for g, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("record", type=Path)
    args = p.parse_args()
    fitted = memfit.fit_record(args.record)
    points = fitted.pop("points")
    old = memfit.errors(points, lambda _: memfit.OLD)
    new = memfit.errors(points, memfit.committed)
    doc = {**fitted, "old": by_precision(old), "new": by_precision(new),
           "rows": [{**n, "old_predicted": o["predicted"], "old_error": o["error"]}
                    for o, n in zip(old, new)]}
    (args.record / "memory_model.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# The memory model on this record's peaks", "",
             f"Fitted: backward factor {fitted['backward_factor']} from "
             f"{fitted['half_points']} fp16/bf16 peaks; fp32 workspace "
             f"{fitted['workspace_bytes'] / 2**30:.2f} GiB + "
             f"{fitted['workspace_per_activation']:.3f} of the activations from "
             f"{fitted['fp32_points_fitted']} fp32 peaks.", "",
             "| precision | points | mean error, CPU constants | mean error, GPU constants "
             "| largest |", "|---|---|---|---|---|"]
    for group, n in doc["new"].items():
        o = doc["old"][group]
        lines.append(f"| {group} | {n['points']} | {100 * o['mean_abs_error']:.1f}% | "
                     f"{100 * n['mean_abs_error']:.1f}% | {100 * n['max_abs_error']:.1f}% |")
    lines += ["", "| run | backbone | precision | batch | peak GiB | model GiB | error | "
              "before |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['where']} | {r['backbone']} | {r['precision']} | {r['batch']} | "
                     f"{r['peak'] / 2**30:.2f} | {r['predicted'] / 2**30:.2f} | "
                     f"{100 * r['error']:+.1f}% | {100 * r['old_error']:+.1f}% |")
    (args.record / "memory_model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))


if __name__ == "__main__":
    main()
