"""The documentation's passages that are made, not written: every table or status statement
that the code's declarations or the records can say, each between ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` in the pages that hold it.

    python -m trainperf.cli.pages [--root .] [--write | --check]

The suite runs ``--check``: a passage that no longer says what the code or the records say
fails there, naming the command that remakes it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Block:
    files: tuple[str, ...]
    """The pages that hold it, relative to the repository root."""
    make: Callable[[Path], str]
    """Its text from the GPU records' folder (most blocks need only the code)."""


def _frameworks(_: Path) -> str:
    from ..backends.capabilities import markdown_table

    return markdown_table() + "\n"


def _tuning(_: Path) -> str:
    from ..backends.capabilities import tuning_table

    return tuning_table() + "\n"


def _results_fields(_: Path) -> str:
    from ..results_schema import fields_markdown

    return fields_markdown()


def _export_columns(_: Path) -> str:
    from ..export import columns_markdown

    return columns_markdown()


def _gpu_plan(_: Path) -> str:
    from ..gpucheck.budget import plan_table

    return plan_table()


def _gpu_parts(_: Path) -> str:
    from ..gpucheck.budget import parts_list

    return parts_list()


def _gpu_matrix(results: Path) -> str:
    from ..gpucheck.matrix import render

    return render(results)


def _gpu_status(results: Path) -> str:
    from ..gpucheck.matrix import status

    return status(results)


def _pythons(results: Path) -> str:
    """Which Python each part runs in: trainperf's (its package's ``Requires-Python``) and each
    framework environment's (``EnvSpec.pythons``), and the Python the records ran on."""
    from ..backends import BACKENDS
    from ..gpucheck.matrix import listed

    own = metadata.metadata("trainperf")["Requires-Python"] or "any"
    if own.startswith(">=") and "," not in own:
        own = f"{own[2:]} or later"
    lines = ["| what | its Python |", "|---|---|", f"| trainperf, torch and the suite | {own} |"]
    for backend in BACKENDS.values():
        if backend.env is None:
            continue
        wanted = backend.env.pythons
        which = (f"{listed(wanted, 'or')} (trainperf's own where it is one of them, else the "
                 "first found on PATH or in pyenv)") if wanted else f"trainperf's own ({own})"
        lines.append(f"| the {backend.name} environment | {which} |")
    return "\n".join(lines) + "\n\n" + _recorded_pythons(results) + "\n"


def _recorded_pythons(results: Path) -> str:
    """The runner's Python of every recorded run, by device kind (each results file's
    ``env.python``)."""
    import json

    seen: dict[str, set[str]] = {}
    for path in sorted(results.rglob("results.json")):
        try:
            env = json.loads(path.read_text(encoding="utf-8")).get("env") or {}
        except (OSError, ValueError):
            continue
        if env.get("python"):
            seen.setdefault(env.get("device_type") or "cpu", set()).add(env["python"])
    kinds = [f"{', '.join(sorted(v))} on {'a GPU' if k == 'cuda' else 'a CPU'}"
             for k, v in sorted(seen.items())]
    return (f"The recorded runs under `benchmarks/results/` ran trainperf on Python "
            f"{'; '.join(kinds) or 'none'} (each results file's `env.python`).")


def _cuda_builds(_: Path) -> str:
    """What `trainperf env create` installs for each framework on a GPU machine (its
    ``EnvSpec.cuda_packages`` and source builds), and what a build needs besides pip."""
    from ..backends import BACKENDS
    from ..gpucheck.matrix import listed

    lines = ["| framework | on a GPU machine it installs | it also needs |", "|---|---|---|"]
    for name, backend in BACKENDS.items():
        if backend.env is None:
            lines.append(f"| {name} | nothing: trainperf's own Python, with its torch | "
                         "torch's CUDA build in that Python |")
            continue
        spec = backend.env
        shown = [f"`{p}`" for p in (*spec.cuda_packages, *spec.no_deps_packages)
                 if not p.startswith("-")]
        indexes = [p.split("=", 1)[1] for p in spec.cuda_packages if p.startswith("--")]
        where = f" from {', '.join(indexes)} and pip's index" if indexes else " from pip's index"
        if spec.packages == spec.cuda_packages:
            where += " (one build for the CPU and GPUs)"
        built = "".join(f"; `{b.requirement}` compiled in it" for b in spec.source_builds)
        needs = [tool for b in spec.source_builds
                 for tool in (*b.tools, *(["a CUDA toolkit's nvcc"] if b.cuda_env else []))]
        if spec.pythons:
            needs.insert(0, f"Python {listed(spec.pythons, 'or')}")
        lines.append(f"| {name} | {', '.join(shown)}{where}{built} | "
                     f"{', '.join(needs) or '-'} |")
    return "\n".join(lines) + "\n"


def _cuda_drivers(results: Path) -> str:
    """The CUDA release and the driver each framework's CUDA build needs (``EnvSpec.cuda``,
    ``trainperf.gpufit``'s tables), and the GPU code its own library carries, as
    benchmarks/gpucode_wheels.py read it from the wheels."""
    import json

    from ..backends import BACKENDS
    from ..gpucode import LibraryCode, sm_text
    from ..gpufit import MINOR_FLOOR, code_fit, cuda_release, driver_for

    path = results / "gpucode_wheels.json"
    record = json.loads(path.read_text(encoding="utf-8"))
    read = {b["framework"]: b for b in record["builds"]}
    lines = [f"Read by `{record['command']}` on {record['date']} "
             f"(`{path.relative_to(results.parent.parent)}`).", "",
             "| framework | CUDA build (the wheels read) | CUDA | driver | by minor version "
             "compatibility | its own library's GPU code | on sm_90 |",
             "|---|---|---|---|---|---|---|"]
    for name, backend in BACKENDS.items():
        spec = backend.env
        if spec is None or not spec.gpu_wheels:
            lines.append(f"| {name} | trainperf's own torch | the one its build names | - | - "
                         "| not read | - |")
            continue
        release = cuda_release(spec.cuda)
        build = read.get(name, {})
        if "main" in build:
            wheel = next(w for w in build["wheels"]
                         if build["main"] in w["libraries"])
            code = LibraryCode.from_json(wheel["libraries"][build["main"]])
            ptx = ("PTX " + sm_text((sm for sm, _ in code.ptx), "compute_") + " (ISA "
                   + ", ".join(isa for _, isa in code.ptx) + ")") if code.ptx else "no PTX"
            own = f"`{build['main'].rsplit('/', 1)[-1]}`: cubins {sm_text(code.cubins)}; {ptx}"
            fit = code_fit(code, (9, 0))
            on90 = {"cubin": "yes", "ptx": "PTX, compiled just in time", "none": "no"}[fit.kind]
        else:
            own = "not read: its wheel could not be downloaded where this was recorded"
            on90 = "not read"
        lines.append(f"| {name} | {', '.join(f'`{w}`' for w in spec.gpu_wheels)} | {spec.cuda} "
                     f"| {driver_for(release)} or newer | {MINOR_FLOOR[release[0]]} or newer, "
                     f"where no PTX is compiled just in time | {own} | {on90} |")
    return "\n".join(lines) + "\n"


def _real_data(_: Path) -> str:
    """Which frameworks read real data and which train to a target, as declared."""
    from ..backends import BACKENDS
    from ..gpucheck.matrix import listed

    caps = {name: b.capabilities for name, b in BACKENDS.items()}
    reads = [n for n, c in caps.items() if c.real_data]
    trains = [n for n, c in caps.items() if c.trains]
    not_trains = [n for n in caps if n not in trains]
    line = (f"Real data (`run --data`) runs in {listed(reads)}; `trainperf train` (to a "
            f"verification accuracy) in {listed(trains) or 'none'}")
    if not_trains:
        line += f", not yet in {listed(not_trains)}"
    return line + " (`trainperf list --frameworks`).\n"


def _emulated_scaling(results: Path) -> str:
    """The scaling model against 2 emulated nodes, from benchmarks/emulated_scaling.py's
    record."""
    import json

    path = results / "emulated-cpu" / "emulated_scaling.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    dlperf = json.loads((results / "scaling_model-dlperf.json").read_text(encoding="utf-8"))
    s, dl = doc["summary"], dlperf["check"]["summary"]
    bench = ", ".join(f"{c['rate']} {c['ratio']:.3f}" for c in doc["commbench"])
    lines = [f"Measured by `{doc['command']}` on {doc['machine']} "
             f"(`{path.relative_to(results.parent.parent)}`). commbench's all-reduce bus "
             f"bandwidth at 4 MiB and up, as a share of the link's rate: {bench}.", "",
             f"{s['points']} points, mean absolute error {s['mae_pct']:.1f}%, largest "
             f"{s['max_abs_pct']:.1f}%, {s['within']} of {s['points']} within 10%"
             + (f"; the model before ({doc['before']}): {s['mae_before_pct']:.1f}%, "
                f"{s['max_abs_before_pct']:.1f}%, {s['within_before']} within 10%"
                if "mae_before_pct" in s else "") + ". The same model against DLPerf's "
             f"published rows (`{dlperf['command']}`): {dl['rows_in_scope']} rows, mean "
             f"absolute error {dl['mae_pct_in_scope']:.2f}% (signed {dl['bias_pct_in_scope']:+.2f}"
             "%).", "",
             "| case | link | 1 node | 2 nodes measured | predicted | error | before | "
             "limited by |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in doc["points"]:
        before = f"{r['error_before_pct']:+.1f}%" if "error_before_pct" in r else "-"
        lines.append(f"| {r['case']} | {r['rate']} | {r['base_samples_per_s']:.1f} | "
                     f"{r['measured']:.1f} | {r['predicted']:.1f} | {r['error_pct']:+.1f}% | "
                     f"{before} | {r['limit']} |")
    return "\n".join(lines) + "\n"


def _run_spread(results: Path) -> str:
    """How far apart the runs of one case lie, on a GPU and on a CPU, as the records show it:
    the range of each case's run figures over their median, for every case with two ok runs
    or more (a follower's records, which hold no figures, left out)."""
    import json
    import statistics

    from ..result_files import json_files

    spreads: dict[str, list[float]] = {"cuda": [], "cpu": []}
    for _, text in json_files(results, ("results.json",)):
        doc = json.loads(text)
        kind = (doc.get("env") or {}).get("device_type")
        if kind not in spreads or doc.get("role") == "follower":
            continue
        for case in doc["cases"]:
            speeds = [r["samples_per_s"] for r in case["runs"]
                      if r["status"] == "ok" and r.get("samples_per_s")]
            if len(speeds) >= 2:
                spreads[kind].append((max(speeds) - min(speeds)) / statistics.median(speeds))
    lines = []
    for kind, where in (("cuda", "On a GPU"), ("cpu", "On a CPU")):
        got = spreads[kind]
        if not got:
            lines.append(f"- {where}: no record holds a case of two runs or more yet.")
            continue
        lines.append(f"- {where}: the runs of {sum(x < 0.01 for x in got)} of the {len(got)} "
                     f"recorded cases of two runs or more lie within 1% of each other, those "
                     f"of {sum(x >= 0.10 for x in got)} 10% or more apart (median "
                     f"{100 * statistics.median(got):.1f}%, widest {100 * max(got):.0f}%).")
    return "\n".join(lines) + "\n"


BLOCKS: dict[str, Block] = {
    "frameworks": Block(("README.md", "docs/frameworks.md"), _frameworks),
    "tuning": Block(("docs/frameworks.md",), _tuning),
    "gpu-status": Block(("README.md", "docs/frameworks.md", "docs/on-your-gpus.md"),
                        _gpu_status),
    "gpu-matrix": Block(("README.md",), _gpu_matrix),
    "gpu-parts": Block(("docs/gpu-check.md",), _gpu_parts),
    "gpu-plan": Block(("docs/gpu-check.md",), _gpu_plan),
    "pythons": Block(("docs/install.md",), _pythons),
    "cuda-builds": Block(("docs/on-your-gpus.md",), _cuda_builds),
    "cuda-drivers": Block(("docs/install.md",), _cuda_drivers),
    "real-data": Block(("docs/real-data.md", "docs/time-to-accuracy.md"), _real_data),
    "results-fields": Block(("docs/results-format.md",), _results_fields),
    "export-columns": Block(("docs/exports.md",), _export_columns),
    "emulated-scaling": Block(("docs/scaling-model.md",), _emulated_scaling),
    "run-spread": Block(("docs/compare.md",), _run_spread),
}


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


def made(results: Path, names: list[str] | None = None) -> dict[str, str]:
    return {name: BLOCKS[name].make(results) for name in names or BLOCKS}


def stale(root: Path, texts: dict[str, str]) -> list[str]:
    """``FILE: NAME`` for each block a page says otherwise (or lacks the markers of)."""
    out = []
    for name, block in texts.items():
        for file in BLOCKS[name].files:
            try:
                same = block_of((root / file).read_text(encoding="utf-8"), name) == block
            except (OSError, ValueError):
                same = False
            if not same:
                out.append(f"{file}: {name}")
    return out


def write(root: Path, texts: dict[str, str]) -> None:
    # Every page is made before any is written, so a page without its markers changes none.
    pages: dict[Path, str] = {}
    for name, block in texts.items():
        for file in BLOCKS[name].files:
            path = root / file
            try:
                pages[path] = replace_block(
                    pages.get(path) or path.read_text(encoding="utf-8"), name, block)
            except ValueError as exc:
                raise ValueError(f"{file}: {exc}") from None
    for path, text in pages.items():
        path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainperf.cli.pages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path("."),
                   help="the repository root, which holds README.md and docs/ (default: .)")
    p.add_argument("--results", type=Path, default=None,
                   help="the GPU records' folder (default: ROOT/benchmarks/results)")
    p.add_argument("--only", help="these blocks (comma-separated) instead of all: "
                                  + ", ".join(BLOCKS))
    group = p.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help="replace the blocks in their pages")
    group.add_argument("--check", action="store_true",
                       help="exit 1 where a page's block differs from what is made now")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else None
    unknown = [n for n in names or () if n not in BLOCKS]
    if unknown:
        p.error(f"no block {', '.join(unknown)}; the blocks: {', '.join(BLOCKS)}")
    texts = made(args.results or args.root / "benchmarks" / "results", names)
    if args.write:
        try:
            write(args.root, texts)
        except ValueError as exc:
            print(f"trainperf.cli.pages: {exc}", file=sys.stderr)
            return 2
    elif args.check:
        old = stale(args.root, texts)
        if old:
            root = "" if args.root == Path(".") else f" --root {args.root}"
            print(f"{', '.join(old)} out of date; run python -m trainperf.cli.pages "
                  f"--write{root}", file=sys.stderr)
            return 1
    else:
        print("\n".join(texts.values()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
