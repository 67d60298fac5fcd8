"""Markdown tables in the DLPerf shape (node_num, gpu_num, samples/s, speedup), with spread,
efficiency, MFU and memory, for one results document or several side by side."""

from __future__ import annotations

from typing import Iterable


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def gib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f} GiB"


def doc_label(doc: dict) -> str:
    w = doc.get("workload", {})
    env = doc.get("env", {})
    parts = [env.get("framework", doc.get("source", {}).get("framework", "")), doc["recipe"],
             w.get("precision", ""), f"fc={w['fc']}" if w.get("fc") else ""]
    if w.get("fc") == "pfc":
        parts.append(f"r={w.get('sample_ratio')}")
    return " ".join(p for p in parts if p)


def unique_labels(docs: list[dict]) -> list[str]:
    labels = [doc_label(d) for d in docs]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if labels.count(label) == 1 else f"{label} #{seen[label]}")
    return out


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def device_text(env: dict) -> str:
    names = env.get("device_names") or []
    if names:
        return f"{len(names)} x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    return env.get("cpu_model") or "unknown device"


def single_table(doc: dict) -> str:
    rows = []
    for c in doc["cases"]:
        status = f"{c.get('ok_runs', 0)}/{len(c['runs'])}"
        rows.append([
            str(c["nodes"]), str(c["world_size"]), str(c["batch_size_per_device"]),
            fmt(c["median_samples_per_s"]), fmt(c["average_samples_per_s"]),
            pct(c.get("spread")), fmt(c["speedup"]), pct(c["scaling_efficiency"]),
            fmt(c["median_samples_per_s"] / c["world_size"]) if c["median_samples_per_s"] else "-",
            pct(c.get("mfu")), gib(c.get("peak_memory_bytes")),
            pct(c.get("memory_model_error")), status,
            ", ".join(c["flags"]) or "-",
        ])
    return table(["node_num", "gpu_num", "batch/device", "samples/s (median)", "average",
                  "IQR/median", "speedup", "efficiency", "per device", "MFU", "peak memory",
                  "memory model off by", "runs ok", "flags"], rows)


def failures(doc: dict) -> list[str]:
    out = []
    for c in doc["cases"]:
        for r in c["runs"]:
            if r["status"] != "ok":
                err = (r.get("error") or "").strip().splitlines()
                out.append(f"- {c['case']} b{c['batch_size_per_device']} run {r['run']}: "
                           f"**{r['status']}** {err[-1] if err else ''}")
    return out


def describe(doc: dict) -> str:
    w, m, env = doc.get("workload", {}), doc.get("measure", {}), doc.get("env", {})
    bits = [f"recipe `{doc['recipe']}`", f"backbone {w.get('backbone')}",
            f"{w.get('num_classes')} classes", f"precision {w.get('precision')}"]
    if w.get("fc"):
        bits.append(f"fc {w['fc']}" + (f" (ratio {w.get('sample_ratio')}, "
                                       f"{w.get('pfc_update_ran', w.get('pfc_update'))} update)"
                                       if w["fc"] == "pfc" else ""))
    line = ", ".join(bits)
    how = (f"{m.get('runs')} runs x {m.get('iters')} iterations, first {m.get('warmup')} not "
           "counted; throughput = samples in the window / wall time of the window; median over "
           "runs" if m else "")
    src = doc.get("source")
    origin = (f"ingested from {src.get('format')} logs ({src.get('method')} method)" if src
              else f"{env.get('framework', '')} {env.get('framework_version', '')} on "
                   f"{device_text(env)}, host {env.get('host', '?')}")
    return f"{line}.  \n{origin}. {how}".strip()


def comparison_table(docs: list[dict], labels: list[str]) -> str:
    keys = sorted({(c["nodes"], c["world_size"], c["batch_size_per_device"])
                   for d in docs for c in d["cases"]}, key=lambda k: (k[2], k[1], k[0]))
    by_doc = [{(c["nodes"], c["world_size"], c["batch_size_per_device"]): c for c in d["cases"]}
              for d in docs]
    header = ["node_num", "gpu_num", "batch/device"]
    for label in labels:
        header += [f"{label} samples/s", f"{label} speedup"]
    rows = []
    for key in keys:
        row = [str(key[0]), str(key[1]), str(key[2])]
        for cases in by_doc:
            c = cases.get(key)
            row += [fmt(c["median_samples_per_s"]) if c else "-",
                    fmt(c["speedup"]) if c else "-"]
        rows.append(row)
    return table(header, rows)


def render_report(docs: list[dict], plots: list[str] | None = None,
                  extra_sections: list[str] | None = None) -> str:
    labels = unique_labels(docs)
    parts = ["# trainperf report", ""]
    if len(docs) > 1:
        parts += ["## Comparison", "", comparison_table(docs, labels), ""]
    for doc, label in zip(docs, labels):
        parts += [f"## {label}", "", describe(doc), "", single_table(doc), ""]
        fails = failures(doc)
        if fails:
            parts += ["Runs that did not finish:", "", *fails, ""]
    for section in extra_sections or []:
        parts += [section, ""]
    for plot in plots or []:
        parts += [f"![{plot}]({plot})", ""]
    parts += ["Flags: `superlinear` speedup above 1.05 x devices; `throughput_falls` fewer "
              "samples/s than a smaller case; `high_spread` IQR above 5% of the median; "
              "`failed_runs` some runs gave no figure; `loss_nonfinite` / `loss_clamped` a run's "
              "loss diverged (its speed is left out)."]
    return "\n".join(parts) + "\n"
