"""Results as one table: a row per run or per case, each setting that defines it and each
figure in a column of its own, written as CSV, Parquet or JSON Lines, or handed over as a
pandas DataFrame (``frame``). The columns are declared once (``COLUMNS``); every format, the
DataFrame and docs/exports.md take their names, order and types from there.

CSV and JSON Lines need the standard library only; Parquet needs pyarrow and the DataFrame
pandas (the ``table`` extra)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from . import results
from .energy import wh_per_million
from .result_files import json_files, superseded

LEVELS = ("run", "case")
FORMATS = ("csv", "parquet", "jsonl")
FLAG_SEPARATOR = ";"
TABLE_EXTRA = "pip install 'trainperf[table]'"

TYPES = ("string", "Int64", "Float64", "boolean")
"""The column types, by their pandas names (the nullable dtypes); Parquet's are in
``_arrow_type``."""


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    levels: tuple[str, ...]
    description: str


BOTH = ("run", "case")
RUN = ("run",)
CASE = ("case",)

COLUMNS: tuple[Column, ...] = (
    Column("case", "string", BOTH, "the case's name: nodes and devices per node (`1n8g`)"),
    Column("run", "Int64", RUN, "the run's number within its case, from 1"),
    Column("framework", "string", BOTH, "trainperf's name of the framework (`torch`, `mxnet`, "
           "...); an ingested log: the framework its tool ran"),
    Column("mode", "string", BOTH, "the execution mode that ran (eager, compiled, ...); "
           "empty where the results predate modes"),
    Column("recipe", "string", BOTH, "the recipe (an ingested log: its model)"),
    Column("model", "string", BOTH, "DLPerf's model key where there is one (`r100`, `rn50`), "
           "else the backbone"),
    Column("backbone", "string", BOTH, "the backbone network"),
    Column("loss", "string", BOTH, "the head's loss (`arcface`, `cosface`, `softmax`, ...)"),
    Column("fc", "string", BOTH, "how the classification layer is split: `dp` (replicated), "
           "`mp` (sharded over devices), `pfc` (sharded and sampled)"),
    Column("sample_ratio", "Float64", BOTH, "the share of classes a sampling head keeps per "
           "step (1.0: all)"),
    Column("num_classes", "Int64", BOTH, "classes of the classification head"),
    Column("pfc_update", "string", BOTH, "how a sampled head's weights were updated (`sparse`, "
           "`full`)"),
    Column("precision", "string", BOTH, "`fp32`, `fp16`, `bf16`, ..."),
    Column("channels_last", "boolean", BOTH, "whether the images were laid out channels-last"),
    Column("data_source", "string", BOTH, "`synthetic` or `recordio` (real data)"),
    Column("batch_size_per_device", "Int64", BOTH, "samples per device per step"),
    Column("world_size", "Int64", BOTH, "devices over all nodes"),
    Column("nodes", "Int64", BOTH, "nodes"),
    Column("devices_per_node", "Int64", BOTH, "devices on each node"),
    Column("device_type", "string", BOTH, "`cuda`, `cpu`, ..."),
    Column("device_name", "string", BOTH, "the first device's name (`NVIDIA H200`); on CPUs "
           "the CPU model"),
    Column("framework_version", "string", BOTH, "the framework's version"),
    Column("python", "string", BOTH, "the Python version the framework ran under"),
    Column("cuda_version", "string", BOTH, "the CUDA version the framework was built with"),
    Column("trainperf_version", "string", BOTH, "trainperf's version"),
    Column("trainperf_commit", "string", BOTH, "trainperf's commit (`-dirty`: with changes)"),
    Column("status", "string", RUN, "how the run ended: `ok`, `oom`, `failed`, `timeout`"),
    Column("samples_per_s", "Float64", RUN, "the run's throughput over its timed window "
           "(empty unless it ended ok)"),
    Column("runs", "Int64", CASE, "runs of the case"),
    Column("ok_runs", "Int64", CASE, "runs that count in the case's statistics (ended ok, "
           "no flags)"),
    Column("median_samples_per_s", "Float64", CASE, "the median of the counted runs' "
           "throughput"),
    Column("average_samples_per_s", "Float64", CASE, "the mean of the counted runs' "
           "throughput"),
    Column("iqr_samples_per_s", "Float64", CASE, "the interquartile range of the counted "
           "runs' throughput"),
    Column("spread", "Float64", CASE, "the counted runs' spread relative to their median"),
    Column("samples_per_s_per_device", "Float64", BOTH, "throughput per device: "
           "`samples_per_s` (a case: `median_samples_per_s`) over `world_size`"),
    Column("speedup", "Float64", BOTH, "the case's median over that of the 1-device case of "
           "the same batch, head and mode, in the same results file"),
    Column("scaling_efficiency", "Float64", BOTH, "the case's speedup over its world size"),
    Column("mfu", "Float64", BOTH, "the case's model FLOP utilisation: model FLOP/s over the "
           "devices' peak (empty where the peak is not known, e.g. CPUs)"),
    Column("energy_j", "Float64", RUN, "GPU: joules the run's boards drew in its window, from "
           "their energy counter; empty where not measured"),
    Column("samples_per_j", "Float64", BOTH, "GPU: samples per joule over the window (a case: "
           "the median over its counted runs); empty where not measured or where only some "
           "nodes' boards were read"),
    Column("wh_per_million_samples", "Float64", BOTH, "GPU: watt-hours per million samples, "
           "10^6 / `samples_per_j` / 3600"),
    Column("peak_memory_bytes", "Int64", BOTH, "peak memory, of the kind `memory_kind` "
           "names (a case: the largest of its runs)"),
    Column("memory_kind", "string", BOTH, "what `peak_memory_bytes` is: allocator_peak, "
           "device_used (device-wide, where the framework keeps no peak) or resident_set_peak "
           "(CPU); figures of different kinds are not comparable"),
    Column("device_used_bytes", "Int64", BOTH, "GPU: device-wide used memory at the end, "
           "every process's (a case: the largest of its runs)"),
    Column("memory_model_error", "Float64", BOTH, "(predicted - measured) / measured peak "
           "memory (a case: the median over its runs)"),
    Column("startup_s", "Float64", BOTH, "seconds from the run's launch to the end of its "
           "first step (a case: the median)"),
    Column("compile_s", "Float64", BOTH, "seconds the framework spent compiling, timed where "
           "it compiles; 0 in a mode that compiles nothing (a case: the median)"),
    Column("first_step_excess_s", "Float64", BOTH, "how much longer the first step took than "
           "the window's median step (a case: the median)"),
    Column("after_mode_probe", "boolean", RUN, "the mode probe ran this mode before the run: "
           "its start-up and compile figures are warm-cache ones"),
    Column("flags", "string", BOTH, "the run's (a case: the case's) flags, joined by `;`; "
           "empty when none"),
    Column("case_flags", "string", RUN, "the flags of the run's case, joined by `;`; empty "
           "when none"),
    Column("error", "string", RUN, "why the run did not end ok"),
    Column("exit_code", "Int64", RUN, "the run's exit status"),
    Column("source", "string", BOTH, "the results.json the row came from (inside an "
           "archive: the archive's path, then the file's path inside it)"),
)


def columns(level: str = "run") -> list[Column]:
    """The columns of a table at ``level``, in their fixed order."""
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}: one of {', '.join(LEVELS)}")
    return [c for c in COLUMNS if level in c.levels]


# -- reading -------------------------------------------------------------------------------


def documents(paths: Iterable[str | Path] | str | Path) -> list[tuple[str, dict]]:
    """(source, checked document) of every results.json the paths name or hold, the paths in
    their order, the files under a folder in sorted order (unpacked ones, then archived); a
    follower node's records and the node folders of a job (whose documents hold their
    figures) left out."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    found, seen = [], set()
    for path in paths:
        for source, doc in _documents_at(Path(path)):
            # Folders that overlap (a tree and one of its folders) give each file once.
            if (key := os.path.abspath(source)) not in seen:
                seen.add(key)
                found.append((source, doc))
    return found


def _documents_at(path: Path) -> list[tuple[str, dict]]:
    if path.is_file():
        return [_parsed(str(path), path.read_bytes())]
    if not path.is_dir():
        raise ValueError(f"no such file or folder: {path}")
    files = list(json_files(path, ("results.json",)))
    skip = superseded(path, [name for name, _ in files])
    found = [_parsed(str(path / name), text) for name, text in files if name not in skip]
    # A follower node's records hold its runs' exits, not their figures (node 0's do).
    found = [(source, doc) for source, doc in found if doc.get("role") != "follower"]
    if not found:
        raise ValueError(f"no results.json under {path}")
    return found


def _parsed(source: str, text: bytes) -> tuple[str, dict]:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{source} is not valid JSON ({exc})") from None
    return source, results.checked(Path(source), doc)


# -- rows ----------------------------------------------------------------------------------


def rows(paths: Iterable[str | Path] | str | Path, level: str = "run") -> list[dict[str, Any]]:
    """One dict per run (or per case) of the results under ``paths``, keyed by the level's
    columns in order, each value of its column's type or None."""
    cols = columns(level)
    out = []
    for source, doc in documents(paths):
        for raw in _raw_rows(source, doc, level):
            out.append({c.name: _cast(c, raw.get(c.name), source) for c in cols})
    return out


def _raw_rows(source: str, doc: dict, level: str) -> Iterable[dict[str, Any]]:
    common = _document_fields(doc) | {"source": source}
    for case in doc["cases"]:
        defined = common | _case_fields(doc, case)
        if level == "case":
            yield defined | _case_figures(case)
            continue
        for run in case["runs"]:
            yield defined | _run_figures(case, run)


def _document_fields(doc: dict) -> dict[str, Any]:
    env, workload = doc["env"], doc["workload"]
    # The devices the run used: not ``gpus``, which lists the host's even for a CPU run.
    names = env.get("device_names") or []
    if not names and env.get("device_type") == "cpu" and env.get("cpu_model"):
        names = [env["cpu_model"]]
    return {
        # The runner records its own framework name; an ingested log only the env's.
        "framework": doc.get("framework") or env.get("framework"),
        "recipe": doc["recipe"],
        "model": results.model_key(doc),
        "backbone": workload.get("backbone"),
        "loss": workload.get("loss"),
        "channels_last": workload.get("channels_last"),
        "data_source": (doc.get("data") or {}).get("source"),
        "device_type": env.get("device_type"),
        "device_name": names[0] if names else None,
        "framework_version": env.get("framework_version"),
        "python": env.get("python"),
        "cuda_version": env.get("cuda_version"),
        "trainperf_version": env.get("trainperf_version"),
        "trainperf_commit": env.get("trainperf_commit"),
    }


def _case_fields(doc: dict, case: dict) -> dict[str, Any]:
    """What defines the case, and the case's figures a run row carries too. The head's
    settings come from the case where it records them (since class sweeps), else from the
    workload all cases share."""
    workload = doc["workload"]
    head = {k: case[k] if case.get(k) is not None else workload.get(k)
            for k in results.HEAD_FIELDS}
    return {
        "case": case["case"],
        **head,
        "pfc_update": case.get("pfc_update") or workload.get("pfc_update_ran"),
        "precision": case["precision"],
        "mode": case.get("mode") or _first(r.get("mode") for r in case["runs"]),
        "batch_size_per_device": case["batch_size_per_device"],
        "world_size": case["world_size"],
        "nodes": case["nodes"],
        "devices_per_node": case["devices_per_node"],
        "speedup": case.get("speedup"),
        "scaling_efficiency": case.get("scaling_efficiency"),
        "mfu": case.get("mfu"),
    }


def _case_figures(case: dict) -> dict[str, Any]:
    median = case.get("median_samples_per_s")
    return {
        "runs": len(case["runs"]),
        "ok_runs": case.get("ok_runs"),
        "median_samples_per_s": median,
        "average_samples_per_s": case.get("average_samples_per_s"),
        "iqr_samples_per_s": case.get("iqr_samples_per_s"),
        "spread": case.get("spread"),
        "samples_per_s_per_device": _per_device(median, case["world_size"]),
        "samples_per_j": case.get("median_samples_per_j"),
        "wh_per_million_samples": case.get("wh_per_million_samples"),
        "peak_memory_bytes": case.get("peak_memory_bytes"),
        "memory_kind": case.get("memory_kind"),
        "device_used_bytes": case.get("device_used_bytes"),
        "memory_model_error": case.get("memory_model_error"),
        "startup_s": case.get("startup_s"),
        "compile_s": case.get("compile_s"),
        "first_step_excess_s": case.get("first_step_excess_s"),
        "flags": _flags(case.get("flags")),
    }


def _run_figures(case: dict, run: dict) -> dict[str, Any]:
    speed = run.get("samples_per_s")
    return {
        "run": run["run"],
        "mode": run.get("mode") or case.get("mode"),
        "status": run["status"],
        "samples_per_s": speed,
        "samples_per_s_per_device": _per_device(speed, case["world_size"]),
        "energy_j": run.get("energy_j"),
        "samples_per_j": run.get("samples_per_j"),
        "wh_per_million_samples": wh_per_million(run.get("samples_per_j")),
        "peak_memory_bytes": run.get("peak_memory_bytes"),
        "memory_kind": run.get("memory_kind") or case.get("memory_kind"),
        "device_used_bytes": run.get("device_used_bytes"),
        "memory_model_error": results.memory_model_error(run),
        "startup_s": run.get("startup_s"),
        "compile_s": run.get("compile_s"),
        "first_step_excess_s": run.get("first_step_excess_s"),
        "after_mode_probe": run.get("after_mode_probe"),
        "flags": _flags(run.get("flags")),
        "case_flags": _flags(case.get("flags")),
        "error": run.get("error"),
        "exit_code": run.get("exit_code"),
    }


def _first(values: Iterable[Any]) -> Any:
    return next((v for v in values if v is not None), None)


def _per_device(speed: Any, world_size: int) -> float | None:
    return speed / world_size if isinstance(speed, (int, float)) and world_size else None


def _flags(flags: Any) -> str | None:
    """Flags are words (``high_spread``, ``loss_nonfinite``): joined by ``;``, no list cell
    needed in any format; none is empty, so that CSV and the typed formats agree."""
    if not flags:
        return None
    if not isinstance(flags, list):
        return flags  # not flags: the column's type check names it
    return FLAG_SEPARATOR.join(str(f) for f in flags)


def _cast(column: Column, value: Any, source: str) -> Any:
    """``value`` as its column's type, None kept; ValueError naming the file and the column
    for a value that is not of it (a field the results check leaves optional)."""
    if value is None:
        return None
    try:
        return _CASTS[column.type](value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {column.name} is {value!r}, not {column.type}") from None


def _to_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(value)
    if value != int(value):
        raise ValueError(value)
    return int(value)


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(value)
    return float(value)


def _to_str(value: Any) -> str:
    # Versions are recorded as numbers by some frameworks (cuDNN's 91900): a string column
    # takes them as written.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(value)
    return str(value)


def _to_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(value)
    return value


_CASTS: dict[str, Callable[[Any], Any]] = {
    "string": _to_str, "Int64": _to_int, "Float64": _to_float, "boolean": _to_bool}


# -- writing -------------------------------------------------------------------------------


def write_csv(table: list[dict[str, Any]], level: str, out: IO[str]) -> None:
    """A header of the level's columns, then one line per row; a missing value is empty, a
    boolean ``true`` or ``false``, a float as Python writes it shortest (it reads back equal)."""
    writer = csv.writer(out, lineterminator="\n")
    names = [c.name for c in columns(level)]
    writer.writerow(names)
    for row in table:
        writer.writerow([_csv_cell(row[n]) for n in names])


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def write_jsonl(table: list[dict[str, Any]], out: IO[str]) -> None:
    """One JSON object per line, every column present, a missing value null (and so is a
    NaN or infinity, which JSON cannot hold)."""
    for row in table:
        clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                 for k, v in row.items()}
        out.write(json.dumps(clean, allow_nan=False) + "\n")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ValueError(f"parquet needs pyarrow: {TABLE_EXTRA}") from None
    return pyarrow, pyarrow.parquet


def _arrow_type(pa, name: str):
    return {"string": pa.string(), "Int64": pa.int64(), "Float64": pa.float64(),
            "boolean": pa.bool_()}[name]


def arrow_table(table: list[dict[str, Any]], level: str):
    """The rows as a pyarrow Table of the level's columns and types; each field carries its
    description in its metadata."""
    pa, _ = _pyarrow()
    fields, arrays = [], []
    for c in columns(level):
        kind = _arrow_type(pa, c.type)
        fields.append(pa.field(c.name, kind, metadata={"description": c.description}))
        arrays.append(pa.array([row[c.name] for row in table], type=kind))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def write_parquet(table: list[dict[str, Any]], level: str, out: Path) -> None:
    _, pq = _pyarrow()
    pq.write_table(arrow_table(table, level), out)


def frame(paths: Iterable[str | Path] | str | Path, level: str = "run"):
    """The results under ``paths`` (a results folder, a folder holding many, a results.json,
    or a list of them) as a pandas DataFrame: the columns of ``rows`` in order, each of its
    nullable dtype (``Int64``, ``Float64``, ``string``, ``boolean``)."""
    try:
        import pandas as pd
    except ImportError:
        raise ValueError(f"the DataFrame needs pandas: {TABLE_EXTRA}") from None
    table = rows(paths, level)
    return pd.DataFrame({c.name: pd.array([row[c.name] for row in table], dtype=c.type)
                         for c in columns(level)})


def export(paths: list[str | Path], fmt: str, level: str = "run",
           out: str | Path | None = None) -> int:
    """Write the table of ``paths`` in ``fmt`` to ``out`` (stdout where None; Parquet needs a
    file); the number of rows written. Everything is read and checked before anything is
    written, so a bad file leaves no half table behind."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "parquet":
        if out is None:
            raise ValueError("--format parquet writes a binary file: give it with --out FILE")
        _pyarrow()
    table = rows(paths, level)
    if fmt == "parquet":
        write_parquet(table, level, Path(out))
        return len(table)
    text = io.StringIO()
    if fmt == "csv":
        write_csv(table, level, text)
    else:
        write_jsonl(table, text)
    if out is None:
        sys.stdout.write(text.getvalue())
    else:
        Path(out).write_text(text.getvalue(), encoding="utf-8", newline="")
    return len(table)


# -- documentation -------------------------------------------------------------------------


def columns_markdown() -> str:
    """The column table of docs/exports.md, made from ``COLUMNS``."""
    lines = ["| column | type | level | description |", "|---|---|---|---|"]
    for c in COLUMNS:
        lines.append(f"| `{c.name}` | {c.type} | {', '.join(c.levels)} | {c.description} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainperf.export",
                                     description="print the export's column table")
    parser.add_argument("--columns-markdown", action="store_true", required=True,
                        help="the Markdown table of docs/exports.md")
    parser.parse_args(argv)
    sys.stdout.write(columns_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
