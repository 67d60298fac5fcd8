"""Reading a committed GPU record folder (``benchmarks/results/gpu-*``): its JSON files,
unpacked or inside its parts' ``.tar.gz`` archives, as the memory model's fit and the support
matrix both need them. The reading itself lives in ``trainperf.result_files``, where the
exports (a floor below) reach it too."""

from __future__ import annotations

from ..result_files import json_files

__all__ = ["json_files"]
