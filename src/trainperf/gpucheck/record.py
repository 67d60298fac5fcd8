"""What a stage writes as it goes: one JSON file, rewritten whole (atomically) after every item,
so that a stage stopped at its cap, or one that crashed, leaves everything it measured.

Items are dicts with a ``kind``: ``check`` (a pass/fail/not-run verdict with its numbers),
``case`` (a measured case), ``note`` (a line for the summary) and stage-specific kinds. The
orchestrator adds the stage's outcome (``status``, ``why``, ``elapsed_s``) once it has ended.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..results import write_json_atomic

PASS, FAIL, NOT_RUN, RECORDED = "pass", "fail", "not run", "recorded"


def stage_path(work: Path, stage_id: str) -> Path:
    return work / f"stage-{stage_id}.json"


class StageLog:
    def __init__(self, work: Path, stage_id: str, title: str, mode: str) -> None:
        self.path = stage_path(work, stage_id)
        self.doc: dict[str, Any] = {"stage": stage_id, "title": title, "mode": mode,
                                    "started": time.time(), "items": []}
        self._write()

    def set(self, **fields: Any) -> None:
        """Stage-wide facts (the device, its memory): kept beside the items."""
        self.doc.update(fields)
        self._write()

    def add(self, kind: str, **fields: Any) -> dict:
        item = {"kind": kind, **fields}
        self.doc["items"].append(item)
        self._write()
        return item

    def check(self, name: str, status: str, detail: str, **numbers: Any) -> dict:
        return self.add("check", name=name, status=status, detail=detail, numbers=numbers)

    def not_run(self, name: str, why: str) -> dict:
        return self.check(name, NOT_RUN, why)

    def note(self, text: str) -> dict:
        return self.add("note", text=text)

    def _write(self) -> None:
        write_json_atomic(self.path, self.doc)


def read_stage(work: Path, stage_id: str) -> dict | None:
    try:
        return json.loads(stage_path(work, stage_id).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def items(stage: dict | None, kind: str) -> list[dict]:
    return [i for i in (stage or {}).get("items", []) if i.get("kind") == kind]
