"""`trainperf search`: the largest batch or number of classes that fits, one search per
framework and device count (``trainperf.search``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import EXIT_OK, EXIT_RUN_FAILED, add_run_options, plan_from_args, reword


def register_search(sub) -> None:
    search = sub.add_parser("search", help="find the largest batch or number of classes that "
                            "fits in memory: one search per framework and device count")
    search.add_argument("kind", choices=["max-batch", "max-classes"])
    search.add_argument("recipe")
    search.add_argument("--start", type=int, help="first value to probe (default: "
                        "--batch-size or --num-classes, else the recipe's)")
    search.add_argument("--resolution", type=float, default=None,
                        help="stop when the smallest value out of memory is within this "
                             "fraction of the largest that fits (default: exact for batch, "
                             "0.01 for classes)")
    search.add_argument("--max-probes", type=int, default=24,
                        help="probes of each search at most (default 24)")
    add_run_options(search)
    reword(search,
           framework="backend(s) to search with: a list makes one search per framework, each "
                     "in a folder of its own (default torch)",
           devices="processes per node: a list makes one search per count, each in a folder "
                   "of its own (default 1)",
           batch_size="per device; max-batch: one value, its first probe (as --start); "
                      "max-classes: a list makes one search per batch (default: recipe's)",
           num_classes="identities; max-classes: one value, its first probe (as --start); "
                       "max-batch: a list makes one search per count, each in a folder of its "
                       "own (default: recipe's)",
           runs="runs of each probe: 1, the only value a search takes",
           mode="execution mode(s) in each framework's own terms (`trainperf list "
                "--frameworks`): a list makes one search per mode; default: each framework's "
                "first, several frameworks too (a search compares no speeds; best probes the "
                "modes at every probe)")
    search.set_defaults(runs=1, iters=6, warmup=2, timeout=900.0, handler=cmd_search)


def cmd_search(args: argparse.Namespace) -> int:
    from ..procs import interrupt_on_sigterm
    from ..report.capacity import write_capacity_report
    from ..results import default_folder
    from ..search import KINDS, prepare, run_search, search_plans, write_outcome

    if args.runs != 1:
        raise ValueError("a search probes each value once (--runs 1)")
    if not args.out:
        args.out = str(default_folder(f"search-{args.kind}-{args.recipe}"))
    args.mode = args.mode or "default"  # run's `best` for several frameworks compares speeds
    root = Path(args.out)
    plans = search_plans(args.kind, plan_from_args(args), root)
    # Every folder is checked before the first probe.
    prepared = [prepare(args.kind, plan, args.start, args.resolution) for plan in plans]
    field_name = KINDS[args.kind]
    interrupt_on_sigterm()
    answered = True
    for plan, (start, resolution, settings) in zip(plans, prepared):
        where = "" if plan.out_dir == root else f"{plan.out_dir.relative_to(root)}: "

        def show(p, where=where) -> None:
            peak = f"{p.peak_memory_bytes / 2**30:.2f} GiB" if p.peak_memory_bytes else "-"
            print(f"{where}probe {field_name}={p.value}: {p.status} (peak {peak})",
                  file=sys.stderr, flush=True)

        outcome = run_search(args.kind, plan, start, resolution, args.max_probes,
                             plan.measure.memory_limit_bytes, show)
        outcome.settings = settings
        path = write_outcome(outcome, plan.out_dir)
        section = write_capacity_report(outcome.to_dict(), plan.out_dir)
        if len(plans) == 1:
            print(section)
        print(f"search: {path}")
        failed = outcome.failure_line()
        if failed:
            print(f"search {args.kind} {where}{failed}", file=sys.stderr, flush=True)
        answered = answered and outcome.answer is not None
    if len(plans) > 1:
        from ..report.assemble import write_report

        report = write_report([str(p.out_dir) for p in plans], root)
        print(report.read_text(encoding="utf-8"))
        print(f"report: {report}")
    return EXIT_OK if answered else EXIT_RUN_FAILED
