"""Reading a committed GPU record folder (``benchmarks/results/gpu-*``): its JSON files,
unpacked or inside its parts' ``.tar.gz`` archives, as the memory model's fit and the support
matrix both need them."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path


def json_files(record: Path, names: tuple[str, ...]) -> Iterator[tuple[str, bytes]]:
    """(name, contents) of every file called one of ``names``: unpacked ones first, named by
    their path in the folder, then those in the archives, named by the archive's path and
    theirs inside it (``part1/gpucheck-part1.tar.gz/<work>/runs/<case>/results.json``)."""
    for path in sorted(record.rglob("*.json")):
        if path.name in names:
            yield str(path.relative_to(record)), path.read_bytes()
    for path in sorted(record.rglob("*.tar.gz")):
        archive = path.relative_to(record)
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.rsplit("/", 1)[-1] in names:
                    yield f"{archive}/{member.name}", tar.extractfile(member).read()
