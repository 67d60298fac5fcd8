#!/bin/bash
# What node 0's link probes cost a 2-node run: torch mp on tiny-arcface (20,000 classes, batch
# 8) on 2 emulated nodes at RATE, three rounds each alternating BEFORE's probes (a checkout's
# src/, e.g. `git archive a25a405 src | tar -x -C /tmp/before`: 1 MiB about once a second, up
# to 5% of the link) and this checkout's. Needs root (trainperf emulate).
#
#   benchmarks/link_probe_cost.sh BEFORE_CHECKOUT [RATE] [OUT]
set -euo pipefail
before=$(realpath "$1"); rate=${2:-50mbit}
here=$(cd "$(dirname "$0")/.." && pwd)
out=${3:-$here/benchmarks/results/emulated-cpu/link_probe_cost}
rm -rf "$out"; mkdir -p "$out"
for k in 1 2 3; do
  for v in before after; do
    src=$here/src; [ $v = before ] && src=$before/src
    PYTHONPATH=$src python -m trainperf.cli emulate --nodes 2 --rate "$rate" -- run tiny-arcface \
      --batch-size 8 --num-classes 20000 --fc mp --runs 1 --iters 25 --warmup 5 --device cpu \
      --out "$out/$v-$k" > "$out/$v-$k.log" 2>&1
  done
done
python - "$out" "$rate" <<'PY'
import json, statistics, sys
from pathlib import Path
out, rate = Path(sys.argv[1]), sys.argv[2]
lines = [f"# Link probes' cost at {rate} (benchmarks/link_probe_cost.sh)", "",
         "| probes | round | samples/s | probes of node 1's link (steps, seconds) |",
         "|---|---|---:|---|"]
median = {}
for v in ("before", "after"):
    sps = []
    for k in (1, 2, 3):
        doc = json.loads((out / f"{v}-{k}" / "node-0" / "results.json").read_text())
        (case,) = [c for c in doc["cases"] if c["case"] == "2n1g"]
        sps.append(case["median_samples_per_s"])
        probes = case["runs"][0].get("link_probes", {}).get("1", [])
        lines.append(f"| {v} | {k} | {sps[-1]:.2f} | {probes} |")
    median[v] = statistics.median(sps)
lines += ["", f"Medians: before {median['before']:.2f}, after {median['after']:.2f} samples/s "
          f"({(median['after'] / median['before'] - 1) * 100:+.1f}%).", ""]
(out / "README.md").write_text("\n".join(lines))
print("\n".join(lines))
PY
# Of each run, its results and logs are kept.
find "$out" -mindepth 2 -maxdepth 3 -name runs -type d -exec rm -rf {} +
find "$out" -mindepth 2 \( -name "*.png" -o -name events.jsonl -o -name plan.json \
  -o -name report.md \) -delete
