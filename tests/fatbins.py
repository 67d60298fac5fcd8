"""Small ELF libraries with fatbins in them, made byte by byte for the reader's tests
(``trainperf.gpucode``): the layout its docstring describes, nothing taken from a toolkit."""

from __future__ import annotations

import struct

from trainperf import gpucode

FLAGS_64BIT_LINUX = 0x11
"""What every entry read from the real wheels has set besides compression (64-bit, Linux)."""


def entry(kind: int, sm: int, version: tuple[int, int] = (1, 7), payload: bytes = b"code",
          compressed: bool = False, header: int = 64, expanded: int | None = None) -> bytes:
    """One fatbin entry: its header (``header`` bytes, zeros past the 64 described) and its
    payload padded to 8 bytes."""
    padded = -(-len(payload) // 8) * 8
    flags = FLAGS_64BIT_LINUX | (gpucode.FLAG_COMPRESSED if compressed else 0)
    head = struct.pack("<HHIQIIHHIIIQQQ", kind, 0x0101, header, padded, len(payload), 0,
                       version[1], version[0], sm, 0, 0, flags, 0,
                       expanded if expanded is not None else len(payload))
    # A header said to be shorter than 64 bytes is written whole all the same: it is the
    # size field that the reader must not trust.
    return head + bytes(max(0, header - len(head))) + payload + bytes(padded - len(payload))


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", gpucode.FATBIN_MAGIC, 1, 16, len(body)) + body


def elf(sections: list[tuple[str, bytes]], bss: int = 0, bits: int = 64) -> bytes:
    """A 64-bit little-endian shared object holding ``sections`` (name, bytes), a string table
    of their names and, with ``bss``, a .bss of that many bytes that takes no room in the
    file. ``bits=32`` marks the header as a 32-bit file (the rest stays 64-bit)."""
    names = bytearray(b"\0")
    name_at = []
    for name, _ in sections + ([(".bss", b"")] if bss else []) + [(".shstrtab", b"")]:
        name_at.append(len(names))
        names += name.encode() + b"\0"
    body = bytearray(64)
    placed = []
    for _, data in sections:
        body += bytes(-len(body) % 8)
        placed.append((len(body), len(data)))
        body += data
    strtab_at = len(body)
    body += names
    body += bytes(-len(body) % 8)
    shoff = len(body)
    headers = [bytes(64)]  # section 0 is null
    for i, (offset, size) in enumerate(placed):
        headers.append(struct.pack("<IIQQQQIIQQ", name_at[i], 1, 2, 0, offset, size, 0, 0, 8, 0))
    if bss:
        headers.append(struct.pack("<IIQQQQIIQQ", name_at[len(placed)], 8, 3, 0, len(body) + 4096,
                                   bss, 0, 0, 8, 0))
    headers.append(struct.pack("<IIQQQQIIQQ", name_at[-1], 3, 0, 0, strtab_at, len(names), 0, 0,
                               1, 0))
    body += b"".join(headers)
    ident = b"\x7fELF" + bytes([2 if bits == 64 else 1, 1, 1]) + bytes(9)
    body[:64] = struct.pack("<16sHHIQQQIHHHHHH", ident, 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64,
                            len(headers), len(headers) - 1)
    return bytes(body)
