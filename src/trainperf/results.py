"""The results format ``trainperf.results/v1``: the one contract between runner, report, ingest
and outside readers. Also the DLPerf export."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import stats
from .devices import mfu_peak
from .energy import case_energy
from .protocol import End, Eval, Event, Start, Step

SCHEMA = "trainperf.results/v1"
RUN_STATUSES = ("ok", "oom", "failed", "timeout")
HEAD_FIELDS = ("num_classes", "fc", "sample_ratio")
"""What a case records of its classification head; a speedup compares cases alike in them."""


@dataclass(frozen=True)
class CaseKey:
    nodes: int
    devices_per_node: int
    batch_size_per_device: int

    @property
    def name(self) -> str:
        return f"{self.nodes}n{self.devices_per_node}g"

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


def run_record(run: int, events: list[Event], status: str, error: str | None = None,
               exit_code: int | None = None) -> dict[str, Any]:
    """One run's record from the worker events of that run."""
    start = next((e for e in events if isinstance(e, Start)), None)
    end = next((e for e in events if isinstance(e, End)), None)
    steps = sorted((e for e in events if isinstance(e, Step)), key=lambda e: e.index)
    if status not in RUN_STATUSES:
        raise AssertionError(f"unknown run status {status!r}")
    flags = stats.loss_flags(end.loss_last, end.nonfinite_losses) if end else []
    if end and end.skipped_steps_in_window:
        flags.append("steps_skipped")
    if end and end.recompiles_in_window:
        flags.append("recompiled_in_window")
    warnings = []
    window_times = [e.seconds for e in steps if not e.warmup]
    if end and len(window_times) != end.window_steps:
        warnings.append(f"{end.window_steps - len(window_times)} of the window's "
                        f"{end.window_steps} steps have no step time")
    return {
        "run": run,
        "status": status,
        "samples_per_s": end.samples_per_s if end and status == "ok" else None,
        "window_s": end.window_s if end else None,
        "window_samples": end.window_samples if end else None,
        "step_times_s": window_times,
        "warmup_step_times_s": [e.seconds for e in steps if e.warmup],
        "samples_per_step": start.global_batch if start else None,
        "peak_memory_bytes": end.peak_memory_bytes if end else None,
        "memory_kind": memory_kind(start),
        "device_used_bytes": end.device_used_bytes if end else None,
        "peak_reserved_bytes": end.peak_reserved_bytes if end else None,
        "window_peak_memory_bytes": end.window_peak_memory_bytes if end else None,
        "peak_memory_bytes_per_rank": end.peak_memory_bytes_per_rank if end else None,
        "baseline_memory_bytes": start.baseline_memory_bytes if start else None,
        "predicted_peak_bytes": start.predicted_peak_bytes if start else None,
        "loss_first": end.loss_first if end else None,
        "loss_last": end.loss_last if end else None,
        "losses": end.losses if end else None,
        "skipped_steps_in_window": end.skipped_steps_in_window if end else None,
        "final_loss_scale": end.final_loss_scale if end else None,
        **startup(start, end, steps),
        **data_waits(steps, end),
        **training_outcome(events, end),
        "error": error,
        "exit_code": exit_code,
        "warnings": warnings,
        "flags": flags,
    }


def startup(start: Start | None, end: End | None, steps: list[Step]) -> dict[str, Any]:
    """The mode that ran and what it cost before the window: seconds from the run's launch to
    the end of step 0 (``End.startup_s``), step 0's own seconds, the seconds the framework
    spent compiling (timed where it compiles, ``End.compile_s``) and what that timed, how much
    longer step 0 took than the window's median step (compilation, autotuning, allocator
    growth, a first batch: not a compile time), and the recompilations inside the window."""
    first = next((e.seconds for e in steps if e.index == 0), None)
    window = sorted(e.seconds for e in steps if not e.warmup)
    median = window[len(window) // 2] if window else None
    return {"mode": start.settings.get("mode") if start else None,
            "startup_s": end.startup_s if end else None,
            "first_step_s": first,
            "compile_s": end.compile_s if end else None,
            "compile_measure": end.compile_measure if end else None,
            "first_step_excess_s": (max(first - median, 0.0)
                                    if first is not None and median else None),
            "recompiles_in_window": end.recompiles_in_window if end else None}


def data_waits(steps: list[Step], end: End | None) -> dict[str, Any]:
    """Real data: how long rank 0 waited for each window step's batch, and every rank's wait
    over the window (the largest is what held the step back). Nothing for synthetic runs."""
    if not any(e.data_wait_s is not None for e in steps):
        return {}
    per_rank = end.data_wait_s_per_rank if end else None
    return {"data_wait_s": [e.data_wait_s for e in steps if not e.warmup],
            "data_wait_window_s_per_rank": per_rank,
            "data_wait_share": (max(per_rank) / end.window_s
                                if per_rank and end.window_s else None)}


def training_outcome(events: list[Event], end: End | None) -> dict[str, Any]:
    """Training runs: the outcome and the accuracy curve; a run that did not finish keeps the
    curve of the evaluations it reported. Nothing for throughput runs."""
    if end is not None and end.train is not None:
        return {"train": end.train}
    curve = [{k: v for k, v in dataclasses.asdict(e).items() if k not in ("rank", "t")}
             for e in events if isinstance(e, Eval)]
    if not curve:
        return {}
    reached = next((e for e in curve if e["reached"]), None)
    return {"train": {"stopped_by": None, "steps": curve[-1]["step"],
                      "train_s": curve[-1]["train_s"],
                      "time_to_target_s": reached["train_s"] if reached else None,
                      "steps_to_target": reached["step"] if reached else None,
                      "samples_to_target": reached["samples"] if reached else None,
                      "best_accuracy": max(e["accuracy"] for e in curve), "curve": curve}}


def training_summary(runs: list[dict]) -> dict[str, Any]:
    """A training case over its runs: how many reached the target and the medians of those
    that did (time and steps to target). Nothing for throughput cases."""
    trained = [r["train"] for r in runs if r.get("train")]
    if not trained:
        return {}
    # A target met at step 0, before any training (results written before such runs were
    # refused), took no time to reach: it is no time to target.
    hit = [t for t in trained if t.get("time_to_target_s") is not None
           and (t.get("steps_to_target") or 0) > 0]
    return {"target": next((t.get("target") for t in trained if t.get("target")), None),
            "target_set": next((t.get("target_set") for t in trained if t.get("target_set")),
                               None),
            "runs_reached_target": len(hit),
            "median_time_to_target_s": stats.median([t["time_to_target_s"] for t in hit]),
            "median_steps_to_target": stats.median([t["steps_to_target"] for t in hit]),
            "best_accuracy": max((t["best_accuracy"] for t in trained
                                  if t.get("best_accuracy") is not None), default=None)}


def memory_kind(start: Start | None) -> str | None:
    """What the run's ``peak_memory_bytes`` is (``workerkit.MEMORY_KINDS``). Records from
    before workers named it: an allocator's peak on a GPU (torch's and JAX's were), the
    resident set on a CPU."""
    if start is None:
        return None
    env = start.env or {}
    if env.get("memory_kind"):
        return env["memory_kind"]
    return "resident_set_peak" if env.get("device_type") == "cpu" else None


def memory_model_error(run: dict) -> float | None:
    """(predicted - measured) / measured peak memory of one run; None where either is
    missing."""
    peak, predicted = run.get("peak_memory_bytes"), run.get("predicted_peak_bytes")
    return (predicted - peak) / peak if peak and predicted else None


def case_record(key: CaseKey, precision: str, runs: list[dict], start: Start | None,
                head: tuple[int, str, float] | None = None) -> dict[str, Any]:
    """``head``: (num_classes, fc, sample_ratio) of the case; recorded so that a case says what
    it ran wherever it is read, and speedups (``finish_cases``) stay within one."""
    st = stats.case_stats(
        r["samples_per_s"] if r["status"] == "ok" and not r["flags"] else None for r in runs)
    peaks = [r["peak_memory_bytes"] for r in runs if r.get("peak_memory_bytes")]
    model_errors = [e for r in runs if (e := memory_model_error(r)) is not None]
    flops = start.train_flops_per_sample if start else None
    env = start.env if start else {}
    names = env.get("device_names") or []
    peak, basis = mfu_peak(names[0] if names else None, precision,
                           start.train_flops_by_op if start else None,
                           env.get("tf32_cudnn"), env.get("tf32_matmul"))
    model_flops = flops * st.median if flops and st.median else None
    return {
        "case": key.name,
        "nodes": key.nodes,
        "devices_per_node": key.devices_per_node,
        "world_size": key.world_size,
        "batch_size_per_device": key.batch_size_per_device,
        "precision": precision,
        **(dict(zip(HEAD_FIELDS, head)) if head else {}),
        "pfc_update": start.pfc_update if start else None,
        "settings": start.settings if start else None,
        "mode": (start.settings or {}).get("mode") if start else None,
        "startup_s": stats.median([r["startup_s"] for r in runs
                                   if r.get("startup_s") is not None]),
        "compile_s": stats.median([r["compile_s"] for r in runs
                                   if r.get("compile_s") is not None]),
        "first_step_excess_s": stats.median([r["first_step_excess_s"] for r in runs
                                             if r.get("first_step_excess_s") is not None]),
        "recompiles_in_window": sum(r.get("recompiles_in_window") or 0 for r in runs),
        "runs": runs,
        "median_samples_per_s": st.median,
        "average_samples_per_s": st.average,
        "iqr_samples_per_s": st.iqr,
        "spread": st.spread,
        "ok_runs": st.ok_runs,
        "speedup": None,
        "scaling_efficiency": None,
        "train_flops_per_sample": flops,
        "train_flops_by_op": start.train_flops_by_op if start else None,
        "model_flops_per_s": model_flops,
        "mfu": model_flops / (peak * key.world_size) if model_flops and peak else None,
        "mfu_peak_basis": basis,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "memory_kind": memory_kind(start),
        "device_used_bytes": max((r["device_used_bytes"] for r in runs
                                  if r.get("device_used_bytes")), default=None),
        "tf32_conv": env.get("tf32_cudnn"),
        "tf32_matmul": env.get("tf32_matmul"),
        "memory_model_error": stats.median(model_errors),
        "memory_model": start.memory_model if start else None,
        "data_wait_share": stats.median([r["data_wait_share"] for r in runs
                                         if r["status"] == "ok"
                                         and r.get("data_wait_share") is not None]),
        **case_energy(runs),
        "flags": st.flags,
        **({"training": summary} if (summary := training_summary(runs)) else {}),
    }


SCALING_FIELDS = (*HEAD_FIELDS, "mode")
"""What cases must share for one to be the other's speedup base: the head, and the execution
mode they were timed in (a speedup across two modes would hold the modes' difference)."""


def finish_cases(cases: list[dict]) -> None:
    """Speedup, efficiency and scaling flags across the cases of one document: a case against
    the 1-device case of its own batch, head and mode (``SCALING_FIELDS``; cases that record
    none share one), never against another class count, head mode or execution mode."""
    groups: dict[tuple, list[dict]] = {}
    for c in cases:
        groups.setdefault(tuple(c.get(k) for k in SCALING_FIELDS), []).append(c)
    for group in groups.values():
        triples = []
        for c in group:
            s = stats.CaseStats(c["median_samples_per_s"], c["average_samples_per_s"],
                                c["iqr_samples_per_s"], c["ok_runs"], flags=[])
            triples.append((c["world_size"], c["batch_size_per_device"], s))
        stats.apply_scaling(triples)
        for c, (_, _, s) in zip(group, triples):
            c["speedup"] = s.speedup
            c["scaling_efficiency"] = s.scaling_efficiency
            c["flags"] = [f for f in c["flags"] if f not in ("superlinear", "throughput_falls")]
            c["flags"] += s.flags


def document(recipe: str, workload: dict, measure: dict, env: dict, cases: list[dict],
             source: dict | None = None, model: str | None = None,
             tuning: dict | None = None) -> dict[str, Any]:
    """``model`` is the key DLPerf's tables and exports use (``r100``, ``y1``, ``r50``,
    ``rn50``); ``tuning`` the speed settings the runs asked for."""
    finish_cases(cases)
    doc = {"schema": SCHEMA, "recipe": recipe, "model": model, "workload": workload,
           "measure": measure, "env": env, "cases": cases}
    doc["model"] = model_key(doc)
    if tuning is not None:
        doc["tuning"] = tuning
    if source:
        doc["source"] = source
    return doc


def default_folder(name: str) -> Path:
    """Where a command writes when no ``--out`` is given: ``results/<name>-<local time>``."""
    return Path("results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def all_runs_ok(docs: list[dict]) -> bool:
    """Whether every run of every case of these documents ended ``ok``."""
    return all(r["status"] == "ok" for doc in docs for c in doc["cases"] for r in c["runs"])


def write_json_atomic(path: Path, data: Any) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "results.v1.schema.json"
"""The published JSON Schema of this format (made by ``results_schema``)."""

REQUIRED_CASE = {"case": str, "nodes": int, "devices_per_node": int, "world_size": int,
                 "batch_size_per_device": int, "precision": str, "runs": list, "flags": list}
REQUIRED_RUN = {"run": int, "status": str, "step_times_s": list}


def validate(doc: Any) -> None:
    """Raise ValueError naming the first problem, and the field it lies in, if ``doc`` is not
    a v1 results document: by the published schema where jsonschema is installed (it is a
    dependency), else by the structural check below (a lent GPU machine installs trainperf
    without its dependencies)."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} document (schema: "
                         f"{doc.get('schema') if isinstance(doc, dict) else type(doc).__name__})")
    validator = schema_validator()
    if validator is None:
        structural_check(doc)
        return
    error = next(iter(sorted(validator.iter_errors(doc), key=_error_order)), None)
    if error is not None:
        raise ValueError(schema_error_line(error))


def _error_order(error) -> tuple:
    # The shallowest problem first: a case that is not an object says more than each of the
    # fields it then lacks.
    return (len(error.absolute_path), [str(p) for p in error.absolute_path])


def schema_error_line(error) -> str:
    """One line: where in the document (``cases[0].runs[2].status``) and what is wrong."""
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    where = where.lstrip(".") or "the document"
    if error.validator == "required":
        missing = next((f for f in error.validator_value
                        if isinstance(error.instance, dict) and f not in error.instance), "?")
        return f"field {where + '.' if where != 'the document' else ''}{missing} is missing"
    if error.validator in ("type", "anyOf"):
        got = "null" if error.instance is None else type(error.instance).__name__
        want = error.schema.get("type") or "the declared type"
        want = " or ".join(want) if isinstance(want, list) else want
        return f"field {where} is {got}, not {want}"
    message = " ".join(str(error.message).split())
    return f"field {where}: {message[:160]}"


@functools.cache
def schema_validator():
    """The schema's validator, made once; None where jsonschema is not installed."""
    try:
        import jsonschema
    except ImportError:
        return None
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    return jsonschema.validators.validator_for(schema)(schema)


def structural_check(doc: dict) -> None:
    """The fields a report cannot do without, checked without jsonschema."""
    for key, typ in (("recipe", str), ("workload", dict), ("measure", dict), ("env", dict),
                     ("cases", list)):
        if not isinstance(doc.get(key), typ):
            raise ValueError(f"results field {key!r} missing or not a {typ.__name__}")
    for c in doc["cases"]:
        for key, typ in REQUIRED_CASE.items():
            if not isinstance(c.get(key), typ):
                raise ValueError(f"case field {key!r} missing or not a {typ.__name__}")
        for key in ("median_samples_per_s", "average_samples_per_s", "iqr_samples_per_s",
                    "speedup", "scaling_efficiency"):
            if key not in c:
                raise ValueError(f"case {c['case']} lacks {key!r}")
        for r in c["runs"]:
            for key, typ in REQUIRED_RUN.items():
                if not isinstance(r.get(key), typ):
                    raise ValueError(f"run field {key!r} missing or not a {typ.__name__}")
            if r["status"] not in RUN_STATUSES:
                raise ValueError(f"run status {r['status']!r} is not one of {RUN_STATUSES}")
            for key in ("samples_per_s", "peak_memory_bytes", "loss_first", "loss_last", "error"):
                if key not in r:
                    raise ValueError(f"run {r['run']} of case {c['case']} lacks {key!r}")


EVENTS = "events.jsonl"
EVENTS_GZ = EVENTS + ".gz"


def has_events(folder: Path) -> bool:
    """Whether a results folder holds its event stream, plain or compressed (a committed
    record keeps a large one as ``events.jsonl.gz``)."""
    return (folder / EVENTS).exists() or (folder / EVENTS_GZ).exists()


def event_lines(folder: Path) -> list[str]:
    """The lines of a results folder's event stream, plain or compressed; none where it has
    none."""
    if (folder / EVENTS).exists():
        return (folder / EVENTS).read_text(encoding="utf-8").splitlines()
    if (folder / EVENTS_GZ).exists():
        with gzip.open(folder / EVENTS_GZ, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    return []


def uncompress_events(folder: Path) -> None:
    """Make a compressed event stream plain again, so that a resumed run appends to it."""
    if (folder / EVENTS_GZ).exists() and not (folder / EVENTS).exists():
        lines = event_lines(folder)
        (folder / EVENTS).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        (folder / EVENTS_GZ).unlink()


def read_json(path: str | Path, name: str) -> tuple[Path, Any]:
    """(the file, its JSON) from a file path or a folder holding ``name``; ValueError saying
    what is wrong with it in one line."""
    p = Path(path)
    if p.is_dir():
        p = p / name
    try:
        return p, json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no {name} at {p}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON ({exc.msg}, line {exc.lineno})") from None


def load(path: str | Path) -> dict[str, Any]:
    """Load and validate ``results.json`` from a folder or a file path."""
    return checked(*read_json(path, "results.json"))


def checked(path: Path, doc: Any) -> dict[str, Any]:
    """``doc``, read from ``path``, once ``validate`` passes it; ValueError naming the file."""
    try:
        validate(doc)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return doc


def model_key(doc: dict) -> str:
    """The document's model name in DLPerf's shape: its DLPerf key where it has one, else the
    backbone (ingested logs name their model there), else the recipe. Documents written before
    the ``model`` field existed fall back the same way."""
    return doc.get("model") or doc.get("workload", {}).get("backbone") or doc["recipe"]


def export_dlperf(doc: dict) -> dict[str, Any]:
    """DLPerf's JSON shape: {model: {"1n8g": {average_speed, median_speed, speedup, batch}}},
    keyed by DLPerf's model name (``r100``, ``y1``, ``r50``, ``rn50``) as its tables are."""
    model = model_key(doc)
    out: dict[str, dict] = {model: {}}
    for c in doc["cases"]:
        if c["median_samples_per_s"] is None:
            continue
        entry = {
            "average_speed": round(c["average_samples_per_s"], 2),
            "median_speed": round(c["median_samples_per_s"], 2),
            "speedup": round(c["speedup"], 2) if c["speedup"] is not None else None,
            "batch_size_per_device": c["batch_size_per_device"],
        }
        label = c["case"] if len({x["batch_size_per_device"] for x in doc["cases"]}) == 1 else (
            f"{c['case']}_b{c['batch_size_per_device']}")
        out[model][label] = entry
    return out
