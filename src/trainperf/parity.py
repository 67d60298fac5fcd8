"""Native parity: each framework's trainperf worker against that framework's own training step.

A ratio column between frameworks measures the frameworks only if every worker trains as fast as
a competent user of its framework would. For each framework, ``benchmarks/native/<fw>_native.py``
in a checkout of trainperf is such a user's step (its model zoo, its optimizer, its usual loop
and compile path). A campaign times it against trainperf's own runner on the same shapes,
precision and threads, in interleaved pairs: pair k runs trainperf first when k is even and the
reference first when it is odd, so a machine that slows down over time weighs on both sides
alike. Each side times ``iters`` steps after ``warmup``, synchronised only at the window's edges.

The campaign writes ``parity.json`` (every pair, both sides' settings and versions) and
``parity.md`` after every pair, and files each row's ratio in the registry
(``trainperf.parities``) that reports read.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from . import envs, parities
from .config import MODE_DEFAULT, Measure, Topology, Tuning, Workload
from .env import cpu_model
from .progress import QuietProgress
from .recipes import get_recipe
from .runner import Case as RunnerCase, Plan, Runner, check_plan, device_kind

SCHEMA = "trainperf.native_parity/v1"
RECIPES = {"rn50": "rn50-v1b-imagenet", "face": "r50-arcface-plsc"}
"""The native references' two cases: ResNet50 v1b on ImageNet, PLSC's IResNet-50 ArcFace."""
FRAMEWORKS = ("torch", "mxnet", "paddle", "jax", "tf", "oneflow")
NATIVE_DIR_ENV = "TRAINPERF_NATIVE_DIR"
ZOOS = {"oneflow": ("flowvision", ("flowvision==0.2.1", "tabulate==0.10.0", "six==1.17.0"))}
"""Model zoos that are packages of their own: the module a reference imports and what is
installed (without dependencies) into the framework's environment where it is missing.
flowvision 0.2.1 is the last release that imports with OneFlow 0.9 (0.2.2 needs
``oneflow.jit._script_if_tracing``); its sdist's setup.py needs pkg_resources, so it is built
with setuptools<81. flowvision's ``__init__`` imports tabulate and six."""
ZOO_BUILD_CONSTRAINT = "setuptools<81\n"


class SideFailed(RuntimeError):
    """One side of a pair did not produce a figure."""


@dataclass(frozen=True)
class Settings:
    """What both sides of every pair share."""

    device: str = "cpu"
    precision: str = "fp32"
    channels_last: bool = False
    threads: int | None = None
    """Threads per process on CPU (None: each framework's default)."""
    iters: int = 6
    """Timed steps."""
    warmup: int = 2
    timeout_s: float = 900.0
    """Per side."""
    input_size: int | None = None
    """ResNet50's input side (None: 224); the face case is always 112."""


@dataclass(frozen=True)
class Row:
    framework: str
    model: str
    batch: int
    mode: str = ""
    """The execution mode both sides run in (``Capabilities.modes``); empty: the
    framework's default on the device."""

    @property
    def recipe(self) -> str:
        return RECIPES[self.model]


def native_dir() -> Path:
    """``$TRAINPERF_NATIVE_DIR``, else ``benchmarks/native`` of the checkout this package lies
    in (the references are benchmark scripts, not part of the installed package)."""
    found = os.environ.get(NATIVE_DIR_ENV)
    return Path(found) if found else Path(__file__).resolve().parents[2] / "benchmarks" / "native"


def native_script(framework: str) -> Path:
    return native_dir() / f"{framework}_native.py"


def input_side(model: str, asked: int | None) -> int:
    """The side both sides train at: ``asked`` for ResNet50 where given, else the recipe's."""
    if asked and model == "rn50":
        return asked
    return get_recipe(RECIPES[model]).workload.input_size


def row_modes(framework: str, device: str, asked: str) -> list[str]:
    """The modes a framework's rows run in: ``default`` (its first on the device), ``all``
    (every one it declares there) or a list of names, each checked against its declaration."""
    from .backends import get_backend
    from .backends.base import require

    backend = get_backend(framework)
    if asked == "all":
        return list(backend.modes_on(device))
    names = [m.strip() for m in asked.split(",") if m.strip()] or [MODE_DEFAULT]
    for name in names:
        require(backend.mode_refusal(name, device))
    return [backend.resolve_mode(name, device) for name in names]


def parse_case(text: str) -> tuple[str, int]:
    """``MODEL:BATCH`` with MODEL ``rn50`` or ``face``."""
    model, _, batch = text.partition(":")
    if model not in RECIPES or not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"case {text!r}: expected MODEL:BATCH with MODEL rn50 or face and "
                         f"BATCH >= 1")
    return model, int(batch)


def check_frameworks(frameworks: list[str]) -> None:
    bad = [f for f in frameworks if f not in FRAMEWORKS or not native_script(f).exists()]
    if bad:
        have = [f for f in FRAMEWORKS if native_script(f).exists()]
        raise ValueError(f"no native reference for {', '.join(bad)} in {native_dir()}; have "
                         f"{', '.join(have) or 'none'}")


def last_json(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("no JSON line in the output")


def last_line(proc: subprocess.CompletedProcess) -> str:
    return ((proc.stderr or proc.stdout or "").strip().splitlines() or ["no output"])[-1]


def ensure_zoo(framework: str, device: str = "cpu") -> None:
    """Install the framework's model zoo into its environment (the one that runs on
    ``device``) where it is not importable."""
    if framework not in ZOOS:
        return
    module, packages = ZOOS[framework]
    python = envs.interpreter(framework, device_kind(device))
    probe = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True)
    if probe.returncode == 0:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as c:
        c.write(ZOO_BUILD_CONSTRAINT)
    try:
        proc = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps",
                               "--build-constraint", c.name, *packages],
                              capture_output=True, text=True)
    finally:
        os.unlink(c.name)
    if proc.returncode != 0:
        raise SideFailed(f"could not install {framework}'s model zoo ({' '.join(packages)}): "
                         f"{last_line(proc)}")


def run_native(row: Row, s: Settings) -> dict:
    ensure_zoo(row.framework, s.device)
    python = envs.interpreter(row.framework, device_kind(s.device))
    cmd = [python, str(native_script(row.framework)),
           "--case", row.model, "--batch", str(row.batch), "--iters", str(s.iters),
           "--warmup", str(s.warmup), "--device", s.device, "--precision", s.precision]
    if s.threads:
        cmd += ["--threads", str(s.threads)]
    if s.channels_last:
        cmd.append("--channels-last")
    if row.mode:
        cmd += ["--mode", row.mode]
    if s.input_size and row.model == "rn50":
        cmd += ["--input-size", str(s.input_size)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if s.threads:
        env["OMP_NUM_THREADS"] = str(s.threads)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=s.timeout_s)
    if proc.returncode != 0:
        raise SideFailed(f"native {row.framework} exited {proc.returncode}: {last_line(proc)}")
    doc = last_json(proc.stdout)
    script = native_script(row.framework)
    if script.is_relative_to(native_dir().parents[1]):
        cmd[1] = str(script.relative_to(native_dir().parents[1]))
    return {**doc, "command": " ".join(["python", *cmd[1:]])}


def row_workload(model: str, batch: int, precision: str, *, channels_last: bool = False,
                 input_size: int | None = None, classes: int | None = None) -> Workload:
    """trainperf's side of a row: the case's recipe at ``batch`` with the ``dp`` head, as the
    references train; ``input_size`` applies to ResNet50 only (the face input is fixed)."""
    changes = {"batch_size": batch, "precision": precision, "fc": "dp",
               "channels_last": channels_last}
    if input_size and model == "rn50":
        changes["input_size"] = input_size
    if classes:
        changes["num_classes"] = classes
    return get_recipe(RECIPES[model]).workload.replace(**changes)


def trainperf_plan(row: Row, s: Settings, out: Path) -> Plan:
    recipe = get_recipe(row.recipe)
    workload = row_workload(row.model, row.batch, s.precision, channels_last=s.channels_last,
                            input_size=s.input_size)
    # trainperf's iters count the warm-up steps too
    measure = Measure(runs=1, iters=s.warmup + s.iters, warmup=s.warmup,
                      timeout_s=s.timeout_s, threads=s.threads)
    return Plan(recipe.name, workload, measure,
                [RunnerCase(Topology(1, device=s.device), row.batch)], out,
                Tuning(mode=row.mode or MODE_DEFAULT), model=recipe.reference_model,
                framework=row.framework)


def run_trainperf(row: Row, s: Settings, out: Path | None = None) -> dict:
    """trainperf's runner on the row, in ``out`` (a temporary folder where None)."""
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        plan = trainperf_plan(row, s, out or Path(tmp) / "run")
        doc = Runner(plan, QuietProgress()).run()
        cases = doc.get("cases") or []
        rate = cases[0].get("median_samples_per_s") if cases else None
        if not rate:
            runs = cases[0].get("runs", []) if cases else []
            why = next((r.get("error") for r in runs if r.get("error")), "no run was recorded")
            raise SideFailed(f"trainperf {row.framework}: {str(why).splitlines()[0]}")
        return {"samples_per_s": rate, "settings": cases[0].get("settings"),
                "threads": (doc.get("measure") or {}).get("threads") or s.threads,
                "versions": doc.get("env") or {}}


def summarise(pairs: list[dict]) -> dict:
    ok = [p for p in pairs if p.get("ratio")]
    if not ok:
        return {"pairs_ok": 0}
    ratios = [p["ratio"] for p in ok]
    return {"pairs_ok": len(ok), "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios),
            "trainperf_median": statistics.median(p["trainperf"] for p in ok),
            "native_median": statistics.median(p["native"] for p in ok)}


def device_name(device: str) -> str:
    if device == "cuda":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout
            return out.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "cuda"
    return cpu_model()


def run_pair(row: Row, s: Settings, k: int, work: Path | None) -> dict:
    """Pair ``k`` of ``row``: both sides, in the order k's parity gives; an error ends it."""
    pair: dict = {"order": "trainperf first" if k % 2 == 0 else "native first"}
    sides: list[tuple[str, Callable[[], dict]]] = [
        ("trainperf", lambda: run_trainperf(
            row, s, work / f"{row.framework}{'-' + row.mode if row.mode else ''}-{row.model}-"
                           f"b{row.batch}-pair{k}" if work else None)),
        ("native", lambda: run_native(row, s))]
    for name, fn in (sides if k % 2 == 0 else sides[::-1]):
        try:
            got = fn()
        except (SideFailed, subprocess.TimeoutExpired, ValueError, OSError) as exc:
            pair["error"] = f"{name}: {exc}".splitlines()[0][:300]
            return pair
        pair[name] = got["samples_per_s"]
        pair[f"{name}_settings"] = got.get("settings")
        pair[f"{name}_detail"] = {key: got[key] for key in
                                  ("command", "versions", "threads", "params", "input_size")
                                  if got.get(key) is not None}
    pair["ratio"] = pair["trainperf"] / pair["native"]
    return pair


def registry_record(doc: dict, row: dict, out: Path) -> dict:
    """What the registry keeps of one row: its figures and what they hold for."""
    ok = [p for p in row["pairs"] if p.get("ratio")]
    versions = next((p["trainperf_detail"].get("versions") for p in ok
                     if p.get("trainperf_detail", {}).get("versions")), {})
    names = versions.get("device_names") or []
    return {"recipe": RECIPES[row["model"]], "framework": row["framework"],
            "mode": row.get("mode") or next(((p.get("trainperf_settings") or {}).get("mode")
                                             for p in ok), None),
            "framework_version": versions.get("framework_version"),
            "device_type": doc["device"],
            "device_name": names[0] if names else versions.get("cpu_model"),
            "precision": doc["precision"], "channels_last": doc["channels_last"],
            "batch": row["batch"],
            "input_size": input_side(row["model"], doc.get("input_size")),
            "threads": doc["threads"], "iters": doc["iters"], "warmup": doc["warmup"],
            "native_step": next((p["native_settings"].get("zoo") for p in ok
                                 if p.get("native_settings")), None),
            **row["summary"], "t": time.time(), "parity_json": str(out / "parity.json")}


def markdown(doc: dict) -> str:
    size = f", ResNet50 at {doc['input_size']}x{doc['input_size']}" if doc.get("input_size") \
        else ""
    lines = [f"# Native parity on {doc['machine']['device_name']}", "",
             f"trainperf's samples/s over the framework's own step (`benchmarks/native/`), "
             f"median of interleaved pairs; {doc['iters']} timed steps after {doc['warmup']} "
             f"warm-up on each side, threads {doc['threads'] or 'default'}, precision "
             f"{doc['precision']}{', channels-last' if doc['channels_last'] else ''}{size}.", "",
             "| framework | mode | case | batch | trainperf / native | min | max | pairs | "
             "trainperf samples/s | native samples/s | native step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        s = r.get("summary") or {}
        if not s.get("pairs_ok"):
            why = r.get("unsupported") or next((p.get("error") for p in r["pairs"]
                                                if p.get("error")), "not run")
            lines.append(f"| {r['framework']} | {r.get('mode') or 'default'} | {r['model']} | "
                         f"{r['batch']} | - | | | 0 | | | "
                         f"{why} |")
            continue
        zoo = next((p["native_settings"].get("zoo", "") for p in r["pairs"]
                    if p.get("native_settings")), "")
        lines.append(
            f"| {r['framework']} | {r.get('mode') or 'default'} | {r['model']} | {r['batch']} | "
            f"**{s['median_ratio']:.3f}** | "
            f"{s['min_ratio']:.3f} | {s['max_ratio']:.3f} | {s['pairs_ok']} | "
            f"{s['trainperf_median']:.2f} | {s['native_median']:.2f} | {zoo} |")
    lines += ["", "Every pair, both sides' settings and versions: `parity.json`.", ""]
    return "\n".join(lines)


def campaign(rows: list[Row], settings: Settings, out: Path, pairs: int = 3,
             budget_s: float | None = None, work: Path | None = None,
             on_pair: Callable[[dict, dict], None] | None = None) -> dict:
    """``pairs`` interleaved pairs of every row, pair k of every row before pair k+1 of any, so
    that a budget cut leaves each row some pairs. ``work`` keeps trainperf's result folders
    (a temporary folder each where None). ``on_pair(row, pair)`` hears of each pair."""
    check_frameworks(sorted({r.framework for r in rows}))
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    doc = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           **{k: v for k, v in asdict(settings).items() if k != "timeout_s"},
           "pairs_asked": pairs,
           "rows": [{"framework": r.framework, "model": r.model, "batch": r.batch,
                     "mode": r.mode or None,
                     "pairs": [], "summary": {"pairs_ok": 0}} for r in rows],
           "machine": {"device_name": device_name(settings.device), "cpus": os.cpu_count(),
                       "platform": platform.platform(), "python": sys.version.split()[0]}}
    for row, rec in zip(rows, doc["rows"]):
        try:  # what trainperf's backend does not run has no pair to time
            check_plan(trainperf_plan(row, settings, out / "unused"))
        except ValueError as exc:
            rec["unsupported"] = f"trainperf: {str(exc).splitlines()[0]}"
    write(doc, out)
    start = time.monotonic()
    for k in range(pairs):
        for row, rec in zip(rows, doc["rows"]):
            if rec.get("unsupported"):
                continue
            if budget_s is not None and time.monotonic() - start > budget_s:
                rec.setdefault("not_started", []).append(k)
                continue
            pair = run_pair(row, settings, k, work)
            rec["pairs"].append(pair)
            rec["summary"] = summarise(rec["pairs"])
            # Written after every pair: a cut campaign keeps what it measured.
            write(doc, out)
            if rec["summary"]["pairs_ok"]:
                parities.put(parities.name_for(row.recipe, row.framework, stamp, row.batch,
                                               row.mode),
                             registry_record(doc, rec, out))
            if on_pair:
                on_pair(rec, pair)
    write(doc, out)
    return doc


def write(doc: dict, out: Path) -> None:
    for name, text in (("parity.json", json.dumps(doc, indent=1)), ("parity.md", markdown(doc))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, out / name)
