"""A synthetic face dataset: real JPEG records, so the whole input pipeline (reading, decoding,
augmenting) is exercised, with identities that a model has to learn to tell apart, as on real
verification sets.

Every image is a drawing of one face-like base that all identities share: an oval face under
a cap of hair, two eyes, brows, a nose and a mouth. An identity moves that base a little: the
proportions (the face's width and height, where the hairline, eyes, brows and mouth sit, the
size of each) and the colours of skin, hair, irises and lips. Each image then shows its
identity under a nuisance of its own, drawn afresh:

- a pose, as left by a face aligner: a shift of up to 3 % of the image, a turn of up to 5
  degrees, a change of scale of up to 5 %;
- light: an overall brightness, and a slope of light across the image from any side;
- a colour cast (a gain per channel), a background of any colour and gradient, pixel noise.

The identity cues survive the nuisance (proportions do not change with light, and a cast
keeps the ratios between one face's colours), but the nuisance changes far more pixels, and
by more, than the identity does. Raw pixels and an untrained network's features are
dominated by it. On the 600 held-out pairs of ``data synth``'s default (112 pixels), measured
over seeds 0 to 2, raw pixels (mean-subtracted, plus the mirror image) verify 48-58 % of the
pairs and the untrained ``tiny-arcface`` 49-58 %; trained on 40 identities x 12 images it
passes 80 % within 1000 steps (docs/time-to-accuracy.md has the runs). In the middle of
the image, where the face is, same-identity images are still closer on average than different
identities' (tests/test_data_pack.py).

``nuisance`` scales every nuisance at once: at 0 every image of an identity is the same
drawing, which shows the identity cues alone (raw pixels then verify every pair).

Everything comes from one seeded generator in a fixed order, so a seed gives the same bytes
on every call (with the same numpy and Pillow); the nuisance's draws are made whatever its
scale, so a seed's identities are the same at every ``nuisance``.

With ``val_pairs``, ``PREFIX.val.bin`` holds a verification set in insightface's ``.bin``
format (``trainperf.data.binset``) made the same way from identities the training set lacks. It
draws from a second stream of the seed, so the ``.rec`` is the same with or without it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from io import BytesIO
from typing import Iterator

import numpy as np

from .binset import write_bin
from .layout import FACE
from .pack import write_dataset
from .recordio import paths

# The shared face, in coordinates where the image spans [-0.5, 0.5] on both axes, y downwards.
# Each entry: (the value every identity starts from, the spread between identities: for a
# position, a standard deviation in image widths; for a size, of its logarithm). A face thus
# differs from the next by a few hundredths of the image where its parts sit and by some tenths
# of their sizes, which a model learns to see, while the nuisance below moves more pixels.
GEOMETRY = {
    "face_w": (0.27, 0.12), "face_h": (0.36, 0.12),
    "hairline": (-0.16, 0.06),
    "eye_y": (-0.05, 0.045), "eye_dx": (0.11, 0.03),
    "eye_w": (0.055, 0.3), "eye_h": (0.028, 0.35),
    "brow_gap": (0.06, 0.03), "brow_h": (0.014, 0.4),
    "nose_len": (0.13, 0.3), "nose_w": (0.035, 0.35),
    "mouth_y": (0.19, 0.035), "mouth_w": (0.085, 0.3), "mouth_h": (0.026, 0.35),
}
COLOURS = {"skin": ((200, 160, 135), 0.15), "hair": ((80, 60, 45), 0.5),
           "iris": ((90, 70, 55), 0.5), "lips": ((170, 90, 85), 0.3)}
POSITIONS = {"hairline", "eye_y", "eye_dx", "brow_gap", "mouth_y"}


@dataclass(frozen=True)
class Nuisance:
    """How far each image strays from the identity's plain portrait, at ``nuisance`` 1."""

    shift: float = 0.03
    """Largest shift of the face, in image widths, on each axis."""
    turn_deg: float = 5.0
    """Largest turn of the face in the image's plane."""
    scale: float = 0.05
    """Largest change of the face's size (log)."""
    brightness: float = 0.35
    """Largest change of the overall light (log)."""
    slope: float = 0.7
    """Largest difference of light between two opposite edges of the image, over its mean."""
    cast: float = 0.12
    """Spread of each channel's gain (log)."""
    background: float = 1.0
    """0: a plain grey behind every face; 1: any colour, with a gradient."""
    noise: float = 10.0
    """Largest standard deviation of the pixel noise, in grey levels."""


NUISANCE = Nuisance()


def _identity(rng: np.random.Generator) -> dict[str, np.ndarray | float]:
    """One person: the shared face with its proportions and colours moved."""
    person: dict[str, np.ndarray | float] = {}
    for name, (value, spread) in GEOMETRY.items():
        change = spread * rng.standard_normal()
        person[name] = value + change if name in POSITIONS else value * np.exp(change)
    for name, (rgb, spread) in COLOURS.items():
        person[name] = np.asarray(rgb, np.float32) * np.exp(spread * rng.standard_normal(3))
    return person


def _ellipse(x: np.ndarray, y: np.ndarray, w: float, h: float, edge: float) -> np.ndarray:
    """Coverage in [0, 1] of an ellipse of half-axes ``w``, ``h`` centred at the origin, soft
    over about ``edge`` (an image width's fraction), so that small sizes still draw it."""
    r = np.sqrt((x / w) ** 2 + (y / h) ** 2)
    return np.clip((1 - r) * min(w, h) / edge + 0.5, 0, 1)


def _paint(img: np.ndarray, cover: np.ndarray, colour: np.ndarray | float) -> None:
    """Lay ``colour`` over ``img`` where ``cover`` says, in place."""
    rows, cols = np.flatnonzero(cover.any(1)), np.flatnonzero(cover.any(0))
    if not len(rows):
        return
    # Only the box around the shape: most shapes are small, and outside it nothing changes.
    box = slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)
    img[box] += cover[box][..., None] * (colour - img[box])


def _portrait(p: dict, x: np.ndarray, y: np.ndarray, edge: float,
              background: np.ndarray) -> np.ndarray:
    """The identity ``p`` drawn over ``background`` at face coordinates ``x``, ``y``."""
    img = background.copy()
    face = _ellipse(x, y, p["face_w"], p["face_h"], edge)
    # a little shading toward the rim, so that the face is a volume and not a flat disc
    depth = 1 - 0.18 * np.clip((x / p["face_w"]) ** 2 + (y / p["face_h"]) ** 2, 0, 1)
    _paint(img, face, 0)
    img += face[..., None] * depth[..., None] * p["skin"]
    hair = (_ellipse(x, y + 0.02, 1.12 * p["face_w"], 1.08 * p["face_h"], edge)
            * np.clip((p["hairline"] - y) / edge + 0.5, 0, 1))
    _paint(img, hair, p["hair"])
    for side in (-1, 1):
        ex, ey = x - side * p["eye_dx"], y - p["eye_y"]
        _paint(img, _ellipse(ex, ey, p["eye_w"], p["eye_h"], edge),
               np.array([235, 235, 230], np.float32))
        _paint(img, _ellipse(ex, ey, 0.9 * p["eye_h"], 0.9 * p["eye_h"], edge), p["iris"])
        _paint(img, _ellipse(ex, ey + p["brow_gap"], 1.2 * p["eye_w"], p["brow_h"], edge),
               0.8 * p["hair"])
    nose_top = p["eye_y"] + 0.02
    _paint(img, 0.35 * _ellipse(x, y - nose_top - p["nose_len"] / 2, p["nose_w"],
                                p["nose_len"] / 2, edge), 0.6 * p["skin"])
    _paint(img, _ellipse(x, y - p["mouth_y"], p["mouth_w"], p["mouth_h"], edge), p["lips"])
    return img


def _photo(rng: np.random.Generator, person: dict, size: int, quality: int,
           amount: float) -> bytes:
    """One image of ``person`` under a fresh nuisance (scaled by ``amount``), JPEG-encoded."""
    from PIL import Image

    n = NUISANCE
    # Every draw is made whatever ``amount`` is, so the identities after it stay the same.
    shift = n.shift * rng.uniform(-1, 1, 2)
    turn = np.deg2rad(n.turn_deg) * rng.uniform(-1, 1)
    scale = np.exp(n.scale * rng.uniform(-1, 1))
    light = np.exp(n.brightness * rng.uniform(-1, 1))
    angle = rng.uniform(0, 2 * np.pi)
    slope = n.slope * rng.uniform(0, 1)
    cast = np.exp(n.cast * rng.standard_normal(3))
    back, back_slope = rng.uniform(20, 235, 3), rng.uniform(-60, 60, 3)
    sigma = n.noise * rng.uniform(0.3, 1)
    noise = rng.standard_normal((size, size, 3), dtype=np.float32)

    grid = (np.arange(size, dtype=np.float32) + 0.5) / size - 0.5
    v, u = np.meshgrid(grid, grid, indexing="ij")
    c, s = np.cos(amount * turn), np.sin(amount * turn)
    du, dv = u - amount * shift[0], v - amount * shift[1]
    zoom = scale ** amount
    x, y = (c * du + s * dv) / zoom, (c * dv - s * du) / zoom
    grey = np.full(3, 128, np.float32)
    background = (grey + amount * n.background * (back - grey)
                  + amount * n.background * back_slope * v[..., None])
    img = _portrait(person, x, y, 1.0 / (size * zoom), background.astype(np.float32))
    side = np.cos(angle) * u + np.sin(angle) * v  # from -0.7 to 0.7 at the corners
    img *= (light ** amount * (1 + amount * slope * side))[..., None]
    img *= cast ** amount
    img += amount * sigma * noise
    out = BytesIO()
    Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8)).save(out, "JPEG",
                                                                      quality=quality)
    return out.getvalue()


def _images(rng: np.random.Generator, identities: int, per_identity: int, size: int,
            quality: int, amount: float) -> Iterator[bytes]:
    for _ in range(identities):
        person = _identity(rng)
        for _ in range(per_identity):
            yield _photo(rng, person, size, quality, amount)


def _val_pairs(seed: int, pairs: int, identities: int, size: int, quality: int,
               amount: float) -> tuple[list[bytes], list[bool]]:
    """Verification pairs of ``identities`` new identities: half same, half different, in a
    shuffled order, every image a fresh one.

    Its own stream, the seed's first child, so that asking for pairs leaves the training
    images' stream, and so the .rec, as it was; its people are new draws, hence identities
    the training set does not hold.
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(1)[0])
    people = [_identity(rng) for _ in range(identities)]
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
        images += [_photo(rng, people[a], size, quality, amount),
                   _photo(rng, people[b], size, quality, amount)]
        issame.append(a == b)
    return images, issame


def synthesize(prefix: str | os.PathLike, identities: int, images_per_identity: int,
               size: int = 112, seed: int = 0, quality: int = 90, val_pairs: int = 0,
               val_identities: int | None = None, nuisance: float = 1.0) -> dict:
    """Write ``PREFIX.rec``/``.idx`` in insightface's face layout and, with ``val_pairs``,
    ``PREFIX.val.bin``, a verification set of other identities in insightface's ``.bin``
    format (``val_identities`` of them, by default a sixth of the pairs and at least 10); a
    summary of what was written. ``nuisance`` scales pose, light, colour cast, background and
    noise together (1: the default; 0: every image of an identity drawn alike)."""
    if identities < 1 or images_per_identity < 1:
        raise ValueError(f"need at least one identity and one image each, got {identities} "
                         f"identities x {images_per_identity} images")
    if size < 8:
        raise ValueError(f"image size must be at least 8 pixels, got {size}")
    if not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
    if val_pairs < 0:
        raise ValueError(f"val_pairs must be >= 0, got {val_pairs}")
    if not 0 <= nuisance <= 1:
        raise ValueError(f"nuisance must be in [0, 1], got {nuisance}")
    if val_identities is None:
        val_identities = max(10, val_pairs // 6)
    if val_pairs and val_identities < 2:
        raise ValueError(f"different-identity pairs need at least 2 val identities, got "
                         f"{val_identities}")
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    size_bytes = write_dataset(prefix, FACE, [images_per_identity] * identities,
                               _images(rng, identities, images_per_identity, size, quality,
                                       nuisance))
    stem = str(paths(prefix)[0].with_suffix(""))
    val_bin = None
    if val_pairs:
        val_bin = stem + ".val.bin"
        write_bin(val_bin, *_val_pairs(seed, val_pairs, val_identities, size, quality,
                                       nuisance))
    return {"prefix": stem, "images": identities * images_per_identity,
            "identities": identities, "bytes": size_bytes, "val_bin": val_bin,
            "val_pairs": val_pairs, "seconds": time.perf_counter() - start}
