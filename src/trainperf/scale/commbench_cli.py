"""``trainperf commbench``: the fabric benchmark's command line (parsing only)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..config import parse_bytes
from ..env import gpu_count
from .commbench import (DTYPE_BYTES, OPS, CommbenchError, CommbenchSpec, markdown,
                        run_commbench)

# A CPU sweep stops where gloo's bandwidth has long levelled off, so two ranks finish in
# seconds; GPUs go where NCCL's does.
DEFAULT_MAX_BYTES = {"cpu": "16MiB", "cuda": "1GiB"}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("commbench", help="latency and bus bandwidth of all-reduce, all-gather "
                       "and reduce-scatter against message size (nccl-tests' definitions)")
    p.add_argument("--devices", type=int, default=2,
                   help="processes per node: GPUs, or CPU ranks on gloo (default 2)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rdzv", metavar="HOST:PORT",
                   help="c10d rendezvous every node joins (needed when --nnodes > 1)")
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
    return p


def spec_from_args(args: argparse.Namespace) -> CommbenchSpec:
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


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    out = Path(args.out or f"results/commbench-{time.strftime('%Y%m%d-%H%M%S')}")
    sizes = spec.sizes
    print(f"commbench: {spec.world_size} ranks on {spec.device}, {len(sizes)} sizes "
          f"{sizes[0]}..{sizes[-1]} bytes, {', '.join(spec.ops)}", file=sys.stderr, flush=True)
    try:
        doc = run_commbench(spec, out)
    except CommbenchError as exc:
        print(f"trainperf: commbench failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trainperf: commbench interrupted; every rank was stopped", file=sys.stderr)
        return 130
    print(markdown(doc))
    print(f"commbench: {out / 'commbench.json'}")
    return 0
