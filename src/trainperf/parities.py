"""Where native parity ratios are kept, so that a comparison of frameworks can say how close each
framework's worker came to that framework's own training step (standard library only).

``trainperf.parity`` files one record per framework and case here: the recipe, the framework
and its version, the device, the precision, the median ratio of trainperf's samples/s to the
native step's with its spread, and where the campaign's ``parity.json`` lies. A report looks
for the newest record of the same recipe, version, device and precision.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from . import records

REGISTRY_ENV = "TRAINPERF_PARITY"
MEASURE_HINT = "python benchmarks/native_parity.py"


def registry() -> Path:
    """``$TRAINPERF_PARITY``, else ``~/.cache/trainperf/parity``: one machine's ratios, for
    the versions and devices that machine has."""
    return Path(os.environ.get(REGISTRY_ENV) or Path.home() / ".cache/trainperf/parity")


def put(name: str, record: dict[str, Any]) -> Path:
    """File (or refresh) the record ``name``: a campaign rewrites its rows' records after
    every pair, so a cut campaign leaves what it measured."""
    return records.put(registry(), name, record)


def name_for(recipe: str, framework: str, stamp: str, batch: int, mode: str = "") -> str:
    return f"{recipe}-{framework}-b{batch}{'-' + mode if mode else ''}-{stamp}"


def find(recipe: str, framework: str, version: str | None, device_type: str,
         device_name: str | None, precision: str, input_size: int | None = None
         ) -> dict[str, Any] | None:
    """The newest record of ``framework`` ``version`` on ``recipe`` measured on this kind of
    device (``cpu``/``cuda`` and its name) in ``precision`` at ``input_size``, or None. A None
    version, device name or input size matches any."""
    return records.newest(registry(), f"{recipe}-{framework}-*.json", lambda r: (
        r.get("recipe") == recipe and r.get("framework") == framework
        and (version is None or r.get("framework_version") == version)
        and r.get("device_type") == device_type
        and (device_name is None or r.get("device_name") == device_name)
        and r.get("precision") == precision and r.get("pairs_ok", 0) > 0
        and (input_size is None or r.get("input_size") == input_size)))


def describe(record: dict[str, Any] | None, recipe: str, framework: str, precision: str,
             device: str) -> str:
    """One line on how close ``framework``'s worker came to its own framework's step."""
    if record is None:
        return (f"native parity not measured: no record of {framework} on {recipe} in "
                f"{precision} on {device} with this version (`{MEASURE_HINT} --frameworks "
                f"{framework}`)")
    when = time.strftime("%Y-%m-%d", time.localtime(record.get("t", 0)))
    spread = (f"{record['min_ratio']:.3f}-{record['max_ratio']:.3f}"
              if record.get("pairs_ok", 0) > 1 else "one pair")
    pairs = record.get("pairs_ok", 0)
    return (f"{record['median_ratio']:.3f} of its native step ({record.get('native_step')}; "
            f"median of {pairs} pair{'s' if pairs != 1 else ''}, {spread}; batch "
            f"{record.get('batch')}, {record.get('threads') or 'default'} threads), measured "
            f"{when}: `{record.get('parity_json')}`")
