"""Face verification sets in insightface's ``.bin`` format (lfw.bin, cfp_fp.bin, agedb_30.bin,
...), read and written without any deep-learning framework.

A ``.bin`` is a pickle of ``(bins, issame_list)``: ``bins`` holds 2N encoded images (bytes, or
in some dumps 1-D uint8 numpy arrays of the same bytes) and ``issame_list`` N bools; pair ``i``
is images ``2i`` and ``2i + 1``. The published files were written by Python 2, so they are read
with ``encoding="bytes"`` (their ``str`` objects are image bytes, not text).

A pickle can run any code when loaded, so ``read_bin`` unpickles with an allow-list: only
numpy's array reconstruction and a few harmless builtins, which is all such files need.
"""

from __future__ import annotations

import codecs
import os
import pickle
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np

from .decode import get_decoder, resize, sniff


class VerificationSetError(ValueError):
    """A ``.bin`` that cannot be read as a verification set; the message names the file."""


@dataclass(frozen=True)
class VerificationSet:
    name: str
    path: str
    images: np.ndarray  # uint8 [2N, H, W, 3], RGB
    issame: np.ndarray  # bool [N]

    @property
    def pairs(self) -> int:
        return len(self.issame)


def _numpy_globals() -> dict[tuple[str, str], Any]:
    # Taken from what numpy's own pickles reference, not imported by module name: the name
    # moved from numpy.core to numpy._core in numpy 2, and numpy.core now warns on access.
    reconstruct = np.empty(0).__reduce__()[0]
    scalar = np.bool_(True).__reduce__()[0]
    allowed: dict[tuple[str, str], Any] = {}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = reconstruct
        allowed[(module, "scalar")] = scalar  # numpy bools in an issame list
    allowed[("numpy", "ndarray")] = np.ndarray
    allowed[("numpy", "dtype")] = np.dtype
    return allowed


def _latin1_encode(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    # Python 3 pickles bytes at protocols 0-2 as _codecs.encode(text, "latin1"); no other codec
    # has a reason to appear in a .bin.
    if codecs.lookup(encoding).name != "iso8859-1":
        raise pickle.UnpicklingError(f"_codecs.encode with codec {encoding!r} is not allowed")
    return codecs.encode(text, "latin1", errors)


_BUILTINS: dict[str, Any] = {"list": list, "tuple": tuple, "bytes": bytes,
                             "bytearray": bytearray, "bool": bool}


class _BinUnpickler(pickle.Unpickler):
    """Resolves only the globals a verification set needs; anything else is refused before it
    can be called."""

    def __init__(self, data: bytes, path: str) -> None:
        super().__init__(BytesIO(data), encoding="bytes")
        self._path = path
        self._allowed = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        # fix_imports has already mapped Python 2's __builtin__ to builtins
        if module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        raise VerificationSetError(f"{self._path}: refused to load {module}.{name} (a .bin "
                                   "needs only lists, bytes, bools and numpy arrays)")


def _load(path: str) -> Any:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise VerificationSetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    # From memory, not the file object: a corrupt length field then fails as truncated instead
    # of asking the file for gigabytes.
    try:
        return _BinUnpickler(data, path).load()
    except VerificationSetError:
        raise
    except MemoryError:
        raise VerificationSetError(f"{path}: not a verification set (asks for more memory "
                                   "than there is)") from None
    except EOFError:
        raise VerificationSetError(f"{path}: truncated pickle ({len(data)} bytes)") from None
    except Exception as exc:  # unpickling garbage raises anything from KeyError to TypeError
        raise VerificationSetError(f"{path}: not a pickled verification set "
                                   f"({type(exc).__name__}: {_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 120 else text[:117] + "..."


def _structure(obj: Any, path: str) -> tuple[list, list]:
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2):
        what = f"a {len(obj)}-{type(obj).__name__}" if isinstance(obj, (tuple, list)) \
            else f"a {type(obj).__name__}"
        raise VerificationSetError(f"{path}: expected a pickled (images, issame) pair, got "
                                   f"{what}")
    bins, issame = obj
    if not isinstance(bins, (list, tuple)):
        raise VerificationSetError(f"{path}: images must be a list, got a "
                                   f"{type(bins).__name__}")
    if isinstance(issame, np.ndarray) and issame.ndim == 1:
        issame = issame.tolist()
    if not isinstance(issame, (list, tuple)):
        raise VerificationSetError(f"{path}: issame must be a list, got a "
                                   f"{type(issame).__name__}")
    if not issame:
        raise VerificationSetError(f"{path}: holds no pairs")
    if len(bins) != 2 * len(issame):
        raise VerificationSetError(f"{path}: {len(bins)} images for {len(issame)} pairs "
                                   f"(need {2 * len(issame)})")
    return list(bins), list(issame)


def _flag(value: Any, index: int, count: int, path: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    # 0/1 integers: what a bool becomes after a round trip through some serialisers
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    raise VerificationSetError(f"{path}: issame entry {index + 1} of {count} is not a bool "
                               f"({_describe(value)})")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _payload(entry: Any, index: int, count: int, path: str) -> bytes:
    if isinstance(entry, (bytes, bytearray)):
        data = bytes(entry)
    elif isinstance(entry, np.ndarray) and entry.ndim == 1 and entry.dtype == np.uint8:
        data = entry.tobytes()
    else:
        raise VerificationSetError(f"{path}: image {index + 1} of {count} is not an image "
                                   f"({_describe(entry)})")
    if sniff(data) is None:
        raise VerificationSetError(f"{path}: image {index + 1} of {count} is not an image "
                                   f"({len(data)} bytes starting {data[:8]!r})")
    return data


def read_bin(path: str | os.PathLike, size: int | None = None) -> VerificationSet:
    """Read an insightface verification ``.bin``; with ``size``, every image is resized to
    ``size`` x ``size``, else all must already be one size. Images are counted from 1 in error
    messages."""
    path = os.fspath(path)
    if size is not None and size < 1:
        raise VerificationSetError(f"{path}: image size must be at least 1, got {size}")
    bins, flags = _structure(_load(path), path)
    issame = np.array([_flag(v, i, len(flags), path) for i, v in enumerate(flags)], bool)
    decode = get_decoder("auto")
    images: np.ndarray | None = None
    for i, entry in enumerate(bins):
        data = _payload(entry, i, len(bins), path)
        try:
            image = decode(data)
        except ValueError as exc:
            raise VerificationSetError(f"{path}: image {i + 1} of {len(bins)} is not an image "
                                       f"({_one_line(exc)})") from None
        if size is not None:
            image = resize(image, size, size)
        if images is None:
            images = np.empty((len(bins),) + image.shape, np.uint8)
        elif image.shape != images.shape[1:]:
            raise VerificationSetError(
                f"{path}: image {i + 1} is {image.shape[0]}x{image.shape[1]} but image 1 is "
                f"{images.shape[1]}x{images.shape[2]}; pass a size to resize them")
        images[i] = image
    assert images is not None  # _structure refuses an empty set
    return VerificationSet(Path(path).stem, path, images, issame)


def write_bin(path: str | os.PathLike, images: list[bytes], issame: list[bool]) -> None:
    """Write encoded images and pair labels as an insightface ``.bin``; the file appears only
    when complete."""
    path = os.fspath(path)
    if len(images) != 2 * len(issame):
        raise VerificationSetError(f"{path}: {len(images)} images for {len(issame)} pairs "
                                   f"(need {2 * len(issame)})")
    payloads = []
    for i, image in enumerate(images):
        if not isinstance(image, (bytes, bytearray, memoryview)):
            raise VerificationSetError(f"{path}: image {i + 1} of {len(images)} is a "
                                       f"{type(image).__name__}, not encoded bytes")
        payloads.append(bytes(image))
    flags = [bool(v) for v in issame]
    partial = path + ".partial"
    try:
        with open(partial, "wb") as f:
            # protocol 4: Python >= 3.4 reads it, and it frames large bytes objects efficiently
            pickle.dump((payloads, flags), f, protocol=4)
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
