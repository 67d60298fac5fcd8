"""The part's folder: ``summary.json`` (every stage's record, with what is derived from them),
``summary.md`` (one table per stage), the plots and one ``.tar.gz`` of the work folder.

Derived here, from the records: MFU against the measured ceiling (stage 1, of this check or of
an earlier part on the same device), each case's ratio to DLPerf's V100 row, the peers' ratios
(trainperf's case stages over the peers') and the published capacity figures beside the
searched ones.
"""

from __future__ import annotations

import json
import tarfile
import time
from pathlib import Path

from .. import references
from ..backends.phases import label
from ..devices import TFLOPS, effective_peak
from ..report.markdown import fmt, gib, pct, table
from ..results import write_json_atomic
from .ceiling import measured_peaks
from .plan import STAGES, get_stage, of_kind
from .record import NOT_RUN, items, stage_path

SCHEMA = "trainperf.gpucheck/v1"
FRESH_S = 24 * 3600
"""An earlier part's record counts only this young (and from the same device)."""
TAR_FILE_LIMIT = 4 * 2**20
"""Files above this stay out of the archive (the summary names them): a borrowed machine
brings back 16 MiB per file."""
SKIP_SUFFIXES = (".rec", ".idx", ".bin", ".npz")


def find_record(work: Path, stage_id: str, device: str, records: dict[str, dict]) -> dict | None:
    """This check's record of a stage, else the newest one an earlier part of a check wrote on
    the same device into a sibling work folder."""
    if stage_id in records and records[stage_id].get("items"):
        return records[stage_id]
    found = []
    for path in work.parent.glob(f"*/{stage_path(work, stage_id).name}"):
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("device") == device and time.time() - rec.get("started", 0) < FRESH_S:
            found.append((rec.get("started", 0), str(path.parent), rec))
    if not found:
        return None
    _, where, rec = max(found, key=lambda f: f[0])
    return {**rec, "found_in": where}


def seed_cases(work: Path, device: str, records: dict[str, dict]) -> list[dict]:
    out = []
    for st in of_kind("cases"):
        rec = find_record(work, st.id, device, records)
        out += items(rec, "case")
    return out


def derive_cases(cases: list[dict], ceiling: dict[str, float]) -> None:
    for c in cases:
        peak, basis = effective_peak(ceiling, c.get("precision", "fp32"),
                                     c.get("train_flops_by_op"), c.get("tf32_conv"),
                                     c.get("tf32_matmul"))
        flops_s = c.get("model_flops_per_s")
        world = c.get("world_size") or 1
        c["mfu_measured"] = flops_s / (peak * world) if flops_s and peak else None
        c["mfu_measured_basis"] = basis
        rate, ref = c.get("median_samples_per_s"), c.get("dlperf")
        c["per_gpu"] = rate / world if rate else None
        c["ratio_to_v100"] = rate / world / ref["samples_per_s"] if rate and ref else None


def peer_ratios(peers: list[dict], cases: list[dict]) -> None:
    by_label = {c["label"]: c for c in cases}
    for p in peers:
        ours = by_label.get(p["label"], {}).get("median_samples_per_s")
        theirs = p.get("samples_per_s") or p.get("median_samples_per_s")
        p["trainperf_samples_per_s"] = ours
        p["trainperf_over_peer"] = ours / theirs if ours and theirs else None


def published_capacity() -> dict:
    """DLPerf's one-V100 limits: R100 fp32 model-parallel "max bsz" (face_emore) and R100 fp16
    Partial FC 0.1 max num_classes at batch 64."""
    batch = [{"framework": r.framework, "batch": r.batch_size_per_device,
              "samples_per_s": r.samples_per_s}
             for r in references.load_throughput()
             if r.model == "r100" and r.precision == "fp32" and r.world_size == 1
             and r.mode_items.get("bsz") == "max"
             and r.mode_items.get("parallel") == "model_parallel"
             and r.mode_items.get("dataset") == "face_emore"]
    classes = [{"framework": c.framework, "classes": c.max_num_classes}
               for c in references.load_max_classes()
               if c.model == "r100" and c.world_size == 1 and c.partial_fc
               and c.sample_ratio == 0.1 and c.batch_size_per_device == 64]
    return {"device": references.DEVICE, "memory_bytes": 16 * 2**30,
            "max-batch": batch, "max-classes": classes}


def build(work: Path, meta: dict, ran: list[dict]) -> dict:
    records = {r["stage"]: r for r in ran}
    device = meta["device"]
    stages = []
    for s in STAGES:
        if s.id in records:
            stages.append(records[s.id])
            continue
        if meta["part"] and s.part != meta["part"]:
            why = f"in part {s.part} (`make gpu-check PART={s.part}`)"
        elif s.id in meta.get("chosen", ()):
            why = "not reached: the check was interrupted before it"
        else:
            why = "not chosen (--stages)"
        stages.append({"stage": s.id, "title": s.title, "part": s.part, "status": NOT_RUN,
                       "why": why, "items": []})
    ceiling_rec = find_record(work, "1", device, records)
    ceiling = measured_peaks(ceiling_rec)
    cases = seed_cases(work, device, records)
    derive_cases(cases, ceiling)
    peers = [p for r in ran if get_stage(r["stage"]).kind == "peers" for p in items(r, "peer")]
    peer_ratios(peers, cases)
    return {"schema": SCHEMA, **meta, "stages": stages,
            "ceiling": {"measured": ceiling, "from": (ceiling_rec or {}).get("found_in",
                                                                           "this check")
                        if ceiling_rec else None},
            "published_capacity": published_capacity()}


# -- markdown ---------------------------------------------------------------------------------

def stage_heading(s: dict) -> str:
    head = f"## Stage {s['stage']}: {s['title']}"
    if s["status"] == NOT_RUN:
        return f"{head}\n\nnot run: {s['why']}"
    cap, own = s.get("cap_s", 0), s.get("own_cap_s", s.get("cap_s", 0))
    extra = f": its own {own:.0f} s and {cap - own:.0f} s earlier stages left" \
        if cap - own >= 1 else ""
    took = f"{s['status']} in {s.get('elapsed_s', 0):.0f} s (cap {cap:.0f} s{extra})"
    return f"{head}\n\n{took}" + (f": {s['why']}" if s.get("why") else "")


def checks_table(s: dict) -> str | None:
    rows = [[c["name"], c["status"], c["detail"]] for c in items(s, "check")]
    return table(["check", "result", "numbers"], rows) if rows else None


def ceiling_section(s: dict) -> list[str]:
    rows = []
    for c in items(s, "ceiling"):
        rows.append([c["format"], _tflops(c["flops_per_s"]), _tflops(c.get("datasheet")),
                     pct(c.get("of_datasheet")), c.get("why") or ""])
    for c in items(s, "copy"):
        rows.append(["copy (GB/s, read + write)", fmt(c["bytes_per_s"] / 1e9, 1),
                     fmt(c["datasheet"] / 1e9 if c.get("datasheet") else None, 1),
                     pct(c.get("of_datasheet")), f"{c['bytes'] / 2**20:.0f} MiB buffer"])
    if not rows:
        return []
    return [f"Device: {s.get('device_name', '-')}", "",
            table(["format", "measured TFLOP/s", "datasheet TFLOP/s", "of datasheet", "note"],
                  rows)]


def _runs_text(c: dict) -> str:
    """Every run's rate; a run left out of the median (flagged) in brackets."""
    words = [f"({r['samples_per_s']:.1f})" if r.get("flags") else f"{r['samples_per_s']:.1f}"
             for r in c.get("runs", []) if r.get("samples_per_s")]
    return ", ".join(words) or "-"


def _flags(c: dict) -> str:
    flags = list(dict.fromkeys([*(c.get("flags") or []),
                                *(f for r in c.get("runs", []) for f in r.get("flags", []))]))
    if flags or c.get("status") == "ok":
        return ", ".join(flags)
    errors = [r["error"] for r in c.get("runs", []) if r.get("error")]
    return errors[0] if errors else "failed"


def _tflops(value: float | None) -> str:
    return "-" if not value else f"{value / TFLOPS:.3g}"


def breakdown_lines(s: dict) -> list[str]:
    """Where the profiled cases' step time went (``run --breakdown``), one line per case."""
    out = []
    for c in items(s, "case"):
        bd = c.get("breakdown")
        if not bd:
            continue
        if bd.get("status") != "ok" or not bd.get("phases_s"):
            out.append(f"- {c['label']}: no breakdown ({bd.get('error') or bd.get('status')})")
            continue
        parts = ", ".join(f"{label(n)} {1000 * v:.1f} ms ({pct(bd['shares'][n])})"
                          for n, v in bd["phases_s"].items())
        out.append(f"- {c['label']}: profiled step {1000 * bd['step_s']:.1f} ms: {parts}")
    return (["", "Where the time goes (one profiled run per case, outside the statistics):", "",
             *out]) if out else []


def seeds_section(s: dict, cases_by_label: dict[str, dict], peers: list[dict]) -> list[str]:
    rows = []
    for item in items(s, "case"):
        c = cases_by_label.get(item["label"], item)
        versus = "; ".join(f"{p['peer']} {p['trainperf_over_peer']:.2f}" for p in peers
                           if p["label"] == c["label"] and p.get("trainperf_over_peer"))
        ref = c.get("dlperf")
        ref_text = (f"{ref['framework']} {ref['precision']} {ref['samples_per_s']:.1f}"
                    if ref else "no published row")
        gaps = [r["timing_gap"] for r in c.get("runs", []) if r.get("timing_gap") is not None]
        worst_gap = max(gaps, key=abs) if gaps else None
        watts = [r["mean_power_w"] for r in c.get("runs", []) if r.get("mean_power_w")]
        rows.append([
            c["label"], fmt(c.get("median_samples_per_s"), 1), _runs_text(c),
            fmt(c.get("per_gpu"), 1), ref_text, fmt(c.get("ratio_to_v100")), versus or "-",
            pct(c.get("mfu_datasheet")), pct(c.get("mfu_measured")),
            pct(ref.get("mfu")) if ref else "-",
            fmt(c.get("samples_per_j"), 2) if c.get("samples_per_j") else "not measured",
            fmt(sum(watts) / len(watts), 0) if watts else "-",
            f"{100 * worst_gap:+.2f}%" if worst_gap is not None else "-",
            gib(c.get("peak_memory_bytes")), gib(c.get("window_peak_memory_bytes")),
            pct(c.get("memory_model_error")), _flags(c)])
    if not rows:
        return []
    head = ["case", "samples/s (median)", "runs", "per GPU", "DLPerf V100 row", "per GPU / V100",
            "trainperf / peer", "MFU (datasheet)", "MFU (measured ceiling)", "V100 row MFU",
            "samples/J",
            "mean W", "events vs host", "peak memory", "peak in the window", "model error",
            "flags"]
    return [table(head, rows)]


def _probe_table(probes: list[dict]) -> str:
    return table(["value", "status", "peak", "predicted", "error"],
                 [[f"{p['value']:,}", p["status"], gib(p.get("peak_bytes")),
                   gib(p.get("predicted_bytes")), (p.get("error") or "")[:80]] for p in probes])


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def capacity_section(s: dict, published: dict, device_bytes: int | None) -> list[str]:
    out = []
    for srch in items(s, "search"):
        kind = srch["search"]
        pub = published.get(kind) or []
        what = "batch" if kind == "max-batch" else "classes"
        pub_text = "; ".join(f"{p['framework']} {p[what]:,}" for p in pub) or "-"
        ans = srch.get("answer")
        per_gib = (f"{ans / (device_bytes / 2**30):,.1f} per GiB here; published "
                   + ", ".join(f"{p[what] / 16:,.1f}" for p in pub) + " per GiB on a 16 GB V100"
                   if ans and device_bytes and pub else "")
        out += [f"### {kind}: {srch['label']}", "",
                f"Answer **{_count(ans)}** (largest fit {_count(srch.get('largest_fit'))}, "
                f"smallest failure {_count(srch.get('smallest_fail'))}, resolution "
                f"{pct(srch.get('resolution'))}, first probe {srch.get('start'):,}). "
                f"Peak at the answer {gib(srch.get('peak_bytes_at_answer'))}, the model said "
                f"{gib(srch.get('predicted_bytes_at_answer'))} "
                f"(error {pct(srch.get('model_error_at_answer'))}). DLPerf on one "
                f"{published['device']}: {pub_text}. {per_gib}", "",
                _probe_table(srch.get("probes", [])), ""]
    done = {x["search"] for x in items(s, "search")}
    unfinished = [p for p in items(s, "probe") if p["search"] not in done]
    for kind in dict.fromkeys(p["search"] for p in unfinished):
        out += [f"### {kind}: stopped before its end", "",
                _probe_table([p for p in unfinished if p["search"] == kind]), ""]
    for r in items(s, "refit"):
        new = r.get("new") or {}
        out += [f"### Memory model constants ({r['device_type']}), refitted to {r['points']} "
                "probes that trained", "",
                table(["", "backward factor", "runtime bytes", "mean error",
                       "error, each probe left out of the fit"],
                      [["old", fmt(r["old"]["backward_factor"]),
                        gib(r["old"]["runtime_bytes"]) if r["old"]["runtime_bytes"] else "0",
                        pct(r.get("old_error")), "-"],
                       ["new", fmt(new.get("backward_factor")),
                        gib(new.get("runtime_bytes")) if new.get("runtime_bytes") else
                        ("0" if new else "-"), pct(r.get("new_error")),
                        pct(r.get("new_error_left_out"))]]), "",
                f"Old constants: {r['old']['source']}. This check applies nothing: once the "
                "record is committed, `benchmarks/memory_model_gpu.py` fits every peak it "
                "holds, by precision, for `backends/torch/memory_model.py`.", ""]
    return out


def peers_section(s: dict, peers: list[dict]) -> list[str]:
    rows = []
    for p in peers:
        theirs = p.get("samples_per_s") or p.get("median_samples_per_s")
        rows.append([p["peer"], p["label"], fmt(theirs, 1),
                     fmt(p.get("trainperf_samples_per_s"), 1),
                     fmt(p.get("trainperf_over_peer"), 3),
                     p.get("interpreter") or p.get("timm_version") or ""])
    if not rows:
        return []
    return [table(["peer", "case", "peer samples/s", "trainperf (torch) samples/s",
                   "trainperf / peer", "where"], rows),
            "", "trainperf's figures are the case stages' medians of the same case."]


def native_section(s: dict) -> list[str]:
    rows = [[p["framework"], f"{p['model']} ({p['recipe']})", fmt(p.get("batch")),
             fmt(p.get("trainperf_samples_per_s"), 1), fmt(p.get("native_samples_per_s"), 1),
             f"**{p['ratio']:.3f}**" if p.get("ratio") else "-",
             p.get("native_step") or p.get("error") or ""] for p in items(s, "parity")]
    if not rows:
        return []
    return [table(["framework", "case", "batch", "trainperf samples/s", "native samples/s",
                   "trainperf / native", "native step"], rows),
            "", "One interleaved pair each (`trainperf.parity`); the goal is 0.97 or more. "
                "Every pair's settings and versions: `parity/parity.json` in the archive."]


def realdata_section(s: dict) -> list[str]:
    out = []
    for d in items(s, "dataset"):
        out.append(f"Dataset: {d['images']} images of {d['identities']} identities "
                   f"({d['bytes'] / 2**20:.1f} MiB), written in {d['seconds']:.1f} s.")
    rows = [[r["label"], r["decoder"] or r["asked"], fmt(r.get("loader_workers")),
             fmt(r.get("synthetic_samples_per_s"), 1), fmt(r.get("real_samples_per_s"), 1),
             fmt(r["real_samples_per_s"] / r["synthetic_samples_per_s"], 3)
             if r.get("real_samples_per_s") and r.get("synthetic_samples_per_s") else "-",
             pct(r.get("data_wait_share")), r["verdict"]] for r in items(s, "realdata")]
    if rows:
        out += ["", table(["case", "decoder", "loader processes", "synthetic samples/s",
                           "real samples/s", "real / synthetic", "window waiting", "verdict"],
                          rows)]
    return out


def render(doc: dict, files: list[str], left_out: list[str]) -> str:
    env = doc["env"]
    lines = [f"# trainperf gpucheck ({doc['name']}, {doc['mode']} mode)", "",
             f"Device: **{doc['device']}**; host {env.get('host')} ({env.get('cpu_model')}, "
             f"{env.get('cpu_count')} cores); driver {env.get('driver_version') or '-'}; "
             f"trainperf {env.get('trainperf_version')} at {env.get('trainperf_commit')}; "
             f"Python {env.get('python')}. Took {doc['elapsed_s']:.0f} s.", ""]
    if doc["mode"] == "cpu":
        lines += ["CPU mode: the stages ran at tiny sizes on the CPU, so no figure here is a "
                  "GPU's; the checks that need a GPU say so.", ""]
    lines += [f"- {n}" for n in doc["notes"]] + ([""] if doc["notes"] else [])
    cases = {c["label"]: c for s in doc["stages"] for c in items(s, "case")}
    ceiling = doc["ceiling"]
    kinds = {s["stage"]: get_stage(s["stage"]).kind for s in doc["stages"]}
    peers = [p for s in doc["stages"] if kinds[s["stage"]] == "peers" for p in items(s, "peer")]
    for s in doc["stages"]:
        lines += [stage_heading(s), ""]
        if s.get("found_in"):
            lines += [f"(from {s['found_in']})", ""]
        body: list[str] = []
        kind = kinds[s["stage"]]
        if kind == "ceiling":
            body = ceiling_section(s)
        elif kind == "cases":
            body = seeds_section(s, cases, peers) + breakdown_lines(s)
            if body and ceiling["measured"] and ceiling["from"] != "this check":
                body += ["", f"MFU against the ceiling measured by stage 1 in {ceiling['from']}."]
            elif body and not ceiling["measured"]:
                body += ["", "No stage 1 ceiling from this device was found: MFU against the "
                             "measured ceiling is left out."]
        elif kind == "capacity":
            body = capacity_section(s, doc["published_capacity"], s.get("device_memory_bytes"))
        elif kind == "peers":
            body = peers_section(s, peers)
        elif kind == "realdata":
            body = realdata_section(s)
        elif kind == "parity":
            body = native_section(s)
        checks = checks_table(s)
        body += ([""] if body and checks else []) + ([checks] if checks else [])
        body += [f"- {n['text']}" for n in items(s, "note")]
        lines += body + ([""] if body else [])
    lines += ["## Files", "", *[f"- `{f}`" for f in files]]
    if left_out:
        lines += ["", "Left out of the archive (too large to bring back): "
                  + ", ".join(f"`{f}`" for f in left_out)]
    lines += ["", "How to read it: each stage says whether it finished (ok), failed (with the "
              "first line of why), ran out of its time cap (what it measured before is kept) or "
              "did not run (and why). A check is pass, fail, not run or recorded (a figure kept "
              "without a limit to meet). MFU counts a multiply-add as 2 FLOPs and training as 3x "
              "the forward, against the datasheet's dense peak and against the matrix-product "
              "rate stage 1 measured, each engine (convolutions, matrix products) at the format "
              "it ran in. *per GPU / V100* divides the per-GPU rate by the fastest published "
              "DLPerf row of the same model, mode and batch on one V100 (in fp32 where DLPerf "
              "published no other precision). *events vs host* is how far the sum of the "
              "window's CUDA-event step times is from the host clock's window. *peak in the "
              "window* is the allocator's peak over the measured steps alone (torch on a GPU), "
              "without the first steps' (where cuDNN's autotuning tries its algorithms)."]
    return "\n".join(lines) + "\n"


# -- files ------------------------------------------------------------------------------------

def archive(work: Path, path: Path) -> list[str]:
    """The work folder as a .tar.gz, data files and oversized files left out; what was left
    out."""
    left_out = []

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.issym() or info.islnk() or ".pythonpath" in info.name.split("/"):
            return None
        if info.isfile() and (info.name.endswith(SKIP_SUFFIXES)):
            return None
        if info.isfile() and info.size > TAR_FILE_LIMIT:
            left_out.append(info.name)
            return None
        return info

    with tarfile.open(path, "w:gz") as tar:
        tar.add(work, arcname=work.name, filter=keep)
    return left_out


def write(out: Path, work: Path, meta: dict, ran: list[dict]) -> dict:
    from .plots import write_plots

    out.mkdir(parents=True, exist_ok=True)
    doc = build(work, meta, ran)
    tar_name = f"gpucheck-{meta['name']}.tar.gz"
    left_out = archive(work, out / tar_name)
    plots = write_plots(doc, out)
    files = ["summary.md", "summary.json", tar_name, *plots]
    doc["files"] = files
    doc["left_out_of_archive"] = left_out
    write_json_atomic(out / "summary.json", doc)
    (out / "summary.md").write_text(render(doc, files, left_out), encoding="utf-8")
    return doc
