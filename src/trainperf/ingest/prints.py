"""One printed speed of an external log, and the time its line was written."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime


@dataclass
class Print:
    index: int
    """Step (iteration or batch) number at which the rate was printed (end of its interval)."""
    rate: float
    """Samples per second as printed."""
    steps: int | None = None
    """Steps the rate covers; None: inferred from the neighbouring prints."""
    seconds: float | None = None
    """Wall seconds of the interval, where the log prints them."""
    timestamp: datetime | None = None
    """When the line was printed, on the log's own clock (no time zone), where the line carries a
    time with sub-second resolution."""
    loss: float | None = None
    counted_by_dlperf: bool = False
    """DLPerf's script for this format would count this line (its own line filter)."""


def fill_steps(prints: list[Print]) -> None:
    """Steps covered by each print whose line does not say: the gap to the previous print. A
    print with no usable gap (the first, or one whose step count repeats or restarts, as when
    several nodes print the same batch) takes the nearest usable gap, as loggers print at a
    fixed interval."""
    gaps: list[int | None] = [None] * len(prints)
    for i in range(1, len(prints)):
        if prints[i].index > prints[i - 1].index:
            gaps[i] = prints[i].index - prints[i - 1].index
    last_gap = next((g for g in gaps if g), None)  # the first print borrows the first gap
    for p, gap in zip(prints, gaps):
        last_gap = gap or last_gap
        if p.steps is None:
            p.steps = gap or last_gap or max(p.index, 1)


# "2020-09-15 14:29:16.161849" (DLLogger) and "2021-05-12 10:21:57,154" (Python logging).
ISO_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)[.,](\d{1,6})")
# absl / glog: "I0915 14:29:16.161849 139871 file.py:119] ...", level letter, month, day.
GLOG_TIME = re.compile(r"(?<![A-Za-z0-9])[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{1,6})")
# glog lines carry no year. Spans are taken within this one (a leap year, so 29 February
# parses); a span across New Year comes out negative and the caller falls back.
GLOG_YEAR = 2000


def line_timestamp(prefix: str) -> datetime | None:
    """The first time with sub-second resolution in the text before a line's message."""
    iso, glog = ISO_TIME.search(prefix), GLOG_TIME.search(prefix)
    if glog and (iso is None or glog.start() < iso.start()):
        fields, fraction = (GLOG_YEAR, *map(int, glog.groups()[:-1])), glog.group(6)
    elif iso:
        fields, fraction = tuple(map(int, iso.groups()[:-1])), iso.group(7)
    else:
        return None
    try:
        return datetime(*fields, int(fraction.ljust(6, "0")))
    except ValueError:  # 31 February: not a time after all
        return None
