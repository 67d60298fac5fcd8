"""Environment capture on the runner's side: host, CPU, driver, Python, trainperf and git.

The worker adds what only the framework knows (its version, CUDA, cuDNN, NCCL, device names);
this module imports no framework.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from functools import lru_cache
from pathlib import Path

from . import __version__


def _run(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def nvidia_driver() -> dict:
    if shutil.which("nvidia-smi") is None:
        return {"driver_version": None, "gpus": []}
    out = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader"])
    gpus = [dict(zip(("name", "driver_version", "memory_total"), (f.strip() for f in line.split(","))))
            for line in (out or "").splitlines() if line.strip()]
    return {"driver_version": gpus[0]["driver_version"] if gpus else None, "gpus": gpus}


@lru_cache(maxsize=1)
def gpu_count() -> int:
    """NVIDIA GPUs on this machine, without importing a framework (0 without nvidia-smi).
    Asked once per process: every plan's check and every run of a matrix would otherwise
    start nvidia-smi again for the same answer."""
    if shutil.which("nvidia-smi") is None:
        return 0
    out = _run(["nvidia-smi", "-L"])
    return sum(1 for line in (out or "").splitlines() if line.startswith("GPU "))


def git_commit() -> str | None:
    here = str(Path(__file__).resolve().parent)
    commit = _run(["git", "rev-parse", "HEAD"], cwd=here)
    if commit and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here):
        commit += "-dirty"
    return commit


def host_env() -> dict:
    return {
        "host": socket.gethostname(),
        "os": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "trainperf_version": __version__,
        "trainperf_commit": git_commit(),
        **nvidia_driver(),
    }
