"""RecordIO framing, image headers and dataset layouts (``trainperf.data.recordio``/``layout``).

The framing is checked three ways: records come back byte-identical; hand-written on-disk bytes
for split and unsplit records (what dmlc-core writes, so a framing bug cannot pass by being
consistent with itself); and, in test_data_pack.py, against MXNet itself. Every corrupt input
must fail with a RecordIOError naming the file and a byte offset or index line.
"""

from __future__ import annotations

import random
import re
import struct

import pytest

from trainperf.data.layout import FACE, FLAT, label_of, open_dataset
from trainperf.data.recordio import (IRHeader, RecordIOError, RecordReader, RecordWriter, pack,
                                     unpack)

MAGIC = struct.pack("<I", 0xCED7230A)


def word(flag: int, length: int) -> bytes:
    return MAGIC + struct.pack("<I", flag << 29 | length)


def no_magic(rng: random.Random, n: int) -> bytes:
    """Random bytes without the magic word anywhere, so only placed magic words split."""
    data = bytes(rng.randrange(256) for _ in range(n))
    return data.replace(MAGIC, b"\0" * 4)


def tricky_records() -> dict[int, bytes]:
    rng = random.Random(0)
    records = {n: no_magic(rng, n) for n in range(8)}  # 0..7 bytes: every padding length
    records.update({
        10: MAGIC,                                          # nothing but the magic: 2 empty parts
        11: MAGIC + no_magic(rng, 9),                       # split at 0
        12: no_magic(rng, 8) + MAGIC + no_magic(rng, 5),    # split in the middle
        13: no_magic(rng, 4) + MAGIC + no_magic(rng, 8) + MAGIC + no_magic(rng, 3),  # 3 parts
        14: no_magic(rng, 4) + MAGIC + MAGIC + no_magic(rng, 2),  # an empty middle part
        15: no_magic(rng, 12) + MAGIC,                      # split at the very end
        16: b"a" + MAGIC + no_magic(rng, 3),                # unaligned: no split
        17: b"ab" + MAGIC + MAGIC[:2],                      # unaligned twice over
        18: b"abc" + MAGIC,                                 # unaligned at the end
        19: no_magic(rng, 3000),
    })
    return records


def write(prefix, records: dict[int, bytes]) -> None:
    with RecordWriter(prefix) as w:
        for key, record in records.items():
            w.write(key, record)


def names_place(exc: pytest.ExceptionInfo, path) -> None:
    """The message names the file and a byte offset or an index line."""
    msg = str(exc.value)
    assert str(path) in msg, msg
    assert re.search(rf"byte \d+|{re.escape(str(path))}:\d+", msg), msg


def test_records_round_trip_byte_identical(tmp_path):
    records = tricky_records()
    write(tmp_path / "r", records)
    reader = RecordReader(tmp_path / "r")
    assert reader.keys == list(records)
    for key, record in records.items():
        assert reader.read(key) == record, key
    scanned = list(reader.scan())
    assert [offset for offset, _ in scanned] == sorted(reader.index.values())
    assert [record for _, record in scanned] == list(records.values())


@pytest.mark.parametrize("record, on_disk", [
    (b"abcde", word(0, 5) + b"abcde\0\0\0"),
    (b"", word(0, 0)),
    (MAGIC, word(1, 0) + word(3, 0)),
    (b"wxyz" + MAGIC + b"12" + b"", word(1, 4) + b"wxyz" + word(3, 2) + b"12\0\0"),
    (b"wxyz" + MAGIC + b"abcd" + MAGIC + b"1",
     word(1, 4) + b"wxyz" + word(2, 4) + b"abcd" + word(3, 1) + b"1\0\0\0"),
    (b"w" + MAGIC + b"xyz", word(0, 8) + b"w" + MAGIC + b"xyz"),
], ids=["padded", "empty", "only-magic", "2-parts", "3-parts", "unaligned"])
def test_on_disk_framing_is_dmlcs(tmp_path, record, on_disk):
    write(tmp_path / "r", {0: record})
    assert (tmp_path / "r.rec").read_bytes() == on_disk
    assert (tmp_path / "r.idx").read_text() == "0\t0\n"


def test_image_headers_with_float_and_array_labels():
    header, payload = unpack(pack(IRHeader(0, 3.0, 7, 2**40), b"\xff\xd8jpeg"))
    assert header == IRHeader(0, 3.0, 7, 2**40) and payload == b"\xff\xd8jpeg"
    header, payload = unpack(pack(IRHeader(0, (1.5, -2.0, 1e6), 8, 9), MAGIC + b"x"))
    assert header == IRHeader(3, (1.5, -2.0, 1e6), 8, 9) and payload == MAGIC + b"x"
    header, payload = unpack(pack(IRHeader(0, [4.0, 5.0], 0, 0), b""))
    assert header == IRHeader(2, (4.0, 5.0), 0, 0) and payload == b""
    assert label_of(IRHeader(0, 3.0, 0, 0)) == 3 and label_of(IRHeader(2, (4.0, 9.0), 0, 0)) == 4


def test_array_labels_through_a_file(tmp_path):
    with RecordWriter(tmp_path / "r") as w:
        w.write(5, pack(IRHeader(0, (0.25, 2.0, 3.0), 5, 1), b"ab" + MAGIC + MAGIC + b"c"))
    header, payload = RecordReader(tmp_path / "r").read_image(5)
    assert header == IRHeader(3, (0.25, 2.0, 3.0), 5, 1)
    assert payload == b"ab" + MAGIC + MAGIC + b"c"


# --- corrupt inputs ------------------------------------------------------------------------------

def test_index_pointing_into_a_record_is_bad_magic(tmp_path):
    write(tmp_path / "r", {0: b"x" * 40, 1: b"y" * 8})
    (tmp_path / "r.idx").write_text("0\t0\n1\t16\n")
    reader = RecordReader(tmp_path / "r")
    with pytest.raises(RecordIOError, match="bad magic .* at byte 16") as exc:
        reader.read(1)
    names_place(exc, tmp_path / "r.rec")


def test_index_pointing_at_a_later_part_is_refused(tmp_path):
    write(tmp_path / "r", {0: b"abcd" + MAGIC + b"efgh"})
    (tmp_path / "r.idx").write_text("0\t12\n")  # the second part's header
    with pytest.raises(RecordIOError, match="part flag 3 at byte 12") as exc:
        RecordReader(tmp_path / "r").read(0)
    names_place(exc, tmp_path / "r.rec")


def test_truncated_rec(tmp_path):
    write(tmp_path / "r", {0: b"a" * 10, 1: b"b" * 100})
    rec = tmp_path / "r.rec"
    rec.write_bytes(rec.read_bytes()[:70])  # record 1 starts at 24 and needs 108 bytes
    reader = RecordReader(tmp_path / "r")
    assert reader.read(0) == b"a" * 10
    with pytest.raises(RecordIOError, match="truncated at byte 70") as exc:
        reader.read(1)
    names_place(exc, rec)
    with pytest.raises(RecordIOError, match="truncated"):
        list(reader.scan())


def test_truncated_inside_a_split_record(tmp_path):
    write(tmp_path / "r", {0: b"abcd" + MAGIC + b"e" * 40})
    rec = tmp_path / "r.rec"
    rec.write_bytes(rec.read_bytes()[:14])  # first part whole, second part's header cut
    with pytest.raises(RecordIOError, match="truncated at byte 14") as exc:
        RecordReader(tmp_path / "r").read(0)
    names_place(exc, rec)


def test_index_offset_past_the_end(tmp_path):
    write(tmp_path / "r", {0: b"abc", 1: b"def"})
    idx = tmp_path / "r.idx"
    idx.write_text("0\t0\n1\t9999\n")
    with pytest.raises(RecordIOError, match="key 1 points at byte 9999") as exc:
        RecordReader(tmp_path / "r")
    names_place(exc, idx)
    assert f"{idx}:2" in str(exc.value)


@pytest.mark.parametrize("line", ["garbage", "1 2", "1\tx", "\t5"])
def test_index_garbage_line(tmp_path, line):
    write(tmp_path / "r", {0: b"abc"})
    idx = tmp_path / "r.idx"
    idx.write_text(f"0\t0\n{line}\n")
    with pytest.raises(RecordIOError, match="expected 'key<TAB>offset'") as exc:
        RecordReader(tmp_path / "r")
    assert f"{idx}:2" in str(exc.value)


def test_missing_files(tmp_path):
    write(tmp_path / "r", {0: b"abc"})
    (tmp_path / "r.idx").unlink()
    with pytest.raises(RecordIOError, match="no such index file") as exc:
        RecordReader(tmp_path / "r")
    assert str(tmp_path / "r.idx") in str(exc.value)
    assert RecordReader(tmp_path / "r", need_index=False).index == {}
    assert [r for _, r in RecordReader(tmp_path / "r", need_index=False).scan()] == [b"abc"]
    with pytest.raises(RecordIOError, match="no such record file"):
        RecordReader(tmp_path / "absent")


def test_record_too_short_for_an_image_header(tmp_path):
    write(tmp_path / "r", {0: b"abc", 1: b"d" * 30, 2: struct.pack("<IfQQ", 3, 0.0, 0, 0) + b"x"})
    reader = RecordReader(tmp_path / "r")
    with pytest.raises(RecordIOError, match="3 bytes is too short") as exc:
        reader.read_image(0)
    names_place(exc, tmp_path / "r.rec")
    assert "record 0" in str(exc.value)
    with pytest.raises(RecordIOError, match="announces 3 labels") as exc:
        reader.read_image(2)
    names_place(exc, tmp_path / "r.rec")
    with pytest.raises(RecordIOError, match="no record with key 7"):
        reader.read(7)


def test_duplicate_key_is_refused(tmp_path):
    with RecordWriter(tmp_path / "r") as w:
        w.write(3, b"a")
        with pytest.raises(RecordIOError, match="key 3 written twice"):
            w.write(3, b"b")


# --- layouts -------------------------------------------------------------------------------------

def write_face(prefix, per_class: list[int], header: tuple[float, float] | None = None,
               skip: tuple[int, ...] = ()) -> None:
    """insightface's face layout written record by record, independently of pack.py."""
    images = sum(per_class)
    first = 1 + images
    with RecordWriter(prefix) as w:
        w.write(0, pack(IRHeader(0, header or (first, first + len(per_class)), 0, 0), b""))
        key = 1
        for c, n in enumerate(per_class):
            for _ in range(n):
                w.write(key, pack(IRHeader(0, float(c), key, 0), b"img%d" % key))
                key += 1
        start = 1
        for c, n in enumerate(per_class):
            if first + c not in skip:
                w.write(first + c, pack(IRHeader(0, (start, start + n), first + c, 0), b""))
            start += n


def test_face_layout(tmp_path):
    write_face(tmp_path / "f", [2, 3, 1])
    ds = open_dataset(tmp_path / "f")
    assert (ds.layout, ds.image_keys, ds.num_classes, len(ds)) == (FACE, [1, 2, 3, 4, 5, 6], 3, 6)
    labels = [label_of(ds.reader.read_image(k)[0]) for k in ds.image_keys]
    assert labels == [0, 0, 1, 1, 1, 2]
    assert ds.reader.read_image(8)[0] == IRHeader(2, (3.0, 6.0), 8, 0)
    assert ds.describe() == {"prefix": str(tmp_path / "f"), "layout": FACE, "images": 6,
                             "num_classes": 3, "bytes": (tmp_path / "f.rec").stat().st_size}


def test_flat_layout(tmp_path):
    with RecordWriter(tmp_path / "flat") as w:
        for key in range(5):
            w.write(key, pack(IRHeader(0, float(key % 2), key, 0), b"img"))
    ds = open_dataset(tmp_path / "flat.rec")
    assert (ds.layout, ds.image_keys, ds.num_classes) == (FLAT, [0, 1, 2, 3, 4], None)


def test_face_header_pointing_at_missing_keys(tmp_path):
    write_face(tmp_path / "f", [2, 2], skip=(6,))  # the last identity record is absent
    with pytest.raises(RecordIOError, match="lacks key 6") as exc:
        open_dataset(tmp_path / "f")
    assert str(tmp_path / "f.rec") in str(exc.value)
    write_face(tmp_path / "g", [2, 2], header=(9.0, 11.0))  # past everything written
    with pytest.raises(RecordIOError, match="lacks key 8"):
        open_dataset(tmp_path / "g")
    write_face(tmp_path / "h", [2, 2], header=(6.0, 5.0))
    with pytest.raises(RecordIOError, match="not a range"):
        open_dataset(tmp_path / "h")


def test_empty_index_is_refused(tmp_path):
    write(tmp_path / "e", {})
    with pytest.raises(RecordIOError, match="lists no records") as exc:
        open_dataset(tmp_path / "e")
    assert str(tmp_path / "e.idx") in str(exc.value)
