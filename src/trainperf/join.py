"""Documents measured apart joined into one: one node today, two nodes tomorrow, or each node
count of a node sweep as its own step. The joined document holds every case of its parts, and
each case's speedup and efficiency against the 1-device case of the whole (``finish_cases``),
so a 2n16g row gets the speedup DLPerf prints, against 1n1g.

Parts join only where they measured the same thing: the same recipe, workload (precision, head,
layout, ...), framework and its version, device model, data, speed settings and execution mode
as it ran, and no case twice. Otherwise the join is refused in one line that names what differs.
Standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import results

CHECKED_ENV = ("framework", "framework_version", "device_type")
"""What a part's environment must share with the others' beyond its device model: a figure of
another build or another kind of device is another measurement."""
IGNORED_WORKLOAD = ("batch_size",)
"""Workload fields a part may differ in: each case records its own batch."""
IGNORED_MEASURE = ("runs",)
"""Runs per case: a median over 3 runs and one over 5 measure the same step."""


def device_model(doc: dict) -> str | None:
    """The device a document's figures come from: its GPU's name, else its CPU's model."""
    env = doc.get("env") or {}
    names = env.get("device_names") or []
    return names[0] if names else env.get("cpu_model")


def modes_ran(doc: dict) -> list[str]:
    """The execution modes its cases ran in (each case records the one that ran)."""
    return sorted({str(c.get("mode")) for c in doc.get("cases", []) if c.get("mode")})


def identity(doc: dict) -> dict[str, Any]:
    """Everything two documents must share to be joined, by the name a refusal gives it."""
    workload = {k: v for k, v in (doc.get("workload") or {}).items()
                if k not in IGNORED_WORKLOAD}
    tuning = {k: v for k, v in (doc.get("tuning") or {}).items() if k != "mode"}
    env = doc.get("env") or {}
    out: dict[str, Any] = {"recipe": doc.get("recipe")}
    # Named on their own first: the differences a reader looks for.
    out["precision"] = workload.pop("precision", None)
    out["mode"] = modes_ran(doc) or (doc.get("tuning") or {}).get("mode")
    for key in ("fc", "sample_ratio", "num_classes"):
        out[key] = workload.pop(key, None)
    out.update({f"workload {k}": v for k, v in workload.items() if k != "pfc_update_ran"})
    out.update({k: env.get(k) or doc.get(k) for k in CHECKED_ENV})
    out["device model"] = device_model(doc)
    out["data"] = (doc.get("data") or {}).get("source", "synthetic")
    out["data role"] = (doc.get("data") or {}).get("role", "synthetic")
    out.update({f"setting {k}": v for k, v in tuning.items()})
    measure = doc.get("measure") or {}
    out.update({f"measure {k}": v for k, v in measure.items() if k not in IGNORED_MEASURE})
    out["training"] = bool(doc.get("train"))
    return out


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "/".join(str(v) for v in value) or "none"
    return json.dumps(value) if isinstance(value, (dict, bool)) or value is None else str(value)


def difference(a: dict, b: dict) -> str | None:
    """What sets two documents apart as ``precision (fp32 / bf16)``, the first differences
    named; None where they may be joined."""
    left, right = identity(a), identity(b)
    differ = [k for k in left.keys() | right.keys() if left.get(k) != right.get(k)]
    if not differ:
        return None
    order = list(left) + [k for k in right if k not in left]
    differ.sort(key=order.index)
    return ", ".join(f"{k} ({_shown(left.get(k))} / {_shown(right.get(k))})" for k in differ[:3]) \
        + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")


def case_key(case: dict) -> tuple:
    return (case["nodes"], case["devices_per_node"], case["batch_size_per_device"],
            case.get("num_classes"), case.get("fc"), case.get("sample_ratio"))


def join(parts: list[tuple[str, dict]]) -> dict[str, Any]:
    """One document from ``parts`` ((where it came from, its document), each a leader's):
    every case of each, speedups and efficiencies recomputed across all of them; ValueError,
    in one line naming the two parts and what differs, where they measured different things
    or hold the same case twice. The environment is the part's that holds the fewest nodes
    and devices (the base of the speedups); ``joined_from`` says where each part came from, and each case
    which part measured it (``measured_in``)."""
    if not parts:
        raise ValueError("nothing to join")
    for where, doc in parts:
        if doc.get("role") == "follower":
            raise ValueError(f"{where} holds a follower node's records, without figures; join "
                             "the folder of the node that kept the measurements")
        if doc.get("source"):
            raise ValueError(f"{where} holds figures ingested from logs; join trainperf's own "
                             "results")
    first_where, first = parts[0]
    for where, doc in parts[1:]:
        why = difference(first, doc)
        if why:
            raise ValueError(f"cannot join {where} to {first_where}: they differ in {why}")
    seen: dict[tuple, str] = {}
    for where, doc in parts:
        for case in doc["cases"]:
            key = case_key(case)
            if key in seen:
                raise ValueError(f"cannot join {where} to {seen[key]}: both hold case "
                                 f"{case['case']} b{case['batch_size_per_device']}")
            seen[key] = where
    ordered = sorted(parts, key=lambda p: min(((c["nodes"], c["world_size"])
                                               for c in p[1]["cases"]), default=(0, 0)))
    base_where, base = ordered[0]
    cases = []
    for where, doc in ordered:
        for case in doc["cases"]:
            # A part that was joined already keeps saying where each of its cases came from.
            inner = case.get("measured_in")
            cases.append({**case, "measured_in": str(Path(where) / inner) if inner else where})
    cases.sort(key=lambda c: (c["batch_size_per_device"], c["nodes"], c["devices_per_node"]))
    joined = results.document(base["recipe"], base["workload"], base["measure"], base["env"],
                              cases, model=base.get("model"), tuning=base.get("tuning"))
    for key in ("framework", "data", "train"):
        if key in base:
            joined[key] = base[key]
    probe = next((doc["mode_probe"] for _, doc in ordered if doc.get("mode_probe")), None)
    if probe is not None:
        joined["mode_probe"] = probe
    joined["measure"] = dict(base["measure"])
    runs = sorted({doc["measure"].get("runs") for _, doc in ordered} - {None})
    if len(runs) > 1:
        joined["measure"]["runs"] = runs[-1]  # each case's own runs say how many it had
    joined["joined_from"] = [
        {"source": where, "nodes": sorted({c["nodes"] for c in doc["cases"]}),
         "host": (doc.get("env") or {}).get("host"),
         "mode_probe": bool(doc.get("mode_probe"))} for where, doc in ordered]
    return joined


def join_folders(folders: list[str | Path]) -> list[tuple[str, dict]]:
    """The plans of ``folders`` (each as a command wrote it: one plan's folder, several
    frameworks', a job's) joined plan by plan: (the plan's folder relative to its part,
    the joined document). Plans pair by their folder's place in their part (``torch``,
    ``jax/real``); a plan in one part only is joined from that one. ValueError where a folder
    holds no results or a pair cannot be joined."""
    from .result_files import plan_documents

    by_plan: dict[str, list[tuple[str, dict]]] = {}
    for folder in folders:
        root = Path(folder)
        found = plan_documents(root)
        if not found:
            raise ValueError(f"{folder}: no results.json in it or below it"
                             if root.exists() else f"{folder}: no such folder")
        for path in found:
            rel = path.parent.relative_to(root) if root.is_dir() else Path()
            by_plan.setdefault(rel.as_posix(), []).append((str(path.parent),
                                                            results.load(path)))
    return [(rel, join(parts)) for rel, parts in by_plan.items()]
