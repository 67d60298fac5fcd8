"""The GPU's power through a measured window, for the check's mean watts, and its samples per
joule where the runner recorded none.

The runner records each timed run's energy from its boards' energy counter (``run_energy``),
and the check takes it from there (``runs.summarise``). This sampler reads the power the driver
reports every ``interval_s``: through trainperf's one NVML reader (``trainperf.energy``: the
same board lookup, the same optional ``nvidia-ml-py``) where NVML opens, keeping the energy
counter beside each reading where the board has one, else through ``nvidia-smi``. A run's
window is known afterwards from its events (it ends when its ``end`` event is written, and
lasts ``window_s``), so energy is read from the samples that fall inside it: the energy
counter's difference where the driver keeps one, else the mean of the power readings times the
window. Where neither source exists the figure is "not measured".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from ..energy import NotMeasured, Nvml, run_entries

MIN_SAMPLES = 3
"""Fewer power readings than this inside a window give no figure."""


@dataclass(frozen=True)
class Energy:
    joules: float
    mean_w: float
    samples: int
    method: str


def gpu_device() -> str:
    """The GPU a one-device run uses, as ``CUDA_VISIBLE_DEVICES`` names it (its first entry:
    an index or a UUID, which NVML and ``nvidia-smi -i`` both take); ``0`` where unset."""
    entries = run_entries(os.environ.get("CUDA_VISIBLE_DEVICES"), 1)
    return entries[0] if entries else "0"


def source() -> str | None:
    """``nvml``, ``nvidia-smi`` or None: how power can be read here."""
    try:
        Nvml().close()
        return "nvml"
    except NotMeasured:  # not installed, or the driver library does not start
        pass
    return "nvidia-smi" if shutil.which("nvidia-smi") else None


class PowerSampler:
    """Start it before the runs it covers and stop it after; then ask for each window."""

    def __init__(self, interval_s: float = 0.05, device: str | None = None) -> None:
        self.interval_s = interval_s
        self.device = gpu_device() if device is None else device
        self.method = source()
        self.times: list[float] = []
        self.watts: list[float] = []
        self.energy_mj: list[float | None] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None
        self.error: str | None = None

    def __enter__(self) -> "PowerSampler":
        if self.method == "nvml":
            self._thread = threading.Thread(target=self._nvml_loop, daemon=True)
        elif self.method == "nvidia-smi":
            self._thread = threading.Thread(target=self._smi_loop, daemon=True)
        if self._thread:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _add(self, watts: float, energy_mj: float | None) -> None:
        self.times.append(time.time())
        self.watts.append(watts)
        self.energy_mj.append(energy_mj)

    def _nvml_loop(self) -> None:
        try:
            with Nvml() as nvml:
                (board,) = nvml.resolve([self.device], os.environ.get("CUDA_DEVICE_ORDER"))
                while not self._stop.is_set():
                    watts = nvml.power_w(board)
                    try:
                        counter: float | None = nvml.energy_mj(board)
                    except NotMeasured:
                        counter = None  # boards before Volta keep no counter
                    self._add(watts, counter)
                    self._stop.wait(self.interval_s)
        except NotMeasured as exc:  # recorded: the windows then say why
            self.error = f"NVML: {exc}"
        except Exception as exc:  # noqa: BLE001 - whatever else the binding raises, the same
            self.error = f"NVML: {exc}"

    def _smi_loop(self) -> None:
        ms = max(50, int(self.interval_s * 1000))
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", self.device, "--query-gpu=power.draw",
                 "--format=csv,noheader,nounits", f"--loop-ms={ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for line in self._proc.stdout:
                if self._stop.is_set():
                    break
                try:
                    self._add(float(line.strip()), None)
                except ValueError:
                    continue  # "[N/A]" on boards that do not report power
        except OSError as exc:
            self.error = f"nvidia-smi: {exc}"

    def window(self, t_end: float, seconds: float) -> Energy | None:
        """Energy through the window that ended at ``t_end`` (Unix time) and lasted
        ``seconds``; None where too few readings fall inside it."""
        return energy_in(self.times, self.watts, self.energy_mj, t_end - seconds, t_end,
                         self.method or "")


def energy_in(times: list[float], watts: list[float], energy_mj: list[float | None],
              t0: float, t1: float, method: str) -> Energy | None:
    lo, hi = bisect_left(times, t0), bisect_right(times, t1)
    inside = watts[lo:hi]
    if len(inside) < MIN_SAMPLES or t1 <= t0:
        return None
    mean_w = sum(inside) / len(inside)
    first, last = energy_mj[lo], energy_mj[hi - 1]
    if first is not None and last is not None and times[hi - 1] > times[lo] and last >= first:
        # The counter's rate between the first and last reading inside, over the whole window.
        rate_w = (last - first) / 1000.0 / (times[hi - 1] - times[lo])
        return Energy(rate_w * (t1 - t0), rate_w, len(inside), f"{method} energy counter")
    return Energy(mean_w * (t1 - t0), mean_w, len(inside), f"{method} power readings")
