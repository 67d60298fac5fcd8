"""One report.md (and plots) over result folders and capacity-search folders."""

from __future__ import annotations

import json
from pathlib import Path

from .. import results
from ..result_files import plan_documents
from .breakdown import Analyse, breakdown_section
from .capacity import capacity_section
from .classes import classes_section, plot_classes
from .energy import energy_section
from .input import input_section
from .markdown import render_report, unique_labels
from .plots import plot_scaling
from .references import references_section
from .training import is_training, plot_training, training_section


def is_search_dir(path: str | Path) -> bool:
    """A capacity search's folder: search.json and no results of its own (its probes have)."""
    p = Path(path)
    return (p / "search.json").exists() and not (p / "results.json").exists()


def documents_in(folder: str | Path) -> list[Path]:
    """The results.json of every plan in ``folder`` as a command wrote it (one plan's folder,
    several frameworks' or sweep points', a job's); ValueError in one line where it holds
    none."""
    found = plan_documents(folder)
    if not found:
        raise ValueError(f"{folder}: no results.json in it or below it"
                         if Path(folder).exists() else f"{folder}: no such folder")
    return found


def write_report(dirs: list[str], out: Path, with_references: bool = False,
                 analyse: Analyse | None = None) -> Path:
    """Write ``out/report.md`` (and plots beside it) for result and search folders;
    ``analyse``: what bounds a case with a breakdown (``scale.bottleneck.analyser``)."""
    searches = [d for d in dirs if is_search_dir(d)]
    docs = [results.load(f) for d in dirs if d not in searches for f in documents_in(d)]
    labels = unique_labels(docs)
    plots = plot_scaling(docs, labels, out) if docs else []
    plots += plot_classes(docs, out)
    extra = [] if plots or not docs else [
        "(No plots: install the `plot` extra, matplotlib, to get them.)"]
    if docs:
        extra.insert(0, energy_section(docs, labels))
    # Training runs have no synthetic twin: their data waits are in their results.
    pipeline = input_section([d for d in docs if not is_training(d)])
    if pipeline:
        extra.insert(0, pipeline)
    training = training_section(docs)
    if training:
        extra.insert(0, training)
        plots = plot_training(docs, out) + plots
    phases = breakdown_section(docs, labels, out, analyse) if docs else None
    if phases:
        extra.insert(0, phases)
    for d in searches:
        extra.append(capacity_section(json.loads((Path(d) / "search.json").read_text())))
    if with_references:
        sections = [references_section(d, label) for d, label in zip(docs, labels)]
        extra += [s for s in sections if s] or ["(No published figure matches these results.)"]
    sweep = classes_section(docs)
    text = render_report(docs, plots, extra, [sweep] if sweep else None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.md"
    path.write_text(text, encoding="utf-8")
    return path
