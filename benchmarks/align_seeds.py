"""Every framework aligned with torch in float64 at the seeds' sizes: the full R100 with its E
block, Y1 with GDC, PLSC's R50 and ResNet50 v1b, at a small batch and with fewer classes (the
head's rule does not depend on how many rows it has), in every head mode the framework runs
(dp and mp on 1 and 2 ranks, pfc at ratio 1.0), a few steps each.

Each (recipe, framework) is one ``trainperf align`` into
benchmarks/results/align-<date>/<recipe>/<framework>/ (its ``align.json`` and the printed
``align.md``; start files, dumps and run folders are removed, being large). torch's side runs
again for each framework: kept for all of them, a full R100's dumps would take tens of GB.
``README.md`` there holds one table per recipe.

    python benchmarks/align_seeds.py [--frameworks mxnet,paddle,jax,tf,oneflow]
        [--recipes r100-arcface-emore,...] [--batch-size 4] [--num-classes 1000] [--steps 3]
        [--devices 1,2] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
import time
from pathlib import Path

from trainperf import align
from trainperf.backends import catalog, get_backend
from trainperf.cli import main as trainperf
from trainperf.recipes import get_recipe

RECIPES = "r100-arcface-emore,y1-arcface-emore,r50-arcface-plsc,rn50-v1b-imagenet"
FRAMEWORKS = "mxnet,paddle,jax,tf,oneflow"


def why_not(framework: str, recipe: str) -> str | None:
    """Why ``framework`` does not build the recipe's model, or None."""
    backend = get_backend(framework)
    workload = get_recipe(recipe).workload
    try:
        catalog.lookup(workload.backbone, backend.capabilities.families, framework)
    except ValueError as exc:
        return str(exc)
    if backend.cannot_run:
        return backend.cannot_run
    return None


def heads(framework: str, recipe: str) -> list[str]:
    if get_recipe(recipe).workload.task == "classification":
        return ["dp"]
    return [fc for fc in ("dp", "mp", "pfc") if fc in get_backend(framework).capabilities.heads]


def check(recipe: str, framework: str, args, folder: Path) -> dict:
    argv = ["align", recipe, "--framework", framework, "--devices", args.devices,
            "--fc", ",".join(heads(framework, recipe)), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--dtype", "float64",
            "--timeout", str(args.timeout), "--out", str(folder)]
    if get_recipe(recipe).workload.task == "face":
        argv += ["--num-classes", str(args.num_classes)]
    print("trainperf " + " ".join(argv), file=sys.stderr, flush=True)
    started = time.monotonic()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = trainperf(argv)
    seconds = time.monotonic() - started
    (folder / "align.md").write_text(printed.getvalue(), encoding="utf-8")
    for big in ("start.npz", "start-witness.npz", "runs"):
        path = folder / big
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    outcome = json.loads((folder / "align.json").read_text(encoding="utf-8"))
    return {"exit": code, "seconds": seconds, "outcome": outcome, "argv": argv}


def _e(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def table(recipe: str, rows: dict[str, dict], skipped: dict[str, str]) -> list[str]:
    lines = [f"## {recipe}", "", "| framework | head | ranks | tensors | worst update (tensor, "
             "step) | worst start | worst loss | worst grad norm | largest tolerance | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, got in rows.items():
        for c in got["outcome"]["checks"]:
            w = c.get("worst_update") or {}
            s = c.get("worst_scalar") or {}
            lines.append(
                f"| {label} {got['outcome']['versions'].get(got['outcome']['framework'])} "
                f"| {c['fc']} "
                f"| {c['ranks']} | {c.get('tensors_compared', 0)} | "
                f"{_e(w.get('error'))} `{w.get('tensor')}` ({w.get('step')}) | "
                f"{_e((c.get('worst_start') or {}).get('error'))} | "
                f"{_e((s.get('loss') or {}).get('error'))} | "
                f"{_e((s.get('grad_norm') or {}).get('error'))} | "
                f"{_e(max(c.get('tolerance_by_step') or [None], key=lambda v: v or 0))} | "
                f"{'aligned' if c['aligned'] else '; '.join(c['problems'])[:300]} |")
    for framework, why in skipped.items():
        lines.append(f"| {framework} | - | - | - | - | - | - | - | - | not built: {why} |")
    lines += ["", "Times: " + ", ".join(f"{label} {got['seconds'] / 60:.1f} min"
                                       for label, got in rows.items()), ""]
    return lines


def write_readme(out: Path, calls: list[str], sections: list[str]) -> None:
    head = [f"# Alignment with torch at the seeds' sizes ({time.strftime('%Y-%m-%d')})", "",
            "Made by these calls, in order (later ones replace a (recipe, framework) that an "
            "earlier one checked):", ""]
    head += [f"    python benchmarks/align_seeds.py {c}" for c in calls]
    head += ["", "float64 on both sides, the recipe's rule (dropout off, the rate's first step "
             "moved to the middle of the steps), a small batch per rank and, for the face "
             f"recipes, fewer classes. Tolerance: {align.FLOAT64.update:g} on every tensor's "
             f"update, {align.FLOAT64.scalar:g} on the loss, the gradient norm and the rate, "
             "raised per step where the rounding witness shows more. Each row is one (head, "
             "ranks) pair of one `trainperf align`; its folder holds align.json (with the "
             "exact command in summary.json) and the printed tables (align.md).", ""]
    (out / "README.md").write_text("\n".join(head + sections) + "\n", encoding="utf-8")


def rows_on_disk(out: Path, recipe: str, summary: dict) -> dict[str, dict]:
    """Every framework aligned into ``out`` on the recipe, by this call or an earlier one."""
    rows = {}
    for framework in FRAMEWORKS.split(","):
        for found in sorted((out / recipe).glob(f"{framework}*/align.json")):
            label = found.parent.name
            rows[label] = {"outcome": json.loads(found.read_text(encoding="utf-8")),
                           "seconds": summary[recipe][label]["seconds"]}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default=FRAMEWORKS)
    parser.add_argument("--recipes", default=RECIPES)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", default="1,2")
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--label", default="",
                        help="appended to each framework's folder and row, so that a call with "
                             "other sizes sits beside the default one instead of replacing it")
    parser.add_argument("--out", help="default benchmarks/results/align-<date>; a folder that "
                                      "holds earlier calls' results keeps them, and its "
                                      "README tables cover them all")
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).parent / "results"
               / f"align-{time.strftime('%Y-%m-%d')}")
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    calls = summary.pop("calls", [])
    calls.append(" ".join(sys.argv[1:]))
    asked = [(r, f) for r in args.recipes.split(",") for f in args.frameworks.split(",")]
    for recipe, framework in asked:
        if why_not(framework, recipe):
            continue
        label = framework + args.label
        got = check(recipe, framework, args, out / recipe / label)
        summary.setdefault(recipe, {})[label] = {
            "aligned": got["outcome"]["aligned"], "seconds": got["seconds"],
            "argv": got["argv"],
            "worst_update": max((c.get("worst_update") or {}).get("error") or 0.0
                                for c in got["outcome"]["checks"])}
        summary_path.write_text(json.dumps({**summary, "calls": calls}, indent=1) + "\n")
        sections = []
        for r in RECIPES.split(","):
            if r in summary:
                skipped = {f: w for f in FRAMEWORKS.split(",") if (w := why_not(f, r))}
                sections += table(r, rows_on_disk(out, r, summary), skipped)
        write_readme(out, calls, sections)
    ran = {r: {f + args.label: summary[r][f + args.label] for f in args.frameworks.split(",")
               if f + args.label in summary.get(r, {})} for r in args.recipes.split(",")}
    print(json.dumps(ran, indent=1))
    return 0 if all(v["aligned"] for r in ran.values() for v in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
