"""Pack a folder of images into a RecordIO dataset that insightface (face layout) or im2rec-style
readers (flat layout) read, and that ``layout.open_dataset`` reads back.

``IMAGE_DIR`` holds one sub-folder per class (an identity, for faces); the classes are the
sub-folder names in sorted order, so label ``i`` is the ``i``-th name, and
``PREFIX.classes.txt`` lists them one a line in label order to map labels back to names.
Inside a class folder, files ending in .jpg, .jpeg, .png or .bmp (any case) are taken in name
order and stored as their file bytes, unchanged: re-encoding would cost quality and time, and
insightface and im2rec store encoded files the same way. Other files, deeper folders and names
starting with a dot are ignored. A class folder without images keeps its label (so labels stay
the folder's position), and simply has no images.

The output appears only when complete: records go to ``PREFIX.partial.rec``/``.idx`` first and
are renamed at the end, so an interrupted or failed pack never leaves a dataset that looks
whole.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

from .decode import sniff
from .layout import FACE, FLAT
from .recordio import IRHeader, RecordWriter, pack, paths

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")


def write_dataset(prefix: str | os.PathLike, layout: str, counts: Sequence[int],
                  payloads: Iterable[bytes]) -> int:
    """Write ``sum(counts)`` images, class by class (``counts[c]`` images of class ``c``, in
    ``payloads`` order), in ``layout``; the size of the ``.rec`` in bytes.

    Counts come first because the face layout's record 0, written first so that a sequential
    reader meets it first, holds where the identity records start.
    """
    if layout not in (FACE, FLAT):
        raise ValueError(f"layout must be {FACE!r} or {FLAT!r}, got {layout!r}")
    rec, idx = paths(prefix)
    tmp_rec, tmp_idx = paths(rec.with_name(rec.stem + ".partial"))
    try:
        with RecordWriter(tmp_rec) as writer:
            _write(writer, layout, counts, iter(payloads))
        os.replace(tmp_rec, rec)
        os.replace(tmp_idx, idx)
    finally:
        for leftover in (tmp_rec, tmp_idx):
            leftover.unlink(missing_ok=True)
    return rec.stat().st_size


def _write(writer: RecordWriter, layout: str, counts: Sequence[int], payloads) -> None:
    images = sum(counts)
    base = 1 if layout == FACE else 0  # the face layout's images start at key 1
    if layout == FACE:
        first = 1 + images
        writer.write(0, pack(IRHeader(2, (first, first + len(counts)), 0, 0), b""))
    key = base
    for label, count in enumerate(counts):
        for _ in range(count):
            writer.write(key, pack(IRHeader(0, float(label), key, 0), next(payloads)))
            key += 1
    if layout == FACE:
        start = base
        for label, count in enumerate(counts):
            writer.write(first + label, pack(IRHeader(2, (start, start + count), first + label,
                                                      0), b""))
            start += count


def _class_files(image_dir: Path) -> tuple[list[str], list[list[Path]]]:
    if not image_dir.is_dir():
        raise ValueError(f"{image_dir}: not a folder")
    visible = sorted((p for p in image_dir.iterdir() if not p.name.startswith(".")),
                     key=lambda p: p.name)
    classes = [p for p in visible if p.is_dir()]
    loose = [p for p in visible if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    if loose:
        raise ValueError(f"{loose[0]}: images must sit in one sub-folder per class, not in "
                         f"{image_dir} itself")
    files = [sorted((f for f in c.iterdir() if f.is_file() and not f.name.startswith(".")
                     and f.suffix.lower() in IMAGE_SUFFIXES), key=lambda f: f.name)
             for c in classes]
    if not any(files):
        raise ValueError(f"{image_dir}: no images (expected sub-folders, one per class, "
                         f"holding {', '.join(IMAGE_SUFFIXES)} files)")
    return [c.name for c in classes], files


def _contents(files: Iterable[Path]) -> Iterable[bytes]:
    for path in files:
        data = path.read_bytes()
        if sniff(data) is None:
            raise ValueError(f"{path}: not a JPEG, PNG or BMP file (starts with "
                             f"{data[:8]!r})")
        yield data


def pack_folder(image_dir: str | os.PathLike, prefix: str | os.PathLike,
                layout: str = FACE) -> dict:
    """Pack ``image_dir`` into ``PREFIX.rec``/``.idx`` (and ``PREFIX.classes.txt``)."""
    names, files = _class_files(Path(image_dir))
    size = write_dataset(prefix, layout, [len(f) for f in files],
                         _contents(f for group in files for f in group))
    rec, _ = paths(prefix)
    rec.with_suffix(".classes.txt").write_text("".join(f"{n}\n" for n in names),
                                               encoding="utf-8")
    return {"prefix": str(rec.with_suffix("")), "layout": layout,
            "images": sum(map(len, files)), "classes": len(names), "bytes": size}
