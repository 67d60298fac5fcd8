"""Finding files of a results tree by name: unpacked ones, and those kept inside ``.tar.gz``
archives (a GPU record folder, ``benchmarks/results/gpu-*``, packs each part's work folder into
one). Standard library only, so that every floor may read a tree through it."""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path


def json_files(root: Path, names: tuple[str, ...]) -> Iterator[tuple[str, bytes]]:
    """(name, contents) of every file under the folder ``root`` called one of ``names``:
    unpacked ones first, named by their path in the folder, then those in the archives, named
    by the archive's path and theirs inside it
    (``part1/gpucheck-part1.tar.gz/<work>/runs/<case>/results.json``); each group in sorted
    order."""
    for path in sorted(root.rglob("*.json")):
        if path.name in names and path.is_file():
            yield str(path.relative_to(root)), path.read_bytes()
    for path in sorted(root.rglob("*.tar.gz")):
        archive = path.relative_to(root)
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.rsplit("/", 1)[-1] in names:
                    yield f"{archive}/{member.name}", tar.extractfile(member).read()


# -- the documents a folder holds as trainperf wrote it ----------------------------------------

RESULTS = "results.json"
JOB = "job.json"
"""A multi-node job's folder (``trainperf slurm``, ``trainperf emulate``): its node folders
hold each node's own records, and the documents it lists are the job's, one per plan, joined
across its node counts."""
SEARCH = "search.json"
NODE_FOLDER = re.compile(r"nodes?-\d+")
"""A job's folder of one node's records (``node-3``), or of one node count's (``nodes-2``)."""


def role_of(path: Path) -> str | None:
    """``leader`` or ``follower`` as a results.json says (a follower's records hold exits
    only; its figures are on node 0's); None where it does not read."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    return "follower" if doc.get("role") == "follower" else "leader"


def job_documents(folder: Path) -> list[Path] | None:
    """The documents a job's folder lists in its ``job.json`` (those present); None where the
    folder is no job's."""
    try:
        job = json.loads((folder / JOB).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder / JOB} does not read ({exc})") from None
    return [folder / rel for rel in job.get("documents", []) if (folder / rel).is_file()]


def plan_documents(path: str | Path) -> list[Path]:
    """The results.json of every plan ``path`` holds, as a command wrote it: the file itself;
    a plan's folder (nothing below it counts: its runs, a search's probes); a job's documents;
    else every plan folder below, in sorted order. A follower node's records and the node
    folders of a job, whose figures its documents hold, are left out."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    listed = job_documents(p)
    if listed is not None:
        return listed
    if (p / RESULTS).is_file():
        return [p / RESULTS] if role_of(p / RESULTS) != "follower" else []
    if (p / SEARCH).is_file():
        return []
    found: list[Path] = []
    for child in sorted(c for c in p.iterdir() if c.is_dir() and not c.name.startswith(".")):
        found += plan_documents(child)
    return found


def superseded(root: Path, names: list[str]) -> set[str]:
    """Of ``names`` (paths under ``root`` of results files, as ``json_files`` names them), those
    a job's documents supersede: the records in its node folders, each of them either a
    follower's (no figures) or one whose figures a document of the job holds."""
    jobs = [p.parent.relative_to(root).parts for p in root.rglob(JOB)]
    out = set()
    for name in names:
        parts = Path(name).parts
        for job in jobs:
            if parts[:len(job)] == job and len(parts) > len(job) + 1 \
                    and NODE_FOLDER.fullmatch(parts[len(job)]):
                out.add(name)
    return out
