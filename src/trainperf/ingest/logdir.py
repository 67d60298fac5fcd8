"""The DLPerf folder layout, ``.../bz<batch>/<N>n<G>g/<model>_b<batch>_<precision>_<run>.log``,
read into one results document per (model, precision)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import results, stats
from .formats import Format, detect, figures, get_format

CASE_DIR = re.compile(r"^(\d+)n(\d+)g$")
LOG_NAME = re.compile(r"^(?P<model>.+?)_b(?P<batch>\d+)_(?P<precision>[A-Za-z0-9]+)_(?P<run>\d+)\.log$")
METHODS = ("exact", "dlperf")


@dataclass
class LogFile:
    path: Path
    model: str
    batch: int
    precision: str
    run: int
    nodes: int
    devices_per_node: int


@dataclass
class Ingested:
    docs: dict[tuple[str, str], dict]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(path, reason) of every file that gave no run."""
    format_name: str = ""
    detected: bool = False

    def write(self, out: Path) -> list[tuple[str, str, int, Path]]:
        """Write each document as ``out/results.json``, or, where there are several, as
        ``out/<model>_<precision>/results.json``: (model, precision, cases, path) of each."""
        written = []
        for (model, precision), doc in self.docs.items():
            folder = out / f"{model}_{precision}" if len(self.docs) > 1 else out
            results.write_json_atomic(folder / "results.json", doc)
            written.append((model, precision, len(doc["cases"]), folder / "results.json"))
        return written


def find_logs(root: Path) -> tuple[list[LogFile], list[tuple[str, str]]]:
    logs, skipped = [], []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = str(path.relative_to(root))
        m = LOG_NAME.match(path.name)
        case = CASE_DIR.match(path.parent.name)
        if not m or not case:
            skipped.append((rel, "not <model>_b<batch>_<precision>_<run>.log in a <N>n<G>g folder"))
            continue
        logs.append(LogFile(path, m["model"], int(m["batch"]), m["precision"].lower(),
                            int(m["run"]), int(case[1]), int(case[2])))
    return logs, skipped


def read_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def ingest_logdir(root: str | Path, format_name: str = "auto", method: str = "exact") -> Ingested:
    """Parse every log under ``root``; unparseable files are listed in ``skipped``."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder")
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    detected = format_name == "auto"
    fmt: Format | None = None if detected else get_format(format_name)
    logs, skipped = find_logs(root)
    if not logs:
        raise ValueError(f"no <N>n<G>g/<model>_b<batch>_<precision>_<run>.log files under {root}")
    if fmt is None:
        fmt, _ = detect([line for log in logs[:20] for line in read_lines(log.path)])

    groups: dict[tuple[str, str], dict[tuple[int, int, int], list[dict]]] = {}
    for log in logs:
        prints = fmt.parse(read_lines(log.path))
        world = log.nodes * log.devices_per_node
        if not prints:
            skipped.append((str(log.path.relative_to(root)), f"no {fmt.name} lines"))
            continue
        fig = figures(fmt, prints, log.batch * world, log.nodes)
        chosen = fig.exact if method == "exact" else fig.dlperf
        flags = stats.loss_flags(fig.loss_last)
        record = {
            "run": log.run,
            "status": "ok" if chosen is not None else "failed",
            "samples_per_s": chosen,
            "samples_per_s_exact": fig.exact,
            "samples_per_s_dlperf": fig.dlperf,
            "method": method,
            "window": fig.window,
            "method_note": fig.note,
            "step_times_s": [],
            "samples_per_step": log.batch * world,
            "peak_memory_bytes": None,
            "loss_first": None,
            "loss_last": fig.loss_last,
            "error": fig.errors.get(method),
            "flags": flags,
            "source_file": str(log.path.relative_to(root)),
        }
        case_key = (log.nodes, log.devices_per_node, log.batch)
        groups.setdefault((log.model, log.precision), {}).setdefault(case_key, []).append(record)

    docs = {}
    for (model, precision), cases in groups.items():
        case_docs = []
        for (nodes, gpus, batch), runs in sorted(cases.items(), key=lambda kv: (kv[0][2],
                                                                                 kv[0][0] * kv[0][1])):
            key = results.CaseKey(nodes, gpus, batch)
            case_docs.append(results.case_record(key, precision, sorted(runs, key=lambda r: r["run"]),
                                                 None))
        source = {"format": fmt.name, "method": method, "logdir": str(root),
                  "dlperf_rule": fmt.dlperf.text, "format_detected": detected}
        docs[(model, precision)] = results.document(
            model, {"backbone": model, "precision": precision}, {}, {"framework": fmt.framework},
            case_docs, source)
    return Ingested(docs, skipped, fmt.name, detected)
