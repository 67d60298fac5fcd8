"""Which records of a ``.rec`` are images, and their labels: insightface's face layout or
im2rec's flat (ImageNet) layout.

Face layout (insightface's face datasets, e.g. faces_emore, glint360k):

- record 0 is a header: ``flag`` 2, label ``(first identity record, end)``;
- records 1 .. first identity record - 1 are images, each labelled with its class;
- identity records ``first .. end - 1`` map class ``key - first`` to its images: label
  ``(first image record, end)``.

Flat layout (im2rec, and insightface's shuffled ``rec2shufrec`` output): every record in the
index is an image whose label (a float, or the first of an array) is its class.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .recordio import IRHeader, RecordIOError, RecordReader

FACE, FLAT = "face", "flat"


def label_of(header: IRHeader) -> int:
    label = header.label[0] if isinstance(header.label, tuple) else header.label
    return int(label)


@dataclass
class Dataset:
    """The image records of a RecordIO file and what is known of its classes."""

    reader: RecordReader
    layout: str
    image_keys: list[int]
    num_classes: int | None
    """Known from the face layout's header; None for a flat file until its labels are read."""

    @property
    def prefix(self) -> str:
        return str(self.reader.rec_path.with_suffix(""))

    def __len__(self) -> int:
        return len(self.image_keys)

    def check_classes(self, num_classes: int) -> None:
        """ValueError when the face header announces more classes than the workload has."""
        if self.num_classes is not None and self.num_classes > num_classes:
            raise ValueError(f"{self.prefix} holds {self.num_classes} classes, more than the "
                             f"workload's {num_classes}: pass --num-classes {self.num_classes}")

    def check_batches(self, world: int, batch_size: int) -> None:
        """ValueError when an epoch cannot give each rank one whole batch."""
        if len(self) // world < batch_size:
            raise ValueError(f"{self.prefix} gives each rank {len(self) // world} images "
                             f"({len(self)} over {world}), fewer than a batch of {batch_size}")

    def describe(self) -> dict:
        return {"prefix": self.prefix, "layout": self.layout, "images": len(self.image_keys),
                "num_classes": self.num_classes, "bytes": self.reader.size}


def open_dataset(prefix: str | os.PathLike) -> Dataset:
    """Open ``PREFIX.rec``/``.idx`` and tell its layout from record 0."""
    reader = RecordReader(prefix)
    if not reader.index:
        raise RecordIOError(f"{reader.idx_path}: the index lists no records")
    # The last record read whole catches a truncated copy now, not hours into a run.
    reader.read_at(max(reader.index.values()))
    if 0 in reader.index:
        header, payload = reader.read_image(0)
        # im2rec can write array labels too; only the face header holds no image.
        if header.flag >= 2 and not payload:
            return _face(reader, header)
    return Dataset(reader, FLAT, sorted(reader.index), None)


def _face(reader: RecordReader, header: IRHeader) -> Dataset:
    first, end = int(header.label[0]), int(header.label[1])
    where = f"{reader.rec_path} record 0 (face header)"
    if not 1 <= first <= end:
        raise RecordIOError(f"{where}: identity records [{first}, {end}) are not a range after "
                            "the images")
    missing = [k for k in (1, first - 1, end - 1) if k > 0 and k < end and k not in reader.index]
    if missing:
        raise RecordIOError(f"{where}: announces records up to {end - 1} but the index lacks "
                            f"key {missing[0]}")
    return Dataset(reader, FACE, list(range(1, first)), end - first)
