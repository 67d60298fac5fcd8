"""``trainperf compare``: pair the cases of result folders and say, with an interval and a rank
test, whether each got faster, slower or stayed the same (``trainperf.significance``).

A side is one folder as given: every plan's ``results.json`` in it as a command wrote it (one
plan's folder, a sweep's or a framework comparison's folders, a multi-node job's documents). Cases pair on their recipe, layout (nodes, devices
per node) and batch per device, and on the head, precision, framework, data and execution mode:
each of those is left out of the pairing where it is the comparison's subject, one value on each
side and not the same on all (``--fc dp`` against ``--fc pfc``, torch against Paddle, eager
against compile); so cases timed in two modes of one framework never pair otherwise. Where the
mode is the subject but was not asked for by name on both sides (two ``--mode best`` folders
whose probes chose differently), the pairs are shown with both figures and no verdict: each
figure is of another step, and that is neither faster nor slower.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import results, significance
from ..mode_choice import MODES_DIFFER, mode_pair_text, modes_asked
from ..result_files import plan_documents
from .markdown import device_text, fmt, framework_name, interval_text, table

ALWAYS_MATCHED = ("recipe", "nodes", "devices_per_node", "batch_size_per_device")
MATCHED_UNLESS_SUBJECT = ("framework", "data", "num_classes", "fc", "sample_ratio", "precision",
                         "mode")
KEY_FIELDS = ALWAYS_MATCHED + MATCHED_UNLESS_SUBJECT
ENV_FIELDS = ("framework_version", "trainperf_commit", "host", "python", "cuda_version",
              "cudnn_version", "nccl_version", "numpy_version", "collective_backend")
MEASURE_FIELDS = ("runs", "iters", "warmup")


@dataclass
class Side:
    """One folder as given and the results documents in or below it."""
    name: str
    docs: list[dict]
    cases: list[tuple[dict, dict]] = field(default_factory=list)
    """(document, case) of every case the documents hold."""

    def __post_init__(self):
        self.cases = [(d, c) for d in self.docs for c in d["cases"]]


def result_files(folder: Path) -> list[Path]:
    """Every plan's results.json in ``folder`` as a command wrote it (``plan_documents``)."""
    return plan_documents(folder)


def load_side(path: str) -> Side:
    """The documents of one folder; ValueError in one line naming the folder where it holds no
    results, mixes schemas or holds a file that does not read."""
    folder = Path(path)
    if not folder.exists():
        raise ValueError(f"{path}: no such folder")
    files = result_files(folder)
    if not files:
        raise ValueError(f"{path}: no results.json in it or below it")
    raw = [results.read_json(f, "results.json") for f in files]
    schemas = sorted({str(doc.get("schema")) if isinstance(doc, dict) else type(doc).__name__
                      for _, doc in raw})
    if len(schemas) > 1:
        raise ValueError(f"{path}: mixes result schemas ({', '.join(schemas)}); compare "
                         "folders of one schema")
    return Side(path, [results.checked(f, doc) for f, doc in raw])


def case_fields(doc: dict, case: dict) -> dict:
    w = doc.get("workload") or {}
    fc = case.get("fc", w.get("fc"))
    return {"recipe": doc["recipe"], "nodes": case["nodes"],
            "devices_per_node": case["devices_per_node"],
            "batch_size_per_device": case["batch_size_per_device"],
            "framework": framework_name(doc) or None,
            "data": (doc.get("data") or {}).get("role"),
            "num_classes": case.get("num_classes", w.get("num_classes")), "fc": fc,
            "sample_ratio": case.get("sample_ratio", w.get("sample_ratio")) if fc == "pfc"
            else None,
            "precision": case["precision"], "mode": case.get("mode")}


def subjects(sides: list[Side]) -> list[str]:
    """The fields the comparison is about: one value within each side, not one over all."""
    out = []
    for name in MATCHED_UNLESS_SUBJECT:
        per_side = [{case_fields(d, c)[name] for d, c in s.cases} for s in sides]
        if all(len(v) == 1 for v in per_side) and len(set().union(*per_side)) > 1:
            out.append(name)
    return out


def key_of(fields: dict, subject: list[str]) -> tuple:
    return tuple((k, fields[k]) for k in KEY_FIELDS if k not in subject)


def case_label(key: tuple) -> str:
    f = dict(key)
    parts = [f["recipe"]]
    if f.get("framework"):
        parts.append(f["framework"])
    if f.get("data") not in (None, "synthetic"):
        parts.append(f"{f['data']} data" if f["data"] == "real" else f["data"])
    if "fc" in f and f["fc"]:
        parts.append(f"fc={f['fc']}" + (f" r={f['sample_ratio']}" if f["fc"] == "pfc" else ""))
    if f.get("num_classes") is not None:
        parts.append(f"{f['num_classes']} classes")
    if f.get("precision"):
        parts.append(f["precision"])
    if f.get("mode"):
        parts.append(f"in {f['mode']}")
    parts.append(f"{f['nodes']}n{f['devices_per_node']}g b{f['batch_size_per_device']}")
    return " ".join(parts)


def match(sides: list[Side]) -> tuple[list[str], dict[tuple, list[dict | None]]]:
    """(the subject fields, each case key with that case on every side or None)."""
    subject = subjects(sides)
    table_: dict[tuple, list[dict | None]] = {}
    for i, side in enumerate(sides):
        for doc, case in side.cases:
            key = key_of(case_fields(doc, case), subject)
            row = table_.setdefault(key, [None] * len(sides))
            if row[i] is not None:
                raise ValueError(f"{side.name}: holds the case {case_label(key)} twice; give "
                                 "each result folder as a side of its own")
            row[i] = case
    return subject, table_


def side_description(side: Side) -> dict[str, str]:
    """What a side ran on and with, field by field; ``mixed`` where its documents differ."""
    values: dict[str, set] = {}

    def put(name, value):
        values.setdefault(name, set()).add("-" if value is None else str(value))

    for doc in side.docs:
        env, measure = doc.get("env") or {}, doc.get("measure") or {}
        put("framework", framework_name(doc) or None)
        for name in ENV_FIELDS:
            value = env.get(name)
            put(name, value[:12] if name == "trainperf_commit" and value else value)
        put("device", device_text(env) if env else None)
        for name in MEASURE_FIELDS:
            put(name, measure.get(name))
        for name, value in sorted((doc.get("tuning") or {}).items()):
            put(name, value)
        if doc.get("source"):
            put("source", doc["source"].get("format"))
    for doc, case in side.cases:
        for name in ("fc", "sample_ratio", "num_classes", "precision", "data"):
            put(name, case_fields(doc, case)[name])
        put("mode ran", case.get("mode"))
    return {k: (next(iter(v)) if len(v) == 1 else "mixed") for k, v in values.items()}


def differences(base: Side, new: Side) -> list[tuple[str, str, str]]:
    a, b = side_description(base), side_description(new)
    return [(k, a.get(k, "-"), b.get(k, "-")) for k in dict.fromkeys([*a, *b])
            if a.get(k, "-") != b.get(k, "-")]


@dataclass
class PairResult:
    key: tuple
    base: dict
    new: dict
    comparison: significance.Comparison

    def to_dict(self) -> dict:
        return {"case": case_label(self.key), "key": dict(self.key),
                "base_median_samples_per_s": self.base["median_samples_per_s"],
                "new_median_samples_per_s": self.new["median_samples_per_s"],
                **self.comparison.to_dict()}


@dataclass
class SideComparison:
    base: Side
    new: Side
    differs: list[tuple[str, str, str]]
    pairs: list[PairResult]
    only_base: list[str]
    only_new: list[str]

    def to_dict(self) -> dict:
        return {"base": self.base.name, "new": self.new.name,
                "differs": [{"field": k, "base": a, "new": b} for k, a, b in self.differs],
                "pairs": [p.to_dict() for p in self.pairs],
                "only_base": self.only_base, "only_new": self.only_new}


def compare_sides(base: Side, new: Side, threshold: float = significance.THRESHOLD,
                  confidence: float = significance.CONFIDENCE) -> SideComparison:
    subject, rows = match([base, new])
    judged = "mode" not in subject or modes_asked(base.docs + new.docs)
    pairs = []
    for key, (b, n) in rows.items():
        if b is None or n is None:
            continue
        c = significance.compare_cases(b, n, threshold, confidence)
        pairs.append(PairResult(key, b, n, c if judged else replace(c, verdict=MODES_DIFFER)))
    only_base = [case_label(k) for k, (b, n) in rows.items() if n is None]
    only_new = [case_label(k) for k, (b, n) in rows.items() if b is None]
    if not pairs:
        raise ValueError(f"nothing comparable between {base.name} and {new.name}: no case of "
                         f"one matches a case of the other ({'; '.join(only_base[:3])} against "
                         f"{'; '.join(only_new[:3])})")
    return SideComparison(base, new, differences(base, new), pairs, only_base, only_new)


def verdict_text(c: significance.Comparison, threshold: float, base: dict | None = None,
                 new: dict | None = None) -> str:
    if c.verdict == MODES_DIFFER:
        return (mode_pair_text(base, new) if base is not None and new is not None
                else MODES_DIFFER) + ": no verdict"
    if c.verdict == "not enough runs":
        if c.runs_needed is None:
            return (f"not enough runs (one run a side shows no spread; at least "
                    f"{significance.min_runs_for_rank_test()} a side)")
        if c.runs_needed > significance.MAX_RUNS_NEEDED:
            return (f"not enough runs (a change this close to {100 * threshold:g}% needs more "
                    f"than {significance.MAX_RUNS_NEEDED} a side)")
        return f"not enough runs (about {c.runs_needed} a side would decide)"
    return c.verdict


def render(comparisons: list[SideComparison], threshold: float, confidence: float) -> str:
    level = f"{100 * confidence:g}%"
    lines = ["# trainperf compare", "",
             f"Ratio: NEW's median samples/s over BASE's, with its {level} bootstrap interval; "
             f"p: two-sided Mann-Whitney U over the runs. `slower` / `faster` needs the whole "
             f"interval below {1 - threshold:g} / above {1 + threshold:g} (the threshold, "
             f"{100 * threshold:g}%) and p below {1 - confidence:.2g}; `no change` needs the "
             f"whole interval between them.", ""]
    for sc in comparisons:
        lines += [f"## {sc.new.name} against {sc.base.name}", ""]
        if sc.differs:
            lines.append("What differs: " + "; ".join(f"{k} {a} -> {b}" for k, a, b in sc.differs)
                         + ".")
        else:
            lines.append("What differs: nothing recorded (the same configuration measured "
                         "again).")
        lines.append("")
        rows = [[case_label(p.key), fmt(p.base["median_samples_per_s"]),
                 fmt(p.new["median_samples_per_s"]), interval_text(p.comparison),
                 fmt(p.comparison.p_value, 3),
                 f"{p.comparison.base_runs} / {p.comparison.new_runs}",
                 verdict_text(p.comparison, threshold, p.base, p.new)] for p in sc.pairs]
        lines += [table(["case", "BASE samples/s", "NEW samples/s", f"ratio ({level} CI)", "p",
                         "runs", "verdict"], rows), ""]
        methods = sorted({p.comparison.interval_method for p in sc.pairs} - {"-"})
        if methods:
            lines += [f"Intervals: {'; '.join(methods)}.", ""]
        if sc.only_base:
            lines += [f"Only in {sc.base.name}: {'; '.join(sc.only_base)}.", ""]
        if sc.only_new:
            lines += [f"Only in {sc.new.name}: {'; '.join(sc.only_new)}.", ""]
    return "\n".join(lines)


def failing(comparisons: list[SideComparison], fail_on: str) -> list[str]:
    """The pairs that fail a CI job: slower ones, or with ``any-change`` faster ones too."""
    bad = {"slower"} if fail_on == "slower" else {"slower", "faster"}
    return [f"{case_label(p.key)}: {p.comparison.verdict} in {sc.new.name}"
            for sc in comparisons for p in sc.pairs if p.comparison.verdict in bad]
