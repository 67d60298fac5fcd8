"""The scaling model (trainperf.scale.model) against 2-node runs it did not see, on emulated nodes
of this CPU (``trainperf emulate``: a network namespace per node, on its own core, joined to the
others by a link that tbf shapes to a chosen rate).

    python benchmarks/emulated_scaling.py [--stages commbench,points,report]
        [--cases face-dp,face-mp,face-pfc,rn50] [--rates 100mbit,1gbit] [--redo]
        [--before CHECKOUT] [--out benchmarks/results/emulated-cpu]

Stages, each resumable (what OUT already holds is kept unless ``--redo``):

- ``commbench``: at every rate a case uses (and CHECK_RATES), ``trainperf emulate --nodes 2
  --rate R -- commbench --devices 1`` (one gloo rank per node) into OUT/commbench/R/; its
  all-reduce bus bandwidth at the large messages is set against the link's rate.
- ``points``: for each case and rate, ROUNDS rounds of the case on one node of one core
  (``taskset -c 0 ... --threads 1``, the same command on core 1 beside it: an emulated node of
  this 2-core machine has one core, and its neighbour is busy) and, straight after, on 2
  emulated nodes at the rate, into OUT/runs/CASE/R/round-K/.
- ``report``: ``trainperf project`` from each round's base with the rate's commbench (the
  model sees the 1-node base and the fabric, never the 2-node figure), run afresh; and with
  ``--before``, the same with another checkout's model. OUT/emulated_scaling.json, .md
  (predicted against measured, per point) and .png.

Every figure is measured by this script; the load average around each run is kept beside
it. Runs' own folders (spec, logs, events) are removed; results.json stays.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainperf.emulated_nodes import parse_rate, rate_text

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "emulated-cpu"
COMMAND = "python benchmarks/emulated_scaling.py"
TRAINPERF = [sys.executable, "-m", "trainperf.cli"]

FACE_RATES = ("20mbit", "50mbit", "200mbit", "1gbit")
RN50_RATES = ("500mbit", "1gbit", "2gbit", "5gbit")
FACE = ["--batch-size", "8", "--num-classes", "20000"]
CASES = {
    "face-dp": ("tiny-arcface", [*FACE, "--fc", "dp"], FACE_RATES),
    "face-mp": ("tiny-arcface", [*FACE, "--fc", "mp"], FACE_RATES),
    "face-pfc": ("tiny-arcface", [*FACE, "--fc", "pfc", "--sample-ratio", "0.1"], FACE_RATES),
    "rn50": ("rn50-v1b-64px", [], RN50_RATES),
}
"""Name -> (recipe, run options, link rates). The face step is IResNet's structure (stem, four
stages of IBasicBlocks, output block E) cut to one block per stage and widths 8-64, with
20,000 classes of 64-d embeddings; ResNet50 v1b is whole, at 64x64. The rates take each from
compute-bound to communication-bound: the face step's dp gradient (its class matrix included)
is 6 MB, its mp/pfc backbone gradient 1.1 MB; ResNet50's is 102 MB."""
MEASURE = {"face": ["--iters", "25", "--warmup", "5"], "rn50": ["--iters", "12", "--warmup", "3"]}
ROUNDS = 3
"""Rounds per point: each a 1-node base (one run) and the 2-node run (one run) straight
after it."""
CHECK_RATES: tuple[str, ...] = ()
"""Rates commbench measures for the link check alone, beside those the cases use (none: the
cases' seven rates span 20 Mbit/s to 5 Gbit/s)."""
SLICE_NS = 100_000
"""The scheduler slice every process of a measurement asks for (sched_setattr's
sched_runtime, which children inherit): a thread that wakes on its node's one core then
runs at once, instead of after whatever else holds that core has used up the default slice
(a gloo rank's small all-reduce took 1.7-2.2 ms as a rule, 0.4-0.5 ms with it, on this
machine while other sessions kept its cores busy)."""
AUTOGROUP_NICE = -20
"""Other sessions' processes sit in autogroups of their own, where their nice 19 counts for
nothing against this one's; this session's autogroup is given this nice while it measures."""
COMMBENCH_MIN_BYTES = "4KiB"
LARGE_BYTES = 4 * 2**20
"""All-reduce messages from this size up are 'large': the link's rate, not its latency,
decides their time at every rate here."""
BUSBW_TOLERANCE = 0.15
PREDICTION_TOLERANCE = 0.10


class SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("sched_util_min", ctypes.c_uint32), ("sched_util_max", ctypes.c_uint32)]


SYS_SCHED_SETATTR = 314  # x86-64


def quiet_scheduling() -> tuple[dict, str | None]:
    """Ask for a short slice (SCHED_OTHER, nice unchanged) and raise this session's autogroup;
    what was set, and the autogroup's nice to put back (None: unchanged)."""
    done: dict = {"policy": "SCHED_OTHER", "nice": os.getpriority(os.PRIO_PROCESS, 0)}
    attr = SchedAttr(size=ctypes.sizeof(SchedAttr), sched_policy=0,
                     sched_nice=done["nice"], sched_runtime=SLICE_NS)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_SCHED_SETATTR, 0, ctypes.byref(attr), 0) == 0:
        done["slice_ns"] = SLICE_NS
    else:
        done["slice_ns"] = f"not set: {os.strerror(ctypes.get_errno())}"
    group = Path("/proc/self/autogroup")
    try:
        before = group.read_text().split()[-1]
        group.write_text(str(AUTOGROUP_NICE))
        done["autogroup_nice"] = AUTOGROUP_NICE
        return done, before
    except (OSError, IndexError) as exc:
        done["autogroup_nice"] = f"not set: {exc}"
        return done, None


SCHEDULING: dict = {}
"""What quiet_scheduling set for this invocation, kept with every figure it measures."""


def load() -> float:
    return round(os.getloadavg()[0], 2)


def run(argv: list[str], log: Path) -> dict:
    """One command, its output into ``log``, with the load and the wall time around it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    before, t0 = load(), time.monotonic()
    with open(log, "w") as fh:
        code = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT).returncode
    return {"argv": argv, "exit": code, "wall_s": round(time.monotonic() - t0, 1),
            "load_before": before, "load_after": load(), "scheduling": SCHEDULING,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine()}


def machine() -> str:
    from trainperf.env import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


def shown(argv: list[str]) -> str:
    """A command as a reader would type it."""
    parts = ["trainperf", *argv[len(TRAINPERF):]] if argv[:len(TRAINPERF)] == TRAINPERF else argv
    text = " ".join(parts)
    return text.replace(str(OUT.parent.parent.parent) + "/", "")


def max_bytes(rate: str) -> int:
    """The largest message: about a second on the link, 4 to 64 MiB."""
    fit = parse_rate(rate) / 8
    size = 4 * 2**20
    while size * 2 <= min(fit, 64 * 2**20):
        size *= 2
    return size


# ------------------------------------------------------------------------------- commbench

def commbench(rate: str, out: Path, redo: bool) -> dict:
    folder = out / "commbench" / rate
    doc_path = folder / "node-0" / "commbench.json"
    if doc_path.exists() and not redo:
        return json.loads((folder / "measured.json").read_text())
    shutil.rmtree(folder, ignore_errors=True)
    argv = [*TRAINPERF, "emulate", "--nodes", "2", "--rate", rate, "--", "commbench",
            "--devices", "1", "--min-bytes", COMMBENCH_MIN_BYTES, "--max-bytes",
            str(max_bytes(rate)), "--out", str(folder)]
    record = run(argv, folder / "emulate.log")
    if record["exit"] != 0:
        raise SystemExit(f"commbench at {rate} failed: {folder / 'emulate.log'}")
    shutil.rmtree(folder / "node-1", ignore_errors=True)  # the same curve, written twice
    for extra in (folder / "node-1.log",):
        extra.unlink(missing_ok=True)
    record.update(check_busbw(rate, json.loads(doc_path.read_text())))
    record["command"] = shown(argv)
    (folder / "measured.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def check_busbw(rate: str, doc: dict) -> dict:
    """All-reduce bus bandwidth at the large messages against the link's rate."""
    link_Bps = parse_rate(rate) / 8
    (ar,) = [op for op in doc["ops"] if op["op"] == "all_reduce"]
    large = [p for p in ar["points"] if p["bytes"] >= LARGE_BYTES]
    busbw = statistics.median(p["busbw_GBps"] for p in large) * 1e9
    return {"rate": rate, "link_Bps": link_Bps, "large_sizes": [p["bytes"] for p in large],
            "busbw_large_Bps": busbw, "busbw_large_range_Bps": [
                min(p["busbw_GBps"] for p in large) * 1e9,
                max(p["busbw_GBps"] for p in large) * 1e9],
            "ratio": busbw / link_Bps,
            "within": abs(busbw / link_Bps - 1) <= BUSBW_TOLERANCE,
            "fit": ar["fit"],
            "latency_s": {op["op"]: op["fit"]["latency_s"] for op in doc["ops"] if "fit" in op}}


# ------------------------------------------------------------------------------- runs

def case_argv(case: str) -> tuple[str, list[str]]:
    recipe, options, _ = CASES[case]
    return recipe, [*options, "--runs", "1", *MEASURE["rn50" if case == "rn50" else "face"],
                    "--device", "cpu"]


def figure(results: Path, name: str) -> dict:
    doc = json.loads(results.read_text())
    (case,) = [c for c in doc["cases"] if c["case"] == name]
    steps = [t for r in case["runs"] for t in r.get("step_times_s") or []]
    return {"samples_per_s": case["median_samples_per_s"],
            "step_s_median": statistics.median(steps) if steps else None}


def tidy(folder: Path) -> None:
    """Keep results.json and the emulation's record; drop per-run folders and events."""
    for runs in folder.rglob("runs"):
        shutil.rmtree(runs, ignore_errors=True)
    for name in ("events.jsonl", "*.png", "report.md", "plan.json"):
        for extra in folder.rglob(name):
            extra.unlink()


def base_run(case: str, folder: Path) -> dict:
    """The case on one node of one core: ``taskset -c 0 ... --threads 1`` into folder/base,
    while the same command runs on core 1 into folder/base-core1, so that each core works
    beside a busy neighbour as each node of a 2-node run does (they share caches and memory)."""
    recipe, options = case_argv(case)
    argv = ["taskset", "-c", "0", *TRAINPERF, "run", recipe, *options, "--threads", "1",
            "--out", str(folder / "base")]
    twin = ["taskset", "-c", "1", *argv[3:-1], str(folder / "base-core1")]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "base-core1.log", "w") as log:
        beside = subprocess.Popen(twin, stdout=log, stderr=subprocess.STDOUT)
        record = run(argv, folder / "base.log")
        beside.wait()
    if record["exit"] != 0 or beside.returncode != 0:
        raise SystemExit(f"{case}: the 1-node base failed ({folder})")
    for sub in ("base", "base-core1"):
        tidy(folder / sub)
    record.update(figure(folder / "base" / "results.json", "1n1g"), command=shown(argv),
                  core1=figure(folder / "base-core1" / "results.json", "1n1g")["samples_per_s"])
    return record


def node_run(case: str, rate: str, folder: Path) -> dict:
    recipe, options = case_argv(case)
    argv = [*TRAINPERF, "emulate", "--nodes", "2", "--rate", rate, "--", "run", recipe,
            *options, "--out", str(folder / "nodes")]
    record = run(argv, folder / "nodes.log")
    if record["exit"] != 0:
        raise SystemExit(f"{case} at {rate} failed: {folder / 'nodes.log'}")
    tidy(folder / "nodes")
    shutil.rmtree(folder / "nodes" / "node-1", ignore_errors=True)  # node 0 holds the results
    (folder / "nodes" / "node-1.log").unlink(missing_ok=True)
    record.update(figure(folder / "nodes" / "node-0" / "results.json", "2n1g"),
                  command=shown(argv))
    return record


def point(case: str, rate: str, out: Path, redo: bool) -> dict:
    """ROUNDS rounds of: the 1-node base, then the 2-node run at ``rate`` straight after it
    (each round's prediction starts from its own base: a drift of the machine between
    rounds moves both alike)."""
    folder = out / "runs" / case / rate
    path = folder / "point.json"
    if path.exists() and not redo:
        return json.loads(path.read_text())
    earlier = json.loads(path.read_text()) if path.exists() else None
    shutil.rmtree(folder, ignore_errors=True)
    rounds = []
    for k in range(ROUNDS):
        where = folder / f"round-{k + 1}"
        rounds.append({"base": base_run(case, where), "nodes": node_run(case, rate, where)})
    record = {"case": case, "rate": rate, "rounds": rounds}
    if earlier:
        record["earlier"] = [{k: v for k, v in earlier.items() if k != "earlier"},
                             *earlier.get("earlier", [])]
    path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def predict(base_dir: Path, rate: str, target: Path, out: Path, src: Path | None = None,
            extra: tuple[str, ...] = ()) -> dict:
    """``trainperf project`` from a round's base with the rate's commbench, run afresh so
    that the record follows the model; ``src``: another checkout's src/ (its model)."""
    fabric = out / "commbench" / rate / "node-0"
    argv = [*TRAINPERF, "project", str(base_dir), "--to", "2n1g", "--fabric", str(fabric),
            *extra, "--out", str(target)]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src)
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"trainperf project failed: {done.stderr[-2000:]}")
    (p,) = json.loads(target.read_text())["predictions"]
    return {**p, "command": shown(argv)}


# ------------------------------------------------------------------------------- report

def error_pct(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured * 100


def points(out: Path, cases: list[str], before: Path | None) -> list[dict]:
    rows = []
    for case in cases:
        for rate in CASES[case][2]:
            path = out / "runs" / case / rate / "point.json"
            if not path.exists() or not (out / "commbench" / rate / "node-0").exists():
                continue
            pt = json.loads(path.read_text())
            folder = path.parent
            preds, olds = [], []
            for k, _ in enumerate(pt["rounds"]):
                where = folder / f"round-{k + 1}"
                preds.append(predict(where / "base", rate, where / "project.json", out))
                if before is not None:
                    olds.append(predict(where / "base", rate, where / "project-before.json",
                                        out, before / "src"))
            measured = [r["nodes"]["samples_per_s"] for r in pt["rounds"]]
            bases = [r["base"]["samples_per_s"] for r in pt["rounds"]]
            predicted = [p["samples_per_s"] for p in preds]
            p = preds[sorted(range(len(preds)), key=lambda i: predicted[i])[len(preds) // 2]]
            row = {
                "case": case, "rate": rate, "rate_bps": parse_rate(rate),
                "base_samples_per_s": statistics.median(bases), "base_rounds": bases,
                "base_core1_rounds": [r["base"]["core1"] for r in pt["rounds"]],
                "measured": statistics.median(measured), "measured_rounds": measured,
                "predicted": statistics.median(predicted), "predicted_rounds": predicted,
                "round_errors_pct": [error_pct(a, b) for a, b in zip(predicted, measured)],
                "measured_step_s": statistics.median(
                    r["nodes"]["step_s_median"] for r in pt["rounds"]),
                "loads": [[r["base"]["load_before"], r["nodes"]["load_after"]]
                          for r in pt["rounds"]],
                "earlier_measured": [statistics.median(
                    r["nodes"]["samples_per_s"] for r in e["rounds"])
                    for e in pt.get("earlier", [])],
                "when": [pt["rounds"][0]["base"]["when"], pt["rounds"][-1]["nodes"]["when"]],
                "machines": sorted({r[k].get("machine") or "an unrecorded machine"
                                    for r in pt["rounds"] for k in ("base", "nodes")}),
                "terms_ms": {k: p[k] * 1e3 for k in (
                    "backbone_s", "head_s", "straggler_s", "comm_cpu_s", "allreduce_s",
                    "allreduce_exposed_s", "head_comm_s")},
                "limit": p["limit"], "overhead": p["overhead"],
                "project_command": p["command"],
                "run_commands": [pt["rounds"][0]["base"]["command"],
                                 pt["rounds"][0]["nodes"]["command"]]}
            row["error_pct"] = error_pct(row["predicted"], row["measured"])
            row["efficiency_measured"] = row["measured"] / (2 * row["base_samples_per_s"])
            row["efficiency_predicted"] = row["predicted"] / (2 * row["base_samples_per_s"])
            if olds:
                row["predicted_before"] = statistics.median(o["samples_per_s"] for o in olds)
                row["error_before_pct"] = error_pct(row["predicted_before"], row["measured"])
            rows.append(row)
    return rows


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def markdown(doc: dict) -> str:
    lines = ["# The scaling model against 2 emulated nodes", "",
             f"Made by `{doc['command']}` on {doc['machine']}. Each node is a network namespace "
             "on one core of this 2-core machine, joined to the other by a link shaped to the "
             "rate (tbf, both ways); one torch rank per node, gloo over TCP. The prediction is "
             "`trainperf project` from a 1-node base (one core, one thread, the same command "
             "on the other core beside it) and commbench at that rate; error = (predicted - "
             "measured) / measured. Each point is "
             f"{doc['rounds']} rounds of a base followed at once by the 2-node run, each round "
             "predicted from its own base; the table gives the medians and, in brackets, the "
             "rounds' spread ((max - min) / median).", "",
             "## commbench: all-reduce bus bandwidth at large messages", "",
             f"Large: {LARGE_BYTES // 2**20} MiB and up; the median of those sizes' busbw "
             f"(range in brackets), against the link's rate; within {BUSBW_TOLERANCE:.0%}?", "",
             "| rate | link (MB/s) | busbw (MB/s) | busbw / link | within | all-reduce "
             "latency (us) | taken from compute beside it | its slowdown there |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    for c in doc["commbench"]:
        lo, hi = c["busbw_large_range_Bps"]
        beside = c.get("beside_compute") or {}
        lines.append(f"| {c['rate']} | {c['link_Bps'] / 1e6:.1f} | "
                     f"{c['busbw_large_Bps'] / 1e6:.1f} ({lo / 1e6:.1f}-{hi / 1e6:.1f}) | "
                     f"{c['ratio']:.3f} | {'yes' if c['within'] else 'no'} | "
                     f"{c['fit']['latency_s'] * 1e6:.0f} | "
                     f"{beside.get('compute_share_taken', 0):.1%} | "
                     f"{beside.get('slowdown', 1):.2f} |")
    s = doc["summary"]
    before = "error_before_pct" in (doc["points"] or [{}])[0]
    lines += ["", "## Predicted against measured, 2 nodes", "",
              f"{s['points']} points, mean absolute error {s['mae_pct']:.1f}%, largest "
              f"{s['max_abs_pct']:.1f}%; within {PREDICTION_TOLERANCE:.0%}: "
              f"{s['within']} of {s['points']}."
              + (f" The model before this change ({doc['before']}): mean absolute error "
                 f"{s['mae_before_pct']:.1f}%, largest {s['max_abs_before_pct']:.1f}%, within "
                 f"{PREDICTION_TOLERANCE:.0%}: {s['within_before']}." if before else ""), "",
              "| case | rate | 1 node | 2 nodes measured | predicted | error % |"
              + (" before % |" if before else "")
              + " eff. measured | eff. predicted | compute ms | stragglers ms | cores taken ms "
              "| exposed all-reduce ms | head comm ms | limited by |",
              "|---|---|---:|---:|---:|---:|" + ("---:|" if before else "")
              + "---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in doc["points"]:
        t = r["terms_ms"]
        lines.append(
            f"| {r['case']} | {r['rate']} | {r['base_samples_per_s']:.2f} "
            f"({spread(r['base_rounds']):.0%}) | {r['measured']:.2f} "
            f"({spread(r['measured_rounds']):.0%}) | {r['predicted']:.2f} | "
            f"{r['error_pct']:+.1f} |" + (f" {r['error_before_pct']:+.1f} |" if before else "")
            + f" {r['efficiency_measured']:.3f} | {r['efficiency_predicted']:.3f} | "
            f"{t['backbone_s'] + t['head_s']:.0f} | {t['straggler_s']:.1f} | "
            f"{t['comm_cpu_s']:.1f} | {t['allreduce_exposed_s']:.1f} | {t['head_comm_s']:.1f} | "
            f"{r['limit']} |")
    lines += ["", "Per round (base, 2 nodes, predicted, error %) and the load average before "
              "the base and after the 2-node run:", "",
              "| case | rate | rounds | load |", "|---|---|---|---|"]
    for r in doc["points"]:
        rounds = "; ".join(f"{b:.1f}, {m:.1f}, {p:.1f}, {e:+.1f}" for b, m, p, e in zip(
            r["base_rounds"], r["measured_rounds"], r["predicted_rounds"],
            r["round_errors_pct"]))
        loads = ", ".join(f"{a}/{b}" for a, b in r["loads"])
        lines.append(f"| {r['case']} | {r['rate']} | {rounds} | {loads} |")
    lines += ["", "![predicted and measured samples/s against the link rate]"
              "(emulated_scaling.png)", ""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in doc["points"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 4), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rows = sorted((r for r in doc["points"] if r["case"] == case),
                      key=lambda r: r["rate_bps"])
        x = [r["rate_bps"] / 1e6 for r in rows]
        ax.errorbar(x, [r["measured"] for r in rows],
                    yerr=[[r["measured"] - min(r["measured_rounds"]) for r in rows],
                          [max(r["measured_rounds"]) - r["measured"] for r in rows]],
                    fmt="o", capsize=3, label="measured, 2 nodes (rounds' range)")
        ax.plot(x, [r["predicted"] for r in rows], "s--", label="predicted")
        if "predicted_before" in rows[0]:
            ax.plot(x, [r["predicted_before"] for r in rows], "x:", color="grey",
                    label="predicted before")
        ax.plot(x, [2 * r["base_samples_per_s"] for r in rows], color="grey", lw=0.8,
                ls="-.", label="2 x 1 node")
        ax.set_xscale("log")
        ax.set_xlabel("link rate (Mbit/s)")
        ax.set_ylabel("samples/s")
        ax.set_title(case)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(out: Path, cases: list[str], rates: list[str], before: Path | None) -> dict:
    bench = []
    for r in rates:
        path = out / "commbench" / r / "measured.json"
        if path.exists():
            c = json.loads(path.read_text())
            doc = json.loads((out / "commbench" / r / "node-0" / "commbench.json").read_text())
            (ar,) = [op for op in doc["ops"] if op["op"] == "all_reduce"]
            c.update(check_busbw(r, doc), beside_compute=ar.get("beside_compute"))
            bench.append(c)
    rows = points(out, cases, before)
    errors = [abs(r["error_pct"]) for r in rows]
    summary = {"points": len(rows), "mae_pct": statistics.fmean(errors) if errors else 0.0,
               "max_abs_pct": max(errors, default=0.0),
               "within": sum(e <= PREDICTION_TOLERANCE * 100 for e in errors)}
    if before is not None and rows:
        old = [abs(r["error_before_pct"]) for r in rows]
        summary.update(mae_before_pct=statistics.fmean(old), max_abs_before_pct=max(old),
                       within_before=sum(e <= PREDICTION_TOLERANCE * 100 for e in old))
    # Where the figures were measured, which need not be where the report is made.
    machines = sorted({c.get("machine") or "an unrecorded machine" for c in bench}
                      | {m for r in rows for m in r["machines"]})
    doc = {"schema": "trainperf.emulated_scaling/v1", "command": COMMAND,
           "machine": " and ".join(machines), "rounds": ROUNDS,
           "before": describe(before) if before else None,
           "cases": {c: {"recipe": CASES[c][0], "options": case_argv(c)[1],
                         "rates": list(CASES[c][2])} for c in cases},
           "commbench": bench, "points": rows, "summary": summary}
    (out / "emulated_scaling.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "emulated_scaling.md").write_text(markdown(doc))
    if rows:
        plot(doc, out / "emulated_scaling.png")
    return doc


def describe(checkout: Path) -> str:
    """A checkout by its commit, or by its folder's name where it is no repository (a
    ``git archive`` of that commit)."""
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h"],
                          capture_output=True, text=True)
    return done.stdout.strip() or checkout.name


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default="commbench,points,report")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rates", help="only these rates (default: every rate of the cases)")
    p.add_argument("--redo", action="store_true",
                   help="measure the chosen points again (the earlier figures are kept beside)")
    p.add_argument("--before", type=Path,
                   help="a checkout of trainperf whose model the report sets beside this one "
                        "(its src/ on PYTHONPATH for `trainperf project`)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    stages = args.stages.split(",")
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    every_rate = sorted({r for c in cases for r in CASES[c][2]} | set(CHECK_RATES),
                        key=parse_rate)
    rates = args.rates.split(",") if args.rates else every_rate
    out = args.out.resolve()
    scheduling, autogroup_before = quiet_scheduling()
    SCHEDULING.update(scheduling)
    print(f"scheduling: {scheduling}", flush=True)
    try:
        if "commbench" in stages:
            for rate in rates:
                c = commbench(rate, out, args.redo)
                print(f"commbench {rate}: busbw {c['busbw_large_Bps'] / 1e6:.1f} MB/s = "
                      f"{c['ratio']:.3f} x link", flush=True)
        if "points" in stages:
            for case in cases:
                for rate in [r for r in CASES[case][2] if r in rates]:
                    pt = point(case, rate, out, args.redo)
                    one = [round(r["base"]["samples_per_s"], 2) for r in pt["rounds"]]
                    two = [round(r["nodes"]["samples_per_s"], 2) for r in pt["rounds"]]
                    print(f"{case} at {rate}: 1 node {one}, 2 nodes {two}", flush=True)
    finally:
        if autogroup_before is not None:
            Path("/proc/self/autogroup").write_text(autogroup_before)
    if "report" in stages:
        doc = report(out, cases, every_rate, args.before.resolve() if args.before else None)
        s = doc["summary"]
        print(f"{s['points']} points: MAE {s['mae_pct']:.1f}%, max {s['max_abs_pct']:.1f}%, "
              f"{s['within']} within {PREDICTION_TOLERANCE:.0%}")
        print(f"wrote {out / 'emulated_scaling.md'}")


if __name__ == "__main__":
    main()
