"""Markdown tables in the DLPerf shape (node_num, gpu_num, samples/s, speedup), with spread,
efficiency, MFU and memory, for one results document or several side by side."""

from __future__ import annotations

from typing import Iterable

from .. import alignments, parities, significance
from ..mode_choice import describe as describe_probe, mode_pair_text, modes_asked, \
    trouble_in_runs
from .limits import stall_line
from .network import change_lines

SPANS_ONE = "~"


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


MEMORY_KIND_WORDS = {"allocator_peak": "allocator peak", "device_used": "device used",
                     "resident_set_peak": "resident set peak"}
"""How a memory figure's kind (``memory_kind``) is written beside it."""


def memory_kind_text(case: dict) -> str:
    kind = case.get("memory_kind")
    return MEMORY_KIND_WORDS.get(kind, kind or "kind not recorded")


def memory_cell(case: dict) -> str:
    """A case's memory figure with its kind: figures of different kinds (an allocator's peak,
    device-wide used memory) are never set side by side as if comparable."""
    peak = case.get("peak_memory_bytes")
    return f"{gib(peak)} ({memory_kind_text(case)})" if peak else "-"


def framework_name(doc: dict) -> str:
    env = doc.get("env", {})
    return (env.get("framework") or doc.get("framework")
            or doc.get("source", {}).get("framework", ""))


def head_key(doc: dict) -> tuple:
    """(num_classes, fc, pfc's ratio) of a document's workload: what a class sweep varies."""
    w = doc.get("workload", {})
    return (w.get("num_classes"), w.get("fc"),
            w.get("sample_ratio") if w.get("fc") == "pfc" else None)


def is_class_sweep(docs: list[dict]) -> bool:
    """Throughput documents of one recipe that differ in class count or head mode: a sweep's
    points (``run --num-classes``/``--fc`` lists, or folders of separate runs). Their
    comparisons pair only documents of the same point."""
    return (len(docs) > 1 and not any(d.get("train") for d in docs)
            and len({d["recipe"] for d in docs}) == 1 and len({head_key(d) for d in docs}) > 1)


def doc_label(doc: dict, with_classes: bool = False) -> str:
    w = doc.get("workload", {})
    parts = [framework_name(doc), doc["recipe"],
             f"classes={w.get('num_classes')}" if with_classes else "",
             w.get("precision", ""), f"fc={w['fc']}" if w.get("fc") else ""]
    if w.get("fc") == "pfc":
        parts.append(f"r={w.get('sample_ratio')}")
    data = doc.get("data") or {}
    if data.get("role") in ("real", "synthetic baseline"):
        parts.append("real-data" if data["role"] == "real" else "synthetic")
    return " ".join(p for p in parts if p)


def unique_labels(docs: list[dict]) -> list[str]:
    with_classes = (is_class_sweep(docs)
                    and len({d["workload"].get("num_classes") for d in docs}) > 1)
    labels = [doc_label(d, with_classes) for d in docs]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if labels.count(label) == 1 else f"{label} #{seen[label]}")
    return out


def shared_words(labels: list[str]) -> set[str]:
    return set.intersection(*(set(label.split()) for label in labels)) if labels else set()


def distinct_parts(labels: list[str]) -> list[str]:
    """Each label without the words every label shares (``pytorch tiny fp32`` and ``mxnet tiny
    fp32`` become ``pytorch`` and ``mxnet``), so that table headers name only the difference."""
    shared = shared_words(labels)
    short = [" ".join(w for w in label.split() if w not in shared) for label in labels]
    return short if all(short) and len(set(short)) == len(short) else labels


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
            pct(c.get("mfu")), memory_cell(c),
            pct(c.get("memory_model_error")), c.get("mode") or "-",
            fmt(c.get("startup_s"), 1), fmt(c.get("compile_s"), 2), status,
            ", ".join(c["flags"]) or "-",
        ])
    return table(["node_num", "gpu_num", "batch/device", "samples/s (median)", "average",
                  "IQR/median", "speedup", "efficiency", "per device", "MFU", "peak memory",
                  "memory model off by", "mode", "start-up s", "compile s", "runs ok",
                  "flags"], rows)


def mode_lines(doc: dict) -> list[str]:
    """How the plan's mode was chosen (``--mode best``), and a line for each case whose timed
    runs then failed or recompiled in it, naming the probe's runner-up. Documents written
    before the probe was one per plan keep a line per case probed."""
    name = framework_name(doc)
    probe = doc.get("mode_probe")
    if probe is None:
        return [f"- {c['case']} b{c['batch_size_per_device']}: "
                f"{describe_probe(name, c['mode_probe'])}"
                for c in doc["cases"] if c.get("mode_probe")]
    shared = f" (the probe of `{probe['probed_in']}`)" if probe.get("probed_in") else ""
    lines = [f"- {describe_probe(name, probe)}{shared}"]
    for c in doc["cases"]:
        trouble = trouble_in_runs(probe, c)
        if trouble:
            lines.append(f"- {trouble}")
    return lines


def failures(doc: dict) -> list[str]:
    """A line for every run that gave no figure, or whose figure was left out, and why."""
    out = []
    for c in doc["cases"]:
        for r in c["runs"]:
            where = f"- {c['case']} b{c['batch_size_per_device']} run {r['run']}"
            if r["status"] != "ok":
                err = (r.get("error") or "").strip().splitlines()
                out.append(f"{where}: **{r['status']}** {err[-1] if err else ''}")
            elif r.get("flags"):
                out.append(f"{where}: left out ({', '.join(r['flags'])}){left_out_reason(r)}")
    return out


def restarts(doc: dict) -> list[str]:
    """A line for every run that was started again before it ran (its ports were taken), with
    what stopped each attempt given up."""
    out = []
    for c in doc["cases"]:
        for r in c["runs"]:
            for given_up in r.get("retries") or []:
                out.append(f"- {c['case']} b{c['batch_size_per_device']} run {r['run']}, attempt "
                           f"{given_up['attempt']}: {given_up['reason']} "
                           f"({given_up.get('error') or 'no error'}); "
                           f"its files: `{given_up.get('folder', '')}`")
    return out


def left_out_reason(run: dict) -> str:
    if "steps_skipped" in run["flags"]:
        return (f": fp16 skipped {run.get('skipped_steps_in_window')} updates in the window "
                f"while its loss scale settled (now {run.get('final_loss_scale'):g}); a longer "
                "--warmup keeps them out of the window")
    if run.get("loss_last") is not None:
        return f": last loss {run['loss_last']:g}"
    return ""


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
    lines = [f"{line}.", f"{origin}. {how}".strip()]
    joined = joined_text(doc)
    if joined:
        lines.append(joined)
    stall = stall_line(doc)
    if stall:
        lines.append(stall)
    data = doc.get("data") or {}
    if data.get("source", "synthetic") != "synthetic":
        lines.append(f"Data: `{data.get('prefix')}` ({data.get('layout')} layout, "
                     f"{data.get('images')} images), decoder {data.get('decoder')}, "
                     f"{data.get('loader_workers')} loader processes per rank.")
    elif data.get("role") == "synthetic baseline":
        lines.append("Data: synthetic tensors made on the device once (the compute-only twin "
                     "of the real-data runs).")
    speed = settings_text(doc)
    if speed:
        lines.append(f"Settings: {speed}.")
    basis = next((c["mfu_peak_basis"] for c in doc["cases"] if c.get("mfu_peak_basis")), None)
    if basis:
        lines.append(f"MFU against the peak this work ran at: {basis}.")
    return "  \n".join(lines)


def joined_text(doc: dict) -> str | None:
    """Where a joined document's cases were measured (``trainperf join``, a node sweep's
    steps): each part's node counts, folder and host; speedups are against its 1-device case
    wherever that was measured."""
    parts = doc.get("joined_from") or []
    if len(parts) < 2:
        return None
    words = [f"{'/'.join(map(str, p.get('nodes') or []))} node(s) in `{p.get('source')}`"
             + (f" on {p['host']}" if p.get("host") else "") for p in parts]
    return (f"Measured in {len(parts)} parts, joined: {'; '.join(words)}. Every speedup is "
            "against the 1-device case of the whole.")


def settings_text(doc: dict) -> str:
    """The speed settings that ran (from the cases' start events), in words."""
    cases = [c.get("settings") or {} for c in doc["cases"]]
    parts = []
    cudnn = {c.get("cudnn_benchmark") for c in cases} - {None}
    if cudnn:
        parts.append("cuDNN autotuning " + ("on" if cudnn == {True} else "off"))
    ddp = next((c["ddp"] for c in cases if c.get("ddp")), None)
    if ddp:
        words = []
        if ddp.get("bucket_cap_mb") is not None:
            words.append(f"buckets {ddp['bucket_cap_mb']:g} MiB")
        for key, name in (("static_graph", "static graph"),
                          ("broadcast_buffers", "buffer broadcast")):
            if key in ddp:
                words.append(f"{name} {'on' if ddp[key] else 'off'}")
        parts.append("DDP " + ", ".join(words) if words else "DDP")
    compile_s = [c["compile_s"] for c in doc["cases"] if c.get("compile_s")]
    if compile_s:
        # Compilation falls before the measured window (in the warm-up, or before the loop);
        # said so it is seen.
        digits = 1 if min(compile_s) >= 1 else 2
        low, high = (f"{v:.{digits}f}" for v in (min(compile_s), max(compile_s)))
        span = low if low == high else f"{low}-{high}"
        parts.append(f"compilation (before the window, not measured) {span} s per run")
    onednn = {c.get("onednn_opts") for c in cases} - {None}
    if onednn:
        parts.append("TensorFlow's oneDNN CPU ops " + ("on" if onednn == {True} else "off"))
    scaling = next((c["loss_scaling"] for c in cases if c.get("loss_scaling")), None)
    if scaling:
        parts.append(f"fp16 loss scaling {scaling}")
    parts += not_applied(doc)
    return "; ".join(parts)


SETTING_WORDS = {"cudnn_benchmark": "cuDNN autotuning", "tf32": "TF32"}


def not_applied(doc: dict) -> list[str]:
    """Each GPU setting the plan asked for (the framework's default included) that its runs did
    not run as asked, as the workers recorded what ran: OneFlow's eager mode, which never
    autotunes; TF32 turned off beneath the framework by NVIDIA_TF32_OVERRIDE=0; XLA's
    autotuning turned off by the caller's XLA_FLAGS. A comparison then says which framework
    ran without what."""
    def said(value) -> str:  # a switch recorded as a bool (autotuning) or a word (TF32)
        return ("on" if value else "off") if isinstance(value, bool) else str(value)

    asked = doc.get("tuning") or {}
    out = []
    for name, words in SETTING_WORDS.items():
        if asked.get(name) is None:
            continue
        want = said(asked[name])
        ran = {said(v) for c in doc["cases"]
               if (v := ((c.get("settings") or {}).get("tuning") or {}).get(name)) is not None}
        if ran and ran != {want}:
            why = ""
            switch = (doc.get("env") or {}).get("tf32_switch") or ""
            if name == "tf32" and "NVIDIA_TF32_OVERRIDE=0" in switch:
                why = " (NVIDIA_TF32_OVERRIDE=0 in the run's environment)"
            out.append(f"**not applied:** {words} asked {want}, ran "
                       f"{'/'.join(sorted(ran))}{why}")
    return out


def comparison_table(docs: list[dict], labels: list[str]) -> str:
    keys = sorted({(c["nodes"], c["world_size"], c["batch_size_per_device"])
                   for d in docs for c in d["cases"]}, key=lambda k: (k[2], k[1], k[0]))
    by_doc = [{(c["nodes"], c["world_size"], c["batch_size_per_device"]): c for c in d["cases"]}
              for d in docs]
    labels = distinct_parts(labels)
    header = ["node_num", "gpu_num", "batch/device"]
    for label in labels:
        header += [f"{label} mode", f"{label} samples/s", f"{label} speedup"]
    # Each later document against the first, as the seeds put one framework against another.
    header += [f"{label} / {labels[0]}" for label in labels[1:]]
    rows = []
    with_ci = significance.available()
    for key in keys:
        row = [str(key[0]), str(key[1]), str(key[2])]
        for cases in by_doc:
            c = cases.get(key)
            row += [(c.get("mode") or "-") if c else "-",
                    fmt(c["median_samples_per_s"]) if c else "-",
                    fmt(c["speedup"]) if c else "-"]
        first = by_doc[0].get(key)
        row += [cross_cell(docs[0], first, doc, cases.get(key), with_ci)
                for doc, cases in zip(docs[1:], by_doc[1:])]
        rows.append(row)
    return table(header, rows)


def cross_cell(base_doc: dict, base: dict | None, doc: dict, case: dict | None,
               with_ci: bool) -> str:
    """The ratio cell of a case against the first document's: ``-`` where no ratio may be
    shown, ``modes differ (...)`` where one framework ran in two modes that a probe chose (two
    ``--mode best`` folders): two steps, no ratio between them."""
    if not ratio_within_one_mode(base_doc, base, doc, case):
        return "-"
    if base and case and base_doc.get("framework") == doc.get("framework") \
            and base.get("mode") != case.get("mode") and not modes_asked([base_doc, doc]):
        return mode_pair_text(base, case)
    return ratio_cell(base, case, with_ci)


def ratio_within_one_mode(base_doc: dict, base: dict | None, doc: dict,
                          case: dict | None) -> bool:
    """Whether a ratio between two documents' cases may be shown: a framework's real-data
    runs against its synthetic twin (the data's overhead) only where both ran in one mode.
    Frameworks against each other, or one framework's modes against each other, are what a
    comparison is for."""
    if not base or not case or base_doc.get("framework") != doc.get("framework"):
        return True
    roles = {(d.get("data") or {}).get("role") for d in (base_doc, doc)}
    return len(roles) == 1 or base.get("mode") == case.get("mode")


def ratio_cell(base: dict | None, case: dict | None, with_ci: bool) -> str:
    """A case's samples/s over the first document's, with its 95% interval where scipy is
    there, marked ``SPANS_ONE`` where the interval holds 1.0."""
    if not base or not case or not base["median_samples_per_s"] \
            or not case["median_samples_per_s"]:
        return "-"
    ratio = case["median_samples_per_s"] / base["median_samples_per_s"]
    if not with_ci:
        return fmt(ratio, 3)
    c = significance.compare_cases(base, case)
    if c.ratio is None:
        return fmt(ratio, 3)
    return interval_text(c) + (f" {SPANS_ONE}" if c.spans_one else "")


def interval_text(c: significance.Comparison) -> str:
    """``1.032 (0.981-1.080)``: a ratio and its interval."""
    return "-" if c.ratio is None else f"{c.ratio:.3f} ({c.low:.3f}-{c.high:.3f})"


def ratio_legend() -> str:
    if not significance.available():
        return ("Ratios are of medians, without intervals: install the `stats` extra (scipy) "
                "for their 95% intervals.")
    return ("Ratios are of medians, with their 95% bootstrap interval (over runs, and over "
            f"blocks of step times where a case has fewer than {significance.FEW_RUNS} runs); "
            f"`{SPANS_ONE}`: the interval holds 1.0, so these runs do not tell the two apart.")


def alignment_lines(docs: list[dict]) -> list[str]:
    """What each framework's figures in a comparison rest on: its alignment with torch on the
    same recipe and versions (``trainperf.alignments``), or "not aligned"."""
    torch_version = next((d.get("env", {}).get("framework_version") for d in docs
                          if d.get("framework") == "torch"), None)
    lines = []
    for d in docs:
        framework = d.get("framework")
        if framework in (None, "torch") or d.get("source"):
            continue  # torch is the reference; ingested logs ran no worker of ours
        version = d.get("env", {}).get("framework_version")
        record = alignments.find(d["recipe"], framework,
                                 {"torch": torch_version, framework: version})
        lines.append(f"- {framework} {version or ''}: "
                     f"{alignments.describe(record, d['recipe'], framework)}")
    return lines


def parity_lines(docs: list[dict]) -> list[str]:
    """How close each framework's worker in a comparison came to its own framework's training
    step on the same recipe, version, device and precision (``trainperf.parities``), or "native
    parity not measured"."""
    lines = []
    for d in docs:
        framework = d.get("framework")
        if framework is None or d.get("source"):
            continue  # ingested logs ran no worker of ours
        env = d.get("env") or {}
        version = env.get("framework_version")
        names = env.get("device_names") or []
        device_type = env.get("device_type") or "cpu"
        device_name = names[0] if names else env.get("cpu_model")
        workload = d.get("workload") or {}
        precision = workload.get("precision") or next(
            (c.get("precision") for c in d.get("cases", [])), "fp32")
        record = parities.find(d["recipe"], framework, version, device_type, device_name,
                               precision, workload.get("input_size"))
        where = device_name or device_type
        lines.append(f"- {framework} {version or ''}: "
                     f"{parities.describe(record, d['recipe'], framework, precision, where)}")
    return lines


def comparisons(docs: list[dict], labels: list[str]) -> list[str]:
    """The comparison tables: all documents side by side, or, for a class sweep, the
    documents of each class count and head (several frameworks) side by side, so that no ratio
    puts one class count against another."""
    groups: dict[tuple, list[int]] = {}
    for i, doc in enumerate(docs):
        groups.setdefault(head_key(doc) if is_class_sweep(docs) else (), []).append(i)
    parts = []
    for members in groups.values():
        if len(members) < 2:
            continue
        group_docs, group_labels = [docs[i] for i in members], [labels[i] for i in members]
        shared = shared_words(group_labels)
        what = " ".join(w for w in group_labels[0].split() if w in shared)
        parts += ["## Comparison" + (f": {what}" if what else ""), "",
                  comparison_table(group_docs, group_labels), "", ratio_legend(), ""]
    return parts


def render_report(docs: list[dict], plots: list[str] | None = None,
                  extra_sections: list[str] | None = None,
                  leading_sections: list[str] | None = None) -> str:
    """``leading_sections`` come first (a sweep's summary), ``extra_sections`` after each
    document's own table."""
    labels = unique_labels(docs)
    parts = ["# trainperf report", ""]
    for section in leading_sections or []:
        parts += [section, ""]
    if len(docs) > 1:
        parts += comparisons(docs, labels)
        aligned = list(dict.fromkeys(alignment_lines(docs)))  # a sweep's points repeat them
        if aligned:
            parts += ["Alignment with torch (`trainperf align`), which a ratio between "
                      "frameworks rests on:", "", *aligned, ""]
        native = list(dict.fromkeys(parity_lines(docs)))
        if native and len({d.get("framework") for d in docs}) > 1:
            parts += ["Native parity (`benchmarks/native_parity.py`): each worker's samples/s "
                      "over its own framework's training step, which a ratio between frameworks "
                      "also rests on:", "", *native, ""]
    for doc, label in zip(docs, labels):
        parts += [f"## {label}", "", describe(doc), "", single_table(doc), ""]
        chosen = mode_lines(doc)
        if chosen:
            parts += ["Execution mode (`--mode best`: a short probe, on the first case, of each "
                      "mode every case can run; every case is timed in the mode chosen, the "
                      "probe is never one of the runs, and the start-up and compile seconds of "
                      "runs after it are warm-cache figures):", "", *chosen, ""]
        fails = failures(doc)
        if fails:
            parts += ["Runs without a figure:", "", *fails, ""]
        changed = change_lines(doc)
        if changed:
            parts += ["Runs whose step time changed part-way (the median step after a step "
                      "against the one before; node 0's probes of each link on either side "
                      "tell a link that changed from a model that did):", "", *changed, ""]
        again = restarts(doc)
        if again:
            parts += ["Runs started again on fresh ports (nothing of an attempt given up counts; "
                      "each stopped before its first step):", "", *again, ""]
    for section in extra_sections or []:
        parts += [section, ""]
    for plot in plots or []:
        parts += [f"![{plot}]({plot})", ""]
    parts += ["Flags: `superlinear` speedup above 1.05 x devices; `throughput_falls` fewer "
              "samples/s than a smaller case; `high_spread` IQR above 5% of the median; "
              "`failed_runs` some runs gave no figure; `loss_nonfinite` / `loss_clamped` a run's "
              "loss diverged, `steps_skipped` fp16 skipped updates inside a run's window (such "
              "a run's speed is left out); `recompiled_in_window` the step compiled again "
              "inside the window (its time holds a compilation, so its speed is left out too). "
              "Speedups and efficiencies compare cases of one execution mode only. Start-up: "
              "seconds from the run's launch to the end of its first step; compile: seconds "
              "the framework spent compiling, timed where it compiles (0 in a mode that "
              "compiles nothing), never inside the window."]
    return "\n".join(parts) + "\n"
