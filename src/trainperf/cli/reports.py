"""`trainperf report`, `join`, `compare`, `history`, `export`, `ingest` and `references`: read
results (trainperf's, older tools' logs, the published figures) and write them out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import EXIT_OK, EXIT_RUN_FAILED

EXIT_SLOWER = EXIT_RUN_FAILED


def register(sub) -> None:
    rep = sub.add_parser("report", help="tables and plots of one or more result folders")
    rep.add_argument("dirs", nargs="+")
    rep.add_argument("--out", help="folder for report.md and plots (default: the first DIR)")
    rep.add_argument("--fabric", action="append", metavar="COMMBENCH",
                     help="commbench.json (or its folder): set each breakdown's exposed "
                          "communication against the fabric's prediction")
    rep.add_argument("--references", action="store_true",
                     help="add the matching published DLPerf rows beside each result")
    rep.set_defaults(handler=cmd_report)
    join = sub.add_parser(
        "join", help="results measured apart (one node today, two nodes tomorrow) as one "
        "document per plan, every case's speedup against the 1-device case of all of them",
        description="Join the plans of result folders measured apart into one document per "
                    "plan in OUT (plans pair by their place in each folder: torch, jax/real, "
                    "...), each case's speedup and efficiency against the 1-device case of the "
                    "whole, and write OUT/report.md. Refused in one line naming what differs "
                    "where two parts measured different things (recipe, workload, precision, "
                    "execution mode as it ran, framework version, device model, data, speed "
                    "settings) or hold the same case.")
    join.add_argument("dirs", nargs="+", metavar="DIR",
                      help="result folders as run (or slurm, emulate) wrote them")
    join.add_argument("--out", required=True, help="folder for the joined documents and "
                      "report.md (a new one)")
    join.set_defaults(handler=cmd_join)
    cmp = sub.add_parser(
        "compare", help="is NEW faster or slower than BASE: intervals, a rank test, a verdict",
        description="Pair the matching cases of result folders and judge each NEW against "
                    "BASE. Exit status: 0 no slowdown beyond the threshold, 1 at least one "
                    "(--fail-on any-change: or a speed-up), 2 a usage error.")
    cmp.add_argument("base", metavar="BASE", help="a results folder (or one holding several)")
    cmp.add_argument("new", metavar="NEW", nargs="+", help="the folder(s) to judge against BASE")
    add_judging_options(cmp)
    cmp.add_argument("--fail-on", choices=["slower", "any-change"], default="slower",
                     help="what makes the exit status 1 (default: slower)")
    cmp.add_argument("--json", metavar="FILE", help="also write the comparison as JSON")
    cmp.add_argument("--out", metavar="FILE", help="also write the comparison as Markdown")
    cmp.set_defaults(handler=cmd_compare)
    hist = sub.add_parser("history", help="one self-contained HTML page of throughput over "
                          "result folders taken over time, regressions marked")
    hist.add_argument("dirs", nargs="+", metavar="DIR", help="result folders, oldest first")
    add_judging_options(hist)
    hist.add_argument("--out", default="history.html", help="the HTML file (default: "
                      "history.html)")
    hist.set_defaults(handler=cmd_history)
    refs = sub.add_parser("references", help="list the published figures trainperf carries")
    refs.add_argument("--framework")
    refs.add_argument("--model")
    refs.set_defaults(handler=cmd_references)
    exp = sub.add_parser(
        "export", help="results as one table (CSV, Parquet, JSON Lines) or in DLPerf's shape",
        description="One row per run or per case of every results.json under the DIRs (a "
                    "results folder, a folder holding many, archives included, or a "
                    "results.json), each setting and figure a column; see docs/exports.md.")
    exp.add_argument("dirs", nargs="+", metavar="DIR")
    exp.add_argument("--format", required=True, choices=["csv", "parquet", "jsonl", "dlperf"])
    exp.add_argument("--level", choices=["run", "case"],
                     help="a row per run (default) or per case; tables only")
    exp.add_argument("--out", help="file to write (default: stdout; parquet needs one)")
    exp.set_defaults(handler=cmd_export)
    ing = sub.add_parser("ingest", help="read logs of older tools into results")
    ing.add_argument("logdir")
    ing.add_argument("--format", default="auto", help="auto or one of: mxnet-speedometer, "
                     "mxnet-partialfc, oneflow-face, plsc, arcface-torch, tf-timehistory, "
                     "dllogger")
    ing.add_argument("--method", default="exact", choices=["exact", "dlperf"],
                     help="which figure fills samples_per_s (both are kept)")
    ing.add_argument("--out", help="output folder (default results/ingest-<logdir name>)")
    ing.set_defaults(handler=cmd_ingest)


def cmd_report(args: argparse.Namespace) -> int:
    from ..report.assemble import write_report

    from ..scale.bottleneck import analyser

    path = write_report(args.dirs, Path(args.out or args.dirs[0]), args.references,
                        analyser(args.fabric))
    print(path.read_text(encoding="utf-8"))
    print(f"report: {path}")
    return EXIT_OK


def cmd_join(args: argparse.Namespace) -> int:
    from ..join import join_folders
    from ..report.assemble import write_report
    from ..results import write_json_atomic

    out = Path(args.out)
    if any(Path(d).resolve() == out.resolve() for d in args.dirs):
        raise ValueError("--out must be a new folder, not one of the DIRs")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new --out")
    joined = join_folders(args.dirs)  # every plan joined before anything is written
    for rel, doc in joined:
        target = out / rel / "results.json"
        write_json_atomic(target, doc)
        cases = ", ".join(c["case"] for c in doc["cases"])
        print(f"{target}: {cases} (from {len(doc['joined_from'])} part(s))")
    path = write_report([str(out)], out, False)
    print(path.read_text(encoding="utf-8"))
    print(f"report: {path}")
    return EXIT_OK


def threshold_value(text: str) -> float:
    """``2``, ``2%`` or ``0.5%``: a percentage, returned as a fraction."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a percentage: {text!r}") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"must lie in [0, 100): {text!r}")
    return value / 100


def confidence_value(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.5 <= value < 1:
        raise argparse.ArgumentTypeError(f"must lie in [0.5, 1), e.g. 0.95: {text!r}")
    return value


def add_judging_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threshold", type=threshold_value, default=0.02, metavar="PCT",
                   help="the smallest change that counts, in percent (default: 2)")
    p.add_argument("--confidence", type=confidence_value, default=0.95,
                   help="of the intervals; the rank test's level is 1 minus it (default: 0.95)")


def cmd_compare(args: argparse.Namespace) -> int:
    from .. import significance
    from ..report.compare import compare_sides, failing, load_side, render

    significance.require()
    base = load_side(args.base)
    comparisons = [compare_sides(base, load_side(new), args.threshold, args.confidence)
                   for new in args.new]
    text = render(comparisons, args.threshold, args.confidence)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"threshold": args.threshold, "confidence": args.confidence,
             "comparisons": [c.to_dict() for c in comparisons]}, indent=1) + "\n",
            encoding="utf-8")
    bad = failing(comparisons, args.fail_on)
    for line in bad:
        print(f"compare: {line}", file=sys.stderr)
    return EXIT_SLOWER if bad else EXIT_OK


def cmd_history(args: argparse.Namespace) -> int:
    from .. import significance
    from ..report.history import write_history

    significance.require()
    path, flagged = write_history(args.dirs, Path(args.out), args.threshold, args.confidence)
    print(f"history: {path} ({flagged} regression(s) marked)")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    if args.format != "dlperf":
        from ..export import export

        count = export(args.dirs, args.format, args.level or "run", args.out)
        if args.out:
            print(f"export: {count} rows -> {args.out}", file=sys.stderr)
        return EXIT_OK
    from .. import results
    from ..report.assemble import documents_in

    if len(args.dirs) > 1:
        raise ValueError("--format dlperf exports one results folder; give one DIR")
    if args.level:
        raise ValueError("--level applies to the table formats, not to --format dlperf")
    paths = documents_in(args.dirs[0])
    if len(paths) == 1:
        shape = results.export_dlperf(results.load(paths[0]))
    else:
        # DLPerf's shape is one framework's table: each plan's under its folder's name.
        root = Path(args.dirs[0])
        shape = {str(p.parent.relative_to(root)): results.export_dlperf(results.load(p))
                 for p in paths}
    text = json.dumps(shape, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return EXIT_OK


def cmd_ingest(args: argparse.Namespace) -> int:
    from ..ingest import ingest_logdir

    got = ingest_logdir(args.logdir, args.format, args.method)
    if got.detected:
        print(f"format: {got.format_name} (detected)", file=sys.stderr)
    for path, reason in got.skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    out = Path(args.out or f"results/ingest-{Path(args.logdir.rstrip('/')).name}")
    for model, precision, cases, path in got.write(out):
        print(f"{model} {precision}: {cases} cases -> {path}")
    return EXIT_OK


def cmd_references(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..references import DEVICE, load_max_classes, load_throughput

    rows = [r for r in load_throughput()
            if (not args.framework or r.framework == args.framework)
            and (not args.model or r.model == args.model)]
    tbl = Table(title=f"Published DLPerf throughput ({DEVICE})")
    for col in ("framework", "model", "precision", "batch", "nodes", "gpus", "samples/s",
                "speedup", "mode"):
        tbl.add_column(col, no_wrap=col != "mode")
    for r in rows:
        tbl.add_row(r.framework, r.model, r.precision, str(r.batch_size_per_device),
                    str(r.nodes), str(r.devices_per_node), f"{r.samples_per_s:.2f}",
                    "-" if r.speedup is None else f"{r.speedup:.2f}", r.mode)
    console = Console()
    console.print(tbl)
    caps = Table(title="Published max num_classes")
    for col in ("framework", "model", "precision", "batch", "nodes", "gpus", "partial fc",
                "max classes"):
        caps.add_column(col, no_wrap=True)
    for c in load_max_classes():
        caps.add_row(c.framework, c.model, c.precision, str(c.batch_size_per_device),
                     str(c.nodes), str(c.devices_per_node),
                     f"{c.sample_ratio}" if c.partial_fc else "no", f"{c.max_num_classes:,}")
    console.print(caps)
    print(f"{len(rows)} throughput rows")
    return EXIT_OK
