"""Where alignment verdicts are kept, so that a comparison of frameworks can name the one it
rests on (standard library only).

`trainperf align` writes one record per check here: the recipe, the framework, both sides'
versions, the dtype, the verdict and where its ``align.json`` lies. A report comparing a
framework with torch looks for a record of the same recipe and the same versions.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

REGISTRY_ENV = "TRAINPERF_ALIGNMENTS"


def registry() -> Path:
    """``$TRAINPERF_ALIGNMENTS``, else ``~/.cache/trainperf/alignments``: one machine's
    verdicts, since the versions a verdict holds for are that machine's."""
    return Path(os.environ.get(REGISTRY_ENV) or Path.home() / ".cache/trainperf/alignments")


def keep(record: dict[str, Any]) -> Path:
    """File ``record`` (``recipe``, ``framework``, ``versions``, ``aligned``...) under a new
    name; returns its path."""
    folder = registry()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{record['recipe']}-{record['framework']}-{stamp}"
    path = folder / f"{base}.json"
    n = 1
    while path.exists():
        n += 1
        path = folder / f"{base}-{n}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def find(recipe: str, framework: str, versions: dict[str, str | None],
         dtype: str | None = None) -> dict[str, Any] | None:
    """The newest record of ``framework`` against torch on ``recipe`` whose versions are
    ``versions`` (``{"torch": ..., framework: ...}``; a None version matches any), in
    ``dtype`` where given, or None."""
    best: dict[str, Any] | None = None
    try:
        paths = list(registry().glob(f"{recipe}-{framework}-*.json"))
    except OSError:
        return None
    for path in paths:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if (record.get("recipe") != recipe or record.get("framework") != framework
                or not _same_versions(record.get("versions") or {}, versions)
                or (dtype is not None and record.get("dtype") != dtype)):
            continue
        if best is None or record.get("t", 0) > best.get("t", 0):
            best = {**record, "record": str(path)}
    return best


def _same_versions(kept: dict[str, Any], asked: dict[str, str | None]) -> bool:
    return set(kept) == set(asked) and all(v is None or kept[k] == v for k, v in asked.items())


def describe(record: dict[str, Any] | None, recipe: str, framework: str) -> str:
    """One line on what a comparison of ``framework`` with torch rests on."""
    if record is None:
        return (f"not aligned: no alignment check of {framework} on {recipe} with these "
                f"versions (`trainperf align {recipe} --framework {framework}`)")
    when = time.strftime("%Y-%m-%d", time.localtime(record.get("t", 0)))
    versions = ", ".join(f"{k} {v}" for k, v in (record.get("versions") or {}).items())
    pairs = ", ".join(f"{fc} on {n}" for fc, n in record.get("checked") or [])
    if not record.get("aligned"):
        return (f"NOT ALIGNED: the last check ({when}, {versions}, {record.get('dtype')}) "
                f"failed: `{record.get('align_json')}`")
    worst = record.get("worst_update")
    return (f"aligned with torch in {record.get('dtype')} ({pairs}; worst update error "
            f"{worst:.1e}), checked {when} with {versions}: `{record.get('align_json')}`"
            if worst is not None else
            f"aligned with torch in {record.get('dtype')} ({pairs}), checked {when} with "
            f"{versions}: `{record.get('align_json')}`")
