"""Command line: argument parsing only; the work is in the modules it calls."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path

from . import results
from .backends import BACKENDS, get_backend
from .config import (MXNET_KVSTORES, TF32_MODES, DataSpec, Measure, Topology, TrainSpec, Tuning,
                     parse_accuracy, parse_bytes, parse_int_list, parse_list)
from .recipes import RECIPES, get_recipe
from .gpucheck import cli as gpucheck_cli
from .scale import commbench_cli, project_cli
from .scale.slurm_cli import add_parser as add_slurm_parser, cmd_slurm

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE = 0, 1, 2


def _add_topology_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", default="1", help="processes per node; a list sweeps cases "
                   "(default 1)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--rdzv", metavar="HOST:PORT",
                   help="several nodes: run the same command on every node; they meet at "
                        "HOST:PORT (torch's c10d rendezvous, hosted by the node that is HOST) "
                        "and get their node ranks there, instead of --node-rank/--master-addr")
    p.add_argument("--rdzv-timeout", type=float, default=300.0, metavar="S",
                   help="seconds a node waits for the others, at each meeting and in a "
                        "collective whose peer vanished (default 300)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])


def _add_tuning_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mxnet-kvstore", choices=list(MXNET_KVSTORES), default="dist_sync",
                   help="mxnet on several devices: one process per rank with a parameter "
                        "server (dist_sync, default) or one process for all (device)")
    p.add_argument("--tf-onednn", action="store_true",
                   help="tf: turn TensorFlow's oneDNN custom CPU ops on (off by default: "
                        "they corrupt memory on AVX-512 CPUs in 1x1 stride-2 convolutions "
                        "with few channels)")
    p.add_argument("--channels-last", action="store_true", help="channels-last backbone")
    p.add_argument("--tf32", choices=list(TF32_MODES), default="default",
                   help="GPU fp32: default (torch's: TF32 convolutions, fp32 matrix products), "
                        "off (all full fp32), on (all TF32)")
    p.add_argument("--no-cudnn-benchmark", action="store_true",
                   help="GPU: do not let cuDNN time its algorithms (it does by default)")
    p.add_argument("--ddp-bucket-mb", type=float, default=Tuning.ddp_bucket_mb,
                   help=f"DDP gradient bucket size in MiB (default {Tuning.ddp_bucket_mb:g})")
    p.add_argument("--ddp-broadcast-buffers", action="store_true",
                   help="re-send rank 0's BatchNorm buffers before every forward (off by "
                        "default, as in arcface_torch)")
    p.add_argument("--no-ddp-static-graph", action="store_true",
                   help="do not tell DDP the graph is the same every step")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--framework", default="torch",
                   help=f"backend(s) to run: {', '.join(BACKENDS)}; a list sweeps them "
                        "side by side (default torch)")
    _add_topology_options(p)
    p.add_argument("--batch-size", help="per device; a list sweeps cases (default: recipe's)")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--fc", choices=["dp", "mp", "pfc"])
    p.add_argument("--sample-ratio", type=float)
    p.add_argument("--pfc-update", choices=["sparse", "dense"],
                   help="pfc: update sampled rows only (default) or the whole matrix "
                        "(arcface_torch)")
    p.add_argument("--num-classes", type=int)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (default 1800)")
    p.add_argument("--memory-limit", help="per-process memory cap for CPU runs, e.g. 8GiB")
    _add_tuning_options(p)
    p.add_argument("--out", help="output folder (default results/<recipe>-<time>)")


def _add_train_parser(sub) -> None:
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
    _add_topology_options(p)
    _add_tuning_options(p)
    p.add_argument("--decoder", default="auto", help="JPEG decoder (default: fastest installed)")
    p.add_argument("--loader-workers", type=int,
                   help="loader processes per rank (default: cores per rank less one, 1 to 8)")
    p.add_argument("--out", help="output folder (default results/train-<recipe>-<time>)")


def _add_verify_parser(sub) -> None:
    p = sub.add_parser("verify", help="verification accuracy of a checkpoint")
    p.add_argument("checkpoint", help="a checkpoint folder, or a folder of them (the newest)")
    p.add_argument("--val", required=True, metavar="A.bin[,B.bin]",
                   help="verification sets (insightface .bin)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--batch-size", type=int, default=64, help="images per forward pass")
    p.add_argument("--far", type=float, default=1e-3,
                   help="false-accept rate of the TAR column (default 1e-3)")


def _add_data_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", metavar="PREFIX",
                   help="train on PREFIX.rec/.idx (RecordIO, insightface or im2rec layout) "
                        "through the input pipeline; the same cases also run on synthetic "
                        "data, and the report says whether the input limits them")
    p.add_argument("--decoder", default="auto",
                   help="--data: JPEG decoder (auto: the fastest installed; see "
                        "`trainperf data bench`)")
    p.add_argument("--loader-workers", type=int,
                   help="--data: loader processes per rank (default: cores per rank less "
                        "one, 1 to 8)")
    p.add_argument("--no-synthetic-baseline", action="store_true",
                   help="--data: skip the synthetic (compute-only) twin of each case")


def _add_data_commands(sub) -> None:
    data = sub.add_parser("data", help="RecordIO datasets: pack, synthesize, measure the loader")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    pack = data_sub.add_parser("pack", help="pack an image folder into PREFIX.rec/.idx")
    pack.add_argument("image_dir", help="one sub-folder per identity (or class)")
    pack.add_argument("--out", required=True, metavar="PREFIX")
    pack.add_argument("--layout", choices=["face", "flat"], default="face",
                      help="face: insightface's (header, images, identity records); flat: "
                           "im2rec's, one record per image (ImageNet)")
    synth = data_sub.add_parser("synth", help="write a synthetic face-like dataset")
    synth.add_argument("--identities", type=int, required=True)
    synth.add_argument("--images-per-identity", type=int, required=True)
    synth.add_argument("--size", type=int, default=112, help="image side (default 112)")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--val-pairs", type=int, default=600, metavar="N",
                       help="also write PREFIX.val.bin, N verification pairs (half of them "
                            "same-identity) of identities not in the training set, in "
                            "insightface's .bin format (default 600, a tenth of lfw.bin's "
                            "6000 and quick to write; 0: none)")
    synth.add_argument("--out", required=True, metavar="PREFIX")
    bench = data_sub.add_parser("bench", help="decoded images/s of the loader per worker count")
    bench.add_argument("prefix")
    bench.add_argument("--workers", default="1,2,4", help="loader processes; a list sweeps")
    bench.add_argument("--decoder", default="auto",
                       help="a decoder, a list, or all (default: the fastest installed)")
    bench.add_argument("--recipe", default="r100-arcface-emore",
                       help="whose augmentation and batch size to use (default "
                            "r100-arcface-emore)")
    bench.add_argument("--batch-size", type=int)
    bench.add_argument("--batches", type=int, default=50, help="batches measured per setting")
    bench.add_argument("--warmup", type=int, default=5, help="batches not measured")
    bench.add_argument("--out", help="folder for data_bench.json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainperf", description=(
        "Measure training throughput of face recognition and ResNet50 workloads."))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the recipes")
    run = sub.add_parser("run", help="run a benchmark matrix")
    run.add_argument("recipe")
    run.add_argument("--resume", metavar="DIR", help="finish the partial matrix in DIR")
    _add_run_options(run)
    _add_data_options(run)
    rep = sub.add_parser("report", help="tables and plots of one or more result folders")
    rep.add_argument("dirs", nargs="+")
    rep.add_argument("--out", help="folder for report.md and plots (default: the first DIR)")
    rep.add_argument("--references", action="store_true",
                     help="add the matching published DLPerf rows beside each result")
    refs = sub.add_parser("references", help="list the published figures trainperf carries")
    refs.add_argument("--framework")
    refs.add_argument("--model")
    exp = sub.add_parser("export", help="write results in another tool's shape")
    exp.add_argument("dir")
    exp.add_argument("--format", required=True, choices=["dlperf"])
    exp.add_argument("--out", help="file to write (default: stdout)")
    search = sub.add_parser("search", help="find the largest batch or number of classes")
    search.add_argument("kind", choices=["max-batch", "max-classes"])
    search.add_argument("recipe")
    search.add_argument("--start", type=int, help="first value to probe (default: recipe's)")
    search.add_argument("--resolution", type=float, default=None,
                        help="stop when the failing value is within this fraction of the "
                             "fitting one (default: exact for batch, 0.01 for classes)")
    search.add_argument("--max-probes", type=int, default=24)
    _add_run_options(search)
    search.set_defaults(runs=1, iters=6, warmup=2, timeout=900.0)
    ing = sub.add_parser("ingest", help="read logs of older tools into results")
    ing.add_argument("logdir")
    ing.add_argument("--format", default="auto", help="auto or one of: mxnet-speedometer, "
                     "mxnet-partialfc, oneflow-face, plsc, arcface-torch, tf-timehistory, "
                     "dllogger")
    ing.add_argument("--method", default="exact", choices=["exact", "dlperf"],
                     help="which figure fills samples_per_s (both are kept)")
    ing.add_argument("--out", help="output folder (default results/ingest-<logdir name>)")
    env = sub.add_parser("env", help="per-framework environments")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    create = env_sub.add_parser("create", help="build a framework's environment")
    create.add_argument("names", nargs="+", metavar="FRAMEWORK")
    create.add_argument("--force", action="store_true", help="rebuild even if it is ready")
    create.add_argument("--cpu", action="store_true",
                        help="install the CPU build even on a machine with a GPU")
    create.add_argument("--where-possible", action="store_true",
                        help="skip, with a line saying why, a framework whose wheels exist "
                             "for no Python this machine has (any other failure still fails)")
    env_sub.add_parser("list", help="each framework's environment and versions")
    align = sub.add_parser("align", help="check that a framework trains the same numbers as "
                           "PyTorch from the same weights and batch")
    align.add_argument("recipe")
    align.add_argument("--framework", required=True)
    align.add_argument("--devices", default="1,2", help="rank counts to check (default 1,2)")
    align.add_argument("--fc", default="dp,mp", help="head modes to check (default dp,mp)")
    align.add_argument("--steps", type=int, default=5, help="SGD steps (default 5)")
    align.add_argument("--batch-size", type=int, help="per device (default: the recipe's)")
    align.add_argument("--num-classes", type=int)
    align.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    align.add_argument("--out", help="folder for the weights, runs and align.json")
    _add_data_commands(sub)
    _add_train_parser(sub)
    _add_verify_parser(sub)
    project_cli.add_parser(sub)
    commbench_cli.add_parser(sub)
    add_slurm_parser(sub)
    gpucheck_cli.add_parser(sub)
    bench = sub.add_parser("bench", help="the default suite, sized to this machine")
    bench.add_argument("--out", default="bench-results")
    return parser


def cmd_list() -> int:
    from rich.console import Console
    from rich.table import Table

    tbl = Table(title="trainperf recipes")
    for col in ("recipe", "backbone", "classes", "batch"):
        tbl.add_column(col, no_wrap=True)  # names are typed back: never break them
    tbl.add_column("description")
    for r in RECIPES.values():
        w = r.workload
        tbl.add_row(r.name, w.backbone, str(w.num_classes), str(w.batch_size), r.description)
    Console().print(tbl)
    return EXIT_OK


def tuning_from_args(args: argparse.Namespace) -> Tuning:
    return Tuning(cudnn_benchmark=not args.no_cudnn_benchmark,
                  ddp_bucket_mb=args.ddp_bucket_mb,
                  ddp_static_graph=not args.no_ddp_static_graph,
                  ddp_broadcast_buffers=args.ddp_broadcast_buffers,
                  mxnet_kvstore=args.mxnet_kvstore, tf_onednn=args.tf_onednn,
                  tf32=args.tf32)


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology every case shares (``--devices`` makes the cases)."""
    if args.rdzv:
        from .scale.rendezvous import parse_endpoint

        parse_endpoint(args.rdzv)
    return Topology(1, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                    args.device, args.rdzv, args.rdzv_timeout)


def plan_from_args(args: argparse.Namespace):
    from .runner import Plan, plan_cases

    recipe = get_recipe(args.recipe)
    changes = {k: v for k, v in (("precision", args.precision), ("fc", args.fc),
                                 ("sample_ratio", args.sample_ratio),
                                 ("pfc_update", args.pfc_update),
                                 ("num_classes", args.num_classes)) if v is not None}
    if args.fc == "pfc" and args.sample_ratio is None:
        changes["sample_ratio"] = 0.1  # DLPerf's and the Partial FC paper's ratio
    if args.channels_last:
        changes["channels_last"] = True
    workload = recipe.workload.replace(**changes)
    batches = (parse_int_list(args.batch_size, "--batch-size") if args.batch_size
               else [workload.batch_size])
    for b in batches[1:]:
        workload.replace(batch_size=b)  # Workload checks each value on construction
    workload = workload.replace(batch_size=batches[0])
    measure = Measure(runs=args.runs, iters=args.iters, warmup=args.warmup,
                      timeout_s=args.timeout,
                      memory_limit_bytes=parse_bytes(args.memory_limit) if args.memory_limit
                      else None)
    tuning = tuning_from_args(args)
    base = topology_from_args(args)
    devices = parse_int_list(args.devices, "--devices")
    cases = plan_cases(devices, batches, base)
    out = Path(getattr(args, "resume", None) or args.out or
               f"results/{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    frameworks = parse_frameworks(args.framework)
    for name in frameworks:
        get_backend(name).check(workload.fc, base.nnodes)
    if "mxnet" in frameworks and base.nnodes > 1 and tuning.mxnet_kvstore == "device":
        raise ValueError("--mxnet-kvstore device runs in one process on one node; several "
                         "nodes use dist_sync")
    if getattr(args, "data", None):
        return data_plans(args, Plan(recipe.name, workload, measure, cases, out, tuning,
                                     recipe.reference_model, frameworks[0]), frameworks)
    # One framework writes into the folder itself; several each into a folder of their own,
    # and the report beside them compares them.
    return [Plan(recipe.name, workload, measure, cases, out if len(frameworks) == 1
                 else out / name, tuning, recipe.reference_model, name) for name in frameworks]


def data_plans(args: argparse.Namespace, plan, frameworks: list[str]) -> list:
    """A real-data plan (``OUT/real``) and, unless skipped, its synthetic twin
    (``OUT/synthetic``), run first so the compute-only figure is there to compare with."""
    from dataclasses import replace

    if frameworks != ["torch"]:
        raise ValueError("--data runs the torch backend only; the other frameworks read "
                         "synthetic data")
    dataset, data = open_data(args)
    dataset.check_classes(plan.workload.num_classes)
    real = replace(plan, out_dir=plan.out_dir / "real", data=data, data_role="real")
    if args.no_synthetic_baseline:
        return [real]
    return [replace(plan, out_dir=plan.out_dir / "synthetic", data_role="synthetic baseline"),
            real]


def open_data(args: argparse.Namespace):
    """The ``--data`` dataset (checked readable) and what the runs are told of it, with the
    ``--decoder`` checked and the loader settings asked for."""
    from .data.dali_feed import choose_decoder
    from .data.layout import open_dataset

    choose_decoder(args.decoder)
    dataset = open_dataset(args.data)
    return dataset, DataSpec(str(Path(dataset.prefix).resolve()), args.decoder,
                             args.loader_workers)


def parse_frameworks(text: str) -> list[str]:
    names = parse_list(text)
    if not names:
        raise ValueError("--framework needs at least one name")
    if len(set(names)) != len(names):
        raise ValueError(f"--framework names a framework twice: {text!r}")
    for name in names:
        get_backend(name)
    return names


def _interrupt_on_sigterm() -> None:
    """A runner stopped by SIGTERM (a scheduler, kill) cleans up as on Ctrl-C: it kills its runs'
    process trees and keeps what was measured."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set there (tests run nodes in threads)

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run_plans(plans: list, resume: bool, take_turns: bool = False) -> list[dict]:
    """Run every plan under one progress display (with ``take_turns``, one run of each in
    turn); their results documents. ``resume`` finishes the folders that hold runs."""
    from .progress import make_progress
    from .runner import Runner, interleave

    runners = [Runner(plan) for plan in plans]  # every environment checked before any run
    _interrupt_on_sigterm()
    progress = make_progress()
    try:
        resumes = []
        for runner in runners:
            runner.progress = progress
            resumes.append(resume and (runner.out / "events.jsonl").exists())
        if take_turns:
            return interleave(runners, resumes)
        return [runner.run(resume=again) for runner, again in zip(runners, resumes)]
    finally:
        close = getattr(progress, "close", None)
        if close:
            close()


def all_runs_ok(docs: list[dict]) -> bool:
    return all(r["status"] == "ok" for doc in docs for c in doc["cases"] for r in c["runs"])


def cmd_run(args: argparse.Namespace) -> int:
    from .report.assemble import write_report

    plans = plan_from_args(args)
    # With --data the real-data runs and their synthetic twin take turns.
    docs = run_plans(plans, bool(args.resume), take_turns=bool(args.data))
    all_ok = all_runs_ok(docs)
    if docs and all(doc.get("role") == "follower" for doc in docs):
        # Rank 0, and every figure, lives on another node: a report here would only list
        # runs without figures.
        runs = sum(len(c["runs"]) for doc in docs for c in doc["cases"])
        print(f"this node was a follower: {runs} run(s) "
              f"{'all exited cleanly' if all_ok else 'not all ok'}; node 0's output folder "
              "holds the figures and the report")
        return EXIT_OK if all_ok else EXIT_RUN_FAILED
    out = Path(args.resume or plans[0].out_dir) if len(plans) == 1 else plans[0].out_dir.parent
    path = write_report([str(p.out_dir) for p in plans], out,
                        with_references=len(plans) > 1 and not args.data)
    print(path.read_text(encoding="utf-8"))
    for plan in plans:
        print(f"results: {plan.out_dir / 'results.json'}")
    return EXIT_OK if all_ok else EXIT_RUN_FAILED


def train_plans_from_args(args: argparse.Namespace) -> list:
    from . import train, verify
    from .runner import Plan, plan_cases

    recipe = get_recipe(args.recipe)
    frameworks = parse_frameworks(args.framework)
    ratios = ([float(r) for r in parse_list(args.sample_ratio)] if args.sample_ratio
              else None)
    chosen = train.variants(parse_list(args.fc or recipe.workload.fc), ratios,
                            parse_list(args.precision or recipe.workload.precision), frameworks)
    target = parse_accuracy(args.target)
    dataset, data = open_data(args)
    changes = {k: v for k, v in (("batch_size", args.batch_size), ("lr", args.lr),
                                 ("pfc_update", args.pfc_update)) if v is not None}
    changes["num_classes"] = args.num_classes or dataset.num_classes or \
        recipe.workload.num_classes
    if recipe.workload.task == "face":
        from .data.pipeline import first_image_size

        # Faces train at the size they were aligned to (insightface's 112 for its sets);
        # resizing every image to the recipe's side would train another model.
        side, width = first_image_size(dataset)
        if side == width and side != recipe.workload.input_size:
            changes["input_size"] = side
    if args.channels_last:
        changes["channels_last"] = True
    workload = recipe.workload.replace(**changes)
    for v in chosen:
        v.apply(workload)  # Workload checks every variant's settings now
    dataset.check_classes(workload.num_classes)
    vals = parse_list(args.val)
    names = [verify.read_bin(p).name for p in vals]  # a bad file fails here, not mid-run
    if len(set(names)) != len(names):
        raise ValueError(f"--val names two sets alike ({', '.join(names)}): results key them "
                         "by file name")
    spec = TrainSpec(tuple(str(Path(p).resolve()) for p in vals), target, args.max_steps,
                     args.eval_every, args.checkpoint_every)
    # Training's throughput counts the steps after each attempt's warm-up.
    measure = Measure(runs=args.runs, iters=max(args.max_steps, args.warmup + 1),
                      warmup=args.warmup, timeout_s=args.timeout)
    base = topology_from_args(args)
    for v in chosen:
        get_backend(v.framework).check(v.fc, base.nnodes, train=True)
    cases = plan_cases(parse_int_list(args.devices, "--devices"), [workload.batch_size], base)
    out = Path(args.resume or args.out or
               f"results/train-{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    base_plan = Plan(recipe.name, workload, measure, cases, out, tuning_from_args(args),
                     recipe.reference_model, data=data, data_role="real", train=spec)
    if workload.input_size != recipe.workload.input_size:
        print(f"training at {workload.input_size}x{workload.input_size}, the size of "
              f"{dataset.prefix}'s images (the recipe's is {recipe.workload.input_size})",
              file=sys.stderr)
    return train.plans(base_plan, chosen)


def cmd_train(args: argparse.Namespace) -> int:
    from .report.assemble import write_report

    plans = train_plans_from_args(args)
    docs = run_plans(plans, bool(args.resume))
    out = Path(args.resume or plans[0].out_dir) if len(plans) == 1 else plans[0].out_dir.parent
    path = write_report([str(p.out_dir) for p in plans], out)
    print(path.read_text(encoding="utf-8"))
    return EXIT_OK if all_runs_ok(docs) else EXIT_RUN_FAILED


def cmd_verify(args: argparse.Namespace) -> int:
    from . import verify
    from .backends.torch.evaluation import verify_checkpoint

    vals = parse_list(args.val)
    if not vals:
        raise ValueError("--val needs at least one .bin file")
    where, figures = verify_checkpoint(args.checkpoint, vals, args.device, args.batch_size,
                                       args.far)
    print(f"checkpoint {where}")
    print(verify.format_table(figures))
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from .report.assemble import write_report

    path = write_report(args.dirs, Path(args.out or args.dirs[0]), args.references)
    print(path.read_text(encoding="utf-8"))
    print(f"report: {path}")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    text = json.dumps(results.export_dlperf(results.load(args.dir)), indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return EXIT_OK


def cmd_ingest(args: argparse.Namespace) -> int:
    from .ingest import ingest_logdir

    got = ingest_logdir(args.logdir, args.format, args.method)
    if got.detected:
        print(f"format: {got.format_name} (detected)", file=sys.stderr)
    for path, reason in got.skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    out = Path(args.out or f"results/ingest-{Path(args.logdir.rstrip('/')).name}")
    many = len(got.docs) > 1
    for (model, precision), doc in got.docs.items():
        folder = out / f"{model}_{precision}" if many else out
        results.write_json_atomic(folder / "results.json", doc)
        print(f"{model} {precision}: {len(doc['cases'])} cases -> {folder / 'results.json'}")
    return EXIT_OK


def cmd_references(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .references import DEVICE, load_max_classes, load_throughput

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


def cmd_search(args: argparse.Namespace) -> int:
    from .report.capacity import write_capacity_report
    from .search import KINDS, default_resolution, run_search, search_settings, write_outcome

    if "," in args.devices:
        raise ValueError("search takes one --devices value")
    if args.runs != 1:
        raise ValueError("a search probes each value once (--runs 1)")
    if not args.out:
        args.out = f"results/search-{args.kind}-{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    plans = plan_from_args(args)
    if len(plans) > 1:
        raise ValueError("search takes one --framework")
    plan = plans[0]
    if (plan.out_dir / "search.json").exists():
        raise ValueError(f"{plan.out_dir} already holds a search; choose another --out")
    field_name = KINDS[args.kind]
    start = args.start or getattr(plan.workload, field_name)
    resolution = (args.resolution if args.resolution is not None
                  else default_resolution(args.kind))
    _interrupt_on_sigterm()

    def show(p) -> None:
        peak = f"{p.peak_memory_bytes / 2**30:.2f} GiB" if p.peak_memory_bytes else "-"
        print(f"probe {field_name}={p.value}: {p.status} (peak {peak})", file=sys.stderr,
              flush=True)

    outcome = run_search(args.kind, plan, start, resolution, args.max_probes,
                         plan.measure.memory_limit_bytes, show)
    outcome.settings = search_settings(plan, start, resolution)
    path = write_outcome(outcome, plan.out_dir)
    print(write_capacity_report(outcome.to_dict(), plan.out_dir))
    print(f"search: {path}")
    return EXIT_OK if outcome.answer is not None else EXIT_RUN_FAILED


def cmd_env(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from . import envs

    if args.env_command == "create":
        for name in args.names:
            get_backend(name)
        for name in args.names:
            try:
                st = envs.create(name, force=args.force, cuda=False if args.cpu else None)
            except envs.NoPython as exc:
                if not args.where_possible:
                    raise
                print(f"{name}: skipped: {exc}")
                continue
            versions = ", ".join(f"{k} {v}" for k, v in st.versions.items())
            print(f"{name}: {st.state} at {st.path} ({versions or st.detail})")
        return EXIT_OK
    tbl = Table(title="trainperf framework environments")
    for col in ("framework", "state", "versions", "where"):
        tbl.add_column(col, overflow="fold")
    for st in envs.states():
        versions = ", ".join(f"{k} {v}" for k, v in st.versions.items()) or st.detail
        tbl.add_row(st.name, st.state, versions, st.path)
    Console().print(tbl)
    return EXIT_OK


def cmd_align(args: argparse.Namespace) -> int:
    from .align import AlignRequest, render_table, run_alignment

    recipe = get_recipe(args.recipe)
    workload = recipe.workload
    if args.batch_size:
        workload = workload.replace(batch_size=args.batch_size)
    if args.num_classes:
        workload = workload.replace(num_classes=args.num_classes)
    framework = get_backend(args.framework).name
    if framework == "torch":
        raise ValueError("align compares another framework with torch: pass --framework mxnet")
    out = Path(args.out or f"results/align-{recipe.name}-{framework}-"
                           f"{time.strftime('%Y%m%d-%H%M%S')}")
    req = AlignRequest(recipe.name, workload, framework,
                       parse_int_list(args.devices, "--devices"),
                       parse_list(args.fc),
                       args.steps, args.timeout, out)
    _interrupt_on_sigterm()
    outcome = run_alignment(req)
    print(render_table(outcome))
    print(f"alignment: {out / 'align.json'}")
    return EXIT_OK if outcome["aligned"] else EXIT_RUN_FAILED


def cmd_data(args: argparse.Namespace) -> int:
    if args.data_command == "pack":
        from .data.pack import pack_folder

        done = pack_folder(args.image_dir, args.out, layout=args.layout)
        print(f"packed {done['images']} images of {done['classes']} classes into "
              f"{done['prefix']}.rec ({done['bytes'] / 2**20:.1f} MiB, {args.layout} layout)")
        return EXIT_OK
    if args.data_command == "synth":
        from .data.synth import synthesize

        done = synthesize(args.out, args.identities, args.images_per_identity, size=args.size,
                          seed=args.seed, val_pairs=args.val_pairs)
        print(f"wrote {done['images']} images of {done['identities']} identities to "
              f"{done['prefix']}.rec ({done['bytes'] / 2**20:.1f} MiB)")
        if done["val_bin"]:
            print(f"wrote {done['val_pairs']} verification pairs of held-out identities to "
                  f"{done['val_bin']}")
        return EXIT_OK
    return cmd_data_bench(args)


def cmd_data_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .data import bench
    from .data.layout import open_dataset
    from .env import host_env

    workload = get_recipe(args.recipe).workload
    batch = args.batch_size or workload.batch_size
    workers = parse_int_list(args.workers, "--workers")
    if min(workers) < 0:
        raise ValueError("--workers takes counts >= 0")
    if args.batches < 1 or args.warmup < 0:
        raise ValueError("--batches must be >= 1 and --warmup >= 0")
    decoders = bench.decoders_of(args.decoder)
    dataset = open_dataset(args.prefix)
    classes = 2**31 - 1  # nothing is trained: every label is welcome
    figures = []
    for name in decoders:
        # DALI decodes in its own threads: it has no in-process (0 workers) mode.
        for n in [n for n in workers if n > 0] if name == "dali" else workers:
            fig = bench.measure(dataset, name, n, task=workload.task,
                                size=workload.input_size, num_classes=classes,
                                batch_size=batch, batches=args.batches, warmup=args.warmup)
            print(f"{name} x{n}: {fig.images_per_s:.0f} images/s", file=sys.stderr, flush=True)
            figures.append(fig)
    tbl = Table(title=f"loader images/s: {args.prefix} ({workload.task} augmentation, "
                      f"{workload.input_size}px, batch {batch})")
    for col in ("decoder", "workers", "images/s", "per worker"):
        tbl.add_column(col, no_wrap=True)
    for f in figures:
        tbl.add_row(f.decoder, str(f.workers), f"{f.images_per_s:.0f}",
                    f"{f.images_per_s_per_worker:.0f}")
    Console().print(tbl)
    if args.out:
        doc = {"schema": "trainperf.data_bench/v1", "dataset": dataset.describe(),
               "recipe": args.recipe, "task": workload.task, "input_size": workload.input_size,
               "batch_size": batch, "batches": args.batches, "warmup": args.warmup,
               "env": host_env(), "figures": [bench.to_dict(f) for f in figures]}
        path = Path(args.out) / "data_bench.json"
        results.write_json_atomic(path, doc)
        print(f"data bench: {path}")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench_arguments
    from .env import gpu_count

    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    argv = bench_arguments(gpu_count(), str(out))
    print("trainperf " + " ".join(argv), file=sys.stderr)
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    commands = {"list": lambda _: cmd_list(), "run": cmd_run, "report": cmd_report,
                "export": cmd_export, "search": cmd_search, "references": cmd_references,
                "ingest": cmd_ingest, "bench": cmd_bench, "env": cmd_env, "align": cmd_align,
                "data": cmd_data, "project": project_cli.run,
                "commbench": commbench_cli.run, "train": cmd_train, "verify": cmd_verify,
                "slurm": cmd_slurm, "gpucheck": gpucheck_cli.run}
    try:
        return commands[args.command](args)
    except ValueError as exc:
        print(f"trainperf: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("trainperf: interrupted; finished runs are in events.jsonl and results.json "
              "(finish with --resume DIR)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
