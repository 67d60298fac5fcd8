"""The README's tables that are made, not written: the GPU check's plan (``budget.plan_table``)
and the GPU support matrix (``matrix.render``), each between two markers.

    python -m trainperf.gpucheck.readme [--write README.md | --check README.md]

The suite runs ``--check``: a table that no longer says what the code or the records say fails
there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def blocks(results: Path) -> dict[str, str]:
    from . import budget, matrix

    return {"gpu-plan": budget.plan_table(), "gpu-matrix": matrix.render(results)}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def block_of(text: str, name: str) -> str:
    begin, end = markers(name)
    return text[text.index(begin) + len(begin):text.index(end)].lstrip("\n")


def replace_block(text: str, name: str, block: str) -> str:
    begin, end = markers(name)
    start, stop = text.index(begin) + len(begin), text.index(end)
    return text[:start] + "\n" + block + text[stop:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, help="replace the tables in this file")
    group.add_argument("--check", type=Path, help="exit 1 where this file's tables differ")
    args = p.parse_args(argv)
    made = blocks(args.results)
    if args.write:
        text = args.write.read_text(encoding="utf-8")
        for name, block in made.items():
            text = replace_block(text, name, block)
        args.write.write_text(text, encoding="utf-8")
    elif args.check:
        text = args.check.read_text(encoding="utf-8")
        stale = [name for name, block in made.items() if block_of(text, name) != block]
        if stale:
            print(f"{args.check}: {', '.join(stale)} out of date; run python -m "
                  f"trainperf.gpucheck.readme --write {args.check}", file=sys.stderr)
            return 1
    else:
        print("\n".join(made.values()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
