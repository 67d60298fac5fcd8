"""A stand-in for NVML's Python binding (``pynvml``, from nvidia-ml-py), for the tests of energy
on a machine without a GPU: no test here has read a real board's counter.

``write(folder, boards)`` writes ``folder/pynvml.py``: it lists ``boards`` (NVML's order is
theirs, which need not be their PCI bus order) and gives each board an energy counter that
rises with the wall clock at the board's ``watts`` (so the joules of any window are known:
watts x seconds), or raises ``NVMLError_NotSupported`` for a board with ``counter: False``, as
boards before Volta do. ``load(folder)`` imports it under the name ``pynvml``. Its ``READS``
counts the counter reads of each board (in the process that imported it).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType

BOARDS = [
    # NVML's order differs from the PCI bus order on purpose: CUDA's index 0 is the board on
    # bus 1B (the lowest), which NVML lists second. Powers of two tell which boards were read.
    {"uuid": "GPU-2c1e0000-0000-0000-0000-000000000002", "bus": "00000000:3d:00.0",
     "name": "NVIDIA H100 80GB HBM3", "watts": 200.0},
    {"uuid": "GPU-1a7f0000-0000-0000-0000-000000000001", "bus": "00000000:1b:00.0",
     "name": "NVIDIA H100 80GB HBM3", "watts": 100.0},
    {"uuid": "GPU-4d900000-0000-0000-0000-000000000004", "bus": "00000000:9a:00.0",
     "name": "NVIDIA H100 80GB HBM3", "watts": 400.0},
]
"""CUDA's order (PCI bus): 1a7f (100 W), 2c1e (200 W), 4d90 (400 W)."""

SOURCE = '''"""pynvml stand-in written by tests/nvml_standin.py: not NVIDIA's binding."""
import json
import time

BOARDS = json.loads(%(boards)r)
ORIGIN = %(origin)r
READS = {}
_open = 0


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    def __str__(self):
        return "Not Supported"


class _PciInfo:
    def __init__(self, bus):
        self.busId = bus.encode()  # bytes, as nvidia-ml-py before 11.515 gave it


def _check():
    if not _open:
        raise NVMLError("Uninitialized")


def _board(handle):
    _check()
    return BOARDS[handle]


def nvmlInit():
    global _open
    _open += 1


def nvmlShutdown():
    global _open
    _open -= 1


def nvmlDeviceGetCount():
    _check()
    return len(BOARDS)


def nvmlDeviceGetHandleByIndex(index):
    _check()
    if not 0 <= index < len(BOARDS):
        raise NVMLError("Invalid Argument")
    return index


def nvmlDeviceGetUUID(handle):
    return _board(handle)["uuid"]


def nvmlDeviceGetName(handle):
    return _board(handle)["name"]


def nvmlDeviceGetPciInfo(handle):
    return _PciInfo(_board(handle)["bus"])


def nvmlDeviceGetPowerUsage(handle):
    return int(_board(handle)["watts"] * 1000)  # mW


def nvmlDeviceGetTotalEnergyConsumption(handle):
    board = _board(handle)
    if not board.get("counter", True):
        raise NVMLError_NotSupported()
    READS[board["uuid"]] = READS.get(board["uuid"], 0) + 1
    return int((time.time() - ORIGIN) * board["watts"] * 1000)  # mJ, as the driver counts
'''


def write(folder: Path, boards: list[dict] | None = None) -> Path:
    """``folder/pynvml.py``, the stand-in over ``boards`` (default ``BOARDS``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "pynvml.py"
    path.write_text(SOURCE % {"boards": json.dumps(BOARDS if boards is None else boards),
                              "origin": time.time() - 1000.0}, encoding="utf-8")
    return path


def load(folder: Path) -> ModuleType:
    """The stand-in in ``folder``, imported as a module (not put in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location("pynvml", folder / "pynvml.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install(monkeypatch, folder: Path, boards: list[dict] | None = None) -> ModuleType:
    """Write the stand-in and make ``import pynvml`` give it for the rest of the test."""
    write(folder, boards)
    module = load(folder)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module
