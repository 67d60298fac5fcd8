"""Child processes as the runner and the other launchers treat them: thread counts per process,
stopping a whole process tree, following a file another process appends to, a log's last
lines. Standard library and psutil only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import psutil

KILL_GRACE_S = 5.0
POLL_S = 0.2
"""How often a supervisor looks at the processes it started and the files they append to."""


def node_cores() -> int:
    """The cores this node may run on: those the process is allowed (a Slurm task's, an
    emulated node's share), not every core of the machine."""
    return len(os.sched_getaffinity(0)) or os.cpu_count() or 1


def cpu_threads_per_process(devices_per_node: int) -> int:
    # Several ranks with several threads each oversubscribe the cores and run slower.
    return max(1, node_cores() // devices_per_node)


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop a launcher and every process under it. The launcher is asked first, so that it
    stops its ranks itself and records them as stopped; whatever is left after the grace
    (a launcher that does not answer, a process in a session of its own) is stopped here."""
    try:
        parent = psutil.Process(proc.pid)
        procs = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for batch in (procs[:1], procs):
        for p in batch:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(batch, timeout=KILL_GRACE_S)
        if not alive:
            break
    _, alive = psutil.wait_procs(procs, timeout=0)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass


class EventTail:
    """Reads complete new lines of a JSON-lines file as another process appends them (raw
    dicts: the caller decodes them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line torn by a killed writer carries nothing usable
        return out


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    useful = [ln for ln in text if ln.strip()]
    return "\n".join(useful[-lines:])


def interrupt_on_sigterm() -> None:
    """A supervisor stopped by SIGTERM (a scheduler, kill) cleans up as on Ctrl-C: it kills the
    process trees it started and keeps what was measured."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set there (tests run nodes in threads)

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
