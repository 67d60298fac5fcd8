"""Line formats of the logs older tools wrote, and how DLPerf turned each into one speed.

A parser turns a log into ``Print`` records, one per printed speed. Two methods then make a
run's figure from the prints in a window:

- ``dlperf``: what DLPerf's extract scripts printed: the mean of the printed rates in their
  window (times the node count for MXNet, whose printed speed is per node).
- ``exact``: samples over elapsed time in the window. From timestamps or printed seconds where
  the log has them; otherwise from the steps each print covers: a print of rate r over k steps
  of g samples took k*g/r seconds, so the window's throughput is the steps-weighted harmonic
  mean of the rates. That equals samples over wall time only if each printed rate was itself
  samples over wall time of its interval; the note in each run says where that fails.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Callable, Sequence


@dataclass
class Print:
    index: int
    """Step (iteration or batch) number at which the rate was printed (end of its interval)."""
    rate: float
    """Samples per second as printed."""
    steps: int | None = None
    """Steps the rate covers; None: infer from the previous print."""
    seconds: float | None = None
    """Wall seconds of the interval, where the log prints them."""
    timestamp: float | None = None
    """Epoch seconds when the line was printed, where the log has them."""
    loss: float | None = None


@dataclass(frozen=True)
class Format:
    name: str
    framework: str
    patterns: tuple[re.Pattern, ...]
    build: Callable[[re.Match], Print]
    dlperf_window: Callable[[list[Print]], list[Print]]
    dlperf_rule: str
    per_node_rate: bool = False
    """The printed rate covers one node's devices (DLPerf multiplies by the node count)."""
    exact_note: str = ""

    def parse(self, lines: Sequence[str]) -> list[Print]:
        prints = []
        for line in lines:
            for pat in self.patterns:
                m = pat.search(line)
                if m:
                    prints.append(self.build(m))
                    break
        fill_steps(prints)
        return prints

    def matches(self, line: str) -> bool:
        return any(p.search(line) for p in self.patterns)


def fill_steps(prints: list[Print]) -> None:
    """Steps covered by each print, from the gap to the previous print (the first takes the
    second's gap, as loggers print at a fixed interval)."""
    for i, p in enumerate(prints):
        if p.steps is None and i > 0 and p.index > prints[i - 1].index:
            p.steps = p.index - prints[i - 1].index
    if prints and prints[0].steps is None:
        prints[0].steps = prints[1].steps if len(prints) > 1 and prints[1].steps else (
            prints[0].index or 1)


def by_index(lo: int, hi: int) -> Callable[[list[Print]], list[Print]]:
    """Prints whose interval ends after step ``lo`` and at or before step ``hi``."""
    return lambda prints: [p for p in prints if lo < p.index <= hi]


def skip_then_take(skip: int, take: int) -> Callable[[list[Print]], list[Print]]:
    return lambda prints: prints[skip:skip + take]


def all_but_first(prints: list[Print]) -> list[Print]:
    return prints[1:]


NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf)"


def _f(text: str | None) -> float | None:
    return None if text is None else float(text)


MXNET_SPEEDOMETER = Format(
    "mxnet-speedometer", "mxnet",
    (re.compile(r"Epoch\[\d+\] Batch \[(\d+)-(\d+)\]\s+Speed: " + NUM + r" samples/sec"),
     re.compile(r"Iter\[\d+\] Batch \[(\d+)\]\s+Speed: " + NUM + r" samples/sec")),
    lambda m: (Print(int(m.group(2)), float(m.group(3)), int(m.group(2)) - int(m.group(1)))
               if m.re.groups == 3 else Print(int(m.group(1)), float(m.group(2)))),
    by_index(20, 120),
    "speedometer windows ending after batch 20 up to 120 (batches 21-120); mean of their "
    "speeds; times the node count",
    per_node_rate=True,
    exact_note="no timestamps: window time derived from each window's batches and speed",
)

MXNET_PARTIALFC = Format(
    "mxnet-partialfc", "mxnet",
    (re.compile(r"Iter:(\d+) Rank:" + NUM + r" it/sec Total:" + NUM + r" it/sec"),),
    lambda m: Print(int(m.group(1)), float(m.group(3))),
    by_index(20, 120),
    "prints at iterations 21-120; mean of Total (the rank's rate times the world size)",
    exact_note="no timestamps: window time derived from each print's iterations and Total, "
               "which is rank 0's rate times the world size (assumes ranks in lockstep)",
)

ONEFLOW_FACE = Format(
    "oneflow-face", "oneflow",
    (re.compile(r"train: iter (\d+), loss " + NUM + r", throughput: " + NUM),),
    lambda m: Print(int(m.group(1)), float(m.group(3)), 1, loss=_f(m.group(2))),
    skip_then_take(5, 100),
    "first 5 iteration lines skipped, the next 100 taken; mean of their throughput",
    exact_note="no timestamps: one line per iteration, window time derived from each rate",
)

PLSC = Format(
    "plsc", "paddle",
    (re.compile(r"Pass:\d+ batch:(\d+) lr:\S+ loss:" + NUM + r" qps:" + NUM),
     re.compile(r"step: (\d+),.*?throughput: " + NUM + r" imgs/sec"),
     re.compile(r"\[Iter: (\d+)/\d+\].*?loss: " + NUM + r".*?ips: " + NUM + r" images/sec")),
    lambda m: (Print(int(m.group(1)), float(m.group(3)), loss=_f(m.group(2)))
               if m.re.groups == 3 else Print(int(m.group(1)), float(m.group(2)))),
    by_index(50, 150),
    "prints at batches 51-150; mean of qps / throughput",
    exact_note="PLSC's qps counts compute time only, so the derived window time leaves out "
               "data loading: this is not wall-clock throughput",
)

ARCFACE_TORCH = Format(
    "arcface-torch", "pytorch",
    (re.compile(r"Speed " + NUM + r" samples/sec\s+Loss " + NUM + r".*?Global Step: (\d+)"),),
    lambda m: Print(int(m.group(3)), float(m.group(1)), loss=_f(m.group(2))),
    by_index(20, 120),
    "prints at global steps 21-120; mean of Speed (rank 0's rate times the world size)",
    exact_note="no timestamps: window time derived from each print's steps and Speed, which is "
               "rank 0's rate times the world size (assumes ranks in lockstep)",
)

TF_TIMEHISTORY = Format(
    "tf-timehistory", "tensorflow",
    (re.compile(r"TimeHistory: " + NUM + r" seconds, " + NUM +
                r" examples/second between steps (\d+) and (\d+)"),),
    lambda m: Print(int(m.group(4)), float(m.group(2)), int(m.group(4)) - int(m.group(3)),
                    seconds=float(m.group(1))),
    all_but_first,
    "every TimeHistory line but the first (which holds start-up); mean of examples/second",
    exact_note="exact: examples and seconds printed per interval",
)


def _dll(m: re.Match) -> Print:
    ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return Print(int(m.group(2)), float(m.group(4)), 1, timestamp=ts, loss=_f(m.group(3)))


DLLOGGER = Format(
    "dllogger", "ngc",
    (re.compile(r"DLL (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) - .*?Iteration: (\d+)\s+"
                r"train\.loss : " + NUM + r"\s+train\.total_ips : " + NUM),),
    _dll,
    by_index(20, 120),
    "iterations 21-120; mean of train.total_ips",
    exact_note="exact: from the line timestamps",
)

FORMATS: dict[str, Format] = {f.name: f for f in (
    MXNET_SPEEDOMETER, MXNET_PARTIALFC, ONEFLOW_FACE, PLSC, ARCFACE_TORCH, TF_TIMEHISTORY,
    DLLOGGER)}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown log format {name!r}; known: auto, {', '.join(FORMATS)}") from None


def detect(lines: Sequence[str]) -> tuple[Format, int]:
    """The format whose patterns match most lines, and how many matched."""
    counts = {name: sum(1 for line in lines if fmt.matches(line)) for name, fmt in FORMATS.items()}
    best = max(counts, key=counts.get)
    if counts[best] == 0:
        raise ValueError("no line matches any known log format")
    return FORMATS[best], counts[best]


@dataclass
class RunFigures:
    dlperf: float | None
    exact: float | None
    window: dict
    note: str
    loss_last: float | None


def figures(fmt: Format, prints: list[Print], samples_per_step: int, nodes: int) -> RunFigures:
    """Both methods' figures for one run's prints."""
    window = fmt.dlperf_window(prints)
    factor = nodes if fmt.per_node_rate else 1
    losses = [p.loss for p in prints if p.loss is not None]
    info = {"first_index": window[0].index if window else None,
            "last_index": window[-1].index if window else None, "prints": len(window)}
    if not window:
        return RunFigures(None, None, info, "no prints in the window", losses[-1] if losses else None)
    dlperf = factor * sum(p.rate for p in window) / len(window)
    note = fmt.exact_note
    if all(p.timestamp is not None for p in window) and len(window) > 1:
        # Elapsed from the first print in the window to the last covers every print after it.
        elapsed = window[-1].timestamp - window[0].timestamp
        steps = sum(p.steps or 1 for p in window[1:])
        exact = steps * samples_per_step / elapsed if elapsed > 0 else None
    elif all(p.seconds is not None for p in window):
        exact = factor * sum(p.rate * p.seconds for p in window) / sum(p.seconds for p in window)
    else:
        steps = [p.steps or 1 for p in window]
        exact = factor * sum(steps) / sum(k / p.rate for k, p in zip(steps, window) if p.rate > 0)
    return RunFigures(dlperf, exact, info, note, losses[-1] if losses else None)
