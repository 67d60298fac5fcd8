"""JPEG (and PNG/BMP) decoding behind one interface, so the loader can use the fastest library
that is installed.

Every decoder returns a C-contiguous, writable ``uint8`` array of shape (height, width, 3) in
RGB order: writable because loaders hand it to ``torch.from_numpy``, which warns on read-only
memory. All of them ignore EXIF orientation: OpenCV would otherwise rotate such files and the
others not, and switching decoders must not change what a benchmark trains on.

Library imports happen inside the functions: trainperf runs without any of them, and a loader
process imports only the one it uses.

``DECODERS`` is in order of measured speed, fastest first. Single process, 2-core CPU VM,
2026-11-23, a photo re-encoded by Pillow at quality 90 (4:2:0; 6.5 kB and 58 kB), images
decoded per second, best of 5 per run, range over several runs (the VM was not idle):

    ==========  ===============  =============
    decoder     112 x 112        500 x 375
    ==========  ===============  =============
    simplejpeg  10,900 - 11,100  1,150 - 1,200
    opencv       9,700 - 10,400  1,040 - 1,120
    pillow       4,800 -  5,250    740 -   935
    ==========  ===============  =============

The three gave identical pixels for those images (all use libjpeg-turbo's default accurate
DCT and smooth chroma upsampling).

torchvision comes last unmeasured (it was not installed there): it decodes with libjpeg-turbo
too, but through a tensor, a CHW -> HWC copy and an import of torch in every loader process.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import lru_cache
from io import BytesIO
from typing import Callable

import numpy as np

DECODERS: tuple[str, ...] = ("simplejpeg", "opencv", "pillow", "torchvision")
_MODULES = {"simplejpeg": "simplejpeg", "opencv": "cv2", "pillow": "PIL",
            "torchvision": "torchvision"}
_PIP = {"simplejpeg": "simplejpeg", "opencv": "opencv-python-headless", "pillow": "pillow",
        "torchvision": "torchvision"}

Decoder = Callable[[bytes], np.ndarray]


def sniff(data: bytes) -> str | None:
    """'jpeg', 'png' or 'bmp' from the leading magic bytes; None for anything else."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:2] == b"BM" and len(data) >= 26:
        return "bmp"
    return None


def _kind(data: bytes) -> str:
    kind = sniff(data)
    if kind is None:
        raise ValueError(f"not a JPEG, PNG or BMP image ({len(data)} bytes starting "
                         f"{bytes(data[:8])!r})")
    return kind


@lru_cache(maxsize=None)
def _installed(module: str) -> bool:
    # find_spec, not import: importing torchvision (and torch) only to list it costs seconds
    return importlib.util.find_spec(module) is not None


@lru_cache(maxsize=None)
def _import_error(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as exc:  # installed but broken, e.g. a non-headless cv2 without libGL
        return str(exc)
    return None


def available() -> list[str]:
    """The decoders whose library is installed, in order of preference."""
    return [name for name in DECODERS if _installed(_MODULES[name])]


def resolve(name: str) -> str:
    """``'auto'`` -> the fastest installed decoder that imports; any other name must import."""
    have = available()
    if name == "auto":
        for candidate in have:
            if _import_error(_MODULES[candidate]) is None:
                return candidate
    elif name in have:
        error = _import_error(_MODULES[name])
        if error is None:
            return name
        raise ValueError(f"decoder {name!r} is installed but does not import: {error}")
    what = ("no decoder is installed" if not have else f"installed: {', '.join(have)}")
    if name in _PIP:
        hint = f"`pip install {_PIP[name]}`"
    else:
        hint = f"known decoders are {', '.join(DECODERS)}; `pip install simplejpeg` is fastest"
    raise ValueError(f"decoder {name!r} is not available ({what}); {hint}")


def _pillow(data: bytes) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    _kind(data)
    try:
        with Image.open(BytesIO(data)) as img:
            img.load()  # decodes here, so a truncated file fails inside the try
            # convert() copies even an RGB image: skipping it more than doubles the speed
            rgb = img if img.mode == "RGB" else img.convert("RGB")
            return np.array(rgb)  # np.asarray of a PIL image is read-only
    except UnidentifiedImageError:  # its message names the BytesIO object, useless here
        raise ValueError("undecodable image (Pillow cannot identify it)") from None
    except (OSError, SyntaxError) as exc:
        raise ValueError(f"undecodable image: {exc}") from None


def _fallback(data: bytes, library: str) -> np.ndarray:
    """Formats a library does not read go to Pillow, when it is there."""
    if not _installed("PIL"):
        raise ValueError(f"{library} cannot decode {_kind(data).upper()}; "
                         "`pip install pillow` to read it")
    return _pillow(data)


def _simplejpeg(data: bytes) -> np.ndarray:
    import simplejpeg

    if _kind(data) != "jpeg":
        return _fallback(data, "simplejpeg")
    try:
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    except ValueError as exc:
        # simplejpeg also refuses JPEGs that libjpeg recovers from (stray bytes before a
        # marker, a damaged segment), which OpenCV and Pillow decode: Pillow judges instead,
        # so that the same dataset passes or fails whichever decoder reads it.
        if _installed("PIL"):
            return _pillow(data)
        raise ValueError(f"undecodable JPEG: {exc}") from None


@lru_cache(maxsize=None)
def _cv2():
    import cv2

    cv2.setNumThreads(1)  # one loader process per core already; threads would oversubscribe
    return cv2


def _opencv(data: bytes) -> np.ndarray:
    cv2 = _cv2()
    _kind(data)
    try:
        bgr = cv2.imdecode(np.frombuffer(data, np.uint8),
                           cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
    except cv2.error as exc:
        raise ValueError(f"undecodable image: {exc}") from None
    if bgr is None:
        raise ValueError("undecodable image (OpenCV could not read it)")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def _torchvision(data: bytes) -> np.ndarray:
    import torch
    from torchvision.io import ImageReadMode, decode_image

    if _kind(data) == "bmp":
        return _fallback(data, "torchvision")
    # bytes are immutable and torch.frombuffer warns about that; a copy is cheap next to decoding
    raw = torch.from_numpy(np.frombuffer(data, np.uint8).copy())
    try:
        chw = decode_image(raw, mode=ImageReadMode.RGB)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"undecodable image: {exc}") from None
    if chw.dtype != torch.uint8:  # a 16-bit PNG decodes to uint16 since torchvision 0.21
        chw = (chw.to(torch.int32) >> 8).to(torch.uint8)
    return np.ascontiguousarray(chw.permute(1, 2, 0).numpy())


_FUNCTIONS: dict[str, Decoder] = {"simplejpeg": _simplejpeg, "opencv": _opencv,
                                  "pillow": _pillow, "torchvision": _torchvision}


def get_decoder(name: str = "auto") -> Decoder:
    """bytes -> HWC uint8 RGB array; raises ValueError (with a short reason) on bad bytes."""
    return _FUNCTIONS[resolve(name)]


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of an HWC (or HW) uint8 image, C-contiguous; an image already that size
    comes back uncopied unless it is a strided view (a crop), which is made contiguous.

    OpenCV when importable, else Pillow. They differ when shrinking: Pillow widens the filter to
    the scale (antialiasing), OpenCV samples 2x2 neighbours, so results are not identical.
    """
    if image.shape[:2] == (height, width):
        return np.ascontiguousarray(image)
    if _installed("cv2"):
        cv2 = _cv2()
        return cv2.resize(image, (width, height), interpolation=cv2.INTER_LINEAR)
    from PIL import Image

    return np.array(Image.fromarray(image).resize((width, height), Image.BILINEAR))


def flip_horizontal(image: np.ndarray) -> np.ndarray:
    """The mirror image, C-contiguous. OpenCV's flip is a vectorised copy; numpy's copy of a
    reversed view goes element by element (about 14x slower at 112 x 112)."""
    if _installed("cv2"):
        return _cv2().flip(image, 1)
    return np.ascontiguousarray(image[:, ::-1])
