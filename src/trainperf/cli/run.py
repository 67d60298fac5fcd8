"""`trainperf list`, `run`, `search` (its handler in ``cli.search``), `train`, `verify` and
`bench`: measure, find a capacity, train to a target."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

from ..config import parse_accuracy, parse_int_list, parse_list
from .common import (EXIT_OK, EXIT_RUN_FAILED, add_loader_options, add_run_options,
                     add_topology_options, add_tuning_options, plan_from_args,
                     topology_from_args, tuning_from_args)
from .search import register_search


def register(sub) -> None:
    lst = sub.add_parser("list", help="list the recipes (and, with --frameworks, what each "
                                      "framework runs)")
    lst.add_argument("--frameworks", action="store_true",
                     help="the matrix of what each framework's backend runs")
    lst.add_argument("--markdown", action="store_true",
                     help="with --frameworks: as the README's Markdown table")
    lst.set_defaults(handler=cmd_list)

    run = sub.add_parser("run", help="run a benchmark matrix")
    add_run_command_arguments(run)
    run.set_defaults(handler=cmd_run)

    register_search(sub)

    _register_train(sub)
    verify = sub.add_parser("verify", help="verification accuracy of a checkpoint")
    verify.add_argument("checkpoint", help="a checkpoint folder, or a folder of them (the newest)")
    verify.add_argument("--val", required=True, metavar="A.bin[,B.bin]",
                        help="verification sets (insightface .bin)")
    verify.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    verify.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
    verify.add_argument("--far", type=float, default=1e-3,
                        help="false-accept rate of the TAR column (default 1e-3)")
    verify.set_defaults(handler=cmd_verify)

    bench = sub.add_parser("bench", help="the default suite, sized to this machine")
    bench.add_argument("--out", default="bench-results")
    bench.set_defaults(handler=cmd_bench)


def add_run_command_arguments(run: argparse.ArgumentParser) -> None:
    """Everything `trainperf run` takes (``slurm`` parses a node's command with it)."""
    run.add_argument("recipe")
    run.add_argument("--resume", metavar="DIR", help="finish the partial matrix in DIR")
    add_run_options(run)
    run.add_argument("--data", metavar="PREFIX",
                     help="train on PREFIX.rec/.idx (RecordIO, insightface or im2rec layout) "
                          "through the input pipeline; the same cases also run on synthetic "
                          "data, and the report says whether the input limits them")
    add_loader_options(run, "--data: ")
    run.add_argument("--mode-from", metavar="DIR",
                     help="--mode best: each plan runs in the mode the probe of its earlier "
                          "run in DIR chose (DIR as run wrote it, or a multi-node step's "
                          "folder), instead of probing again: every node count of a sweep in "
                          "the mode its first case chose")
    run.add_argument("--no-synthetic-baseline", action="store_true",
                     help="--data: skip the synthetic (compute-only) twin of each case")
    run.add_argument("--breakdown", action="store_true",
                     help="after each case's runs, one more, profiled and outside the "
                          "statistics: where the step's time goes, phase by phase, and what "
                          "bounds it")
    run.add_argument("--breakdown-steps", type=int, default=10, metavar="N",
                     help="profiled steps of that run, after --warmup plain ones (default 10)")
    run.add_argument("--fabric", action="append", metavar="COMMBENCH",
                     help="--breakdown: commbench.json (or its folder) whose prediction the "
                          "exposed communication is set against in the report")
    run.add_argument("--trace", action="store_true",
                     help="the profiled run (implies --breakdown) also writes the "
                          "framework's own trace into its run folder")


def _register_train(sub) -> None:
    p = sub.add_parser("train", help="train to a verification accuracy: time and steps to "
                                     "target, the accuracy curve, throughput")
    p.add_argument("recipe")
    p.add_argument("--data", required=True, metavar="PREFIX",
                   help="PREFIX.rec/.idx to train on (insightface's face layout)")
    p.add_argument("--val", required=True, metavar="A.bin[,B.bin]",
                   help="verification sets (insightface .bin); the first decides the target")
    p.add_argument("--target", required=True,
                   help="accuracy on the first --val set that ends a run: 0.95 or 95%%")
    p.add_argument("--max-steps", type=int, default=10_000,
                   help="steps after which a run stops anyway (default 10000)")
    p.add_argument("--eval-every", type=int, default=500,
                   help="steps between evaluations: time to target is known to this "
                        "resolution (default 500)")
    p.add_argument("--checkpoint-every", type=int,
                   help="steps between checkpoints (default: at every evaluation)")
    p.add_argument("--resume", metavar="DIR",
                   help="go on with the runs in DIR from their last checkpoints (give the "
                        "same options)")
    p.add_argument("--framework", default="torch",
                   help="backend(s) that train; a list sweeps them (default torch)")
    p.add_argument("--fc", default=None, help="head mode(s): dp, mp, pfc; a list sweeps them "
                   "(default: recipe's)")
    p.add_argument("--sample-ratio", help="pfc ratio(s); a list sweeps them (default 0.1 for "
                   "pfc)")
    p.add_argument("--precision", help="fp32, bf16, fp16; a list sweeps them (default: "
                   "recipe's)")
    p.add_argument("--pfc-update", choices=["sparse", "dense"])
    p.add_argument("--batch-size", type=int, help="per device (default: recipe's)")
    p.add_argument("--num-classes", type=int,
                   help="default: the identities the dataset announces")
    p.add_argument("--lr", type=float, help="base learning rate (default: recipe's)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=20,
                   help="steps of each run left out of its throughput (default 20)")
    p.add_argument("--timeout", type=float, default=7 * 24 * 3600.0,
                   help="seconds per run (default a week)")
    add_topology_options(p)
    add_tuning_options(p)
    add_loader_options(p)
    p.add_argument("--out", help="output folder (default results/train-<recipe>-<time>)")
    p.set_defaults(handler=cmd_train)


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..recipes import RECIPES

    if args.frameworks:
        return print_frameworks(args.markdown)
    tbl = Table(title="trainperf recipes")
    for col in ("recipe", "backbone", "classes", "batch"):
        tbl.add_column(col, no_wrap=True)  # names are typed back: never break them
    tbl.add_column("description")
    for r in RECIPES.values():
        w = r.workload
        tbl.add_row(r.name, w.backbone, str(w.num_classes), str(w.batch_size), r.description)
    Console().print(tbl)
    return EXIT_OK


def print_frameworks(markdown: bool) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..backends.capabilities import LAYOUT_COLUMN, markdown_table, rows

    if markdown:
        print(markdown_table())
        return EXIT_OK
    # The short columns; --markdown has every one (how each is written, how ranks start).
    short = {"framework": "framework", "version": "version", "heads": "heads",
             "precisions on a CPU": "precisions CPU", "precisions on a GPU": "precisions GPU",
             "modes on a CPU": "modes CPU", "modes on a GPU": "modes GPU",
             "backbones": "backbones", LAYOUT_COLUMN: "layout (auto)",
             "layouts it runs": "layouts",
             "real data (`--data`)": "--data", "trains to a target": "train",
             "several nodes": "nodes"}
    tbl = Table(title="what each framework runs (anything else is refused before a run)",
                caption="modes: bold is the one a single framework's run takes; --mode best "
                        "picks among them by a probe")
    for col in short.values():
        tbl.add_column(col, overflow="fold")
    for r in rows():
        # The Markdown table's bold, as the terminal shows it.
        tbl.add_row(*(re.sub(r"\*\*(.+?)\*\*", r"[bold]\1[/bold]", r[c]) for c in short))
    console = Console()
    if not console.is_terminal:  # a log or a pipe: keep every column whole
        console = Console(width=200)
    console.print(tbl)
    return EXIT_OK


def _report_and_exit(plans: list, docs: list[dict], out: Path, with_references: bool,
                     fabric: list[str] | None = None) -> int:
    from ..report.assemble import write_report
    from ..results import all_runs_ok
    from ..scale.bottleneck import analyser

    path = write_report([str(p.out_dir) for p in plans], out, with_references=with_references,
                        analyse=analyser(fabric))
    print(path.read_text(encoding="utf-8"))
    return EXIT_OK if all_runs_ok(docs) else EXIT_RUN_FAILED


def run_plans_of(args: argparse.Namespace) -> list:
    """The plans of `trainperf run` with every option checked (``slurm`` checks a node's
    command with it before the queue)."""
    plans = plan_from_args(args)
    if args.mode_from:
        from ..plans import report_dir, take_decided_modes

        root = args.resume or args.out
        take_decided_modes(args.mode_from, plans,
                           Path(root) if root else report_dir(plans, None))
    if args.fabric:
        from ..scale.commbench import load_fabric

        for path in args.fabric:  # a bad file is told now, not after the runs
            load_fabric(path)
    if args.breakdown or args.trace:
        if args.breakdown_steps < 2:
            raise ValueError(f"--breakdown-steps must be >= 2, got {args.breakdown_steps}")
        for plan in plans:
            plan.profile_steps, plan.trace = args.breakdown_steps, args.trace
    return plans


def cmd_run(args: argparse.Namespace) -> int:
    from ..plans import report_dir, run_plans
    from ..results import all_runs_ok

    plans = run_plans_of(args)
    # With --data the real-data runs and their synthetic twin take turns.
    docs = run_plans(plans, bool(args.resume), take_turns=bool(args.data))
    if docs and all(doc.get("role") == "follower" for doc in docs):
        # Rank 0, and every figure, lives on another node: a report here would only list
        # runs without figures.
        runs = sum(len(c["runs"]) for doc in docs for c in doc["cases"])
        ok = all_runs_ok(docs)
        print(f"this node was a follower: {runs} run(s) "
              f"{'all exited cleanly' if ok else 'not all ok'}; node 0's output folder "
              "holds the figures and the report")
        return EXIT_OK if ok else EXIT_RUN_FAILED
    code = _report_and_exit(plans, docs, report_dir(plans, args.resume),
                            with_references=len({p.framework for p in plans}) > 1,
                            fabric=args.fabric)
    for plan in plans:
        print(f"results: {plan.out_dir / 'results.json'}")
    return code


def cmd_train(args: argparse.Namespace) -> int:
    from ..plans import open_data, parse_frameworks, report_dir, run_plans
    from ..train import training_plans

    changes = {k: v for k, v in (("batch_size", args.batch_size), ("lr", args.lr),
                                 ("pfc_update", args.pfc_update),
                                 ("num_classes", args.num_classes))
               if v is not None}
    out = args.resume or args.out
    data = open_data(args.data, args.decoder, args.loader_workers)
    plans = training_plans(
        args.recipe, frameworks=parse_frameworks(args.framework),
        fcs=parse_list(args.fc) if args.fc else None,
        ratios=[float(r) for r in parse_list(args.sample_ratio)] if args.sample_ratio else None,
        precisions=parse_list(args.precision) if args.precision else None, changes=changes,
        data=data,
        vals=parse_list(args.val), target=parse_accuracy(args.target),
        max_steps=args.max_steps, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, runs=args.runs, warmup=args.warmup,
        timeout_s=args.timeout, devices=parse_int_list(args.devices, "--devices"),
        base=topology_from_args(args),
        tuning=replace(tuning_from_args(args), mode=args.mode or "default"),
        out=Path(out) if out else None)
    workload, recipe_side = plans[0].workload, _recipe_side(args.recipe)
    if workload.input_size != recipe_side:
        print(f"training at {workload.input_size}x{workload.input_size}, the size of "
              f"{data[0].prefix}'s images (the recipe's is {recipe_side})", file=sys.stderr)
    docs = run_plans(plans, bool(args.resume))
    return _report_and_exit(plans, docs, report_dir(plans, args.resume), with_references=False)


def _recipe_side(name: str) -> int:
    from ..recipes import get_recipe

    return get_recipe(name).workload.input_size


def cmd_verify(args: argparse.Namespace) -> int:
    from .. import verify
    from ..backends.torch.evaluation import verify_checkpoint

    vals = parse_list(args.val)
    if not vals:
        raise ValueError("--val needs at least one .bin file")
    where, figures = verify_checkpoint(args.checkpoint, vals, args.device, args.batch_size,
                                       args.far)
    print(f"checkpoint {where}")
    print(verify.format_table(figures))
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    import time

    from ..bench import bench_arguments
    from ..env import gpu_count

    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    argv = bench_arguments(gpu_count(), str(out))
    print("trainperf " + " ".join(argv), file=sys.stderr)
    run = argparse.ArgumentParser(prog="trainperf run")
    add_run_command_arguments(run)
    return cmd_run(run.parse_args(argv[1:]))
