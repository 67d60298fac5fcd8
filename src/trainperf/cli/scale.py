"""`trainperf commbench` (the fabric: collective latency and bus bandwidth against message
size) and `trainperf project` (throughput at scales not run, from a measured results.json)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import parse_bytes
from ..env import gpu_count
from ..scale.commbench import DTYPE_BYTES, OPS
from ..scale.model import DEFAULT_INTER_LATENCY_S, DEFAULT_INTRA_LATENCY_S
from .common import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED

# A CPU sweep stops where gloo's bandwidth has long levelled off, so two ranks finish in
# seconds; GPUs go where NCCL's does.
DEFAULT_MAX_BYTES = {"cpu": "16MiB", "cuda": "1GiB"}


def register(sub) -> None:
    p = sub.add_parser("commbench", help="latency and bus bandwidth of all-reduce, all-gather "
                       "and reduce-scatter against message size (nccl-tests' definitions)")
    p.add_argument("--devices", type=int, default=2,
                   help="processes per node: GPUs, or CPU ranks on gloo (default 2)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rdzv", metavar="HOST:PORT",
                   help="rendezvous every node joins, as `trainperf run --rdzv` (needed when "
                        "--nnodes > 1); the node at HOST hosts it")
    p.add_argument("--rdzv-id", default="trainperf-commbench",
                   help="job name at the rendezvous (the same on every node)")
    p.add_argument("--ops", default=",".join(OPS), help=f"collectives (default {','.join(OPS)})")
    p.add_argument("--min-bytes", default="4KiB", help="smallest message (default 4KiB)")
    p.add_argument("--max-bytes", help="largest message (default: "
                   + ", ".join(f"{v} on {k}" for k, v in DEFAULT_MAX_BYTES.items()) + ")")
    p.add_argument("--factor", type=float, default=2.0,
                   help="each size is the last times this (default 2)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before them (default 5)")
    p.add_argument("--dtype", choices=list(DTYPE_BYTES), default="float32")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds for the whole benchmark (default 900)")
    p.add_argument("--out", help="output folder (default results/commbench-<time>)")
    p.set_defaults(handler=cmd_commbench)

    p = sub.add_parser("project", help="predict throughput at larger scales from a measured "
                       "step and a communication model")
    p.add_argument("results", metavar="RESULTS", help="a results.json or the folder holding it")
    p.add_argument("--to", required=True, metavar="SCALES",
                   help="target scales, NODESnDEVICESg, e.g. 2n8g,4n8g,16n8g,64n8g")
    p.add_argument("--fabric", action="append", metavar="COMMBENCH",
                   help="commbench.json (or its folder): one measured on a single node gives "
                        "the intra-node figures, one on several nodes the inter-node ones; "
                        "repeat for both")
    p.add_argument("--intra-bw", type=float, metavar="GB/s",
                   help="intra-node bus bandwidth (nccl-tests busbw, 1 GB = 1e9 bytes)")
    p.add_argument("--inter-bw", type=float, metavar="GB/s",
                   help="inter-node bus bandwidth (nccl-tests busbw of a multi-node ring)")
    p.add_argument("--intra-latency-us", type=float, default=DEFAULT_INTRA_LATENCY_S * 1e6,
                   help="latency of one collective within a node (default %(default)g)")
    p.add_argument("--inter-latency-us", type=float, default=DEFAULT_INTER_LATENCY_S * 1e6,
                   help="latency of one collective across nodes (default %(default)g)")
    p.add_argument("--base", metavar="CASE", help="case to start from, e.g. 1n1g or 1n8g "
                   "(default: the 1-device case, else the largest single-node one)")
    p.add_argument("--batch-size", type=int, help="batch per device of the base case, when "
                   "the results hold several")
    p.add_argument("--bucket-mb", type=float, help="gradient bucket size in MiB (default: the "
                   "results' --ddp-bucket-mb, else 25)")
    p.add_argument("--grad-bytes", type=int, choices=(2, 4), default=4,
                   help="bytes per all-reduced gradient: 4 when parameters stay fp32 (trainperf's "
                        "autocast), 2 when the model is cast to half (default 4)")
    p.add_argument("--no-overlap", action="store_true",
                   help="the all-reduce runs after the backward instead of during it")
    p.add_argument("--no-stragglers", action="store_true",
                   help="every rank takes the base's average step (default: each rank's step "
                        "drawn from the base's measured step times, a step as long as its "
                        "slowest rank's)")
    p.add_argument("--backbone-params", type=int,
                   help="parameters of a backbone trainperf has no model of")
    p.add_argument("--backbone-gflops", type=float,
                   help="its forward GFLOPs per sample (multiply-add = 2 FLOPs)")
    p.add_argument("--out", help="project.json, or a folder for it (default: beside RESULTS)")
    p.set_defaults(handler=cmd_project)


def commbench_spec(args: argparse.Namespace):
    from ..scale.commbench import CommbenchSpec

    gpus = gpu_count() if args.device != "cpu" else 0
    device = args.device if args.device != "auto" else ("cuda" if gpus else "cpu")
    if device == "cuda" and args.nnodes == 1 and 0 < gpus < args.devices:
        raise ValueError(f"--devices {args.devices} but this machine has {gpus} GPU(s)")
    ops = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    return CommbenchSpec(
        devices_per_node=args.devices, nnodes=args.nnodes, rdzv=args.rdzv, rdzv_id=args.rdzv_id,
        ops=ops, min_bytes=parse_bytes(args.min_bytes),
        max_bytes=parse_bytes(args.max_bytes or DEFAULT_MAX_BYTES[device]),
        factor=args.factor, iters=args.iters, warmup=args.warmup, dtype=args.dtype,
        device=device, timeout_s=args.timeout)


def cmd_commbench(args: argparse.Namespace) -> int:
    from ..procs import interrupt_on_sigterm
    from ..results import default_folder
    from ..scale.commbench import CommbenchError, markdown
    from ..scale.commbench_launch import run_commbench

    spec = commbench_spec(args)
    interrupt_on_sigterm()  # a scheduler's SIGTERM stops every rank, as Ctrl-C does
    out = Path(args.out) if args.out else default_folder("commbench")
    sizes = spec.sizes
    print(f"commbench: {spec.world_size} ranks on {spec.device}, {len(sizes)} sizes "
          f"{sizes[0]}..{sizes[-1]} bytes, {', '.join(spec.ops)}", file=sys.stderr, flush=True)
    try:
        doc = run_commbench(spec, out)
    except CommbenchError as exc:
        print(f"trainperf: commbench failed: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    except KeyboardInterrupt:
        print("trainperf: commbench interrupted; every rank was stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(markdown(doc))
    print(f"commbench: {out / 'commbench.json'}")
    return EXIT_OK


def cmd_project(args: argparse.Namespace) -> int:
    from ..results import write_json_atomic
    from ..scale.project import out_path, project_results, results_paths

    fabric = {"intra_bw": args.intra_bw, "inter_bw": args.inter_bw,
              "intra_latency_us": args.intra_latency_us,
              "inter_latency_us": args.inter_latency_us, "commbench": args.fabric}
    job = {"backbone_params": args.backbone_params, "backbone_gflops": args.backbone_gflops,
           "bucket_mb": args.bucket_mb, "grad_bytes": args.grad_bytes,
           "overlap": not args.no_overlap}
    paths = results_paths(args.results)
    if len(paths) > 1 and args.out and args.out.endswith(".json"):
        raise ValueError(f"{args.results} holds {len(paths)} plans' results: give --out a "
                         "folder, where each plan's projection goes as its folder lies")
    # Every plan checked and projected before any file is written: a plan whose results
    # cannot be projected (no base case) stops the command with nothing half done.
    done = [(path, *project_results(path, args.to, fabric, job, args.base, args.batch_size,
                                    not args.no_stragglers)) for path in paths]
    for path, doc, predictions, _ in done:
        if len(done) > 1:
            print(f"{path}:")
        print_projection(doc, predictions)
        target = out_path(args.out, path, Path(args.results))
        write_json_atomic(target, doc)
        print(f"projection: {target}")
    return EXIT_OK


def print_projection(doc: dict, predictions: list) -> None:
    from rich.console import Console
    from rich.table import Table

    base = doc["base"]
    tbl = Table(title=f"projected from {base['case']} ({base['median_samples_per_s']:.1f} "
                      f"samples/s, batch {base['batch_size_per_device']} per device)")
    for col in ("scale", "devices", "samples/s", "speedup", "efficiency", "step ms",
                "compute ms", "stragglers ms", "cores taken ms", "exposed all-reduce ms",
                "head comm ms", "limited by", "largest overhead"):
        tbl.add_column(col, no_wrap=col in ("scale", "devices"))
    for p in predictions:
        tbl.add_row(p.scale, str(p.world_size), f"{p.samples_per_s:.1f}", f"{p.speedup:.2f}",
                    f"{p.scaling_efficiency:.3f}", f"{p.step_s * 1e3:.1f}",
                    f"{(p.backbone_s + p.head_s) * 1e3:.1f}", f"{p.straggler_s * 1e3:.2f}",
                    f"{p.comm_cpu_s * 1e3:.2f}", f"{p.allreduce_exposed_s * 1e3:.2f}",
                    f"{p.head_comm_s * 1e3:.2f}", p.limit,
                    f"{p.overhead} ({p.overhead_share * 100:.1f}%)")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: keep every column whole
        console = Console(width=200)
    console.print(tbl)
