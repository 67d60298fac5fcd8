"""The GPU support matrix: for every GPU path, the device and date it last ran on a GPU, made
from the records under ``benchmarks/results/gpu-*`` (every ``results.json`` and ``parity.json``,
unpacked or in a part's archive, and the parts' ``summary.json`` checks). The README holds it
(``cli.pages``). A record's folder is named ``gpu-<device>-<YYYY-MM-DD>``: its date is
every path's date in it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Sequence

from ..result_files import json_files
from .coverage import first_parts

FRAMEWORKS = (("torch", "torch"), ("jax", "JAX"), ("mxnet", "MXNet"), ("paddle", "Paddle"),
              ("tf", "TensorFlow"), ("oneflow", "OneFlow"))
LENT = ("torch", "jax")
"""What a lent GPU machine can run (the other frameworks' GPU builds are too large to carry)."""
ROWS = (
    ("fp32", "training step, fp32 (its TF32 as the run records it)"),
    ("bf16", "training step, bf16"),
    ("fp16", "training step, fp16 with loss scaling"),
    ("dp", "face head: data parallel (`dp`)"),
    ("mp", "face head: model-parallel FC (`mp`)"),
    ("pfc", "face head: Partial FC (`pfc`)"),
    ("classification", "ResNet50 v1b (classification)"),
    ("correctness", "losses on CUDA against the CPU's"),
    ("parity", "native parity against the framework's own step"),
    ("capacity", "capacity search (max batch, max classes)"),
    ("breakdown", "step breakdown (`--breakdown`)"),
    ("realdata", "real data through the input pipeline"),
    ("multiprocess", "several processes (2+ GPUs)"),
)
"""(key, what it is). Which gpu-check part runs a row for torch and for JAX is read from the
stages (``coverage.first_parts``); none runs several processes, as no lent machine has 2
GPUs."""
NOT_YET = "not yet run on a GPU"


def record_date(folder: Path) -> str | None:
    m = re.search(r"(\d{4}-\d{2}-\d{2})$", folder.name)
    return m.group(1) if m else None


def _short(name: str) -> str:
    return name.replace("NVIDIA ", "").strip() or "GPU"


def from_results(doc: dict, path: str) -> list[tuple[str, str, str, str | None]]:
    """(framework, path key, device name, framework version) of one trainperf results file,
    where it ran on a GPU."""
    env = doc.get("env") or {}
    if env.get("device_type") != "cuda":
        return []
    fw = doc.get("framework", "torch")
    name = (env.get("device_names") or ["GPU"])[0]
    workload = doc.get("workload") or {}
    keys = set()
    for c in doc.get("cases", []):
        if not any(r.get("status") == "ok" for r in c.get("runs", [])):
            continue
        keys.add(c.get("precision", "fp32"))
        keys.add(workload.get("fc", "dp") if workload.get("task") == "face" else
                 "classification")
        if (c.get("breakdown") or {}).get("status") == "ok":
            keys.add("breakdown")
        if c.get("world_size", 1) > 1:
            keys.add("multiprocess")
        if "/probes/" in path:
            keys.add("capacity")
        if (doc.get("data") or {}).get("role") == "real":
            keys.add("realdata")
    return [(fw, k, name, env.get("framework_version")) for k in keys]


def from_parity(doc: dict) -> list[tuple[str, str, str, str | None]]:
    if doc.get("device") != "cuda":
        return []
    name = (doc.get("machine") or {}).get("device_name") or "GPU"
    out = []
    for r in doc.get("rows", []):
        if any(p.get("ratio") for p in r.get("pairs", [])):
            ran = next((((p.get("trainperf_detail") or {}).get("versions") or {})
                        .get("framework_version") for p in r["pairs"]), None)
            # trainperf's side of a pair is a training step of its own, with the dp head
            out += [(r["framework"], key, name, ran) for key in
                    ("parity", doc.get("precision", "fp32"),
                     "classification" if r.get("model") == "rn50" else "dp")]
    return out


def from_summary(doc: dict) -> list[tuple[str, str, str, str | None]]:
    if doc.get("mode") != "gpu":
        return []
    passed = any(i.get("kind") == "check" and i.get("status") == "pass"
                 and "losses on cuda match" in i.get("name", "")
                 for s in doc.get("stages", []) for i in s.get("items", []))
    return [("torch", "correctness", doc.get("device") or "GPU", None)] if passed else []


def _read(name: str, text: bytes | str) -> list[tuple[str, str, str, str | None]]:
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    base = name.rsplit("/", 1)[-1]
    if base == "results.json":
        return from_results(doc, name)
    if base == "parity.json":
        return from_parity(doc)
    if base == "summary.json":
        return from_summary(doc)
    return []


def observations(results: Path) -> list[dict]:
    """Every (framework, path, device, date) the GPU records under ``results`` show."""
    seen = []
    for record in sorted(results.glob("gpu-*")):
        date = record_date(record)
        if not record.is_dir() or date is None:
            continue
        found = []
        for name, text in json_files(record, ("results.json", "parity.json", "summary.json")):
            found += _read(name, text)
        seen += [{"framework": fw, "key": key, "device": _short(dev), "date": date,
                  "record": record.name, "version": version}
                 for fw, key, dev, version in found]
    return seen


def latest(seen: list[dict]) -> dict[tuple[str, str], dict]:
    out: dict[tuple[str, str], dict] = {}
    for o in seen:
        k = (o["framework"], o["key"])
        if k not in out or (o["date"], o["device"]) > (out[k]["date"], out[k]["device"]):
            out[k] = o
    return out


def next_part(last: dict[tuple[str, str], dict]) -> tuple[int, str] | None:
    """The part to run after part 1 (which every lent machine runs first, as it proves the code
    as it is now): the one running the most paths no GPU has run, else the one whose paths
    ran longest ago."""
    missing: dict[int, int] = {}
    oldest: dict[int, str] = {}
    first = first_parts()
    for key, _ in ROWS:
        for fw in LENT:
            part = first.get((fw, key))
            if part in (None, 1):
                continue
            o = last.get((fw, key))
            if o is None:
                missing[part] = missing.get(part, 0) + 1
            elif part not in oldest or o["date"] < oldest[part]:
                oldest[part] = o["date"]
    if missing:
        part = max(sorted(missing), key=lambda p: missing[p])
        return part, (f"it runs {missing[part]} of the paths torch and JAX have not run on a "
                      "GPU")
    if oldest:
        part = min(sorted(oldest), key=lambda p: oldest[p])
        return part, f"its rows last ran on {oldest[part]}, the oldest"
    return None


def render(results: Path) -> str:
    last = latest(observations(results))
    head = ["GPU path", *[label for _, label in FRAMEWORKS], "gpu-check part (torch / JAX)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first = first_parts()
    for key, what in ROWS:
        cells = []
        for fw, _ in FRAMEWORKS:
            o = last.get((fw, key))
            cells.append(f"{o['device']}, {o['date']}" if o else NOT_YET)
        which = " / ".join(str(first.get((fw, key), "-")) for fw in LENT)
        lines.append(f"| {what} | " + " | ".join(cells) + f" | {which} |")
    chosen = next_part(last)
    if chosen:
        lines += ["", "On a lent GPU, part 1 runs first (it proves the code as it is now); "
                      f"then `make gpu-check PART={chosen[0]}`: {chosen[1]}."]
    return "\n".join(lines) + "\n"


def listed(names: Sequence[str], last: str = "and") -> str:
    """``a, b and c`` (or ``a, b or c``)."""
    if len(names) <= 1:
        return "".join(names)
    return f"{', '.join(names[:-1])} {last} {names[-1]}"


def version_words(framework: str, label: str, seen: list[dict]) -> str:
    """Which release of the framework those runs were, where the records say: a lent
    machine runs the framework its image carries, which need not be the one `trainperf env
    create` pins, and a page must not credit the pinned one with them."""
    from ..backends import get_backend

    versions = sorted({o["version"] for o in seen if o.get("version")})
    if not versions:
        return ""
    env = get_backend(framework).env
    pinned = env.packages[0].partition("==")[2] if env is not None else None
    text = f", {label} {listed(versions)}"
    if pinned and pinned not in versions:
        text += (f", the lent machine's own, not the {pinned} of the environment "
                 "`trainperf env create` builds")
    return text


def status(results: Path) -> str:
    """One paragraph: which frameworks have run on a GPU (and how many of the matrix's paths),
    which have not, from the same records as the matrix. The front page and the frameworks
    page hold it, so that neither says what the records do not."""
    last = latest(observations(results))
    ran, never = [], []
    for fw, label in FRAMEWORKS:
        seen = [o for (f, _), o in last.items() if f == fw]
        if not seen:
            never.append(label)
            continue
        newest = max(seen, key=lambda o: (o["date"], o["device"]))
        ran.append(f"{label} ({len(seen)} of the {len(ROWS)} paths; latest on "
                   f"{newest['device']}, {newest['date']}{version_words(fw, label, seen)})")
    parts = []
    if ran:
        parts.append(f"Run on a GPU, as the records under `benchmarks/results/gpu-*` show: "
                     f"{listed(ran)}.")
    if never:
        parts.append(f"Not yet run on a GPU: {listed(never)}. Their GPU paths are written to "
                     "each framework's documented API for its version and checked against its "
                     "source; every test a CPU allows runs them.")
    return " ".join(parts) + "\n"
