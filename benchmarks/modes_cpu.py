"""Every framework in every execution mode it declares on this CPU, on 1 and 2 ranks, and the
choice ``--mode best`` makes from its probe.

    python benchmarks/modes_cpu.py [--frameworks torch,oneflow,...]
        [--cases tiny,tiny-pfc,rn50,face,r100]
        [--out benchmarks/results/modes-cpu]

Each (framework, case) is one ``trainperf run --mode best --devices 1,2``: one probe of the modes
both rank counts can run, on the 1-rank case, in two rounds of opposite order
(``trainperf.mode_choice``), and both cases timed in its choice. The cases (``CASES``) are
small enough for 2 cores. Each framework's folders are kept under OUT/runs/, and
OUT/modes.json and OUT/modes.md gather every probe, choice and timed figure; a framework run
again is measured afresh and replaces its own rows only, so the record can be made one
framework at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from trainperf.backends import BACKENDS
from trainperf.config import Measure, Topology, Tuning
from trainperf.env import cpu_model
from trainperf.plans import run_plans, throughput_plans

HERE = Path(__file__).resolve().parent
CASES = {
    "tiny": ("tiny-arcface", {}, 8),
    "tiny-pfc": ("tiny-arcface", {"fc": "pfc", "sample_ratio": 0.1}, 8),
    "rn50": ("rn50-v1b-imagenet", {"input_size": 64}, 4),
    "face": ("r50-arcface-plsc", {"num_classes": 1000}, 2),
    "r100": ("r100-arcface-emore", {"num_classes": 1000}, 2),
}
"""Name -> (recipe, workload changes, batch per rank): the tiny recipe (its dp head, and Partial
FC at 0.1), ResNet50 v1b at 64x64, and the face step at 112x112 with 1,000 classes, in PLSC's
IResNet-50 and in IResNet-100."""
MEASURE = Measure(runs=1, iters=10, warmup=3, timeout_s=900)
"""One timed run per case: each mode's two probe rounds are the comparison between modes; the
timed run is the figure in the chosen one."""


def measure_one(framework: str, case: str, out: Path) -> list[dict]:
    """The framework's plan of the case on 1 and 2 ranks under ``--mode best``: one probe (on
    the 1-rank case, over the modes both cases can run) and both cases timed in its choice.
    Where the plan left out a mode that the 1-rank case can run (one refused on 2 ranks), a
    plan of the 1-rank case alone follows, so that every mode the framework runs on a CPU is
    probed once. A row per case of each plan: the probe's rounds, the choice, the timed
    figure and the start-up and compile seconds, with the machine's load before and after."""
    rows = plan_rows(framework, case, out, [1, 2])
    if any(not why.startswith(f"{r['probe_case']}:")
           for r in rows if isinstance(r.get("refused"), dict) for why in r["refused"].values()):
        rows += plan_rows(framework, case, out, [1])
    return rows


def plan_rows(framework: str, case: str, out: Path, ranks: list[int]) -> list[dict]:
    recipe, changes, batch = CASES[case]
    suffix = "" if ranks == [1, 2] else "-" + "-".join(map(str, ranks)) + "rank"
    folder = out / "runs" / f"{framework}-{case}{suffix}"
    # Measured afresh: the runner would resume a finished plan, and its rows would then carry
    # today's load beside another day's figures.
    shutil.rmtree(folder, ignore_errors=True)
    plans = throughput_plans(recipe, changes, [batch], ranks, MEASURE, Tuning(),
                             Topology(device="cpu"), [framework], folder, modes=["best"])
    load_before = os.getloadavg()
    try:
        docs = run_plans(plans, resume=(folder / "events.jsonl").exists())
    except ValueError as exc:
        return [{"framework": framework, "case": case, "refused": str(exc).splitlines()[0]}]
    load_after = os.getloadavg()
    probe = docs[0].get("mode_probe") or {}
    rows = []
    for c in docs[0]["cases"]:
        runs = c["runs"]
        rows.append({
            "framework": framework, "case": case, "plan_ranks": ranks,
            "ranks": c["world_size"], "batch": batch,
            "modes": probe.get("modes"), "probe_case": probe.get("case"),
            "probe_rates": probe.get("rates"), "probe_medians": probe.get("medians"),
            "probe_rounds": probe.get("rounds"), "probe_wall_s": probe.get("wall_s"),
            "refused": probe.get("refused"), "unclean": probe.get("unclean"),
            "chosen": probe.get("chosen"), "why": probe.get("why"),
            "runner_up": probe.get("runner_up"), "margin": probe.get("margin"),
            "samples_per_s": c.get("median_samples_per_s"), "mode_ran": c.get("mode"),
            "speedup": c.get("speedup"),
            "startup_s": c.get("startup_s"), "compile_s": c.get("compile_s"),
            "compile_measure": next((r.get("compile_measure") for r in runs
                                     if r.get("compile_measure")), None),
            "first_step_excess_s": c.get("first_step_excess_s"),
            "status": [r["status"] for r in runs],
            "error": next((r["error"] for r in runs if r.get("error")), None),
            "load_1min_before": load_before[0], "load_1min_after": load_after[0],
            "folder": str(folder.relative_to(out))})
    for runs in folder.rglob("runs"):  # per-run specs and logs stay out of the record
        shutil.rmtree(runs, ignore_errors=True)
    return rows


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(doc: dict) -> str:
    lines = [f"# Execution modes on {doc['machine']}", "",
             f"Every mode each framework declares on this CPU, probed by `--mode best`: one "
             f"probe per plan, on its 1-rank case, over the modes both rank counts can run, two "
             f"rounds of opposite order, each timing {doc['probe']} steps from one step after "
             f"its compile count stopped moving; both rank counts are then timed in the chosen "
             f"mode ({doc['measure']}). Where a mode could not run on 2 ranks, a plan of the "
             f"1-rank case alone follows (plan's ranks 1) and probes it. Samples/s; threads: the "
             f"node's cores shared among the ranks. Load: the 1-minute load average before and "
             f"after each plan (on 2 cores the runs' own processes hold it near 2).", "",
             "| framework | case | plan's ranks | ranks | probe medians (samples/s) | chosen | "
             "why | timed samples/s | speedup | start-up s | compile s | first-step excess s | "
             "load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if "ranks" not in r:
            lines.append(f"| {r['framework']} | {r['case']} | - | - | - | - | {r['refused']} | "
                         "- | - | - | - | - | - |")
            continue
        medians = ", ".join(f"{m} {v:.2f}" for m, v in (r["probe_medians"] or {}).items())
        # The refused modes are in the probe's own words already; what failed a round is not.
        extra = "; ".join(f"{m}: {why}" for m, why in (r.get("unclean") or {}).items())
        rate = _num(r["samples_per_s"], 2) if r["samples_per_s"] else (r["error"] or "-")
        why = f"{r['why']} ({extra})" if extra else r["why"]
        if r["ranks"] > 1:
            medians, why = "(the 1-rank probe's)", "as the 1-rank case"
        plan = ",".join(map(str, r.get("plan_ranks") or [1, 2]))
        lines.append(f"| {r['framework']} | {r['case']} | {plan} | {r['ranks']} | "
                     f"{medians or '-'} | "
                     f"{r['chosen']} | {why} | {rate} | {_num(r.get('speedup'), 2)} | "
                     f"{_num(r['startup_s'], 1)} | {_num(r['compile_s'], 2)} | "
                     f"{_num(r.get('first_step_excess_s'), 2)} | "
                     f"{r.get('load_1min_before', 0):.1f}-{r.get('load_1min_after', 0):.1f} |")
    lines += ["", "Every probe's rounds and each run's folder: `modes.json`.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", default=",".join(BACKENDS))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--out", default=str(HERE / "results" / "modes-cpu"))
    a = p.parse_args(argv)
    frameworks = [f for f in a.frameworks.split(",") if f]
    cases = [c for c in a.cases.split(",") if c]
    unknown = [f for f in frameworks if f not in BACKENDS] + [c for c in cases if c not in CASES]
    if unknown:
        p.error(f"unknown framework or case: {', '.join(unknown)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "modes.json"
    doc = json.loads(path.read_text()) if path.exists() else {"rows": []}
    from trainperf.mode_choice import probe_shape

    doc.update(machine=cpu_model(), cpus=os.cpu_count(),
               probe=probe_shape(MEASURE.warmup, MEASURE.window_steps)[1],
               measure=f"{MEASURE.runs} run of {MEASURE.iters} steps, {MEASURE.warmup} not "
                       "counted")
    for framework in frameworks:
        for case in cases:
            print(f"{framework} {case} ...", file=sys.stderr, flush=True)
            rows = measure_one(framework, case, out)
            doc["rows"] = [r for r in doc["rows"]
                           if (r["framework"], r["case"]) != (framework, case)] + rows
            doc["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            path.write_text(json.dumps(doc, indent=1))
            (out / "modes.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
