"""`trainperf gpucheck` (``make gpu-check``): the offline GPU check, in parts."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..config import parse_list
from ..gpucheck.plan import PARTS, STAGES
from .common import EXIT_OK, EXIT_RUN_FAILED


def register(sub) -> None:
    p = sub.add_parser("gpucheck", help="the offline GPU check (make gpu-check), in parts: "
                                        "correctness, parity, the headline cases, the seeds' "
                                        "table, capacity, peers, real data")
    p.add_argument("--part", type=int, choices=list(PARTS),
                   help="run one part (part 1 fits 6 minutes on one H100, install "
                        "included; each later part 5); default: every stage")
    p.add_argument("--stages", help="only these stages of the part, comma-separated ("
                                    + ", ".join(s.id for s in STAGES) + ")")
    p.add_argument("--mode", choices=["auto", "gpu", "cpu"], default="auto",
                   help="gpu, or cpu's tiny sizes; auto: gpu where torch sees CUDA")
    p.add_argument("--cap-scale", type=float, default=1.0,
                   help="multiply every stage's time cap (default 1)")
    p.add_argument("--out", help="folder for the summary, plots and archive (default "
                                 "gpucheck-results/<time>-<part>); must be new or empty")
    p.add_argument("--work", help="folder for the raw results and logs (default "
                                  "gpucheck-work/<time>-<part>)")
    p.add_argument("--plan", action="store_true",
                   help="print every part's stages, caps and expected times on one H100, and "
                        "run nothing")
    p.set_defaults(handler=cmd_gpucheck)


def cmd_gpucheck(args: argparse.Namespace) -> int:
    if args.plan:
        from ..gpucheck.budget import plan_table

        print(plan_table(), end="")
        return EXIT_OK
    from ..gpucheck.orchestrate import run_check
    from ..procs import interrupt_on_sigterm

    interrupt_on_sigterm()  # a scheduler's SIGTERM stops the stage and writes the summary
    name = f"part{args.part}" if args.part else "all"
    out = Path(args.out or f"gpucheck-results/{time.strftime('%Y%m%d-%H%M%S')}-{name}")
    doc = run_check(out, args.part, args.mode, parse_list(args.stages) if args.stages else None,
                    args.cap_scale, Path(args.work) if args.work else None)
    print((out / "summary.md").read_text(encoding="utf-8"))
    print(f"gpucheck: {out / 'summary.md'}")
    failed = [s["stage"] for s in doc["stages"] if s["status"] in ("failed", "timeout")]
    return EXIT_RUN_FAILED if failed else EXIT_OK
