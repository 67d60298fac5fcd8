"""Live progress with rich while runs go; plain lines when output is not a terminal."""

from __future__ import annotations

import sys

from .runner import Progress, QuietProgress


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
        rate = record.get("samples_per_s")
        style = "green" if record["status"] == "ok" else "red"
        figure = f"{rate:.2f} samples/s" if rate else (record.get("error") or "")[:120]
        self.console.print(f"[{style}]{label}: {record['status']}[/] {figure}",
                           highlight=False, markup=True)

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()


def make_progress() -> Progress:
    return RichProgress() if sys.stderr.isatty() else QuietProgress()
