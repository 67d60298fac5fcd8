"""Native parity: each framework's trainperf worker against that framework's own training step.

A ratio column between frameworks measures the frameworks only if every worker trains as fast as
a competent user of its framework would. For each framework, ``benchmarks/native/<fw>_native.py``
is such a user's step (its model zoo, its optimizer, its usual loop and compile path), and this
script times it against ``trainperf run`` on the same shapes, precision and threads, in
interleaved pairs: pair k runs trainperf first when k is even and the reference first when it is
odd, so a machine that slows down over time weighs on both sides alike. Each side times a window
of ``--iters`` steps after ``--warmup`` steps, synchronised only at the window's edges.

    python benchmarks/native_parity.py [--device cpu] [--frameworks torch,jax,...]
        [--case rn50:8] [--case face:8] [--pairs 3] [--iters 6] [--warmup 2] [--threads 2]
        [--precision fp32] [--channels-last] [--out DIR] [--budget-s S]

A case is MODEL:BATCH, MODEL ``rn50`` (ResNet50 v1b, 224x224, 1000 classes) or ``face``
(IResNet-50 ArcFace, PLSC's recipe, 112x112, 85,742 classes). The record goes to
``benchmarks/results/native_parity-<device>/``: ``parity.json`` (every pair, both sides'
settings and versions) and ``parity.md`` (median ratio, spread, the pairs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NATIVE = HERE / "native"
SCHEMA = "trainperf.native_parity/v1"
RECIPES = {"rn50": "rn50-v1b-imagenet", "face": "r50-arcface-plsc"}
FRAMEWORKS = ("torch", "mxnet", "paddle", "jax", "tf", "oneflow")
DEFAULT_CASES = {"cpu": ["rn50:8", "rn50:2", "face:8"], "cuda": ["rn50:128", "face:128"]}


class SideFailed(RuntimeError):
    """One side of a pair did not produce a figure."""


def native_script(framework: str) -> Path:
    return NATIVE / f"{framework}_native.py"


def interpreter(framework: str) -> str:
    from trainperf import envs

    return envs.interpreter(framework)


def thread_env(threads: int | None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def run_native(framework: str, model: str, batch: int, a: argparse.Namespace,
               timeout_s: float) -> dict:
    cmd = [interpreter(framework), str(native_script(framework)), "--case", model,
           "--batch", str(batch), "--iters", str(a.iters), "--warmup", str(a.warmup),
           "--device", a.device, "--precision", a.precision]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    if a.channels_last:
        cmd.append("--channels-last")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=thread_env(a.threads),
                          timeout=timeout_s)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SideFailed(f"native {framework} exited {proc.returncode}: {tail[0]}")
    doc = last_json(proc.stdout)
    doc["command"] = " ".join(cmd[1:])
    return doc


def run_trainperf(framework: str, model: str, batch: int, a: argparse.Namespace,
                  timeout_s: float) -> dict:
    from trainperf import results

    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        argv = ["run", RECIPES[model], "--framework", framework, "--device", a.device,
                "--batch-size", str(batch), "--fc", "dp", "--runs", "1",
                # trainperf's --iters counts the warm-up steps too
                "--iters", str(a.warmup + a.iters), "--warmup", str(a.warmup),
                "--precision", a.precision, "--timeout", str(int(timeout_s))]
        if a.threads:
            argv += ["--threads", str(a.threads)]
        if a.channels_last:
            argv.append("--channels-last")
        shown = "trainperf " + " ".join(argv)
        argv += ["--out", str(Path(tmp) / "r")]
        proc = subprocess.run([sys.executable, "-m", "trainperf.cli", *argv],
                              capture_output=True, text=True, env=thread_env(None),
                              timeout=timeout_s + 120)
        try:
            doc = results.load(Path(tmp) / "r")
            case = doc["cases"][0]
        except (OSError, ValueError, KeyError, IndexError):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SideFailed(f"trainperf {framework} exited {proc.returncode}: {tail[0]}")
        rate = case.get("median_samples_per_s")
        if not rate:
            raise SideFailed(f"trainperf {framework}: run {case.get('runs')}")
        return {"samples_per_s": rate, "settings": case.get("settings"),
                "threads": (doc.get("measure") or {}).get("threads") or a.threads,
                "versions": doc.get("env"), "command": shown}


def summarise(pairs: list[dict]) -> dict:
    ratios = [p["ratio"] for p in pairs if p.get("ratio")]
    if not ratios:
        return {"pairs_ok": 0}
    return {"pairs_ok": len(ratios), "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios),
            "trainperf_median": statistics.median(p["trainperf"] for p in pairs if p.get("ratio")),
            "native_median": statistics.median(p["native"] for p in pairs if p.get("ratio"))}


def markdown(doc: dict) -> str:
    lines = [f"# Native parity on {doc['machine']['device_name']}", "",
             f"trainperf's samples/s over the framework's own step (`benchmarks/native/`), "
             f"median of interleaved pairs; {doc['iters']} timed steps after {doc['warmup']} "
             f"warm-up on each side, threads {doc['threads'] or 'default'}, precision "
             f"{doc['precision']}{', channels-last' if doc['channels_last'] else ''}.", "",
             "| framework | case | batch | trainperf / native | min | max | pairs | "
             "trainperf samples/s | native samples/s | native step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        s = r.get("summary") or {}
        if not s.get("pairs_ok"):
            why = next((p.get("error") for p in r["pairs"] if p.get("error")), "not run")
            lines.append(f"| {r['framework']} | {r['model']} | {r['batch']} | - | | | 0 | | | "
                         f"{why} |")
            continue
        zoo = next((p["native_settings"].get("zoo", "") for p in r["pairs"]
                    if p.get("native_settings")), "")
        lines.append(
            f"| {r['framework']} | {r['model']} | {r['batch']} | **{s['median_ratio']:.3f}** | "
            f"{s['min_ratio']:.3f} | {s['max_ratio']:.3f} | {s['pairs_ok']} | "
            f"{s['trainperf_median']:.2f} | {s['native_median']:.2f} | {zoo} |")
    lines += ["", "Every pair, both sides' settings and versions: `parity.json`.", ""]
    return "\n".join(lines)


def device_name(device: str) -> str:
    if device == "cuda":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout
            return out.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "cuda"
    return platform.processor() or platform.machine()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--case", action="append", help="MODEL:BATCH, MODEL rn50 or face")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, help="threads per process on CPU (default: cores)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--timeout", type=float, default=900, help="seconds per side")
    p.add_argument("--budget-s", type=float, help="start no new pair after this many seconds")
    p.add_argument("--out", help="default benchmarks/results/native_parity-<device>")
    a = p.parse_args()
    if a.device == "cpu" and a.threads is None:
        a.threads = os.cpu_count() or 1
    frameworks = [f for f in a.frameworks.split(",") if f]
    bad = [f for f in frameworks if f not in FRAMEWORKS or not native_script(f).exists()]
    if bad:
        p.error(f"no native reference for {', '.join(bad)}; have "
                f"{', '.join(f for f in FRAMEWORKS if native_script(f).exists())}")
    cases = []
    for c in a.case or DEFAULT_CASES[a.device]:
        model, _, batch = c.partition(":")
        if model not in RECIPES or not batch.isdigit() or int(batch) < 1:
            p.error(f"--case {c!r}: expected MODEL:BATCH with MODEL rn50 or face")
        cases.append((model, int(batch)))
    out = Path(a.out or HERE / "results" / f"native_parity-{a.device}")
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"framework": f, "model": m, "batch": b, "pairs": []}
            for m, b in cases for f in frameworks]
    doc = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "device": a.device, "precision": a.precision, "channels_last": a.channels_last,
           "threads": a.threads, "iters": a.iters, "warmup": a.warmup, "rows": rows,
           "machine": {"device_name": device_name(a.device), "cpus": os.cpu_count(),
                       "platform": platform.platform()}}
    start = time.monotonic()
    # Pair k of every row before pair k+1 of any: a cut budget leaves each row some pairs.
    for k in range(a.pairs):
        for row in rows:
            if a.budget_s and time.monotonic() - start > a.budget_s:
                print(f"budget of {a.budget_s:.0f} s spent: pair {k} of "
                      f"{row['framework']} {row['model']} not started", file=sys.stderr)
                continue
            pair: dict = {"order": "trainperf first" if k % 2 == 0 else "native first"}
            sides = [("trainperf", run_trainperf), ("native", run_native)]
            for name, fn in (sides if k % 2 == 0 else sides[::-1]):
                try:
                    got = fn(row["framework"], row["model"], row["batch"], a, a.timeout)
                except (SideFailed, subprocess.TimeoutExpired, ValueError) as exc:
                    pair["error"] = f"{name}: {exc}".splitlines()[0][:300]
                    break
                pair[name] = got["samples_per_s"]
                pair[f"{name}_settings"] = got.get("settings")
                pair[f"{name}_detail"] = {k2: got.get(k2) for k2 in
                                          ("command", "versions", "threads", "params")
                                          if got.get(k2) is not None}
            if "error" not in pair:
                pair["ratio"] = pair["trainperf"] / pair["native"]
            row["pairs"].append(pair)
            row["summary"] = summarise(row["pairs"])
            print(f"{row['framework']} {row['model']} b{row['batch']} pair {k}: "
                  + (f"{pair['ratio']:.3f} ({pair['trainperf']:.2f} / {pair['native']:.2f})"
                     if "ratio" in pair else pair["error"]), file=sys.stderr, flush=True)
            # Written after every pair: a killed campaign keeps what it measured.
            (out / "parity.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
            (out / "parity.md").write_text(markdown(doc), encoding="utf-8")
    for row in rows:
        row.setdefault("summary", summarise(row["pairs"]))
    (out / "parity.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    (out / "parity.md").write_text(markdown(doc), encoding="utf-8")
    print(markdown(doc))
    return 0 if all(r["summary"].get("pairs_ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
