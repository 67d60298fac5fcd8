"""Results documents with a known throughput and spread, for the comparison tests: each run's
speed is drawn around the true rate (run-to-run spread), and its window's step times around that
run's speed (step-to-step spread), as measured runs behave."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trainperf import results

BATCH = 8


def runs_of(rate: float, runs: int, rng: np.random.Generator, run_cv: float = 0.02,
            step_cv: float = 0.05, steps: int = 100) -> list[dict]:
    out = []
    for i in range(runs):
        speed = rate * (1 + run_cv * rng.standard_normal())
        times = (BATCH / speed) * (1 + step_cv * rng.standard_normal(steps)).clip(0.5)
        window = float(times.sum())
        out.append({"run": i + 1, "status": "ok", "samples_per_s": BATCH * steps / window,
                    "window_s": window, "window_samples": BATCH * steps,
                    "step_times_s": [float(t) for t in times], "peak_memory_bytes": None,
                    "loss_first": 7.0, "loss_last": 6.5, "error": None, "flags": []})
    return out


def case_of(run_list: list[dict], world: int = 1, batch: int = BATCH, precision: str = "fp32",
            fc: str = "dp", num_classes: int = 1000, sample_ratio: float = 1.0) -> dict:
    rates = [r["samples_per_s"] for r in run_list
             if r["status"] == "ok" and r["samples_per_s"] is not None]
    st = results.stats.case_stats(rates)
    return {"case": f"1n{world}g", "nodes": 1, "devices_per_node": world, "world_size": world,
            "batch_size_per_device": batch, "precision": precision,
            "num_classes": num_classes, "fc": fc, "sample_ratio": sample_ratio,
            "runs": run_list, "median_samples_per_s": st.median,
            "average_samples_per_s": st.average, "iqr_samples_per_s": st.iqr,
            "spread": st.spread, "ok_runs": st.ok_runs, "speedup": None,
            "scaling_efficiency": None, "flags": st.flags}


def doc_of(cases: list[dict], framework: str = "torch", version: str = "2.13.0",
           commit: str = "a" * 40, recipe: str = "tiny-arcface", fc: str = "dp") -> dict:
    env = {"framework": framework, "framework_version": version, "trainperf_commit": commit,
           "host": "vm", "cpu_model": "AMD EPYC", "device_type": "cpu", "device_names": []}
    workload = {"backbone": "tiny", "num_classes": 1000, "fc": fc, "precision": "fp32"}
    doc = results.document(recipe, workload, {"runs": len(cases[0]["runs"]), "iters": 120,
                                              "warmup": 20}, env, cases)
    doc["framework"] = framework
    results.validate(doc)
    return doc


def write(folder: Path, doc: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(doc), encoding="utf-8")
    return folder


def folder_of(folder: Path, rate: float, runs: int, seed: int, **kw) -> Path:
    """A results folder of one case at ``rate`` samples/s; ``kw`` go to ``doc_of``."""
    rng = np.random.default_rng(seed)
    fc = kw.get("fc", "dp")
    return write(folder, doc_of([case_of(runs_of(rate, runs, rng), fc=fc)], **kw))
