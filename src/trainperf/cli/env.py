"""`trainperf env` (each framework's environment) and `trainperf align` (does a framework train
the same numbers as PyTorch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..backends import BACKENDS, get_backend
from ..config import parse_int_list, parse_list
from .common import EXIT_OK, EXIT_RUN_FAILED


def register(sub) -> None:
    env = sub.add_parser("env", help="per-framework environments")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    create = env_sub.add_parser("create", help="build a framework's environment (on a GPU "
                                "machine its CUDA build, refused where it has no code for the "
                                "GPUs or the driver is too old)")
    create.add_argument("names", nargs="+", metavar="FRAMEWORK")
    create.add_argument("--force", action="store_true", help="rebuild even if it is ready")
    create.add_argument("--cpu", action="store_true",
                        help="a CPU build is enough: keep any ready build, a CUDA one too (it "
                             "runs on the CPU), and build the CPU one only where there is none "
                             "or it is outdated for another reason than this machine's GPUs")
    create.add_argument("--where-possible", action="store_true",
                        help="skip, with a line saying why, a framework whose wheels exist "
                             "for no Python this machine has (any other failure still fails)")
    create.set_defaults(handler=cmd_create)
    env_sub.add_parser("list", help="each framework's environment: its state, CPU or CUDA "
                                    "build, versions, packages, the package indexes they came "
                                    "from and its size on disk (`trainperf list --frameworks`: "
                                    "what each runs); on a GPU machine, whether each CUDA "
                                    "build has code for its GPUs and its driver runs it"
                       ).set_defaults(handler=cmd_list)

    align = sub.add_parser("align", help="check that a framework trains the same numbers as "
                           "PyTorch from the same weights and batch")
    align.add_argument("recipe")
    align.add_argument("--framework", required=True)
    align.add_argument("--devices", default="1,2", help="rank counts to check (default 1,2)")
    align.add_argument("--fc", default="dp,mp", help="head modes to check (default dp,mp)")
    align.add_argument("--mode", default="default",
                       help="the candidate's execution mode (default: its framework's first; "
                            "`trainperf list --frameworks` names them)")
    align.add_argument("--steps", type=int, default=5, help="SGD steps (default 5)")
    align.add_argument("--batch-size", type=int, help="per device (default: the recipe's)")
    align.add_argument("--num-classes", type=int)
    on_gpu = ", ".join(n for n in BACKENDS if "cuda" in get_backend(n).capabilities.float64_on)
    align.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="where both sides run (default cpu, where every framework's "
                            "worker computes float64; cuda only for a framework whose worker "
                            f"declares float64 there: {on_gpu})")
    align.add_argument("--dtype", default="float64", choices=["float64"],
                       help="what both sides compute in: float64, the only dtype whose "
                            "rounding stays far under every difference of rule (every "
                            "framework's worker computes in it on a CPU)")
    align.add_argument("--controls", nargs="?", const="all", metavar="NAMES",
                       help="also break one rule at a time in the framework and show that the "
                            "check fails on each: all, or some of no_weight_decay, momentum, "
                            "no_clip, lr_schedule, straight_through (comma-separated)")
    align.add_argument("--keep-dumps", action="store_true",
                       help="keep every step's weights (large at full size)")
    align.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    align.add_argument("--out", help="folder for the weights, runs and align.json")
    align.set_defaults(handler=cmd_align)


def cmd_create(args: argparse.Namespace) -> int:
    from .. import envs
    from ..backends import get_backend

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
        line = f"{name}: {st.state} at {st.path} ({versions or st.detail})"
        if st.state == "outdated" and st.runs:
            line += (f"; {st.detail}: it runs CPU runs, all --cpu asks for (`trainperf env "
                     f"create {name}` builds it for the GPUs)")
        print(line)
    _print_gpu_lines(args.names)
    return EXIT_OK


def _print_gpu_lines(names: list[str]) -> None:
    """On a GPU machine (or with a stand-in GPU): whether each framework's CUDA build has
    code for the GPUs, and whether the driver runs it (``envs.gpu_line``)."""
    from .. import envs, gpufit

    gpus = gpufit.gpus()
    if not gpus:
        return
    lines = [line for line in (envs.gpu_line(name, gpus) for name in names) if line]
    if lines:
        print(f"GPUs: {envs.gpu_text(gpus)}")
        print("\n".join(lines))


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .. import envs

    tbl = Table(title="trainperf framework environments",
                caption=f"each built in {envs.env_root()}/FRAMEWORK")
    for col in ("framework", "state", "build", "versions", "packages", "indexes", "size",
                "detail"):
        # Short words stay whole on a narrow terminal; the long cells fold instead.
        tbl.add_column(col, overflow="fold",
                       no_wrap=col in ("framework", "state", "build", "size"))
    states = envs.states()
    for st in states:
        versions = "\n".join(f"{k} {v}" for k, v in st.versions.items()) or "-"
        ours = st.state not in ("built-in", "external")
        build = "-" if st.cuda is None else "CUDA" if st.cuda else "CPU"
        # An index option in the requirements shows with the indexes, not as a package.
        packages = "\n".join(p for p in st.packages if not p.startswith("-")) or "-"
        indexes = ("-" if not st.packages else "not recorded" if st.indexes is None
                   else "\n".join(st.indexes))
        folder = Path(st.path)
        size = size_text(envs.disk_bytes(folder)) if ours and folder.is_dir() else "-"
        # An interpreter of another folder's is named; a build lies where the caption says.
        detail = st.detail if ours else f"{st.detail}: {st.path}"
        tbl.add_row(st.name, st.state, build, versions, packages, indexes, size, detail)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: keep every cell whole, as `list` does
        console = Console(width=200)
    console.print(tbl)
    _print_gpu_lines([st.name for st in states])
    return EXIT_OK


def size_text(n: int) -> str:
    """Bytes in decimal units, as ``du --si`` and pip write them (``2.1 GB``)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def align_request(args: argparse.Namespace):
    """The ``AlignRequest`` of `trainperf align`'s options, checked."""
    from ..align import request

    return request(args.recipe, args.framework, parse_int_list(args.devices, "--devices"),
                   parse_list(args.fc), args.steps, args.timeout,
                   Path(args.out) if args.out else None, args.batch_size, args.num_classes,
                   parse_list(args.controls) if args.controls else None, args.keep_dumps,
                   args.mode, args.device)


def cmd_align(args: argparse.Namespace) -> int:
    from ..align import render_table, run_alignment
    from ..procs import interrupt_on_sigterm

    req = align_request(args)
    interrupt_on_sigterm()
    outcome = run_alignment(req)
    print(render_table(outcome))
    print(f"alignment: {req.out / 'align.json'}")
    ok = outcome["aligned"] and outcome["controls_caught"] is not False
    return EXIT_OK if ok else EXIT_RUN_FAILED
