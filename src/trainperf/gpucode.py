"""What GPU code a CUDA build carries, read from its shared libraries without a GPU, without
the CUDA toolkit and without importing the framework.

nvcc (and clang's CUDA) put a library's device code in a *fatbin*: a container, most often in
the ELF section ``.nv_fatbin`` (``__nv_relfatbin`` for relocatable device code), holding one
entry per compiled variant. Each entry is either a cubin (SASS for one SM architecture,
``sm_XY``) or PTX (the virtual ISA of ``compute_XY``, which the driver compiles for the GPU
at hand when no cubin fits). The layout read here, all little-endian:

- container header, 16 bytes: magic ``0xBA55ED50`` (u32), version 1 (u16), the header's own
  size (u16, 16), and the size of the entries that follow it (u64). Several containers may lie
  back to back in one section, each padded with zeros to 8 bytes.
- entry header, ``header size`` bytes (64; 80 or 96 for the newest architectures): kind (u16 at
  0: 1 PTX, 2 cubin; others, such as LTO IR, are counted apart), the header's size (u32 at 4),
  the payload's size padded to 8 bytes (u64 at 8), the payload's stored size (u32 at 16), the
  format version (u32 at 24: minor in its low half, major in its high half; for PTX it is the
  PTX ISA version, ``.version 7.7`` in the text), the SM architecture (u32 at 28: 90 for
  ``sm_90``/``compute_90``), flags (u64 at 40: ``0x2000`` marks a compressed payload) and the
  payload's size once expanded (u64 at 56). The next entry starts header size + padded size
  after this one; the last ends exactly where the container says it ends.

Only the headers are read: a compressed payload is stepped over, never expanded, since what
the check needs (kind, architecture, PTX version) is in the header. A library may also hold a
fatbin as plain data (one it loads itself at run time); containers found by their magic in its
other sections, and whose entries parse to the container's end, are counted as ``embedded``.

A wheel is read member by member: each ELF member is expanded once into a temporary file and
mapped, so that a library of 1.7 GB costs disk, not memory. The summary of a wheel (a small
JSON) is kept beside it (``<wheel>.gpucode.json``) and reused while the wheel's size and time
are those it was read from.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

ELF_MAGIC = b"\x7fELF"
FATBIN_MAGIC = 0xBA55ED50
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
KIND_PTX = 1
KIND_CUBIN = 2
FLAG_COMPRESSED = 0x2000
CONTAINER = struct.Struct("<IHHQ")
ENTRY_MIN = 64
SUMMARY_FORMAT = 1
"""Bumped whenever what a summary records changes, so that an older one is read again."""
SUMMARY_SUFFIX = ".gpucode.json"


class FatbinError(ValueError):
    """Bytes that claim to be a fatbin (or an ELF file) and do not parse as one."""


@dataclass(frozen=True)
class Entry:
    kind: int
    """``KIND_PTX``, ``KIND_CUBIN`` or another kind (LTO IR...), as the header says."""
    sm: int
    """The architecture: 90 for ``sm_90`` (a cubin) or ``compute_90`` (PTX)."""
    version: tuple[int, int]
    """For PTX, its ISA version (7, 7); for a cubin, the cubin format's version."""
    compressed: bool


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    size: int
    nobits: bool


def elf_sections(data) -> list[Section]:
    """The section headers of a 64-bit little-endian ELF file (every CUDA library on x86_64
    and aarch64 Linux is one); FatbinError for anything else that starts as ELF."""
    if bytes(data[:4]) != ELF_MAGIC:
        raise FatbinError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    if len(data) < 64:
        raise FatbinError("ELF header cut short")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shnum == 0:
        return []
    if shentsize < 64 or shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise FatbinError("ELF section headers lie outside the file")
    raw = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at, names_size = raw[shstrndx][4], raw[shstrndx][5]
    out = []
    for name_off, kind, _flags, _addr, offset, size in raw:
        start = names_at + name_off
        end = data.find(b"\0", start, names_at + names_size) if start < len(data) else -1
        name = bytes(data[start:end]).decode("ascii", "replace") if end >= 0 else ""
        nobits = kind == 8  # SHT_NOBITS: takes no room in the file (.bss)
        if not nobits and offset + size > len(data):
            raise FatbinError(f"ELF section {name or '?'} runs past the end of the file")
        out.append(Section(name, offset, size, nobits))
    return out


def container_entries(data, at: int, end: int) -> tuple[list[Entry], int]:
    """The entries of the container whose header is at ``at`` (none of it past ``end``), and
    where the container ends. FatbinError where it does not parse to its own end."""
    if at + CONTAINER.size > end:
        raise FatbinError(f"fatbin header at {at} cut short")
    magic, version, header, size = CONTAINER.unpack_from(data, at)
    if magic != FATBIN_MAGIC:
        raise FatbinError(f"no fatbin magic at {at}")
    if version != 1 or header < CONTAINER.size:
        raise FatbinError(f"fatbin at {at}: version {version}, header {header} bytes")
    stop = at + header + size
    if stop > end:
        raise FatbinError(f"fatbin at {at} runs {stop - end} bytes past its section")
    entries = []
    pos = at + header
    while pos < stop:
        if pos + ENTRY_MIN > stop:
            raise FatbinError(f"fatbin entry at {pos} cut short")
        kind, _, head = struct.unpack_from("<HHI", data, pos)
        padded, stored = struct.unpack_from("<QI", data, pos + 8)
        minor, major, sm = struct.unpack_from("<HHI", data, pos + 24)
        flags, = struct.unpack_from("<Q", data, pos + 40)
        if head < ENTRY_MIN or stored > padded or pos + head + padded > stop:
            raise FatbinError(f"fatbin entry at {pos}: header {head} bytes, payload {stored} "
                              f"of {padded}, past the container's end at {stop}")
        entries.append(Entry(kind, sm, (major, minor), bool(flags & FLAG_COMPRESSED)))
        pos += head + padded
    return entries, stop


def section_entries(data, section: Section) -> tuple[list[Entry], int]:
    """Every entry of the containers lying back to back in ``section``, and how many
    containers there were."""
    entries: list[Entry] = []
    pos, end, count = section.offset, section.offset + section.size, 0
    while pos < end:
        if data[pos] == 0:  # zeros pad one container to the next one's alignment
            pos += 1
            continue
        found, pos = container_entries(data, pos, end)
        entries += found
        count += 1
    return entries, count


MAGIC_BYTES = struct.pack("<I", FATBIN_MAGIC)


def embedded_entries(data, section: Section) -> tuple[list[Entry], int]:
    """Fatbins kept as plain data in ``section``: each place its bytes start with the magic
    and parse as a whole container. A chance match of the 4 magic bytes (one in 4 billion
    places) fails to parse and is passed over."""
    entries: list[Entry] = []
    count = 0
    pos, end = section.offset, section.offset + section.size
    while True:
        pos = data.find(MAGIC_BYTES, pos, end)
        if pos < 0:
            return entries, count
        try:
            found, stop = container_entries(data, pos, end)
        except FatbinError:
            pos += 1
            continue
        entries += found
        count += 1
        pos = stop


@dataclass(frozen=True)
class LibraryCode:
    """One library's device code."""

    cubins: tuple[int, ...]
    """SM architectures with a cubin, ascending."""
    ptx: tuple[tuple[int, str], ...]
    """(architecture, highest PTX ISA version for it), ascending."""
    other: int = 0
    """Entries of another kind (LTO IR...), which the driver does not run."""
    entries: int = 0
    containers: int = 0
    compressed: int = 0
    embedded: int = 0
    """Containers found as plain data outside the fatbin sections."""

    def to_json(self) -> dict:
        return {"cubin": list(self.cubins), "ptx": [[sm, v] for sm, v in self.ptx],
                "other": self.other, "entries": self.entries, "containers": self.containers,
                "compressed": self.compressed, "embedded": self.embedded}

    @classmethod
    def from_json(cls, d: dict) -> "LibraryCode":
        return cls(tuple(d["cubin"]), tuple((sm, v) for sm, v in d["ptx"]), d["other"],
                   d["entries"], d["containers"], d["compressed"], d["embedded"])


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def summarize(entries: Iterable[Entry], containers: int = 0, embedded: int = 0
              ) -> LibraryCode:
    entries = list(entries)
    ptx: dict[int, str] = {}
    for e in entries:
        if e.kind == KIND_PTX:
            text = f"{e.version[0]}.{e.version[1]}"
            if e.sm not in ptx or _version_key(text) > _version_key(ptx[e.sm]):
                ptx[e.sm] = text
    return LibraryCode(
        cubins=tuple(sorted({e.sm for e in entries if e.kind == KIND_CUBIN})),
        ptx=tuple(sorted(ptx.items())),
        other=sum(1 for e in entries if e.kind not in (KIND_PTX, KIND_CUBIN)),
        entries=len(entries), containers=containers,
        compressed=sum(1 for e in entries if e.compressed), embedded=embedded)


def library_code(data) -> LibraryCode | None:
    """The device code of one ELF library in ``data`` (bytes or a mapping); None where it
    holds none. FatbinError where a fatbin section does not parse."""
    entries: list[Entry] = []
    containers = embedded = 0
    for section in elf_sections(data):
        if section.nobits or not section.size:
            continue
        if section.name in FATBIN_SECTIONS:
            found, n = section_entries(data, section)
            containers += n
        else:
            found, n = embedded_entries(data, section)
            embedded += n
        entries += found
    if not entries:
        return None
    return summarize(entries, containers + embedded, embedded)


def file_code(path: Path) -> LibraryCode | None:
    """``library_code`` of a file on disk (mapped, not read into memory); None for a file that
    is not ELF or holds no device code."""
    with open(path, "rb") as f:
        if f.read(4) != ELF_MAGIC:
            return None
        size = os.fstat(f.fileno()).st_size
        if size < 64:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return library_code(data)


def _library_name(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return base.endswith(".so") or ".so." in base


def wheel_code(wheel: Path, scratch: Path | None = None) -> dict[str, LibraryCode]:
    """The device code of every shared library in ``wheel``, by its path in the wheel. Each
    library is expanded into a temporary file in ``scratch`` (default: beside the wheel) and
    mapped; one at a time, removed once read."""
    out: dict[str, LibraryCode] = {}
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir() or not _library_name(info.filename) or info.file_size < 64:
                continue
            with zf.open(info) as member, tempfile.TemporaryFile(
                    dir=scratch or wheel.parent) as tmp:
                head = member.read(4)
                if head != ELF_MAGIC:
                    continue
                tmp.write(head)
                shutil.copyfileobj(member, tmp, 1 << 22)
                tmp.flush()
                with mmap.mmap(tmp.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    try:
                        code = library_code(data)
                    except FatbinError as exc:
                        raise FatbinError(f"{wheel.name}: {info.filename}: {exc}") from None
            if code is not None:
                out[info.filename] = code
    return out


def tree_code(folder: Path) -> dict[str, LibraryCode]:
    """The device code of every shared library under ``folder`` (an installed environment),
    by its path relative to the folder; links are not followed, so each file counts once."""
    out: dict[str, LibraryCode] = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            if not _library_name(name) or path.is_symlink():
                continue
            try:
                code = file_code(path)
            except FatbinError as exc:
                raise FatbinError(f"{path}: {exc}") from None
            if code is not None:
                out[str(path.relative_to(folder))] = code
    return out


def summary_path(wheel: Path) -> Path:
    return wheel.with_name(wheel.name + SUMMARY_SUFFIX)


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def read_wheel(wheel: Path) -> dict:
    """The wheel's summary: its libraries' device code, its size, and how long reading it
    took. Kept beside the wheel and reused while the wheel is the one it was read from."""
    cached = summary_path(wheel)
    stamp = _stamp(wheel)
    try:
        doc = json.loads(cached.read_text(encoding="utf-8"))
        if doc.get("format") == SUMMARY_FORMAT and all(doc.get(k) == v
                                                        for k, v in stamp.items()):
            return doc
    except (OSError, json.JSONDecodeError):
        pass
    started = time.monotonic()
    libraries = wheel_code(wheel)
    doc = {"format": SUMMARY_FORMAT, "wheel": wheel.name, **stamp,
           "read_s": round(time.monotonic() - started, 2),
           "libraries": {k: v.to_json() for k, v in sorted(libraries.items())}}
    tmp = cached.with_name(cached.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, cached)
    return doc


def libraries_of(doc: dict) -> dict[str, LibraryCode]:
    return {k: LibraryCode.from_json(v) for k, v in doc["libraries"].items()}


def sm_text(sms: Iterable[int], prefix: str = "sm_") -> str:
    """``sm_35..sm_86`` style ranges would hide gaps; every architecture is named."""
    return ", ".join(f"{prefix}{sm}" for sm in sms) or "none"
