"""Frameworks side by side: torch, MXNet, Paddle, JAX, TensorFlow and OneFlow on the same
recipes, 1 and 2 ranks.

Each case is one ``trainperf run --framework A,B,...`` (the frameworks whose backend runs its
heads and backbone) into benchmarks/results/framework_compare-<device>/<case folder>/, whose
report.md holds the comparison table (samples/s per framework, speedups, each framework's ratio
to torch). Sizes default to what a 2-core CPU finishes in minutes; on a GPU pass the recipes'
own batch sizes.

    python benchmarks/framework_compare.py [--device cpu] [--runs 3] [--iters 12] [--warmup 4]
        [--frameworks torch,mxnet,paddle,jax,tf,oneflow] [--case tiny-arcface:dp:8] ...
        [--data PREFIX] [--breakdown [--fabric COMMBENCH.json]]
    python benchmarks/framework_compare.py --readme-table FOLDER

A case is RECIPE:FC:BATCH[:CLASSES]; FC and CLASSES may be lists (``mp,pfc``,
``1000,1000000``), which ``run`` sweeps, and the report then plots speed and memory against
the number of classes. ``--data`` trains every case on a RecordIO dataset beside its synthetic
twin (the case's folder gets ``-real``). ``--breakdown`` adds each case's profiled run
(``run --breakdown``) and writes into benchmarks/results/breakdown-<device>/ by default: the
report then says, per framework and device count, where the step's time goes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from trainperf import results
from trainperf.backends import get_backend
from trainperf.cli import main as trainperf

CPU_CASES = ["tiny-arcface:dp:8", "tiny-arcface:mp:8", "tiny-arcface:pfc:8",
             "r50-arcface-plsc:mp:4", "rn50-v1b-imagenet:dp:2"]
FRAMEWORKS = "torch,mxnet,paddle,jax,tf,oneflow"


def runs_case(framework: str, recipe: str, fc: str) -> bool:
    from trainperf.recipes import get_recipe

    backend = get_backend(framework)
    return (all(f in backend.capabilities.heads for f in fc.split(","))
            and backend.model_refusal(get_recipe(recipe).workload) is None)


def case_folder(recipe: str, fc: str, classes: list[str], real: bool) -> str:
    parts = [recipe, fc.replace(",", "+")]
    if classes:
        parts.append("c" + classes[0].replace(",", "+"))
    if real:
        parts.append("real")
    return "-".join(parts)


def readme_table(folder: Path) -> str:
    """The README's sample table from a case's record (``folder``: one folder per framework):
    each framework's median samples/s per layout, with the execution mode it ran in."""
    from trainperf.report.markdown import fmt, framework_name, table

    docs = [results.load(p) for p in sorted(folder.glob("*/results.json"),
                                            key=lambda p: FRAMEWORKS.split(",").index(
                                                p.parent.name))]
    keys = sorted({(c["nodes"], c["world_size"], c["batch_size_per_device"])
                   for d in docs for c in d["cases"]}, key=lambda k: (k[2], k[1], k[0]))
    rows = []
    for key in keys:
        row = [str(k) for k in key]
        for d in docs:
            c = next((c for c in d["cases"] if (c["nodes"], c["world_size"],
                                                c["batch_size_per_device"]) == key), None)
            row.append(f"{fmt(c['median_samples_per_s'])} ({c.get('mode') or '-'})" if c
                       else "-")
        rows.append(row)
    return table(["node_num", "gpu_num", "batch/device", *(framework_name(d) for d in docs)],
                 rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", default="1,2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--frameworks", default=FRAMEWORKS)
    parser.add_argument("--case", action="append", help="RECIPE:FC:BATCH[:CLASSES]")
    parser.add_argument("--data", help="PREFIX of a RecordIO dataset: every case on real data")
    parser.add_argument("--breakdown", action="store_true",
                        help="one profiled run per case after its timed runs")
    parser.add_argument("--breakdown-steps", default="6")
    parser.add_argument("--fabric", help="commbench.json the exposed communication is set "
                                         "against (with --breakdown)")
    parser.add_argument("--out", help="default benchmarks/results/framework_compare-<device> "
                                      "(breakdown-<device> with --breakdown)")
    parser.add_argument("--readme-table", metavar="FOLDER",
                        help="print the README's sample table from a case's record and stop")
    args = parser.parse_args()
    if args.readme_table:
        print(readme_table(Path(args.readme_table)))
        return 0
    kind = "breakdown" if args.breakdown else "framework_compare"
    out = Path(args.out or Path(__file__).parent / "results" / f"{kind}-{args.device}")
    summary = {}
    for case in args.case or CPU_CASES:
        recipe, fc, batch, *classes = case.split(":")
        names = [n for n in args.frameworks.split(",") if runs_case(n, recipe, fc)]
        folder = out / case_folder(recipe, fc, classes, bool(args.data))
        shutil.rmtree(folder, ignore_errors=True)
        argv = ["run", recipe, "--framework", ",".join(names), "--devices", args.devices,
                "--device", args.device, "--fc", fc, "--batch-size", batch,
                "--runs", str(args.runs), "--iters", str(args.iters),
                "--warmup", str(args.warmup), "--out", str(folder)]
        if classes:
            argv += ["--num-classes", classes[0]]
        if args.data:
            argv += ["--data", args.data]
        if args.breakdown:
            argv += ["--breakdown", "--breakdown-steps", args.breakdown_steps]
            if args.fabric:
                argv += ["--fabric", args.fabric]
        print("trainperf " + " ".join(argv), file=sys.stderr, flush=True)
        trainperf(argv)
        # Per-run specs and worker logs stay out of the record; results and events remain.
        for runs in sorted(folder.rglob("runs"), reverse=True):
            shutil.rmtree(runs, ignore_errors=True)
        summary[case] = {
            str(doc.parent.relative_to(folder)): {
                f"c{c.get('num_classes')} {c.get('fc')} {c['case']}": (
                    c["median_samples_per_s"] if not args.breakdown else
                    {"samples_per_s": c["median_samples_per_s"],
                     "phases_s": (c.get("breakdown") or {}).get("phases_s")})
                for c in results.load(doc.parent)["cases"]}
            for doc in sorted(folder.rglob("results.json"))}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
