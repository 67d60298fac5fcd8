"""Line formats of the logs older tools wrote, and the two figures trainperf makes of each run.

A format's parser turns a log into ``Print`` records, one per printed speed, in file order. Two
methods then make a run's figure:

- ``dlperf``: the figure DLPerf's extract script for that format printed, redone step for step:
  the same line filter, the same positional slice of the lines it kept (DLPerf windows by where
  a line sits among the lines it counted, not by the step the line names), the same rounding.
  Each format's comment block names the script, the commit and the lines it follows; citations
  are to github.com/Oneflow-Inc/DLPerf at c89430b unless another commit is named. Where the log
  ends before the script's window is complete and the script would print 0 or nan, there is no
  dlperf figure, and the run's note says why.
- ``exact`` (exact.py): samples over elapsed wall time across the same window. The window opens at
  the print just before its first print (the end of the previous interval) and closes at its last
  print, so it holds the steps of every window print; with no print before it, it opens at its
  first print and holds the steps of the others. Elapsed time comes from, in this order: the line
  timestamps, where every print involved has one with sub-second resolution (the wall-clock span,
  logging included, as DLPerf's ``*_time.py`` scripts compute it); the seconds printed for each
  interval; else the printed rates, a print of rate r over k steps of g samples having taken
  k*g/r seconds (a steps-weighted harmonic mean of the rates, which is wall-clock throughput only
  where each printed rate was itself samples over wall time). The run's note says which was used
  and what the format's printed rate leaves out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .exact import exact_throughput
from .prints import Print, fill_steps, line_timestamp


@dataclass(frozen=True)
class RunShape:
    """What the folder layout says about a run."""
    nodes: int
    samples_per_step: int
    """Global batch: nodes x devices per node x batch per device."""


@dataclass
class DlperfResult:
    figure: float | None
    """What the script printed; None where it would print 0 or nan, or has no figure at all."""
    window: list[Print]
    """The prints the figure rests on, in file order; ``exact`` measures the same window."""
    note: str = ""
    """One line: why there is no figure, or that the window is short."""


@dataclass(frozen=True)
class DlperfRule:
    text: str
    """The rule in words, recorded in each ingested document's ``source``."""
    compute: Callable[[list[Print], RunShape], DlperfResult]


@dataclass(frozen=True)
class LineKind:
    pattern: re.Pattern
    build: Callable[[re.Match], Print]
    """Makes the print from a match; ``match.string`` is the whole line, for line filters."""


@dataclass(frozen=True)
class Format:
    name: str
    framework: str
    lines: tuple[LineKind, ...]
    dlperf: DlperfRule
    per_node_rate: bool = False
    """The printed rate covers one node's devices (DLPerf multiplies by the node count)."""
    rate_caveat: str = ""
    """What the printed rate leaves out; kept in every run's note."""

    def parse(self, lines: Sequence[str]) -> list[Print]:
        prints = []
        for line in lines:
            for kind in self.lines:
                m = kind.pattern.search(line)
                if m:
                    p = kind.build(m)
                    if p.timestamp is None:
                        p.timestamp = line_timestamp(line[:m.start()])
                    prints.append(p)
                    break
        fill_steps(prints)
        return prints

    def matches(self, line: str) -> bool:
        return any(kind.pattern.search(line) for kind in self.lines)


# --- DLPerf's arithmetic ----------------------------------------------------------------------

def dlperf_lines(prints: list[Print]) -> list[Print]:
    """The prints the format's DLPerf script counts, in file order."""
    return [p for p in prints if p.counted_by_dlperf]


def numpy_mean_2dp(values: Sequence[float]) -> float | None:
    """``round(np.mean(values), 2)`` as the scripts compute it: numpy's pairwise sum and numpy's
    rounding (which differs from Python's ``round`` on some halves, 4072.505 for one). None
    where numpy would give nan (no values)."""
    if not values:
        return None
    return float(round(np.mean(values), 2))


def short_window_note(got: int, want: int, what: str) -> str:
    """One line for a positional window that the log did not fill."""
    if got >= want:
        return ""
    if got == 0:
        return (f"log too short for DLPerf's window (no {what} in it; the script would print "
                "nan): no dlperf figure")
    return (f"log ends before DLPerf's window is complete ({got} of {want} {what}): dlperf is "
            "the mean of those, as the script's slice would give")


# MXNet InsightFace ArcFace, MxNet/InsightFace/ArcFace/extract_mxnet_logs.py:
#   17-18  warmup_batches 20, train_batches 120
#   61-67  lines containing "INFO:root:Epoch[0] Batch" or "INFO:root:Iter[0] Batch"; the first
#          `Speed: (\d+\.\d+) samples/sec`, rounded to 1 decimal, times the node count
#   69     round(np.mean(speeds[20//20 : 120//20]), 2): the 2nd to 6th such line in file order;
#          Speedometer prints every 20 batches, so batches 21-120 from its second print on.
# Line 46 reads the node count as the case folder's first character, which would be wrong from
# 10 nodes up; trainperf uses the folder's real count.
MXNET_WARMUP, MXNET_TRAIN, MXNET_PRINT_EVERY = 20, 120, 20
MXNET_SCRIPT_SPEED = re.compile(r"Speed: (\d+\.\d+) samples/sec")


def _speedometer_line(m: re.Match) -> Print:
    line, lo, hi = m.string, m.group(1), int(m.group(2))
    in_script = (("INFO:root:Epoch[0] Batch" in line or "INFO:root:Iter[0] Batch" in line)
                 and MXNET_SCRIPT_SPEED.search(line) is not None)
    return Print(hi, float(m.group(3)), hi - int(lo) if lo is not None else None,
                 counted_by_dlperf=in_script)


def _speedometer_rule(prints: list[Print], run: RunShape) -> DlperfResult:
    first, last = MXNET_WARMUP // MXNET_PRINT_EVERY, MXNET_TRAIN // MXNET_PRINT_EVERY
    window = dlperf_lines(prints)[first:last]
    speeds = [round(p.rate, 1) * run.nodes for p in window]
    return DlperfResult(numpy_mean_2dp(speeds), window,
                        short_window_note(len(window), last - first, "epoch-0 speedometer prints"))


NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|nan|inf)"


def _f(text: str | None) -> float | None:
    return None if text is None else float(text)


MXNET_SPEEDOMETER = Format(
    "mxnet-speedometer", "mxnet",
    (LineKind(re.compile(r"(?:Epoch|Iter)\[\d+\] Batch \[(?:(\d+)-)?(\d+)\]\s+Speed: " + NUM +
                         r" samples/sec"), _speedometer_line),),
    DlperfRule("MxNet/InsightFace/ArcFace/extract_mxnet_logs.py: epoch-0 speedometer lines in "
               "file order, each speed rounded to 1 decimal and times the node count; mean of "
               "the 2nd to 6th (batches 21-120), rounded to 2", _speedometer_rule),
    per_node_rate=True,
    rate_caveat="MXNet's Speed is one node's rate: dlperf, and exact where derived from it, "
                "multiply it by the node count",
)


# MXNet Partial FC, MxNet/InsightFace/PartailFC/extract_mxnet_logs.py:
#   17-18  warmup_batches 20 (train_batches is not used)
#   61-66  lines containing "Rank:" and "Total:"; `Total:(\d+\.\d+) it/sec` rounded to 1 decimal
#   68     round(np.mean(speeds[20 - 1:]), 2): the 20th such line to the end of the log. DLPerf
#          set config.frequent = 1 (the folder's README), so that is iteration 20 onwards.
PFC_WARMUP = 20
PFC_SCRIPT_TOTAL = re.compile(r"Total:(\d+\.\d+) it/sec")


def _partialfc_line(m: re.Match) -> Print:
    line = m.string
    in_script = "Rank:" in line and "Total:" in line and PFC_SCRIPT_TOTAL.search(line) is not None
    return Print(int(m.group(1)), float(m.group(3)), counted_by_dlperf=in_script)


def _partialfc_rule(prints: list[Print], run: RunShape) -> DlperfResult:
    window = dlperf_lines(prints)[PFC_WARMUP - 1:]
    note = "" if window else (f"log too short for DLPerf's window (fewer than {PFC_WARMUP} "
                              "Total prints; the script would print nan): no dlperf figure")
    return DlperfResult(numpy_mean_2dp([round(p.rate, 1) for p in window]), window, note)


MXNET_PARTIALFC = Format(
    "mxnet-partialfc", "mxnet",
    (LineKind(re.compile(r"Iter:(\d+) Rank:" + NUM + r" it/sec Total:" + NUM + r" it/sec"),
              _partialfc_line),),
    DlperfRule("MxNet/InsightFace/PartailFC/extract_mxnet_logs.py: lines with Rank: and Total: "
               "in file order, Total rounded to 1 decimal; mean from the 20th to the end of the "
               "log, rounded to 2", _partialfc_rule),
    rate_caveat="the printed Total is rank 0's rate times the world size: dlperf, and exact "
                "where derived from it, assume all ranks ran in lockstep",
)


# OneFlow InsightFace, OneFlow/Recognition/insightface/extract_oneflow_logs_time.py (it averages
# the printed throughput despite its name):
#   18-19  warmup_batches 20, train_batches 120
#   57     the figure stays 0 unless the loop below reaches its end
#   66-80  "train: iter N" lines with N > 5 are counted from 1; counted lines 20 to 120 (101
#          lines) keep their throughput; at counted line 120, round(np.mean(...), 2)
OF_WARMUP, OF_TRAIN, OF_SKIPPED_ITERS = 20, 120, 5


def _oneflow_line(m: re.Match) -> Print:
    index = int(m.group(1))
    return Print(index, float(m.group(3)), 1, loss=_f(m.group(2)),
                 counted_by_dlperf=index > OF_SKIPPED_ITERS)


def _oneflow_rule(prints: list[Print], run: RunShape) -> DlperfResult:
    lines = dlperf_lines(prints)
    window = lines[OF_WARMUP - 1:OF_TRAIN]
    if len(lines) < OF_TRAIN:
        return DlperfResult(None, window, f"log ends before DLPerf's window is complete "
                            f"({len(lines)} of {OF_TRAIN} iteration lines after iteration "
                            f"{OF_SKIPPED_ITERS}; the script prints 0): no dlperf figure")
    return DlperfResult(numpy_mean_2dp([p.rate for p in window]), window)


ONEFLOW_FACE = Format(
    "oneflow-face", "oneflow",
    (LineKind(re.compile(r"train: iter (\d+), loss " + NUM + r", throughput: " + NUM),
              _oneflow_line),),
    DlperfRule("OneFlow/Recognition/insightface/extract_oneflow_logs_time.py: iteration lines "
               "after iteration 5 counted from 1; mean throughput of counted lines 20 to 120, "
               "rounded to 2; none if the log has fewer than 120", _oneflow_rule),
)


# PaddlePaddle PLSC, PaddlePaddle/PLSC/extract_paddle_logs.py at commit 7e236cf:
#   17-18  warmup_batches 50, train_batches 150
#   62-67  lines containing "Pass:0 batch:", their ` qps:([0-9]+\.[0-9]+)`
#   70     round(np.mean(qps[50//10*nodes : 150//10*nodes]), 2). PLSC prints at batch 0, 10,
#          20, ..., so on one node that is the ten prints batch:50 to batch:140; on N nodes
#          the slice is N times as long.
# Line 43 reads the node count as the case folder's first character (see MXNet above).
# PLSC's newer lines ("step: N, ... throughput", "[Iter: N/M] ... ips") are not read by that
# script: they get no dlperf figure; ``exact`` then covers the prints at steps 50-149.
PLSC_WARMUP, PLSC_TRAIN, PLSC_PRINT_EVERY = 50, 150, 10
PLSC_SCRIPT_QPS = re.compile(r" qps:([0-9]+\.[0-9]+)")


def _plsc_pass_line(m: re.Match) -> Print:
    line = m.string
    in_script = "Pass:0 batch:" in line and PLSC_SCRIPT_QPS.search(line) is not None
    return Print(int(m.group(1)), float(m.group(3)), loss=_f(m.group(2)),
                 counted_by_dlperf=in_script)


def _plsc_newer_line(m: re.Match) -> Print:
    loss = _f(m.group(2)) if m.re.groups == 3 else None
    return Print(int(m.group(1)), float(m.group(m.re.groups)), loss=loss)


def _plsc_rule(prints: list[Print], run: RunShape) -> DlperfResult:
    lines = dlperf_lines(prints)
    if not lines:
        window = [p for p in prints if PLSC_WARMUP <= p.index < PLSC_TRAIN]
        return DlperfResult(None, window, "PLSC's newer log lines: DLPerf's script reads only "
                            "'Pass:0 batch:' lines, so there is no dlperf figure")
    lo = PLSC_WARMUP // PLSC_PRINT_EVERY * run.nodes
    hi = PLSC_TRAIN // PLSC_PRINT_EVERY * run.nodes
    window = lines[lo:hi]
    return DlperfResult(numpy_mean_2dp([p.rate for p in window]), window,
                        short_window_note(len(window), hi - lo, "'Pass:0 batch:' prints"))


PLSC = Format(
    "plsc", "paddle",
    (LineKind(re.compile(r"Pass:\d+ batch:(\d+) lr:\S+ loss:" + NUM + r" qps:" + NUM),
              _plsc_pass_line),
     LineKind(re.compile(r"step: (\d+),.*?throughput: " + NUM + r" imgs/sec"), _plsc_newer_line),
     LineKind(re.compile(r"\[Iter: (\d+)/\d+\].*?loss: " + NUM + r".*?ips: " + NUM +
                         r" images/sec"), _plsc_newer_line)),
    DlperfRule("PaddlePaddle/PLSC/extract_paddle_logs.py (7e236cf): 'Pass:0 batch:' lines in "
               "file order; mean qps of lines 50//10*nodes to 150//10*nodes (batches 50-140 on "
               "one node), rounded to 2; newer PLSC lines get none", _plsc_rule),
    rate_caveat="PLSC's qps counts compute time only, leaving out data loading: dlperf, and "
                "exact where derived from it, are not wall-clock throughput",
)


# insightface's arcface_torch: DLPerf never measured it, so no DLPerf script exists. Its dlperf
# figure is by analogy with the MXNet rule above: the mean of the printed Speed over the prints
# after global step 20 up to step 120, rounded to 2 (no per-print rounding, no node factor: the
# printed Speed is already rank 0's rate times the world size).
ARCFACE_WARMUP, ARCFACE_TRAIN = 20, 120


def _arcface_line(m: re.Match) -> Print:
    return Print(int(m.group(3)), float(m.group(1)), loss=_f(m.group(2)))


def _arcface_rule(prints: list[Print], run: RunShape) -> DlperfResult:
    window = [p for p in prints if ARCFACE_WARMUP < p.index <= ARCFACE_TRAIN]
    note = ""
    if not window:
        note = (f"no prints after step {ARCFACE_WARMUP} up to step {ARCFACE_TRAIN}: "
                "no dlperf figure")
    elif prints[-1].index < ARCFACE_TRAIN:
        note = (f"log ends at step {window[-1].index}, before step {ARCFACE_TRAIN}: dlperf is "
                "the mean of the prints it has")
    return DlperfResult(numpy_mean_2dp([p.rate for p in window]), window, note)


ARCFACE_TORCH = Format(
    "arcface-torch", "pytorch",
    (LineKind(re.compile(r"Speed " + NUM + r" samples/sec\s+Loss " + NUM +
                         r".*?Global Step: (\d+)"), _arcface_line),),
    DlperfRule("no DLPerf script exists for arcface_torch; by analogy with MXNet's: mean Speed of "
               "the prints after global step 20 up to step 120, rounded to 2", _arcface_rule),
    rate_caveat="the printed Speed is rank 0's rate times the world size: dlperf, and exact "
                "where derived from it, assume all ranks ran in lockstep",
)


# TensorFlow ResNet50, TensorFlow/resnet50v1.5/extract_tensorflow_logs.py (the published table
# is this script's output: TensorFlow/resnet50v1.5/README.md, lines 229-233):
#   17-18  warmup_batches 100, train_batches 600
#   60-65  every line containing "TimeHistory"; its `\, (\d+.\d+) examples/second `
#   68-70  round(np.mean(rates[1 : 600 // 100]), 2): the 2nd to 6th such line in file order;
#          TimeHistory prints every 100 steps, so steps 101-600.
# Its companion extract_tensorflow_logs_time.py (lines 59-83) instead takes the time between
# the timestamps of the 1st and 6th lines for 500 steps: what ``exact`` does when the log has
# timestamps.
TF_WARMUP, TF_TRAIN, TF_PRINT_EVERY = 100, 600, 100
TF_SCRIPT_RATE = re.compile(r"\, (\d+.\d+) examples/second ")


def _timehistory_line(m: re.Match) -> Print:
    first, last = int(m.group(3)), int(m.group(4))
    in_script = "TimeHistory" in m.string and TF_SCRIPT_RATE.search(m.string) is not None
    return Print(last, float(m.group(2)), last - first, seconds=float(m.group(1)),
                 counted_by_dlperf=in_script)


def _timehistory_rule(prints: list[Print], run: RunShape) -> DlperfResult:
    first = 1 if TF_WARMUP <= TF_PRINT_EVERY else TF_WARMUP // TF_PRINT_EVERY
    last = TF_TRAIN // TF_PRINT_EVERY
    window = dlperf_lines(prints)[first:last]
    return DlperfResult(numpy_mean_2dp([p.rate for p in window]), window,
                        short_window_note(len(window), last - first, "TimeHistory prints"))


TF_TIMEHISTORY = Format(
    "tf-timehistory", "tensorflow",
    (LineKind(re.compile(r"TimeHistory: " + NUM + r" seconds, " + NUM +
                         r" examples/second between steps (\d+) and (\d+)"), _timehistory_line),),
    DlperfRule("TensorFlow/resnet50v1.5/extract_tensorflow_logs.py: TimeHistory lines in file "
               "order; mean examples/second of the 2nd to 6th (steps 101-600), rounded to 2",
               _timehistory_rule),
)


# NGC PyTorch ResNet50 (DLLogger lines),
# NVIDIADeepLearningExamples/PyTorch/resnet50v1.5/extract_pytorch_logs_time.py:
#   18-19  warmup_batches 20, train_batches 120
#   50     global batch = nodes x devices per node x batch per device
#   57     the figure stays 0 unless the loop below reaches counted line 120
#   59     the line's "%Y-%m-%d %H:%M:%S.%f" timestamp
#   65-83  "Iteration: N" lines with N > 5 are counted from 1; the figure is
#          round(global batch / ((time of counted line 120 - time of counted line 20) / 100), 2)
#          (100 = train_batches - warmup_batches): timestamps, not the printed total_ips.
# Lines 44-48 read the node and device counts by position in the case folder's name, which
# fails from 10 nodes up; trainperf uses the folder's real counts.
DLL_WARMUP, DLL_TRAIN, DLL_SKIPPED_ITERS = 20, 120, 5


def _dllogger_line(m: re.Match) -> Print:
    index, timestamp = int(m.group(2)), line_timestamp(m.group(1))
    return Print(index, float(m.group(4)), 1, timestamp=timestamp, loss=_f(m.group(3)),
                 counted_by_dlperf=index > DLL_SKIPPED_ITERS and timestamp is not None)


def _dllogger_rule(prints: list[Print], run: RunShape) -> DlperfResult:
    lines = dlperf_lines(prints)
    window = lines[DLL_WARMUP:DLL_TRAIN]  # counted line 20 opens the span, 21-120 fill it
    if len(lines) < DLL_TRAIN:
        return DlperfResult(None, window, f"log ends before DLPerf's window is complete "
                            f"({len(lines)} of {DLL_TRAIN} iteration lines after iteration "
                            f"{DLL_SKIPPED_ITERS}; the script prints 0): no dlperf figure")
    span = (lines[DLL_TRAIN - 1].timestamp - lines[DLL_WARMUP - 1].timestamp).total_seconds()
    if span <= 0:
        return DlperfResult(None, window, "timestamps of counted lines 20 and 120 give no "
                            "positive span: no dlperf figure")
    figure = round(float(run.samples_per_step) / (span / (DLL_TRAIN - DLL_WARMUP)), 2)
    return DlperfResult(figure, window)


DLLOGGER = Format(
    "dllogger", "ngc",
    (LineKind(re.compile(r"DLL (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) - .*?Iteration: (\d+)\s+"
                         r"train\.loss : " + NUM + r"\s+train\.total_ips : " + NUM),
              _dllogger_line),),
    DlperfRule("NVIDIADeepLearningExamples/PyTorch/resnet50v1.5/extract_pytorch_logs_time.py: "
               "iteration lines after iteration 5 counted from 1; global batch x 100 / (time of "
               "counted line 120 - time of counted line 20), rounded to 2", _dllogger_rule),
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


# --- Both figures ------------------------------------------------------------------------------

@dataclass
class RunFigures:
    dlperf: float | None
    exact: float | None
    window: dict
    note: str
    """One line each: the dlperf window's shortfall (if any), how exact was computed, and the
    format's caveat about its printed rate (if any)."""
    loss_last: float | None
    errors: dict[str, str] = field(default_factory=dict)
    """Per method, why it has no figure."""


def print_before(prints: list[Print], window: list[Print]) -> Print | None:
    """The print just before the window's first print in file order (None: none precedes)."""
    if not window:
        return None
    position = next(i for i, p in enumerate(prints) if p is window[0])
    return prints[position - 1] if position > 0 else None


def figures(fmt: Format, prints: list[Print], samples_per_step: int, nodes: int) -> RunFigures:
    """Both methods' figures for one run's prints (``samples_per_step`` is the global batch)."""
    dl = fmt.dlperf.compute(prints, RunShape(nodes, samples_per_step))
    before = print_before(prints, dl.window)
    exact = exact_throughput(dl.window, before, samples_per_step,
                             nodes if fmt.per_node_rate else 1)
    window = {"first_index": dl.window[0].index if dl.window else None,
              "last_index": dl.window[-1].index if dl.window else None,
              "prints": len(dl.window),
              "previous_index": before.index if before is not None else None}
    note = "\n".join(line for line in (dl.note, exact.how, fmt.rate_caveat) if line)
    errors = {}
    if dl.figure is None:
        errors["dlperf"] = dl.note or "no dlperf figure"
    if exact.value is None:
        errors["exact"] = exact.how
    losses = [p.loss for p in prints if p.loss is not None]
    return RunFigures(dl.figure, exact.value, window, note, losses[-1] if losses else None, errors)
