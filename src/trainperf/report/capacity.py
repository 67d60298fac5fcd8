"""Capacity results in the DLPerf shape, with the published limits beside them."""

from __future__ import annotations

from pathlib import Path

from .. import references
from .markdown import gib, pct, table
from .references import reference_model


def write_capacity_report(doc: dict, out_dir: Path) -> str:
    """Write ``out_dir/report.md`` for one search; returns its section."""
    section = capacity_section(doc)
    (out_dir / "report.md").write_text("# trainperf capacity\n\n" + section + "\n",
                                       encoding="utf-8")
    return section


def _model_error(doc: dict) -> float | None:
    peak, predicted = doc.get("peak_memory_bytes_at_answer"), doc.get(
        "predicted_peak_bytes_at_answer")
    return (predicted - peak) / peak if peak and predicted else None


def capacity_section(doc: dict) -> str:
    s = doc["settings"]
    fc = s.get("fc")
    answer = doc["answer"]
    batch = answer if doc["kind"] == "max-batch" else s.get("batch_size")
    classes = answer if doc["kind"] == "max-classes" else s.get("num_classes")
    row = [str(s.get("nnodes")), str(s.get("world_size")), "-" if batch is None else str(batch),
           s.get("precision", ""),
           "yes" if fc in ("mp", "pfc") else "no",
           f"{s.get('sample_ratio')}" if fc == "pfc" else "no",
           f"{classes:,}" if classes else "-", gib(doc.get("peak_memory_bytes_at_answer")),
           gib(doc.get("predicted_peak_bytes_at_answer")), pct(_model_error(doc)),
           f"{doc['smallest_fail']:,}" if doc.get("smallest_fail") else "none found"]
    header = ["node_num", "devices", "batch/device", "precision", "model parallel",
              "partial fc", "num_classes", "peak memory", "predicted", "model off by",
              "smallest out of memory"]
    limit = s.get("memory_limit_bytes")
    where = s.get("device_names") or s.get("device", "")
    world = s.get("world_size")
    framework = (f" ({s['framework']}, {world} device{'' if world == 1 else 's'})"
                 if s.get("framework") else "")
    text = [f"### {doc['kind']} of `{doc['recipe']}`{framework}: "
            f"{answer if answer is not None else 'none'}",
            "", f"Device: {where}" + (f"; memory limit {gib(limit)} per process" if limit else ""),
            "", table(header, [row])]
    ended = limited_text(doc)
    if ended:
        text += ["", ended]
    text += ["", probes_table(doc)]
    pub = published_rows(doc)
    if pub:
        text += ["", "Published (DLPerf, " + references.DEVICE + "):", "", pub]
    return "\n".join(text)


def limited_text(doc: dict) -> str | None:
    """What ended the search, in words (``search.limit_of``); None for a search recorded
    before searches said it."""
    limited = doc.get("limited_by") or {}
    reason, value = limited.get("reason"), limited.get("value")
    what = {"max-batch": "batch", "max-classes": "class count"}.get(doc["kind"], "value")
    if reason == "failure":
        return (f"**Ended on a failure, not a capacity**: the probe at {what} {value:,} "
                f"{limited.get('status')}: {_short(limited.get('error'), 300)}. Only running "
                "out of memory says that a value does not fit.")
    if reason == "out_of_memory":
        return f"Limited by memory: out of memory at {what} {value:,}."
    if reason == "ceiling":
        return f"Limited by the search's ceiling ({value:,}): nothing ran out of memory."
    if reason == "max_probes":
        return (f"Limited by --max-probes ({value}): the search stopped before it found where "
                "memory runs out to its resolution.")
    return None


def _short(error: str | None, width: int = 90) -> str:
    """The end of an error's last line: allocators put the size that failed at the end."""
    if not error:
        return ""
    line = error.strip().splitlines()[-1].replace("|", "/")
    return line if len(line) <= width else "..." + line[-width:]


def probes_table(doc: dict) -> str:
    rows = [[f"{p['value']:,}", p["status"], gib(p["peak_memory_bytes"]),
             gib(p["predicted_peak_bytes"]), _short(p["error"])] for p in doc["probes"]]
    return table(["value", "status", "peak memory", "predicted", "error"], rows)


def published_rows(doc: dict) -> str | None:
    s = doc["settings"]
    model, _ = reference_model({"recipe": doc["recipe"], "workload": {}})
    world = s.get("world_size")
    if doc["kind"] == "max-classes":
        rows = [[c.framework, str(c.nodes), str(c.world_size), str(c.batch_size_per_device),
                 c.precision, str(c.sample_ratio), f"{c.max_num_classes:,}"]
                for c in references.load_max_classes()
                if c.model == model and c.world_size == world]
        header = ["framework", "node_num", "devices", "batch/device", "precision", "partial fc",
                  "max num_classes"]
    else:
        parallel = references.FC_PARALLEL.get(s.get("fc") or "dp", ())
        rows = [[r.framework, str(r.nodes), str(r.world_size), r.precision,
                 r.mode_items.get("dataset", ""), r.mode_items.get("parallel", ""),
                 str(r.batch_size_per_device)]
                for r in references.load_throughput()
                if r.model == model and r.world_size == world
                and r.mode_items.get("bsz") == "max"
                and r.mode_items.get("parallel") in parallel]
        header = ["framework", "node_num", "devices", "precision", "dataset", "parallel",
                  "max batch/device"]
    return table(header, rows) if rows else None
