"""What the framework table declares (`trainperf list --frameworks --markdown`, the table the
README and docs/frameworks.md hold), read back from the table's own text, and a run's
results.json held against it: the layout, mode, precision, TF32 and speed settings each case
recorded are ones its framework's row declares for the device the run went to."""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainperf.backends.base import DEVICE_KINDS, KIND_WORDS
from trainperf.backends.capabilities import LAYOUT_COLUMN, markdown_table
from trainperf.backends.workerkit import tf32_setting
from trainperf.config import GPU_SETTINGS, MODE_BEST, MODE_DEFAULT

LAYOUTS = {"NHWC": True, "NCHW": False}
"""A layout cell's word -> the ``channels_last`` a run in it records."""


@dataclass(frozen=True)
class Declared:
    """One framework's row on one device kind, as the table says it."""

    channels_last: bool
    """What ``--memory-format auto`` runs."""
    modes: tuple[str, ...]
    """Its default (the bold one) first."""
    precisions: tuple[str, ...]
    tuning: tuple[str, ...]
    """The speed settings it honours."""


def _cells(line: str) -> list[str]:
    return line.strip().removeprefix("| ").removesuffix(" |").split(" | ")


def table_rows() -> dict[str, dict[str, str]]:
    """Each framework's row of the Markdown table, by column."""
    header, _, *lines = markdown_table().splitlines()
    columns = _cells(header)
    rows = {}
    for line in lines:
        cells = _cells(line)
        # A cell holding " | " would shift every cell after it.
        assert len(cells) == len(columns), line
        rows[cells[0]] = dict(zip(columns, cells))
    return rows


def _listed(cell: str) -> tuple[str, ...]:
    return () if cell == "-" else tuple(cell.split(", "))


def declared(framework: str, kind: str) -> Declared:
    """``framework``'s row on device kind ``kind`` (``cpu`` or ``cuda``)."""
    row, on = table_rows()[framework], KIND_WORDS[kind]
    layouts = dict(zip(DEVICE_KINDS, row[LAYOUT_COLUMN].split(" / ")))
    modes = _listed(row[f"modes on {on}"])
    bold = [i for i, m in enumerate(modes) if m.startswith("**")]
    assert bold == ([0] if modes else []), f"{framework}'s default mode is not first: {modes}"
    return Declared(LAYOUTS[layouts[kind]], tuple(m.strip("*") for m in modes),
                    _listed(row[f"precisions on {on}"]),
                    tuple(re.findall(r"`(\w+)`", row["speed settings"])))


def assert_runs_as_declared(doc: dict) -> None:
    """Every case of ``doc`` (a results.json) ran as its framework's row declares, for what
    the plan asked (``doc["tuning"]``): its layout (``auto``: the row's), its mode (``default``:
    the row's first; ``best``: one of the row's), a declared precision, no speed setting the
    row does not list, and on a CPU no TF32 (none exists there)."""
    kind, asked = doc["env"]["device_type"], doc["tuning"]
    row = declared(doc["framework"], kind)
    where = f"{doc['framework']} on {KIND_WORDS[kind]}"
    fmt = asked["memory_format"]
    layout = row.channels_last if fmt == "auto" else fmt == "channels_last"
    assert doc["workload"]["channels_last"] is layout, (where, fmt)
    assert doc["workload"]["precision"] in row.precisions, where
    for case in doc["cases"]:
        mode = case["mode"]
        if asked["mode"] == MODE_DEFAULT:
            assert mode == row.modes[0], (where, mode)
        elif asked["mode"] != MODE_BEST:
            assert mode == asked["mode"], (where, mode)
        assert mode in row.modes and {r["mode"] for r in case["runs"]} == {mode}, (where, mode)
        assert case["precision"] == doc["workload"]["precision"], where
        applied = {k: v for k, v in case["settings"]["tuning"].items() if v is not None}
        assert set(applied) <= set(row.tuning), (where, applied)
        tf32 = (case["tf32_conv"], case["tf32_matmul"])
        if kind == "cpu":
            assert tf32 == (None, None) and not set(applied) & set(GPU_SETTINGS), (where, applied)
        elif "tf32" in applied:
            assert applied["tf32"] == tf32_setting(*tf32), (where, applied, tf32)
