"""What GPU boards draw, from NVML's energy counter: the one reader of NVML in trainperf.

The runner records each timed run's joules with it (``run_energy``), and the GPU check reads
power with it (``gpucheck.power``). NVML comes from the optional ``nvidia-ml-py`` package
(``import pynvml``; ``pip install 'trainperf[energy]'``), imported only when a reader opens.
Without it, without a driver, or on a board whose driver keeps no energy counter
(``nvmlDeviceGetTotalEnergyConsumption``, from Volta on), there is no figure, and
``NotMeasured`` says why in one line.

Which board a CUDA device is
----------------------------
CUDA numbers the devices a process sees after ``CUDA_VISIBLE_DEVICES``; NVML lists every board
the machine lets it open, in an order of its own that its documentation does not promise. An
entry of ``CUDA_VISIBLE_DEVICES`` is read here as CUDA reads it (``board_for``):

- ``GPU-<uuid>``, or a prefix of one that only one board's UUID starts with (CUDA accepts
  those): the board with that UUID, exactly.
- An index: CUDA's device order. Under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` that is the boards in
  ascending PCI bus id, which NVML reports for each, so the index is exact. CUDA's default
  order (``FASTEST_FIRST``) puts faster boards first; among boards of one model it is the PCI
  bus order (what CUDA does; its documentation does not promise it), so an index is taken in
  PCI bus order where every board has the same name, and refused where names differ, since no
  reading of that order is safe there.
- ``MIG-<uuid>``: refused. A MIG instance keeps no energy counter of its own, and its board's
  counts every instance's work.
- Unset: every board, CUDA device ``i`` being the ``i``-th in the order above.

This assumes NVML and CUDA see the same boards (a container or a job's cgroup hides the same
device files from both). A run's boards are named by UUID in its record, so a reader can check.

The counter
-----------
Millijoules the board drew since its driver was loaded. ``CounterSampler`` reads it for a set of
boards every ``SAMPLE_S`` on a thread (a read costs microseconds) and stamps each reading with
the Unix time. A window's energy is the counter's rise between the window's edges, each edge
placed linearly between the two readings around it (``counter_between``). The readings bound
what that can be off by (``error_j``: the counter never falls, so the rise lies between what
the readings just inside and just outside the edges allow). Beyond that bound, the driver
updates the counter at its own rate: a counter that lags by ``u`` seconds moves both edges by
``u``, which costs ``u`` x the difference of the power at the two edges.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import stats

SAMPLE_S = 0.05
"""Seconds between two readings of the counter: each edge of a window falls between two
readings, so the bound on a window's energy is about 2 x this x the boards' power."""
METHOD = f"NVML energy counter, read every {SAMPLE_S:g} s, linear between the readings " \
         "around each edge of the window"
J_PER_WH = 3600.0
MJ_PER_J = 1000.0


class NotMeasured(Exception):
    """No energy figure; the message says why, in one line."""


@dataclass(frozen=True)
class Board:
    """A GPU board as NVML lists it."""

    index: int
    """NVML's index of the board (its own order: not CUDA's)."""
    uuid: str
    """``GPU-...``: what names the board in a record."""
    pci_bus_id: str
    """``00000000:1B:00.0``: CUDA's ``PCI_BUS_ID`` order sorts by it."""
    name: str


def visible_entries(value: str | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as a list of its entries; None where it is unset (every board
    is visible), ``[]`` where it is empty (none is)."""
    if value is None:
        return None
    return [e.strip() for e in value.split(",") if e.strip()]


def run_entries(visible: str | None, devices: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries of the boards that a run of ``devices`` ranks on
    this node drives: local rank ``r`` takes the ``r``-th visible device (``visible``: the
    variable the run inherits; every backend picks its GPU so, ``backends.base.rank_gpu``),
    so the first ``devices`` entries, or every entry where fewer are visible (torch's ranks
    then share them); devices ``0`` to ``devices - 1`` where the variable is unset."""
    entries = visible_entries(visible)
    if entries is None:
        return [str(i) for i in range(devices)]
    return entries[:devices]


def board_for(entry: str, boards: Sequence[Board], order: str | None) -> Board:
    """The board a ``CUDA_VISIBLE_DEVICES`` entry names, as CUDA reads it under the device
    order ``order`` (``CUDA_DEVICE_ORDER``; None: CUDA's default, ``FASTEST_FIRST``).
    NotMeasured where the entry names no board, or none that can be told for sure (the
    module's docstring has the rules)."""
    if entry.startswith("MIG-"):
        raise NotMeasured(f"{entry} is a MIG instance, which keeps no energy counter of its "
                          "own (its board's counts every instance's work)")
    if entry.startswith("GPU-"):
        found = [b for b in boards if b.uuid.startswith(entry)]
        if len(found) != 1:
            which = "no board's UUID starts with it" if not found else "several boards' do"
            raise NotMeasured(f"CUDA_VISIBLE_DEVICES names {entry}, and {which}")
        return found[0]
    if not entry.isdigit():
        raise NotMeasured(f"CUDA_VISIBLE_DEVICES entry {entry!r} is neither a device index "
                          "nor a GPU UUID")
    index = int(entry)
    if index >= len(boards):
        raise NotMeasured(f"CUDA device {index} is not among the {len(boards)} board(s) NVML "
                          "lists")
    if order != "PCI_BUS_ID" and len({b.name for b in boards}) > 1:
        raise NotMeasured("CUDA_VISIBLE_DEVICES names devices by index, and CUDA's default "
                          "order (FASTEST_FIRST) over boards of different models does not say "
                          "which board an index is: set CUDA_DEVICE_ORDER=PCI_BUS_ID or name "
                          "the GPUs by UUID")
    return sorted(boards, key=lambda b: b.pci_bus_id)[index]


def _text(value: Any) -> str:
    # nvidia-ml-py returns str; its releases before 11.515 returned bytes.
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An open NVML session: the boards it lists and their counters (``with Nvml() as
    nvml``). NotMeasured where NVML is not installed or does not start."""

    def __init__(self) -> None:
        try:
            import pynvml  # optional (nvidia-ml-py): imported only where energy is read
        except ImportError:
            raise NotMeasured("NVML is not installed (pip install nvidia-ml-py)") from None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # noqa: BLE001 - no library, no driver, ...: no figure
            raise NotMeasured(f"NVML did not start ({str(exc) or type(exc).__name__})") from None
        self.lib = pynvml
        self._boards: list[Board] | None = None
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> "Nvml":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.lib.nvmlShutdown()
        except Exception:  # noqa: BLE001 - a session the driver has dropped needs no closing
            pass

    def boards(self) -> list[Board]:
        """Every board NVML lists, in its order."""
        if self._boards is None:
            lib, found = self.lib, []
            try:
                for i in range(lib.nvmlDeviceGetCount()):
                    handle = lib.nvmlDeviceGetHandleByIndex(i)
                    board = Board(i, _text(lib.nvmlDeviceGetUUID(handle)),
                                  _text(lib.nvmlDeviceGetPciInfo(handle).busId).upper(),
                                  _text(lib.nvmlDeviceGetName(handle)))
                    self._handles[board.uuid] = handle
                    found.append(board)
            except lib.NVMLError as exc:
                raise NotMeasured(f"NVML could not list the boards ({exc})") from None
            self._boards = found
        return self._boards

    def resolve(self, entries: Sequence[str], order: str | None) -> list[Board]:
        """The boards ``CUDA_VISIBLE_DEVICES`` entries name (``board_for``), each once."""
        if not entries:
            raise NotMeasured("no GPU is visible to the run (CUDA_VISIBLE_DEVICES is empty)")
        boards = self.boards()
        picked: list[Board] = []
        for entry in entries:
            board = board_for(entry, boards, order)
            if board not in picked:  # ranks sharing a board: its energy is counted once
                picked.append(board)
        return picked

    def energy_mj(self, board: Board) -> float:
        """The board's energy counter: millijoules since its driver was loaded."""
        try:
            return float(self.lib.nvmlDeviceGetTotalEnergyConsumption(self._handle(board)))
        except self.lib.NVMLError as exc:
            raise NotMeasured(self._why(exc, board, "energy counter")) from None

    def power_w(self, board: Board) -> float:
        """The board's power now, as the driver last read it (watts)."""
        try:
            return self.lib.nvmlDeviceGetPowerUsage(self._handle(board)) / 1000.0  # mW
        except self.lib.NVMLError as exc:
            raise NotMeasured(self._why(exc, board, "power reading")) from None

    def _handle(self, board: Board) -> Any:
        if board.uuid not in self._handles:
            self.boards()
        return self._handles[board.uuid]

    def _why(self, exc: Exception, board: Board, what: str) -> str:
        if isinstance(exc, getattr(self.lib, "NVMLError_NotSupported", ())):
            return f"the driver keeps no {what} for {board.name} (NVML: {exc})"
        return f"NVML could not read the {what} of {board.name} ({exc})"


def counter_between(times_s: Sequence[float], counter_mj: Sequence[float], t0: float,
                    t1: float) -> tuple[float, float]:
    """(joules, error_j) drawn from Unix time ``t0`` to ``t1``, from readings of an energy
    counter (``counter_mj``, millijoules) taken at ``times_s`` (ascending). Each edge is placed
    linearly between the two readings around it; ``error_j`` is the farthest the true rise can
    lie from that estimate given only the readings and that the counter never falls (between
    the readings just inside both edges and those just outside them). NotMeasured where the
    readings do not reach past both edges, or the counter fell (its driver was reloaded)."""
    if not t1 > t0:
        raise NotMeasured("the window has no length")
    if len(times_s) < 2 or times_s[0] > t0 or times_s[-1] < t1:
        raise NotMeasured("the counter's readings do not cover the window")
    if any(b < a for a, b in zip(counter_mj, counter_mj[1:])):
        raise NotMeasured("the energy counter went backwards during the run (its driver was "
                          "reloaded?)")

    def at(t: float) -> tuple[float, float, float]:
        """(estimate, the reading at or before ``t``, the one at or after it)."""
        before = bisect_right(times_s, t) - 1
        after = bisect_left(times_s, t)
        low, high = counter_mj[before], counter_mj[after]
        if times_s[before] == t:
            return low, low, low
        share = (t - times_s[before]) / (times_s[after] - times_s[before])
        return low + share * (high - low), low, high

    start, start_low, start_high = at(t0)
    end, end_low, end_high = at(t1)
    joules = (end - start) / MJ_PER_J
    least = max(end_low - start_high, 0.0) / MJ_PER_J
    most = (end_high - start_low) / MJ_PER_J
    return joules, max(joules - least, most - joules)


class CounterSampler:
    """The energy counters of ``boards``, summed, read every ``interval_s`` on a thread from
    ``start`` to ``stop``; ``between`` gives a window's energy from them. ``clock`` stamps each
    reading (Unix time, the clock a worker's events are stamped with)."""

    def __init__(self, nvml: Nvml, boards: Sequence[Board], interval_s: float = SAMPLE_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.nvml, self.boards = nvml, list(boards)
        self.interval_s, self.clock = interval_s, clock
        self.times_s: list[float] = []
        self.total_mj: list[float] = []
        self.error: str | None = None
        """Why the readings stopped before ``stop`` (a board that stopped answering)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "CounterSampler":
        """The first reading now, so that a board without a counter raises NotMeasured here,
        then the rest on a thread."""
        self._read()
        self._thread = threading.Thread(target=self._loop, name="energy-counter", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop reading; a last reading now, so that the readings reach past a window that
        ended before this call."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self.error is None:
            try:
                self._read()
            except NotMeasured as exc:
                self.error = str(exc)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._read()
            except NotMeasured as exc:
                self.error = str(exc)
                return

    def _read(self) -> None:
        before = self.clock()
        total = sum(self.nvml.energy_mj(b) for b in self.boards)
        after = self.clock()
        with self._lock:
            # Stamped halfway through the reads: with several boards they take a moment.
            self.times_s.append((before + after) / 2)
            self.total_mj.append(total)

    def between(self, t0: float, t1: float) -> tuple[float, float]:
        """(joules, error_j) of the boards from ``t0`` to ``t1`` (``counter_between``)."""
        with self._lock:
            times, totals = list(self.times_s), list(self.total_mj)
        try:
            return counter_between(times, totals, t0, t1)
        except NotMeasured as exc:
            if self.error is not None:
                raise NotMeasured(f"{exc}: {self.error}") from None
            raise


def wh_per_million(samples_per_j: float | None) -> float | None:
    """Watt-hours per million samples, from samples per joule."""
    return 1e6 / samples_per_j / J_PER_WH if samples_per_j else None


def case_energy(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A case's energy over the runs its samples/s counts (ended ok, no flags): the median
    samples per joule and the Wh per million samples it makes; where none has a figure, why
    (the runs' first note)."""
    counted = [r["samples_per_j"] for r in runs
               if r["status"] == "ok" and not r.get("flags") and r.get("samples_per_j")]
    per_j = stats.median(counted)
    note = None if per_j else next((r["energy_note"] for r in runs if r.get("energy_note")),
                                   None)
    return {"median_samples_per_j": per_j, "wh_per_million_samples": wh_per_million(per_j),
            "energy_note": note}
