"""The scaling model (trainperf.scale.model) against every published multi-GPU DLPerf row.

For each published table (one framework, model, precision, batch per device and mode, as
src/trainperf/references holds them), the model starts from that table's own 1-GPU row and
predicts every row with more than one GPU; the error is (predicted - published) / published.
A second pass starts from the table's 1n8g row and predicts its 2- and 4-node rows. The fabric
is DGX-1-class V100-SXM2 nodes with one 100 Gb/s EDR InfiniBand NIC each, as DLPerf's reports
describe their cluster; FABRIC_SOURCES says where each figure comes from. Nothing is fitted to
the published throughput. Writes benchmarks/results/scaling_model-dlperf.json and .md.

    python benchmarks/scaling_model.py
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from trainperf.references import Reference, load_throughput
from trainperf.scale.model import (
    BACKWARD_SHARE, DEFAULT_BUCKET_BYTES, Fabric, Job, Scale, backbone_counts, project,
    uniform_fabric)

COMMAND = "python benchmarks/scaling_model.py"
OUT = Path(__file__).resolve().parent / "results"

INTRA_BUSBW_BPS = 120e9
INTER_BUSBW_BPS = 12.2e9
INTRA_LATENCY_S = 10e-6
INTER_LATENCY_S = 30e-6
FABRIC_SOURCES = {
    "cluster": "DLPerf's reports (reports/dlperf_benchmark_test_report_v1.md and OneFlow's "
               "report pages in Oneflow-Inc/DLPerf): 4 nodes of 8 Tesla V100-SXM2-16GB, "
               "'InfiniBand 100 Gb/sec (4X EDR), Mellanox Technologies MT27700 Family'; their "
               "`nvidia-smi topo -m` shows NV1/NV2 links between GPUs (the DGX-1 hybrid "
               "cube-mesh: 6 NVLinks per GPU) and a single NIC, mlx5_0, per node. The seeds "
               "name NCCL 2.7.3.",
    "intra_busbw": "120 GB/s = 6 NVLink2 links per V100 x 25 GB/s line rate per direction x "
                   "0.8: NCCL moves 128-byte payloads and gets about 20 GB/s of a 25 GB/s "
                   "NVLink (NCCL's maintainer, NVIDIA/nccl-tests#149). NVIDIA describes the "
                   "cube-mesh as three interwoven NVLink rings, so rings can keep all six links "
                   "of a GPU busy. GPUs 0-3 have only 4 links among themselves, yet one figure "
                   "serves every single-node case.",
    "inter_busbw": "12.2 GB/s: ring all-reduce bus bandwidth of one 100 Gb/s EDR adapter, 'as "
                   "good as you can get' per NCCL's maintainer on 8xV100 nodes with one 4X EDR "
                   "card each (NVIDIA/nccl-tests#29); the line rate is 12.5 GB/s.",
    "latency": "10 us within a node, 30 us across nodes per collective: round figures, not "
               "measured on this cluster; the sensitivity section shows they barely move the "
               "predictions.",
}

NUM_CLASSES = {"face_emore": 85742, "glint360k": 360232}
EMBEDDING = {"r100": 512, "r50": 512, "y1": 128}
FC = {"data_parallel": "dp", "model_parallel": "mp", "plsc_model_parallel": "mp",
      "partial_fc": "pfc"}
OUT_OF_SCOPE_IMPL = {
    "recognition/ArcFace": (
        "insightface's MXNet ArcFace runs one process driving every GPU with kvstore 'device' "
        "(its sample_config's default): gradients are summed by copies between GPUs, not NCCL "
        "ring collectives, which is what the model describes"),
}


@dataclass
class Table:
    key: tuple
    rows: list[Reference]

    @property
    def first(self) -> Reference:
        return self.rows[0]

    def at(self, world: int, nodes: int | None = None) -> Reference | None:
        return next((r for r in self.rows if r.world_size == world
                     and (nodes is None or r.nodes == nodes)), None)

    def describe(self) -> dict:
        r = self.first
        return {"framework": r.framework, "model": r.model, "precision": r.precision,
                "batch_size_per_device": r.batch_size_per_device, "mode": r.mode,
                "source": r.source}


def tables() -> list[Table]:
    grouped: dict[tuple, list[Reference]] = defaultdict(list)
    for r in load_throughput():
        key = (r.framework, r.model, r.precision, r.batch_size_per_device, r.mode, r.source)
        grouped[key].append(r)
    return [Table(k, sorted(v, key=lambda r: (r.world_size, r.nodes))) for k, v in grouped.items()]


def scope(table: Table) -> str | None:
    """None when the model describes the table's communication, else why it does not."""
    impl = table.first.mode_items.get("impl")
    return OUT_OF_SCOPE_IMPL.get(impl) if impl else None


def job_for(table: Table, counts: dict[str, tuple[int, float]]) -> Job:
    r = table.first
    items = r.mode_items
    params, flops = counts[r.model]
    grad_bytes = 2 if r.precision == "fp16" else 4  # fp16 = the model cast to half; amp keeps fp32
    if r.suite == "resnet50":
        return Job("dp", r.batch_size_per_device, params, flops, grad_bytes=grad_bytes)
    dataset = items.get("dataset", "")
    classes = NUM_CLASSES.get(dataset) or int(dataset.split("num_classes=")[1].rstrip(")"))
    fc = FC[items["parallel"]]
    ratio = float(items["sample_ratio"]) if fc == "pfc" else 1.0
    return Job(fc, r.batch_size_per_device, params, flops, num_classes=classes,
               embedding_size=EMBEDDING[r.model], sample_ratio=ratio, grad_bytes=grad_bytes)


def model_counts() -> dict[str, tuple[int, float]]:
    """Backbone parameters and forward FLOPs per sample, counted on torch's meta device. The
    ResNet50 rows are v1.5 or v1b: the same layers (stride on the 3x3), so the same counts."""
    return {"r100": backbone_counts("r100", 112, 512, output_block="E"),
            "r50": backbone_counts("r50", 112, 512, output_block="E"),
            "y1": backbone_counts("y1", 112, 128),
            "rn50": backbone_counts("rn50", 224, num_classes=1000)}


def error_pct(predicted: float, published: float) -> float:
    return (predicted - published) / published * 100


def predict_table(table: Table, job: Job, fabric: Fabric, base: Reference,
                  targets: list[Reference]) -> list[dict]:
    scales = [Scale(r.nodes, r.devices_per_node) for r in targets]
    preds = project(job, Scale(base.nodes, base.devices_per_node), base.samples_per_s, scales,
                    fabric)
    return [{"case": p.scale, "world_size": p.world_size, "published": r.samples_per_s,
             "predicted": round(p.samples_per_s, 2),
             "error_pct": round(error_pct(p.samples_per_s, r.samples_per_s), 2),
             "published_efficiency": round(r.samples_per_s / r.world_size
                                           / table.at(1).samples_per_s, 4),
             "predicted_efficiency": round(p.scaling_efficiency, 4),
             "limit": p.limit, "overhead": p.overhead,
             "overhead_share": round(p.overhead_share, 4)}
            for p, r in zip(preds, targets)]


def mae(values: list[float]) -> float | None:
    return round(statistics.fmean(abs(v) for v in values), 2) if values else None


def bias(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 2) if values else None


def check(fabric: Fabric, counts: dict, all_tables: list[Table], overlap: bool = True) -> dict:
    out_tables, not_applicable = [], []
    for t in all_tables:
        multi = [r for r in t.rows if r.world_size > 1]
        if not multi:
            continue
        job = replace(job_for(t, counts), overlap=overlap)
        rows = predict_table(t, job, fabric, t.at(1), multi)
        reason = scope(t)
        entry = {**t.describe(), "fc": job.fc, "in_scope": reason is None,
                 "base_samples_per_s": t.at(1).samples_per_s, "rows": rows,
                 "mae_pct": mae([r["error_pct"] for r in rows])}
        out_tables.append(entry)
        if reason:
            not_applicable.append({**t.describe(),
                                   "cases": [r["case"] for r in rows], "reason": reason})
    errors_in = [r["error_pct"] for t in out_tables if t["in_scope"] for r in t["rows"]]
    errors_all = [r["error_pct"] for t in out_tables for r in t["rows"]]
    groups: dict[str, list[float]] = defaultdict(list)
    for t in out_tables:
        if not t["in_scope"]:
            continue
        suite = "insightface" if t["model"] != "rn50" else "resnet50"
        half = "fp32" if t["precision"] == "fp32" else "amp/fp16"
        for r in t["rows"]:
            where = "one node" if r["case"].startswith("1n") else "several nodes"
            groups[f"{suite}, {half}, {where}"].append(r["error_pct"])
    return {"tables": out_tables, "not_applicable": not_applicable,
            "summary": {"rows_in_scope": len(errors_in), "mae_pct_in_scope": mae(errors_in),
                        "bias_pct_in_scope": bias(errors_in),
                        "rows_all": len(errors_all), "mae_pct_all": mae(errors_all),
                        "bias_pct_all": bias(errors_all),
                        "groups": {k: {"rows": len(v), "mae_pct": mae(v), "bias_pct": bias(v)}
                                   for k, v in sorted(groups.items())}}}


def from_single_node(fabric: Fabric, counts: dict, all_tables: list[Table]) -> dict:
    """Multi-node rows predicted from the same table's 1n8g row, in-scope tables only."""
    out, errors = [], []
    by_precision: dict[str, list[float]] = defaultdict(list)
    for t in all_tables:
        base = t.at(8, nodes=1)
        multi = [r for r in t.rows if r.nodes > 1]
        if scope(t) or base is None or not multi:
            continue
        rows = predict_table(t, job_for(t, counts), fabric, base, multi)
        errors += [r["error_pct"] for r in rows]
        half = "fp32" if t.first.precision == "fp32" else "amp/fp16"
        by_precision[half] += [r["error_pct"] for r in rows]
        out.append({**t.describe(), "base_case": "1n8g", "base_samples_per_s": base.samples_per_s,
                    "rows": rows, "mae_pct": mae([r["error_pct"] for r in rows])})
    return {"tables": out, "summary": {
        "rows": len(errors), "mae_pct": mae(errors), "bias_pct": bias(errors),
        "groups": {k: {"rows": len(v), "mae_pct": mae(v), "bias_pct": bias(v)}
                   for k, v in sorted(by_precision.items())}}}


def sensitivity(counts: dict, all_tables: list[Table]) -> list[dict]:
    """The check again with one assumption changed at a time (none of them fitted)."""
    variants = [("as assumed", 1, 1, True), ("latencies x0", 0, 1, True),
                ("latencies x4", 4, 1, True), ("inter-node busbw x0.5", 1, 0.5, True),
                ("inter-node busbw x2", 1, 2, True),
                ("no overlap: all-reduce after the backward", 1, 1, False)]
    out = []
    for name, lat, bw, overlap in variants:
        fabric = uniform_fabric(INTRA_BUSBW_BPS, INTER_BUSBW_BPS * bw, INTRA_LATENCY_S * lat,
                                INTER_LATENCY_S * lat)
        s = check(fabric, counts, all_tables, overlap)["summary"]
        out.append({"variant": name, "mae_pct_in_scope": s["mae_pct_in_scope"],
                    "bias_pct_in_scope": s["bias_pct_in_scope"],
                    "groups": s["groups"]})
    return out


def short_mode(table: dict) -> str:
    items = dict(p.split("=", 1) for p in table["mode"].split(";") if "=" in p)
    if "parallel" in items:
        text = f"{table['fc']}"
        if items.get("sample_ratio"):
            text += f" {items['sample_ratio']}"
        text += f", {items.get('dataset', '').split('(')[0]}"
        if items.get("impl"):
            text += f", {items['impl']}"
        return text
    return ";".join(p for p in table["mode"].split(";")
                    if not p.startswith(("variant=", "repeats=")))


def markdown(doc: dict) -> str:
    s = doc["check"]["summary"]
    lines = ["# Scaling model against DLPerf's published multi-GPU rows", "",
             f"Made by `{doc['command']}`. Each table's multi-GPU rows are predicted from its own "
             "1-GPU row (same framework, batch, precision and mode); error = (predicted - "
             "published) / published.", "",
             "## Fabric assumed", "",
             f"- intra-node bus bandwidth {INTRA_BUSBW_BPS / 1e9:g} GB/s, latency "
             f"{INTRA_LATENCY_S * 1e6:g} us; inter-node {INTER_BUSBW_BPS / 1e9:g} GB/s, "
             f"{INTER_LATENCY_S * 1e6:g} us", ""]
    lines += [f"- {k}: {v}" for k, v in FABRIC_SOURCES.items()]
    lines += ["", "Model settings: " + "; ".join(doc["assumptions"]), "",
              "## Summary", "",
              f"- in scope: {s['rows_in_scope']} rows, mean absolute error "
              f"{s['mae_pct_in_scope']}%, mean signed error {s['bias_pct_in_scope']}%",
              f"- every row (out-of-scope tables too): {s['rows_all']} rows, mean absolute "
              f"error {s['mae_pct_all']}%, mean signed error {s['bias_pct_all']}%"]
    h = doc["from_1n8g"]["summary"]
    lines += [f"- multi-node rows predicted from the table's 1n8g row instead: {h['rows']} rows, "
              f"mean absolute error {h['mae_pct']}%, mean signed error {h['bias_pct']}%", "",
              "| in-scope rows | rows | MAE % | mean signed error % |", "|---|---|---|---|"]
    lines += [f"| {k} | {g['rows']} | {g['mae_pct']} | {g['bias_pct']} |"
              for k, g in s["groups"].items()]
    lines += [f"| several nodes from 1n8g, {k} | {g['rows']} | {g['mae_pct']} | {g['bias_pct']} |"
              for k, g in h["groups"].items()]
    lines += ["",
              "## Mean absolute error per table", "",
              "| framework | model | precision | batch | mode | rows | MAE % | source |",
              "|---|---|---|---|---|---|---|---|"]
    for t in doc["check"]["tables"]:
        flag = "" if t["in_scope"] else " (out of scope)"
        lines.append(f"| {t['framework']} | {t['model']} | {t['precision']} | "
                     f"{t['batch_size_per_device']} | {short_mode(t)}{flag} | {len(t['rows'])} | "
                     f"{t['mae_pct']} | {t['source']} |")
    lines += ["", "## Every row", "",
              "| framework | model | precision | batch | mode | case | published | predicted | "
              "error % | eff. published | eff. predicted | limited by | largest overhead |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in doc["check"]["tables"]:
        flag = "" if t["in_scope"] else " (out of scope)"
        for r in t["rows"]:
            lines.append(
                f"| {t['framework']} | {t['model']} | {t['precision']} | "
                f"{t['batch_size_per_device']} | {short_mode(t)}{flag} | {r['case']} | "
                f"{r['published']:.2f} | {r['predicted']:.2f} | {r['error_pct']:+.1f} | "
                f"{r['published_efficiency']:.3f} | {r['predicted_efficiency']:.3f} | "
                f"{r['limit']} | {r['overhead']} ({r['overhead_share'] * 100:.1f}%) |")
    lines += ["", "## Rows the model does not apply to", ""]
    for na in doc["check"]["not_applicable"]:
        lines.append(f"- {na['framework']} {na['model']} {na['precision']} batch "
                     f"{na['batch_size_per_device']} {short_mode({**na, 'fc': ''})} "
                     f"({', '.join(na['cases'])}): {na['reason']}")
    lines += ["", "## Multi-node rows from the 1n8g row", "",
              "| framework | model | precision | batch | case | published | predicted | error % |",
              "|---|---|---|---|---|---|---|---|"]
    for t in doc["from_1n8g"]["tables"]:
        for r in t["rows"]:
            lines.append(f"| {t['framework']} | {t['model']} | {t['precision']} | "
                         f"{t['batch_size_per_device']} | {r['case']} | {r['published']:.2f} | "
                         f"{r['predicted']:.2f} | {r['error_pct']:+.1f} |")
    names = list(doc["check"]["summary"]["groups"])
    lines += ["", "## Sensitivity (in-scope rows, from the 1-GPU row)", "",
              "MAE % overall and per group (" + "; ".join(names) + ")", "",
              "| variant | all | " + " | ".join(names) + " |",
              "|---|---|" + "---|" * len(names)]
    lines += [f"| {v['variant']} | {v['mae_pct_in_scope']} | "
              + " | ".join(str(v["groups"][k]["mae_pct"]) for k in names) + " |"
              for v in doc["sensitivity"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    counts = model_counts()
    all_tables = tables()
    fabric = uniform_fabric(INTRA_BUSBW_BPS, INTER_BUSBW_BPS, INTRA_LATENCY_S, INTER_LATENCY_S,
                            source="DGX-1-class V100 nodes, one EDR NIC each (see sources)")
    doc = {
        "schema": "trainperf.scaling_check/v1",
        "command": COMMAND,
        "fabric": {**fabric.to_dict(), "sources": FABRIC_SOURCES},
        "assumptions": [
            f"gradient buckets of {DEFAULT_BUCKET_BYTES // 2**20} MiB",
            f"backward = {BACKWARD_SHARE:.3g} of the compute it covers",
            "gradients of 2 bytes for fp16 rows (model cast to half), 4 for fp32 and amp",
            "head FLOPs 6 x rows x gathered samples x embedding; same FLOP/s as the backbone",
        ],
        "backbones": {k: {"params": p, "forward_gflops_per_sample": round(f / 1e9, 4)}
                      for k, (p, f) in counts.items()},
        "check": check(fabric, counts, all_tables),
        "from_1n8g": from_single_node(fabric, counts, all_tables),
        "sensitivity": sensitivity(counts, all_tables),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scaling_model-dlperf.json").write_text(json.dumps(doc, indent=1) + "\n",
                                                   encoding="utf-8")
    (OUT / "scaling_model-dlperf.md").write_text(markdown(doc), encoding="utf-8")
    s = doc["check"]["summary"]
    print(f"in scope: {s['rows_in_scope']} rows, MAE {s['mae_pct_in_scope']}% "
          f"(bias {s['bias_pct_in_scope']}%); all rows: MAE {s['mae_pct_all']}%")
    print(f"wrote {OUT / 'scaling_model-dlperf.json'} and .md")


if __name__ == "__main__":
    main()
