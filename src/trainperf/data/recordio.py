"""MXNet RecordIO (``.rec`` + ``.idx``) read and written with the standard library alone.

The on-disk format, as dmlc-core writes it:

- A record is one or more *parts*. Each part is the magic word ``0xced7230a`` (little-endian
  uint32), a length word, the part's bytes, and zero padding up to a multiple of 4 bytes.
- The length word holds the part's byte count in its low 29 bits and a continuation flag in its
  top 3: 0 a whole record, 1 its first part, 2 a middle part, 3 its last part.
- The writer splits a record wherever its payload holds the magic word at a 4-byte-aligned
  offset, and drops that word: the reader puts it back between the parts. So a reader that
  lost its place can find the next record by scanning for the magic.
- ``.idx`` is text, one ``key<TAB>byte offset`` line per record.

The image record payload starts with ``IRHeader``: ``flag`` (uint32), ``label`` (float32),
``id``, ``id2`` (uint64). When ``flag`` > 0 the label is an array of ``flag`` float32 that
follows the header (and ``label`` is 0); the image bytes come last.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterator, NamedTuple

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_WORD = struct.Struct("<II")
_HEADER = struct.Struct("<IfQQ")
LENGTH_BITS = 29
MAX_PART = (1 << LENGTH_BITS) - 1
WHOLE, FIRST, MIDDLE, LAST = 0, 1, 2, 3


class RecordIOError(ValueError):
    """A RecordIO file that does not follow the format; the message names the file and where."""


class IRHeader(NamedTuple):
    flag: int
    label: float | tuple[float, ...]
    id: int
    id2: int


def pack(header: IRHeader, payload: bytes) -> bytes:
    """An image record: the header (an array label sets ``flag`` to its length) and payload."""
    if isinstance(header.label, (tuple, list)):
        labels = tuple(float(v) for v in header.label)
        return (_HEADER.pack(len(labels), 0.0, header.id, header.id2)
                + struct.pack(f"<{len(labels)}f", *labels) + payload)
    return _HEADER.pack(0, float(header.label), header.id, header.id2) + payload


def unpack(record: bytes, where: str = "record") -> tuple[IRHeader, bytes]:
    """(header, image bytes) of an image record; an array label comes back as a tuple."""
    if len(record) < _HEADER.size:
        raise RecordIOError(f"{where}: {len(record)} bytes is too short for an image header "
                            f"({_HEADER.size} bytes)")
    flag, label, id_, id2 = _HEADER.unpack_from(record)
    body = record[_HEADER.size:]
    if flag > 0:
        if len(body) < 4 * flag:
            raise RecordIOError(f"{where}: header announces {flag} labels but the record ends "
                                f"after {len(body)} bytes")
        label = struct.unpack_from(f"<{flag}f", body)
        body = body[4 * flag:]
    return IRHeader(flag, label, id_, id2), body


def _split(record: bytes) -> list[bytes]:
    """The parts of a record: cut at each 4-byte-aligned magic word, which is dropped."""
    parts, begin = [], 0
    i = record.find(_MAGIC_BYTES)
    while i >= 0:
        if i % 4 == 0:
            parts.append(record[begin:i])
            begin = i + 4
            i = record.find(_MAGIC_BYTES, begin)
        else:
            i = record.find(_MAGIC_BYTES, i + 1)
    parts.append(record[begin:])
    return parts


def encode_record(record: bytes) -> bytes:
    """The bytes a record takes on disk (its parts, framed and padded)."""
    if len(record) > MAX_PART:
        raise RecordIOError(f"a record holds at most {MAX_PART} bytes, got {len(record)}")
    parts = _split(record)
    out = bytearray()
    for n, part in enumerate(parts):
        if len(parts) == 1:
            flag = WHOLE
        else:
            flag = FIRST if n == 0 else LAST if n == len(parts) - 1 else MIDDLE
        out += _WORD.pack(MAGIC, (flag << LENGTH_BITS) | len(part)) + part
        out += b"\0" * (-len(part) % 4)
    return bytes(out)


def paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """``PREFIX.rec`` and ``PREFIX.idx``; a prefix that already ends in ``.rec`` is taken as is."""
    p = Path(prefix)
    if p.suffix in (".rec", ".idx"):
        p = p.with_suffix("")
    return p.with_name(p.name + ".rec"), p.with_name(p.name + ".idx")


class RecordWriter:
    """Appends records to ``.rec`` and their offsets to ``.idx``."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.rec_path, self.idx_path = paths(prefix)
        self.rec_path.parent.mkdir(parents=True, exist_ok=True)
        self._rec = open(self.rec_path, "wb")
        self._idx = open(self.idx_path, "w", encoding="ascii")
        self._keys: set[int] = set()

    def write(self, key: int, record: bytes) -> None:
        if key in self._keys:
            raise RecordIOError(f"{self.idx_path}: key {key} written twice")
        encoded = encode_record(record)  # first: a record refused leaves no index line behind
        self._keys.add(key)
        self._idx.write(f"{key}\t{self._rec.tell()}\n")
        self._rec.write(encoded)

    def close(self) -> None:
        self._rec.close()
        self._idx.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_index(idx_path: Path, rec_size: int) -> dict[int, int]:
    """key -> byte offset, checked: every line two integers, every offset inside the file."""
    index: dict[int, int] = {}
    try:
        text = idx_path.read_text(encoding="ascii")
    except FileNotFoundError:
        raise RecordIOError(f"{idx_path}: no such index file") from None
    except UnicodeDecodeError as exc:
        raise RecordIOError(f"{idx_path}: not a text index (byte {exc.start})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        try:
            key, offset = int(fields[0]), int(fields[1])
        except (IndexError, ValueError):
            raise RecordIOError(f"{idx_path}:{lineno}: expected 'key<TAB>offset', got "
                                f"{line[:60]!r}") from None
        if not 0 <= offset <= rec_size - _WORD.size:
            raise RecordIOError(f"{idx_path}:{lineno}: key {key} points at byte {offset}, past "
                                f"the end of the .rec ({rec_size} bytes)")
        index[key] = offset
    return index


class RecordReader:
    """Random access to the records of a ``.rec`` through its ``.idx``.

    Reads with ``os.pread`` on a descriptor opened per process, so loader processes forked
    from the one that opened the reader each get their own and never share a file position.
    """

    def __init__(self, prefix: str | os.PathLike, need_index: bool = True) -> None:
        self.rec_path, self.idx_path = paths(prefix)
        try:
            self.size = self.rec_path.stat().st_size
        except FileNotFoundError:
            raise RecordIOError(f"{self.rec_path}: no such record file") from None
        self.index = (read_index(self.idx_path, self.size)
                      if need_index or self.idx_path.exists() else {})
        self._fd: int | None = None
        self._pid = -1

    @property
    def keys(self) -> list[int]:
        return list(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def _descriptor(self) -> int:
        if self._pid != os.getpid():
            self._fd = os.open(self.rec_path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._fd

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd, self._pid = None, -1

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_fd"], state["_pid"] = None, -1  # a descriptor means nothing in another process
        return state

    def _pread(self, length: int, offset: int) -> bytes:
        data = os.pread(self._descriptor(), length, offset)
        if len(data) < length:
            raise RecordIOError(f"{self.rec_path}: truncated at byte {offset + len(data)} "
                                f"(wanted {length} bytes at {offset}, file ends at {self.size})")
        return data

    def read_at(self, offset: int) -> tuple[bytes, int]:
        """The record that starts at ``offset`` and the offset just past it."""
        parts: list[bytes] = []
        pos = offset
        while True:
            magic, word = _WORD.unpack(self._pread(_WORD.size, pos))
            if magic != MAGIC:
                raise RecordIOError(f"{self.rec_path}: bad magic 0x{magic:08x} at byte {pos} "
                                    "(not a record start; wrong .idx or a corrupt file)")
            flag, length = word >> LENGTH_BITS, word & MAX_PART
            expected = (WHOLE, FIRST) if not parts else (MIDDLE, LAST)
            if flag not in expected:
                raise RecordIOError(f"{self.rec_path}: part flag {flag} at byte {pos} where "
                                    f"{' or '.join(map(str, expected))} belongs")
            parts.append(self._pread(length, pos + _WORD.size))
            pos += _WORD.size + length + (-length % 4)
            if flag in (WHOLE, LAST):
                return _MAGIC_BYTES.join(parts), pos

    def read(self, key: int) -> bytes:
        try:
            offset = self.index[key]
        except KeyError:
            raise RecordIOError(f"{self.idx_path}: no record with key {key}") from None
        return self.read_at(offset)[0]

    def read_image(self, key: int) -> tuple[IRHeader, bytes]:
        return unpack(self.read(key), f"{self.rec_path} record {key} "
                                      f"(byte {self.index.get(key)})")

    def scan(self) -> Iterator[tuple[int, bytes]]:
        """Every record in file order, with its offset, without the index."""
        pos = 0
        while pos < self.size:
            record, end = self.read_at(pos)
            yield pos, record
            pos = end
