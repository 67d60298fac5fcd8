"""Finding files of a results tree by name: unpacked ones, and those kept inside ``.tar.gz``
archives (a GPU record folder, ``benchmarks/results/gpu-*``, packs each part's work folder into
one). Standard library only, so that every floor may read a tree through it."""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path


def json_files(root: Path, names: tuple[str, ...]) -> Iterator[tuple[str, bytes]]:
    """(name, contents) of every file under the folder ``root`` called one of ``names``:
    unpacked ones first, named by their path in the folder, then those in the archives, named
    by the archive's path and theirs inside it
    (``part1/gpucheck-part1.tar.gz/<work>/runs/<case>/results.json``); each group in sorted
    order."""
    for path in sorted(root.rglob("*.json")):
        if path.name in names and path.is_file():
            yield str(path.relative_to(root)), path.read_bytes()
    for path in sorted(root.rglob("*.tar.gz")):
        archive = path.relative_to(root)
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.rsplit("/", 1)[-1] in names:
                    yield f"{archive}/{member.name}", tar.extractfile(member).read()
