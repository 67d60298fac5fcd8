"""Helpers for tests that run whole runs through the CLI."""

from __future__ import annotations

from pathlib import Path

import psutil


def left_behind(folder: Path) -> list[psutil.Process]:
    """Live processes of runs under ``folder``: every process of a run (parameter servers,
    schedulers and launchers included) inherits TRAINPERF_RUN_ID, its run's folder, from the
    runner."""
    root = str(folder.resolve())
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TRAINPERF_RUN_ID", "").startswith(root):
                out.append(p)
        except psutil.Error:
            continue
    return out
