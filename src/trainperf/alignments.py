"""Where alignment verdicts are kept, so that a comparison of frameworks can name the one it
rests on (standard library only).

`trainperf align` writes one record per check here: the recipe, the framework, both sides'
versions, the dtype, the verdict and where its ``align.json`` lies. A report comparing a
framework with torch looks for a record of the same recipe and the same versions.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from . import records

REGISTRY_ENV = "TRAINPERF_ALIGNMENTS"


def registry() -> Path:
    """``$TRAINPERF_ALIGNMENTS``, else ``~/.cache/trainperf/alignments``: one machine's
    verdicts, since the versions a verdict holds for are that machine's."""
    return Path(os.environ.get(REGISTRY_ENV) or Path.home() / ".cache/trainperf/alignments")


def keep(record: dict[str, Any]) -> Path:
    """File ``record`` (``recipe``, ``framework``, ``versions``, ``aligned``...) under a new
    name; returns its path."""
    folder = registry()
    base = f"{record['recipe']}-{record['framework']}-{time.strftime('%Y%m%d-%H%M%S')}"
    return records.put(folder, records.new_name(folder, base), record)


def find(recipe: str, framework: str, versions: dict[str, str | None],
         dtype: str | None = None) -> dict[str, Any] | None:
    """The newest record of ``framework`` against torch on ``recipe`` whose versions are
    ``versions`` (``{"torch": ..., framework: ...}``; a None version matches any), in
    ``dtype`` where given, or None."""
    return records.newest(registry(), f"{recipe}-{framework}-*.json", lambda r: (
        r.get("recipe") == recipe and r.get("framework") == framework
        and _same_versions(r.get("versions") or {}, versions)
        and (dtype is None or r.get("dtype") == dtype)))


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
