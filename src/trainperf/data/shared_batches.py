"""The memory a loader process and a worker share (``feed``, ``loader_process``): slots of one
batch each, every slot its uint8 NHWC images, then its int64 labels, then its (epoch, sample)
pairs as int64. numpy and the standard library only: both sides import it."""

from __future__ import annotations

import numpy as np


def slot_layout(batch_size: int, size: int) -> tuple[int, int, int]:
    """Byte sizes of a slot's images, labels and (epoch, sample) pairs."""
    return batch_size * size * size * 3, batch_size * 8, batch_size * 16


def slot_views(buffer, slot: int, batch_size: int, size: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot ``slot`` of ``buffer`` as (images [B, H, W, 3] uint8, labels [B] int64, pairs
    [B, 2] int64), views into the shared memory."""
    image_bytes, label_bytes, pair_bytes = slot_layout(batch_size, size)
    base = slot * (image_bytes + label_bytes + pair_bytes)
    images = np.frombuffer(buffer, np.uint8, image_bytes, base
                           ).reshape(batch_size, size, size, 3)
    labels = np.frombuffer(buffer, np.int64, batch_size, base + image_bytes)
    pairs = np.frombuffer(buffer, np.int64, 2 * batch_size, base + image_bytes + label_bytes
                          ).reshape(batch_size, 2)
    return images, labels, pairs
