"""The framework-neutral real-data feed (``trainperf.data.feed``): loader processes in
trainperf's own interpreter hand numpy uint8 batches to a worker. Its batches are torch's feed's,
pixel for pixel, whatever the number of loaders and across epochs; a bad record, a dead loader
and closing leave one-line errors and no process behind."""

from __future__ import annotations

import psutil
import pytest
import torch

from trainperf.config import DataSpec, Workload
from trainperf.data.feed import LoaderError, LoaderFeed
from trainperf.data.pipeline import open_feed
from trainperf.data.recordio import RecordIOError
from trainperf.data.synth import synthesize

WORKLOAD = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=4, embedding_size=64)


@pytest.fixture(scope="module")
def faces(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("feed") / "faces")
    synthesize(prefix, identities=6, images_per_identity=5, size=112, seed=3, val_pairs=0)
    return prefix


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_batches_are_torch_feeds_pixel_for_pixel(faces):
    loaders = 2  # batches 0, 2, 4... from one, 1, 3, 5... from the other
    before = children()
    feed = LoaderFeed(DataSpec(faces, loader_workers=loaders, prefetch_batches=2), WORKLOAD,
                      rank=1, world=2)
    torch_feed, _ = open_feed(faces, task="face", size=112, num_classes=10, batch_size=4,
                              rank=1, world=2, local_world=1, seed=WORKLOAD.seed,
                              device=torch.device("cpu"), workers=0)
    try:
        assert feed.info["loader_workers"] == loaders
        assert feed.info["steps_per_epoch"] == 3
        for _ in range(7):  # past two epochs' edges
            images, labels = next(feed)
            assert images.dtype.name == "uint8" and images.shape == (4, 112, 112, 3)
            x, y = next(torch_feed)
            # torch's feed normalises: (x - 127.5) / 128 is exact in float32 for uint8 x.
            pixels = (x * 128 + 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
            assert (pixels == images).all()
            assert (y.numpy() == labels).all()
            assert feed.last_wait_s >= 0
    finally:
        feed.close()
        torch_feed.close()
    assert children() <= before


def corrupt_record(prefix: str, tmp_path, key: int) -> str:
    """A copy of the dataset whose record ``key`` holds bytes that are no image."""
    from trainperf.data.recordio import RecordReader

    out = tmp_path / "bad"
    reader = RecordReader(prefix)
    data = bytearray(open(prefix + ".rec", "rb").read())
    start = reader.index[key]
    data[start + 40:start + 200] = b"\x00" * 160  # past the record and image headers
    (out.with_suffix(".rec")).write_bytes(bytes(data))
    (out.with_suffix(".idx")).write_text(open(prefix + ".idx").read())
    return str(out)


def test_a_bad_record_is_one_line_naming_the_file(faces, tmp_path):
    bad = corrupt_record(faces, tmp_path, key=1)
    feed = LoaderFeed(DataSpec(bad, loader_workers=2, prefetch_batches=2),
                      WORKLOAD.replace(batch_size=15), rank=0, world=1)
    try:
        with pytest.raises(LoaderError) as info:
            for _ in range(4):
                next(feed)
    finally:
        feed.close()
    message = str(info.value)
    assert "\n" not in message and f"{bad}.rec record 1" in message and "not an image" in message


def test_a_truncated_file_fails_before_any_loader_starts(faces, tmp_path):
    cut = tmp_path / "cut"
    rec = open(faces + ".rec", "rb").read()
    cut.with_suffix(".rec").write_bytes(rec[:len(rec) // 2])
    cut.with_suffix(".idx").write_text(open(faces + ".idx").read())
    before = children()
    with pytest.raises(RecordIOError, match=f"{cut}.idx.*past the end of the .rec"):
        LoaderFeed(DataSpec(str(cut)), WORKLOAD, rank=0, world=1)
    assert children() <= before


def test_a_dead_loader_is_named(faces):
    feed = LoaderFeed(DataSpec(faces, loader_workers=2, prefetch_batches=1), WORKLOAD,
                      rank=0, world=1)
    try:
        next(feed)
        feed.procs[1].kill()
        feed.procs[1].wait()
        with pytest.raises(LoaderError, match="data loader 1 of rank 0 exited with status -9"):
            for _ in range(4):  # a batch it finished before it died may still be in the pipe
                next(feed)
    finally:
        feed.close()
