"""The command line. One module per command family registers its parsers and handlers; a
handler parses, calls the module that owns the work, and prints:

- ``run``: list, run, search, train, verify, bench
- ``data``: data pack, synth, bench
- ``env``: env create, list; align
- ``reports``: report, compare, history, export, ingest, references
- ``scale``: commbench, project; ``emulate``: emulate; ``slurm``: slurm
- ``gpucheck``: gpucheck

``common`` holds the option groups several commands share and the conversion of options into
plans. Exit status: 0 when every run finished, 1 when some run failed (it is still recorded;
for ``compare``: some case got slower), 2 for a usage error, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys

from . import data, emulate, env, gpucheck, reports, run, scale, slurm
from .common import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE

__all__ = ["EXIT_INTERRUPTED", "EXIT_OK", "EXIT_RUN_FAILED", "EXIT_USAGE", "build_parser", "main"]

FAMILIES = (run, reports, env, data, scale, emulate, slurm, gpucheck)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainperf", description=(
        "Measure training throughput of face recognition and ResNet50 workloads."))
    sub = parser.add_subparsers(dest="command", required=True)
    for family in FAMILIES:
        family.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as exc:
        print(f"trainperf: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("trainperf: interrupted; finished runs are in events.jsonl and results.json "
              "(finish with --resume DIR)", file=sys.stderr)
        return EXIT_INTERRUPTED
