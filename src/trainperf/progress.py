"""How a runner shows its runs as they go: live with rich on a terminal, one line per finished
run otherwise (logs, CI), or nothing (capacity probes report through their own lines)."""

from __future__ import annotations

import sys
from typing import Protocol


class Progress(Protocol):
    def run_started(self, label: str, total_steps: int) -> None: ...
    def steps_done(self, count: int) -> None: ...
    def run_finished(self, label: str, record: dict) -> None: ...


class NullProgress:
    """Shows nothing (capacity probes report through their own lines)."""

    def run_started(self, label: str, total_steps: int) -> None:
        pass

    def steps_done(self, count: int) -> None:
        pass

    def run_finished(self, label: str, record: dict) -> None:
        pass


def finished_text(record: dict) -> str:
    """A finished run's figure or error, and the attempts it took where it took more."""
    rate = record.get("samples_per_s")
    text = f"{rate:.2f} samples/s" if rate else (record.get("error") or "")[:120]
    retries = record.get("retries") or []
    if retries:
        text += (f" (on attempt {len(retries) + 1}: {retries[-1]['reason']})")
    return text


class QuietProgress(NullProgress):
    """No live display: one line per finished run, for logs and CI."""

    def __init__(self, stream=None) -> None:
        self.stream = stream

    def run_finished(self, label: str, record: dict) -> None:
        print(f"{label}: {record['status']} {finished_text(record)}",
              file=self.stream or sys.stderr, flush=True)


class RichProgress:
    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn,
                                   TimeElapsedColumn)

        self.console = Console(stderr=True)
        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("steps"), TimeElapsedColumn(), console=self.console,
                       transient=True)
        self.task = None

    def run_started(self, label: str, total_steps: int) -> None:
        if self.task is None:
            self.bar.start()
        else:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(label, total=total_steps)

    def steps_done(self, count: int) -> None:
        if self.task is not None:
            self.bar.advance(self.task, count)

    def run_finished(self, label: str, record: dict) -> None:
        style = "green" if record["status"] == "ok" else "red"
        from rich.markup import escape

        # An error may hold brackets of its own ("[W1125 ...]"), which are not markup.
        self.console.print(f"[{style}]{escape(label)}: {record['status']}[/] "
                           f"{escape(finished_text(record))}", highlight=False, markup=True)

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()


def make_progress() -> Progress:
    return RichProgress() if sys.stderr.isatty() else QuietProgress()
