"""The published JSON Schemas of ``results.json`` (``trainperf.results/v1``) and of a results
folder's ``events.jsonl``, made from the field tables below and from the worker events'
dataclasses (``protocol``). The files under ``schemas/`` are this module's output; the suite
holds them equal, and holds the tables to the keys ``results`` writes.

    python -m trainperf.results_schema --write    # regenerate src/trainperf/schemas/
    python -m trainperf.results_schema --check    # exit 1 where a file is out of date
    python -m trainperf.results_schema --fields   # the Markdown field tables of the docs

Standard library only. A v1 reader ignores fields it does not know, as ``protocol.decode``
does, so every object admits more properties than it names: the schema catches a missing,
mistyped or out-of-range field, not a new one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

from . import protocol
from .results import RUN_STATUSES, SCHEMA

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
RESULTS_FILE = "results.v1.schema.json"
EVENTS_FILE = "events.v1.schema.json"
BASE_ID = "https://trainperf.dev/schemas/"

# A field: (name, type, required, description). Types: str, int, num, bool, obj, list,
# list[num], list[int], list[str], list[obj]; a trailing "?" admits null.
Field = tuple[str, str, bool, str]

RUN_FIELDS: list[Field] = [
    ("run", "int", True, "the run's number within its case, from 1"),
    ("status", "status", True, "how the run ended: " + ", ".join(RUN_STATUSES)),
    ("samples_per_s", "num?", True, "samples per second over the measured window, all ranks "
     "together; null unless status is ok"),
    ("window_s", "num?", False, "seconds of the measured window"),
    ("window_samples", "int?", False, "samples trained in the window"),
    ("step_times_s", "list[num]", True, "seconds of each measured step (rank 0's clock)"),
    ("warmup_step_times_s", "list[num]", False, "seconds of each warm-up step"),
    ("samples_per_step", "int?", False, "global batch: samples per step over all ranks"),
    ("peak_memory_bytes", "int?", True, "largest memory figure of any rank, of the kind "
     "memory_kind names"),
    ("memory_kind", "str?", False, "what peak_memory_bytes is: allocator_peak (the framework "
     "allocator's peak), device_used (device-wide used memory, where the framework keeps no "
     "peak) or resident_set_peak (CPU)"),
    ("device_used_bytes", "int?", False, "GPU: largest device-wide used memory (every "
     "process's) of any rank at the end, from the CUDA driver"),
    ("peak_reserved_bytes", "int?", False, "largest peak the allocator reserved"),
    ("window_peak_memory_bytes", "int?", False, "the peak inside the measured window"),
    ("peak_memory_bytes_per_rank", "list[int]?", False, "each rank's peak"),
    ("baseline_memory_bytes", "int?", False, "device memory in use before the model was built"),
    ("predicted_peak_bytes", "int?", False, "the memory model's prediction of the peak"),
    ("loss_first", "num?", True, "the loss of the first step"),
    ("loss_last", "num?", True, "the loss of the last step"),
    ("losses", "list[num?]?", False, "every step's loss"),
    ("skipped_steps_in_window", "int?", False, "steps the loss scaler skipped in the window"),
    ("final_loss_scale", "num?", False, "the fp16 loss scale at the end"),
    ("mode", "str?", False, "the execution mode that ran (eager, compile, graph, ...)"),
    ("startup_s", "num?", False, "seconds from the run's launch to the end of its step 0"),
    ("first_step_s", "num?", False, "seconds of the first step"),
    ("compile_s", "num?", False, "seconds the framework spent compiling, timed where it "
     "compiles; 0 in a mode that compiles nothing"),
    ("compile_measure", "str?", False, "what compile_s timed, in the framework's terms"),
    ("first_step_excess_s", "num?", False, "the first step's excess over the window's median "
     "step (compilation, autotuning, allocator growth, a first batch)"),
    ("recompiles_in_window", "int?", False, "compilations counted inside the window"),
    ("after_mode_probe", "bool", False, "the mode probe ran this mode on this machine before "
     "the run: its start-up and compile figures are warm-cache ones"),
    ("data_wait_s", "list[num?]", False, "real data: rank 0's wait for each window step's "
     "batch"),
    ("data_wait_window_s_per_rank", "list[num]?", False, "real data: each rank's wait over "
     "the window"),
    ("data_wait_share", "num?", False, "real data: the largest rank's wait as a share of the "
     "window"),
    ("train", "obj", False, "training runs: the outcome and the accuracy curve"),
    ("energy_j", "num?", False, "GPU: joules the run's boards drew in the window, from their "
     "energy counter (NVML), summed over the boards of every node read (energy_scope); null "
     "where not measured"),
    ("energy_error_j", "num?", False, "the most energy_j can be off, given the counter's "
     "readings around the window's edges"),
    ("samples_per_j", "num?", False, "window samples / energy_j, where every node's boards "
     "were read; null otherwise (a part is never scaled to the whole)"),
    ("energy_scope", "str?", False, "which nodes' boards energy_j covers: 1 node, all N "
     "nodes, or node(s) K of N"),
    ("energy_devices", "list[str]", False, "the boards read, by UUID"),
    ("energy_method", "str?", False, "how energy_j was read"),
    ("energy_note", "str?", False, "why energy was not measured (a CPU run, no NVML, a board "
     "without a counter), or which nodes it lacks"),
    ("error", "str?", True, "why the run did not end ok, in one line"),
    ("exit_code", "int?", False, "the launcher's exit status"),
    ("stall_timeout_s", "num?", False, "seconds without a step after which the run would have "
     "been stopped as hung, as it stood when its steps ended (sized from the case's step "
     "times, or fixed by --stall-timeout); null where no stall limit applied"),
    ("retries", "list[obj]", False, "attempts given up (a port taken by another process) "
     "before this one"),
    ("unreachable", "obj", False, "several nodes: the node that became unreachable during "
     "the run, as the nodes agreed: node, step (rank 0's steps done when it was last heard), "
     "link_down (its own link went down, which it saw itself), link, seen_by"),
    ("link_probes", "obj", False, "several nodes, node 0: its probes of each other node's "
     "link, by node: [rank 0's steps at the probe's start, seconds to send a block and have "
     "it acknowledged]"),
    ("step_change", "obj", False, "several nodes: a lasting change of the step time inside the "
     "run: at_step, before_s, after_s, ratio, each link's probes before and after, and the "
     "verdict (link, model or unclear)"),
    ("nodes_lost", "bool", False, "several nodes: the run failed because the nodes lost each "
     "other (a node or a link gone), not for anything of the work's own; a resumed plan runs "
     "it again"),
    ("warnings", "list[str]", False, "what went wrong without spoiling the measurement"),
    ("flags", "list[str]", False, "why the run's speed is left out of the case's statistics "
     "(loss_nan, recompiled_in_window, ...)"),
]

CASE_FIELDS: list[Field] = [
    ("case", "str", True, "the topology's name, e.g. 1n8g"),
    ("nodes", "int", True, "nodes"),
    ("devices_per_node", "int", True, "devices (processes) per node"),
    ("world_size", "int", True, "nodes times devices per node"),
    ("batch_size_per_device", "int", True, "samples per device per step"),
    ("precision", "str", True, "fp32, fp16, bf16 or float64"),
    ("num_classes", "int", False, "classes of the face head"),
    ("fc", "str", False, "the face head: dp, mp or pfc"),
    ("sample_ratio", "num", False, "Partial FC's share of the classes sampled"),
    ("pfc_update", "str?", False, "how Partial FC updated the class matrix"),
    ("settings", "obj?", False, "what rank 0 recorded of how it ran (mode, threads, ...)"),
    ("mode", "str?", False, "the execution mode the timed runs ran in"),
    ("mode_probe", "obj", False, "--mode best, before the probe was one per plan: this case's "
     "probe"),
    ("startup_s", "num?", False, "median over runs of startup_s"),
    ("compile_s", "num?", False, "median over runs of compile_s"),
    ("first_step_excess_s", "num?", False, "median over runs of first_step_excess_s"),
    ("recompiles_in_window", "int", False, "compilations inside the windows, all runs"),
    ("runs", "list[run]", True, "every run, in run order"),
    ("median_samples_per_s", "num?", True, "median over the ok, unflagged runs"),
    ("average_samples_per_s", "num?", True, "mean over the same runs"),
    ("iqr_samples_per_s", "num?", True, "interquartile range over the same runs"),
    ("spread", "num?", False, "(max - min) / median over the same runs"),
    ("ok_runs", "int", False, "runs whose speed counts"),
    ("speedup", "num?", True, "median against the 1-device case of the same batch, head and "
     "mode"),
    ("scaling_efficiency", "num?", True, "speedup over the device count"),
    ("train_flops_per_sample", "num?", False, "the model's training FLOPs per sample (a "
     "multiply-add is 2)"),
    ("train_flops_by_op", "obj?", False, "those FLOPs by kind of operation"),
    ("model_flops_per_s", "num?", False, "FLOPs per sample times the median samples/s"),
    ("mfu", "num?", False, "model FLOPs utilization against the devices' peak"),
    ("mfu_peak_basis", "str?", False, "which peak the MFU is taken against"),
    ("tf32_conv", "bool?", False, "GPU fp32: whether convolutions ran in TF32 (null on a CPU "
     "or not recorded)"),
    ("tf32_matmul", "bool?", False, "GPU fp32: whether matrix products ran in TF32"),
    ("peak_memory_bytes", "int?", False, "the largest peak of any run, of the kind "
     "memory_kind names"),
    ("memory_kind", "str?", False, "what peak_memory_bytes is (a run's memory_kind)"),
    ("device_used_bytes", "int?", False, "GPU: the largest device-wide used memory of any "
     "run"),
    ("memory_model_error", "num?", False, "median (predicted - measured) / measured peak"),
    ("memory_model", "obj?", False, "the memory model's terms"),
    ("data_wait_share", "num?", False, "real data: median over runs of data_wait_share"),
    ("median_samples_per_j", "num?", False, "GPU: median samples_per_j over the runs "
     "median_samples_per_s counts"),
    ("wh_per_million_samples", "num?", False, "watt-hours per million samples: 10^6 / "
     "median_samples_per_j / 3600"),
    ("energy_note", "str?", False, "why the case has no samples per joule (its runs' first "
     "energy_note)"),
    ("breakdown", "obj", False, "--breakdown: the profiled run's phases"),
    ("training", "obj", False, "training: runs that reached the target and their medians"),
    ("measured_in", "str", False, "a joined document (trainperf join, a multi-node job's "
     "node counts): the folder of the part that measured this case"),
    ("flags", "list[str]", True, "what to know before trusting the case (few_runs, "
     "superlinear, ...)"),
]

DOC_FIELDS: list[Field] = [
    ("schema", "const", True, f"always {SCHEMA}"),
    ("recipe", "str", True, "the recipe (or ingested model) the runs ran"),
    ("model", "str?", False, "DLPerf's key for the model (r100, y1, r50, rn50)"),
    ("framework", "str", False, "the framework that ran (torch, mxnet, paddle, jax, tf, "
     "oneflow)"),
    ("workload", "obj", True, "what one step computes: backbone, head, precision, batch, ..."),
    ("measure", "obj", True, "runs, iterations, warm-up, timeouts"),
    ("env", "obj", True, "host, devices, versions"),
    ("tuning", "obj", False, "the speed settings asked for (mode, layout, ...)"),
    ("mode_probe", "obj", False, "--mode best: the probe's rounds, the mode every case ran in "
     "and why, the runner-up and the probe's seconds"),
    ("data", "obj?", False, "real data: the dataset and the input pipeline"),
    ("train", "obj", False, "training: the target and the evaluation settings"),
    ("source", "obj", False, "ingested results: the log format and folder they came from"),
    ("role", "str", False, "follower: rank 0 ran on another node"),
    ("joined_from", "list[obj]", False, "a joined document: each part it was joined from "
     "(source folder, its node counts, host, whether it holds the mode probe); speedups are "
     "against the 1-device case of the whole"),
    ("job", "obj", False, "a multi-node job's document: the job's kind (slurm, emulated) and "
     "its steps, each a node count with its devices per node"),
    ("cases", "list[case]", True, "every case measured"),
]

WORKLOAD_FIELDS: list[Field] = [
    ("backbone", "str", False, "the backbone's name"),
    ("task", "str", False, "face or classification"),
    ("loss", "str", False, "the face head's margin (arcface, cosface)"),
    ("fc", "str", False, "dp, mp or pfc"),
    ("num_classes", "int", False, "classes"),
    ("sample_ratio", "num", False, "Partial FC's sampled share"),
    ("precision", "str", False, "fp32, fp16, bf16 or float64"),
    ("batch_size", "int", False, "samples per device per step"),
    ("input_size", "int", False, "image side in pixels"),
    ("channels_last", "bool", False, "whether images ran channels-last"),
]

ENV_FIELDS: list[Field] = [
    ("framework", "str", False, "the framework"),
    ("framework_version", "str", False, "its version"),
    ("python", "str", False, "Python's version"),
    ("device_type", "str", False, "cpu or cuda"),
    ("device_names", "list[str]", False, "each device's name"),
    ("device_count", "int", False, "devices seen"),
]

TAGS: list[Field] = [
    ("case", "str", False, "the case the run belongs to"),
    ("batch", "int", False, "its batch per device"),
    ("run", "int", False, "its number"),
    ("probe", "str", False, "--mode best: the mode a probe run ran"),
    ("profile", "bool", False, "the profiled run of --breakdown"),
    ("attempt", "int", False, "a later attempt of the same run"),
]

RUNNER_EVENTS: dict[str, list[Field]] = {
    "runner_start": [("env", "obj", True, "the host as the runner saw it")],
    "run_start": [],
    "run_end": [("record", "run", True, "the run's record, as in results.json")],
    "run_retry": [("attempt", "int", True, "the attempt given up"),
                  ("reason", "str", True, "why it is started again"),
                  ("error", "str?", False, "what the attempt reported"),
                  ("folder", "str", True, "where its files are kept")],
    "profile_end": [("breakdown", "obj", True, "the profiled run's summary")],
    "mode_probe": [("probe", "obj", True, "the plan's probe: its rounds and the choice")],
}
"""What the runner itself writes into a results folder's ``events.jsonl``, beside the worker
events it copies there (each tagged with ``TAGS``)."""


def _type(kind: str, refs: dict[str, str]) -> dict[str, Any]:
    nullable = kind.endswith("?")
    kind = kind.rstrip("?")
    if kind.startswith("list[") and kind.endswith("]"):
        out: dict[str, Any] = {"type": "array", "items": _type(kind[5:-1], refs)}
    elif kind in refs:
        out = {"$ref": refs[kind]}
    else:
        out = {"type": {"str": "string", "int": "integer", "num": "number", "bool": "boolean",
                        "obj": "object", "list": "array"}[kind]}
    if nullable:
        return {"anyOf": [out, {"type": "null"}]} if "$ref" in out else {
            **out, "type": [out["type"], "null"]}
    return out


def _object(fields: list[Field], refs: dict[str, str], title: str = "") -> dict[str, Any]:
    props = {}
    for name, kind, _, text in fields:
        props[name] = {**_type(kind, refs), "description": text}
    out: dict[str, Any] = {"type": "object"}
    if title:
        out["title"] = title
    out["properties"] = props
    required = [name for name, _, req, _ in fields if req]
    if required:
        out["required"] = required
    return out


def results_schema() -> dict[str, Any]:
    refs = {"run": "#/$defs/run", "case": "#/$defs/case",
            "status": "#/$defs/status", "const": "#/$defs/schema_name"}
    doc = _object(DOC_FIELDS, refs)
    doc["properties"]["workload"] = {**_object(WORKLOAD_FIELDS, refs),
                                     "description": doc["properties"]["workload"]["description"]}
    doc["properties"]["env"] = {**_object(ENV_FIELDS, refs),
                                "description": doc["properties"]["env"]["description"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": BASE_ID + RESULTS_FILE,
        "title": f"trainperf results ({SCHEMA})",
        "description": "One results.json: a benchmark's cases, each with every run's record.",
        **doc,
        "$defs": {
            "schema_name": {"const": SCHEMA},
            "status": {"enum": list(RUN_STATUSES)},
            "run": _object(RUN_FIELDS, refs, "run"),
            "case": _object(CASE_FIELDS, refs, "case"),
        },
    }


def _hint_type(hint: Any) -> dict[str, Any]:
    """A worker event field's annotation as a JSON Schema type."""
    if hint is Any:
        return {}
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        parts = [_hint_type(h) for h in typing.get_args(hint)]
        if any(not p for p in parts):
            return {}
        return {"anyOf": parts}
    if hint is type(None):
        return {"type": "null"}
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return {"type": "array", "items": _hint_type(item)} if item is not Any else {
            "type": "array"}
    if origin is dict or hint is dict:
        return {"type": "object"}
    return {"type": {str: "string", int: "integer", float: "number", bool: "boolean"}[hint]}


def _worker_event(cls: type[protocol.Event], refs: dict[str, str]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {"event": {"const": cls.KIND}}
    required = ["event"]
    for f in dataclasses.fields(cls):
        props[f.name] = _hint_type(hints[f.name])
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    tags = _object(TAGS, refs)["properties"]
    doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    return {"type": "object", "title": cls.KIND, "description": doc,
            "properties": {**props, **tags}, "required": required}


def events_schema() -> dict[str, Any]:
    """One line of a results folder's ``events.jsonl``: a worker event (``protocol``), as the
    worker wrote it plus the runner's tags, or one of the runner's own."""
    refs = {"run": BASE_ID + RESULTS_FILE + "#/$defs/run"}
    defs = {cls.KIND: _worker_event(cls, refs) for cls in protocol.EVENT_TYPES.values()}
    for kind, fields in RUNNER_EVENTS.items():
        obj = _object([("t", "num", True, "Unix time the runner wrote it"), *TAGS, *fields],
                      refs, kind)
        obj["properties"] = {"event": {"const": kind}, **obj["properties"]}
        obj["required"] = ["event", *obj["required"]]
        defs[kind] = obj
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": BASE_ID + EVENTS_FILE,
        "title": "trainperf events (one line of a results folder's events.jsonl)",
        "oneOf": [{"$ref": f"#/$defs/{kind}"} for kind in defs],
        "$defs": defs,
    }


def made() -> dict[str, dict[str, Any]]:
    return {RESULTS_FILE: results_schema(), EVENTS_FILE: events_schema()}


def text_of(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1) + "\n"


WORDS = {"str": "string", "int": "integer", "num": "number", "bool": "boolean",
         "obj": "object", "list": "list", "run": "run", "case": "case",
         "status": "one of " + ", ".join(RUN_STATUSES), "const": f"`{SCHEMA}`"}


def _words(kind: str) -> str:
    """A field's type as the docs' tables say it: ``list[num?]?`` is "list of number (nulls
    allowed) or null"."""
    nullable = kind.endswith("?")
    kind = kind.rstrip("?")
    if kind.startswith("list["):
        item = kind[5:-1]
        text = f"list of {WORDS[item.rstrip('?')]}" + (
            " (nulls allowed)" if item.endswith("?") else "")
    else:
        text = WORDS[kind]
    return f"{text} or null" if nullable else text


def fields_markdown() -> str:
    """The field tables of docs/results-format.md."""
    out = []
    for title, fields in (("The document", DOC_FIELDS), ("`workload` (named fields)",
                                                         WORKLOAD_FIELDS),
                          ("`env` (named fields)", ENV_FIELDS), ("A case", CASE_FIELDS),
                          ("A run", RUN_FIELDS)):
        out += [f"#### {title}", "", "| field | type | required | what it is |",
                "|---|---|---|---|"]
        out += [f"| `{n}` | {_words(k)} | {'yes' if r else ''} | {t} |"
                for n, k, r, t in fields]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", action="store_true", help="regenerate the schema files")
    group.add_argument("--check", action="store_true", help="exit 1 where one is out of date")
    group.add_argument("--fields", action="store_true", help="print the docs' field tables")
    args = p.parse_args(argv)
    if args.fields:
        print(fields_markdown(), end="")
        return 0
    stale = []
    for name, schema in made().items():
        path = SCHEMA_DIR / name
        if args.write:
            SCHEMA_DIR.mkdir(exist_ok=True)
            path.write_text(text_of(schema), encoding="utf-8")
        elif not path.exists() or path.read_text(encoding="utf-8") != text_of(schema):
            stale.append(name)
    if stale:
        print(f"{', '.join(stale)} out of date; run python -m trainperf.results_schema "
              "--write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
