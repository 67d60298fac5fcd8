"""A folder of JSON records, one per file, written whole or not at all (standard library only).

The alignment verdicts (``trainperf.alignments``) and the native parity ratios
(``trainperf.parities``) are kept this way: a report looks for the newest record that fits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def new_name(folder: Path, base: str) -> str:
    """``base``, or ``base-2``, ``base-3``... where a record of that name exists already."""
    name, n = base, 1
    while (folder / f"{name}.json").exists():
        n += 1
        name = f"{base}-{n}"
    return name


def put(folder: Path, name: str, record: dict[str, Any]) -> Path:
    """Write ``record`` as ``folder/name.json``, replacing what was there; returns its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def newest(folder: Path, pattern: str, fits: Callable[[dict[str, Any]], bool]
           ) -> dict[str, Any] | None:
    """The record matching the glob ``pattern`` that ``fits`` and has the latest ``t``, with
    its path under ``record``; None where none fits. Unreadable files are passed over."""
    best: dict[str, Any] | None = None
    try:
        paths = list(folder.glob(pattern))
    except OSError:
        return None
    for path in paths:
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or not fits(record):
            continue
        if best is None or record.get("t", 0) > best.get("t", 0):
            best = {**record, "record": str(path)}
    return best
