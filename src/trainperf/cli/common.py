"""What several commands share: exit codes, option groups, and turning options into the typed
settings the modules below take (``Topology``, ``Tuning``, ``Measure``, a plan's changes)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..backends import BACKENDS
from ..config import (MEMORY_FORMATS, MXNET_KVSTORES, STALL_FLOOR_S, TF32_MODES, Measure,
                      Topology, Tuning, parse_bytes, parse_int_list)
from ..stall import STEP_MULTIPLE

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130


def add_topology_options(p: argparse.ArgumentParser) -> None:
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


def add_tuning_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mxnet-kvstore", choices=list(MXNET_KVSTORES), default=Tuning.mxnet_kvstore,
                   help="mxnet on several devices: one process per rank over Horovod "
                        "(horovod, default: NCCL on GPUs, gloo on a CPU), one process per rank "
                        "with MXNet's parameter server (dist_sync: every gradient through a "
                        "CPU server process per node) or one process for all (device)")
    p.add_argument("--tf-onednn", action="store_true",
                   help="tf: turn TensorFlow's oneDNN custom CPU ops on (off by default: "
                        "they corrupt memory on AVX-512 CPUs in 1x1 stride-2 convolutions "
                        "with few channels)")
    p.add_argument("--memory-format", choices=list(MEMORY_FORMATS), default="auto",
                   help="backbone layout: auto (each framework's default on the device: "
                        "channels-last for torch on a GPU, `trainperf list --frameworks`), "
                        "channels_last or channels_first (the seeds' NCHW rows)")
    p.add_argument("--mode", default=None,
                   help="execution mode(s) in each framework's own terms (torch eager, "
                        "compile; oneflow eager, graph; ...: `trainperf list --frameworks`), "
                        "default (each framework's first) or best (each mode probed, the "
                        "runs in the fastest); a list sweeps them. Default: best when "
                        "several frameworks are compared, else default")
    p.add_argument("--tf32", choices=list(TF32_MODES), default=Tuning.tf32,
                   help="GPU fp32 convolutions and matrix products, in every framework by its "
                        "own switch: on (TF32 where the device has it; default) or off (full "
                        "fp32)")
    p.add_argument("--no-cudnn-benchmark", action="store_true",
                   help="GPU: do not let cuDNN time its algorithms (it does by default)")
    p.add_argument("--ddp-bucket-mb", type=float, default=Tuning.ddp_bucket_mb,
                   help=f"DDP gradient bucket size in MiB (default {Tuning.ddp_bucket_mb:g})")
    p.add_argument("--ddp-broadcast-buffers", action="store_true",
                   help="re-send rank 0's BatchNorm buffers before every forward (off by "
                        "default, as in arcface_torch)")
    p.add_argument("--no-ddp-static-graph", action="store_true",
                   help="do not tell DDP the graph is the same every step")


def add_run_options(p: argparse.ArgumentParser) -> None:
    """`trainperf run`'s options (``search`` and ``slurm`` take them too)."""
    p.add_argument("--framework", default="torch",
                   help=f"backend(s) to run: {', '.join(BACKENDS)}; a list sweeps them "
                        "side by side (default torch)")
    add_topology_options(p)
    p.add_argument("--batch-size", help="per device; a list sweeps cases (default: recipe's)")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--fc", help="head mode(s): dp, mp, pfc; a list sweeps them, each in a "
                   "folder of its own (default: recipe's)")
    p.add_argument("--sample-ratio", help="pfc ratio(s); a list sweeps them (default 0.1 with "
                   "--fc pfc)")
    p.add_argument("--pfc-update", choices=["sparse", "dense"],
                   help="pfc: update sampled rows only (default) or the whole matrix "
                        "(arcface_torch)")
    p.add_argument("--num-classes", help="identities; a list sweeps them, each in a folder of "
                   "its own, and the report plots speed and memory against them (default: "
                   "recipe's)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (default: %(default)g)")
    p.add_argument("--stall-timeout", default="auto", metavar="auto|off|S",
                   help="stop a run as hung once it has gone this long without a step after "
                        f"its first: auto (default) {STEP_MULTIPLE:g}x the median step of "
                        "the case so far, at least --stall-floor; S seconds; off: only --timeout "
                        "(a --breakdown's profiled run reports its steps at its end, so only "
                        "--timeout applies to it)")
    p.add_argument("--stall-floor", type=float, metavar="S",
                   help="--stall-timeout auto: the least it is, and all it is until the case "
                        f"has steps (default {STALL_FLOOR_S:g}: about 3x the longest "
                        "compilation recorded)")
    p.add_argument("--memory-limit", help="per-process memory cap for CPU runs, e.g. 8GiB")
    p.add_argument("--threads", type=int,
                   help="CPU runs: intra-op threads per process, in every framework "
                        "(default: the node's cores / processes)")
    add_tuning_options(p)
    p.add_argument("--out", help="output folder (default results/<recipe>-<time>)")


def reword(p: argparse.ArgumentParser, **helps: str) -> None:
    """Another help for options ``p`` shares with other commands (by their ``dest``), where
    this command takes them otherwise: no help may promise what the command refuses."""
    for action in p._actions:
        if action.dest in helps:
            action.help = helps.pop(action.dest)
    assert not helps, f"no such options: {sorted(helps)}"


def add_loader_options(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--decoder", default="auto",
                   help=f"{prefix}JPEG decoder (auto: the fastest installed; see "
                        "`trainperf data bench`)")
    p.add_argument("--loader-workers", type=int,
                   help=f"{prefix}loader processes per rank (default: cores per rank less "
                        "one, 1 to 8)")


def tuning_from_args(args: argparse.Namespace) -> Tuning:
    return Tuning(cudnn_benchmark=not args.no_cudnn_benchmark,
                  ddp_bucket_mb=args.ddp_bucket_mb,
                  ddp_static_graph=not args.no_ddp_static_graph,
                  ddp_broadcast_buffers=args.ddp_broadcast_buffers,
                  mxnet_kvstore=args.mxnet_kvstore, tf_onednn=args.tf_onednn,
                  tf32=args.tf32, memory_format=args.memory_format)


def topology_from_args(args: argparse.Namespace) -> Topology:
    """The topology every case shares (``--devices`` makes the cases)."""
    if args.rdzv:
        from ..rendezvous import parse_endpoint

        parse_endpoint(args.rdzv)
    return Topology(1, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                    args.device, args.rdzv, args.rdzv_timeout)


def measure_from_args(args: argparse.Namespace) -> Measure:
    return Measure(runs=args.runs, iters=args.iters, warmup=args.warmup,
                   timeout_s=args.timeout, **stall_from_args(args),
                   memory_limit_bytes=parse_bytes(args.memory_limit) if args.memory_limit
                   else None, threads=getattr(args, "threads", None))


def stall_from_args(args: argparse.Namespace) -> dict:
    """``Measure``'s stall fields from ``--stall-timeout auto|off|S`` and ``--stall-floor``."""
    text = str(args.stall_timeout).strip().lower()
    floor = getattr(args, "stall_floor", None)
    if text != "auto" and floor is not None:
        raise ValueError(f"--stall-floor sizes --stall-timeout auto, not --stall-timeout "
                         f"{args.stall_timeout}")
    if text == "auto":
        return {} if floor is None else {"stall_floor_s": floor}
    if text == "off":
        return {"stall_auto": False}
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise ValueError(f"--stall-timeout takes auto, off or seconds, got "
                         f"{args.stall_timeout!r}")
    return {"stall_timeout_s": seconds}


def plan_from_args(args: argparse.Namespace) -> list:
    """The plans of `trainperf run` (``search`` and ``slurm`` plan with them too)."""
    from ..plans import (open_data, parse_fcs, parse_frameworks, parse_modes, parse_num_classes,
                         parse_ratios, sweep_points, throughput_plans, workload_changes)
    from ..recipes import get_recipe

    classes = parse_num_classes(args.num_classes) if args.num_classes else None
    fcs = parse_fcs(args.fc) if args.fc else None
    ratios = parse_ratios(args.sample_ratio) if args.sample_ratio else None
    sweep = sweep_points(classes, fcs, ratios, get_recipe(args.recipe).workload.fc)
    # A single value of each goes in as before; a sweep's points carry the values that vary.
    heads_vary = len(fcs or []) > 1 or len(ratios or []) > 1
    changes = workload_changes(None if heads_vary else (fcs or [None])[0],
                               None if heads_vary else (ratios or [None])[0],
                               precision=args.precision, pfc_update=args.pfc_update,
                               num_classes=classes[0] if classes and len(classes) == 1 else None)
    batches = (parse_int_list(args.batch_size, "--batch-size") if args.batch_size else None)
    out = getattr(args, "resume", None) or args.out
    data = None
    prefix = getattr(args, "data", None)
    frameworks = parse_frameworks(args.framework)
    if prefix:
        data = open_data(prefix, args.decoder, args.loader_workers, frameworks)
    return throughput_plans(args.recipe, changes, batches,
                            parse_int_list(args.devices, "--devices"), measure_from_args(args),
                            tuning_from_args(args), topology_from_args(args), frameworks,
                            Path(out) if out else None, data,
                            not getattr(args, "no_synthetic_baseline", False), sweep,
                            parse_modes(args.mode, frameworks) if args.mode else None)
