"""The documentation's tables that are made, not written, each between two markers in the one
file that holds it: the GPU check's plan (``budget.plan_table``) on ``docs/gpu-check.md`` and
the GPU support matrix (``matrix.render``) on the front page, ``README.md``.

    python -m trainperf.gpucheck.readme [--root .] [--write | --check]

The suite runs ``--check``: a table that no longer says what the code or the records say fails
there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Where each table lives, relative to the repository root.
FILES = {"gpu-plan": Path("docs/gpu-check.md"), "gpu-matrix": Path("README.md")}


def blocks(results: Path) -> dict[str, str]:
    from . import budget, matrix

    return {"gpu-plan": budget.plan_table(), "gpu-matrix": matrix.render(results)}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _span(text: str, name: str) -> tuple[int, int]:
    begin, end = markers(name)
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} markers")
    return text.index(begin) + len(begin), text.index(end)


def block_of(text: str, name: str) -> str:
    start, stop = _span(text, name)
    return text[start:stop].lstrip("\n")


def replace_block(text: str, name: str, block: str) -> str:
    start, stop = _span(text, name)
    return text[:start] + "\n" + block + text[stop:]


def stale(root: Path, made: dict[str, str]) -> list[str]:
    """``FILE: table`` for each table whose file says something else (or lacks its markers)."""
    out = []
    for name, block in made.items():
        text = (root / FILES[name]).read_text(encoding="utf-8")
        try:
            same = block_of(text, name) == block
        except ValueError:
            same = False
        if not same:
            out.append(f"{FILES[name].as_posix()}: {name}")
    return out


def write(root: Path, made: dict[str, str]) -> None:
    # Every file is made before any is written, so a file without its markers changes none.
    texts = {}
    for name, block in made.items():
        path = root / FILES[name]
        try:
            texts[path] = replace_block(path.read_text(encoding="utf-8"), name, block)
        except ValueError as exc:
            raise ValueError(f"{FILES[name].as_posix()}: {exc}") from None
    for path, text in texts.items():
        path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("."),
                   help="the repository root, which holds README.md and docs/ (default: .)")
    p.add_argument("--results", type=Path, default=None,
                   help="the GPU records' folder (default: ROOT/benchmarks/results)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="replace the tables in their files")
    group.add_argument("--check", action="store_true",
                       help="exit 1 where a file's table differs from what is made now")
    args = p.parse_args(argv)
    made = blocks(args.results or args.root / "benchmarks" / "results")
    if args.write:
        try:
            write(args.root, made)
        except ValueError as exc:
            print(f"trainperf.gpucheck.readme: {exc}", file=sys.stderr)
            return 2
    elif args.check:
        old = stale(args.root, made)
        if old:
            root = "" if args.root == Path(".") else f" --root {args.root}"
            print(f"{', '.join(old)} out of date; run python -m trainperf.gpucheck.readme "
                  f"--write{root}", file=sys.stderr)
            return 1
    else:
        print("\n".join(made.values()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
