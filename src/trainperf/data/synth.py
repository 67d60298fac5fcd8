"""A synthetic face-layout dataset: real JPEG records, so the whole input pipeline (reading,
decoding, augmenting) is exercised, with images a model can actually learn to tell apart.

Each identity is a smooth colour field of its own (a few random low-frequency 2-D sinusoids per
channel over an identity colour, plus two soft blobs); each of its images is that field shifted
by a few pixels, with brightness/contrast jitter and mild noise. Same-identity images are then
much closer to each other than to any other identity's, as faces of one person should be for a
classifier, while no two images are byte-identical.

Everything comes from one seeded generator in a fixed order, so a seed gives the same bytes
on every call (with the same numpy and Pillow).

With ``val_pairs``, ``PREFIX.val.bin`` holds a verification set in insightface's ``.bin``
format (``trainperf.data.binset``) made the same way from identities the training set lacks. It
draws from a second stream of the seed, so the ``.rec`` is the same with or without it.

The set is easy: raw pixels (mean-subtracted, plus the mirror image) verify about 98-99.5 %
of 600 pairs, as the jitter is small next to the differences between identities. Harder jitter
would also defeat the raw-pixel nearest-centroid check in tests/test_data_pack.py, so it stays.
"""

from __future__ import annotations

import os
import time
from io import BytesIO
from typing import Iterator

import numpy as np

from .binset import write_bin
from .layout import FACE
from .pack import write_dataset
from .recordio import paths

WAVES = 3
"""Sinusoids per colour channel; more would make identities busier, not more distinct."""


def _template(rng: np.random.Generator, side: int) -> np.ndarray:
    """An identity's field over a ``side`` x ``side`` grid (larger than an image, for shifts)."""
    y, x = np.mgrid[0:side, 0:side].astype(np.float32) / side
    field = np.empty((side, side, 3), np.float32)
    for c in range(3):
        freq = rng.uniform(-2.5, 2.5, (WAVES, 2)).astype(np.float32)
        phase = rng.uniform(0, 2 * np.pi, WAVES).astype(np.float32)
        amp = rng.uniform(15, 35, WAVES).astype(np.float32)
        field[..., c] = rng.uniform(70, 185)
        for k in range(WAVES):
            field[..., c] += amp[k] * np.sin(2 * np.pi * (freq[k, 0] * x + freq[k, 1] * y)
                                              + phase[k])
    for _ in range(2):
        cy, cx = rng.uniform(0.25, 0.75, 2)
        width = rng.uniform(0.08, 0.2)
        blob = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * width ** 2))
        field += blob[..., None] * rng.uniform(-60, 60, 3).astype(np.float32)
    return field


def _margin(size: int) -> int:
    return max(2, size // 28)  # 4 pixels at 112: a small misalignment, as after face align


def _jittered(rng: np.random.Generator, field: np.ndarray, size: int, quality: int) -> bytes:
    """One image of the identity whose template is ``field``, JPEG-encoded."""
    from PIL import Image

    margin = _margin(size)
    dy, dx = rng.integers(0, 2 * margin + 1, 2)
    crop = field[dy:dy + size, dx:dx + size]
    mean = crop.mean()
    img = ((crop - mean) * rng.uniform(0.85, 1.15) + mean + rng.uniform(-15, 15)
           + 4 * rng.standard_normal(crop.shape, dtype=np.float32))
    out = BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=quality)
    return out.getvalue()


def _images(rng: np.random.Generator, identities: int, per_identity: int, size: int,
            quality: int) -> Iterator[bytes]:
    for _ in range(identities):
        field = _template(rng, size + 2 * _margin(size))
        for _ in range(per_identity):
            yield _jittered(rng, field, size, quality)


def _val_pairs(seed: int, pairs: int, identities: int, size: int, quality: int
               ) -> tuple[list[bytes], list[bool]]:
    """Verification pairs of ``identities`` new identities: half same, half different, in a
    shuffled order, every image a fresh one.

    Its own stream, the seed's first child, so that asking for pairs leaves the training
    images' stream, and so the .rec, as it was; its templates are new draws, hence
    identities the training set does not hold.
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
    fields = [_template(rng, size + 2 * _margin(size)) for _ in range(identities)]
    same = pairs // 2
    # same pairs cycle through the identities, so every one of them is used evenly
    plan = [(k % identities, k % identities) for k in range(same)]
    for _ in range(pairs - same):
        a, b = rng.choice(identities, 2, replace=False)
        plan.append((int(a), int(b)))
    images: list[bytes] = []
    issame: list[bool] = []
    for k in rng.permutation(pairs):
        a, b = plan[k]
        images += [_jittered(rng, fields[a], size, quality),
                   _jittered(rng, fields[b], size, quality)]
        issame.append(a == b)
    return images, issame


def synthesize(prefix: str | os.PathLike, identities: int, images_per_identity: int,
               size: int = 112, seed: int = 0, quality: int = 90, val_pairs: int = 0,
               val_identities: int | None = None) -> dict:
    """Write ``PREFIX.rec``/``.idx`` in insightface's face layout and, with ``val_pairs``,
    ``PREFIX.val.bin``, a verification set of other identities in insightface's ``.bin``
    format (``val_identities`` of them, by default a sixth of the pairs and at least 10); a
    summary of what was written."""
    if identities < 1 or images_per_identity < 1:
        raise ValueError(f"need at least one identity and one image each, got {identities} "
                         f"identities x {images_per_identity} images")
    if size < 8:
        raise ValueError(f"image size must be at least 8 pixels, got {size}")
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
    if val_pairs < 0:
        raise ValueError(f"val_pairs must be >= 0, got {val_pairs}")
    if val_identities is None:
        val_identities = max(10, val_pairs // 6)
    if val_pairs and val_identities < 2:
        raise ValueError(f"different-identity pairs need at least 2 val identities, got "
                         f"{val_identities}")
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    size_bytes = write_dataset(prefix, FACE, [images_per_identity] * identities,
                               _images(rng, identities, images_per_identity, size, quality))
    stem = str(paths(prefix)[0].with_suffix(""))
    val_bin = None
    if val_pairs:
        val_bin = stem + ".val.bin"
        write_bin(val_bin, *_val_pairs(seed, val_pairs, val_identities, size, quality))
    return {"prefix": stem, "images": identities * images_per_identity,
            "identities": identities, "bytes": size_bytes, "val_bin": val_bin,
            "val_pairs": val_pairs, "seconds": time.perf_counter() - start}
