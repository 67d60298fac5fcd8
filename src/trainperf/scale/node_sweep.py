"""A multi-node job's folder, from one device to N nodes: the node counts a job runs as steps
(``trainperf slurm --nodes 1,2,4``, ``trainperf emulate --nodes 1,2``), each step's node
folders, and at the end one results document per plan joined across the steps (``join``), so
that every row of DLPerf's table, 2n16g and 4n32g included, has its speedup against 1n1g.

A job of one node count keeps its node folders at the top (``OUT/node-k``, as before); a sweep
puts each count's under ``OUT/nodes-N``. Either way the job's documents lie where ``run`` would
have put them (``OUT/results.json`` for one plan, ``OUT/torch/results.json`` ... for several),
``OUT/job.json`` lists them with the node folders each was joined from, and ``OUT/report.md``
covers them all. Every command that reads results reads a job's folder as its documents
(``result_files.plan_documents``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import join, results
from ..config import parse_int_list
from ..result_files import JOB, RESULTS, plan_documents, role_of

JOB_SCHEMA = "trainperf.job/v1"
NODE_DIR = "node-{}"
STEP_DIR = "nodes-{}"
CASE_NAME = re.compile(r"(\d+)n(\d+)g")


@dataclass(frozen=True)
class Step:
    """One node count of a job: its nodes and the processes per node of its cases."""

    nodes: int
    devices: tuple[int, ...]

    def folder(self, sweep: bool) -> str:
        """Where its node folders go, relative to the job's folder ("" without a sweep)."""
        return STEP_DIR.format(self.nodes) if sweep else ""

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "devices_per_node": list(self.devices)}


def parse_cases(text: str) -> list[Step]:
    """``1n1g,1n8g,2n8g``, case names as DLPerf's tables and trainperf's results give them
    (nodes, and devices per node: 2n8g is 16 devices), as the steps that run them: one per
    node count, smallest first. ValueError where a name is not of that form or comes twice."""
    by_nodes: dict[int, list[int]] = {}
    for name in [part.strip() for part in text.split(",") if part.strip()]:
        m = CASE_NAME.fullmatch(name)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(f"--cases takes case names NnGg (nodes, devices per node), e.g. "
                             f"1n1g,1n8g,2n8g; got {name!r}")
        nodes, per_node = int(m.group(1)), int(m.group(2))
        if per_node in by_nodes.setdefault(nodes, []):
            raise ValueError(f"--cases names {name} twice")
        by_nodes[nodes].append(per_node)
    if not by_nodes:
        raise ValueError("--cases needs at least one case, e.g. 1n1g,2n1g")
    return [Step(n, tuple(sorted(by_nodes[n]))) for n in sorted(by_nodes)]


def steps_of(nodes: str, devices: str | None, cases: str | None) -> list[Step]:
    """A job's steps: each node count of ``nodes`` (``1,2,4``) with every device count of
    ``devices`` per node, or exactly the cases ``cases`` names. ValueError in one line where
    the two disagree or a count is not one."""
    if cases:
        steps = parse_cases(cases)
        if nodes and [s.nodes for s in steps] != sorted(set(parse_int_list(nodes, "--nodes"))):
            raise ValueError(f"--cases {cases} runs on {','.join(str(s.nodes) for s in steps)} "
                             f"node(s), --nodes says {nodes}: give one of them")
        if devices:
            raise ValueError("--cases names each case's devices: drop --devices")
        return steps
    counts = parse_int_list(nodes, "--nodes")
    if any(n < 1 for n in counts):
        raise ValueError(f"--nodes takes counts of 1 or more, got {nodes!r}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"--nodes names a count twice: {nodes!r}")
    per_node = tuple(parse_int_list(devices or "1", "--devices"))
    return [Step(n, per_node) for n in sorted(counts)]


def is_sweep(steps: list[Step]) -> bool:
    return len(steps) > 1


def step_dir(out_dir: Path, steps: list[Step], step: Step) -> Path:
    return Path(out_dir) / step.folder(is_sweep(steps))


def node_dirs(folder: Path) -> list[Path]:
    """A step's node folders, by node."""
    found = [p for p in Path(folder).glob(NODE_DIR.format("*")) if p.is_dir()
             and p.name[len("node-"):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len("node-"):]))


# -- the job's documents ------------------------------------------------------------------------

@dataclass
class PlanParts:
    """One plan of a job: where each step's measurements of it are, and what is missing."""

    rel: str
    """The plan's folder in a node's folder (``.``, ``torch``, ``jax/real``)."""
    parts: list[tuple[str, dict]]
    """(the node folder's plan folder, relative to the job's folder; its document)."""
    missing: list[str]
    """Steps without the plan's measurements, in words."""


def leader_of(step_folder: Path, rel: str) -> tuple[Path | None, str | None]:
    """The node folder of a step whose plan ``rel`` kept the measurements (the leader is
    found per plan: each plan's nodes meet on their own), and why none where there is none."""
    nodes = node_dirs(step_folder)
    roles = {node: role_of(node / rel / RESULTS) for node in nodes}
    leaders = [node for node, role in roles.items() if role == "leader"]
    if len(leaders) == 1:
        return leaders[0], None
    if leaders:
        return None, (f"{', '.join(p.name for p in leaders)} each hold measurements of it "
                      "(exactly one should)")
    seen = sum(role is not None for role in roles.values())
    return None, (f"{seen} of {len(nodes)} node folder(s) hold records of it, none the "
                  "measurements" if seen else "no node folder holds records of it")


def plan_rels(out_dir: Path, steps: list[Step]) -> list[str]:
    """Every plan a job's node folders hold, by its place in a node's folder."""
    rels: list[str] = []
    for step in steps:
        for node in node_dirs(step_dir(out_dir, steps, step)):
            for path in node_documents(node):
                rel = path.parent.relative_to(node).as_posix()
                if rel not in rels:
                    rels.append(rel)
    return rels


def node_documents(node: Path) -> list[Path]:
    """A node folder's plan documents, the followers' too (``plan_documents`` leaves those
    out, as they hold no figures; a plan's leader is found among all of them)."""
    if (node / RESULTS).is_file():
        return [node / RESULTS]
    found = []
    for path in sorted(node.rglob(RESULTS)):
        rel = path.parent.relative_to(node).parts
        if "runs" not in rel and "probes" not in rel and len(rel) <= 2:
            found.append(path)
    return found


def gather(out_dir: Path, steps: list[Step]) -> list[PlanParts]:
    out_dir = Path(out_dir)
    plans = []
    for rel in plan_rels(out_dir, steps):
        parts, missing = [], []
        for step in steps:
            leader, why = leader_of(step_dir(out_dir, steps, step), rel)
            if leader is None:
                missing.append(f"{step.nodes} node(s): {why}")
                continue
            folder = leader / rel
            parts.append((folder.relative_to(out_dir).as_posix(), results.load(folder)))
        plans.append(PlanParts(rel, parts, missing))
    return plans


def collect(out_dir: Path, steps: list[Step], kind: str,
            fabric: list[str] | tuple[str, ...] = ()) -> tuple[list[Path], Path, list[str]]:
    """Write the job's documents (one per plan, joined across its steps), ``job.json`` and
    ``report.md``: (the documents, the report, what is missing: a line for each plan and step
    without measurements). ValueError, in one line, where no step holds measurements of any
    plan or a plan's steps cannot be joined (``join.join`` says why)."""
    from ..report.assemble import write_report
    from .bottleneck import analyser

    out_dir = Path(out_dir)
    plans = gather(out_dir, steps)
    missing = [f"{p.rel}: {m}" if p.rel != "." else m for p in plans for m in p.missing]
    written: list[Path] = []
    listing = []
    for plan in plans:
        if not plan.parts:
            continue
        doc = join.join(plan.parts)
        doc["job"] = {"kind": kind, "folder": ".", "steps": [s.to_dict() for s in steps]}
        target = out_dir / plan.rel / RESULTS
        results.write_json_atomic(target, doc)
        written.append(target)
        listing.append({"document": target.relative_to(out_dir).as_posix(),
                        "sources": [where for where, _ in plan.parts],
                        "missing": plan.missing})
    if not written:
        found = "; ".join(missing) or "no node folders"
        raise ValueError(f"{out_dir}: no measurements to report ({found})")
    results.write_json_atomic(out_dir / JOB, {
        "schema": JOB_SCHEMA, "kind": kind, "steps": [s.to_dict() for s in steps],
        "documents": [entry["document"] for entry in listing], "plans": listing})
    report = write_report([str(out_dir)], out_dir, False, analyser(list(fabric) or None))
    return written, report, missing


def all_runs_ok(documents: list[Path], missing: list[str]) -> bool:
    """Whether the job measured everything it was to: no step without a plan's
    measurements, and every run of every case ok."""
    docs = [results.load(p) for p in documents]
    return not missing and bool(docs) and results.all_runs_ok(docs) and all(
        c["runs"] for d in docs for c in d["cases"])


def read_job(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out_dir) / JOB).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def documents(out_dir: Path) -> list[Path]:
    return plan_documents(out_dir)
