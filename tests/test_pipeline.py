"""The input pipeline: each rank its own part of every epoch, batches independent of the number
of loader processes, normalisation as insightface's, one-line errors for bad records, and the
input-bound verdict."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from trainperf.data.layout import open_dataset
from trainperf.data.pipeline import (DeviceFeed, RankSampler, RecordImages, default_workers,
                                     make_loader, open_feed, random_resized_crop)
from trainperf.data.recordio import IRHeader, RecordIOError, RecordWriter, pack
from trainperf.data.synth import synthesize
from trainperf.report.input import verdict


@pytest.fixture(scope="module")
def faces(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("faces") / "train")
    synthesize(prefix, identities=6, images_per_identity=5, size=112, seed=3)
    return prefix


@pytest.mark.parametrize("size,world", [(30, 2), (31, 2), (30, 3), (7, 4)])
def test_ranks_share_out_each_epoch_without_overlap(size, world):
    for epoch in range(3):
        parts = [RankSampler(size, rank, world, seed=5).epoch(epoch) for rank in range(world)]
        assert len({len(p) for p in parts}) == 1  # every rank takes as many steps
        seen = np.concatenate(parts)
        assert len(set(seen.tolist())) == len(seen) == (size // world) * world
    # Epochs are shuffled differently, and the stream runs on into the next epoch.
    sampler = RankSampler(size, 0, world, seed=5)
    assert not np.array_equal(sampler.epoch(0), sampler.epoch(1))
    stream = iter(sampler)
    first = [next(stream) for _ in range(2 * sampler.per_rank)]
    assert [e for e, _ in first] == [0] * sampler.per_rank + [1] * sampler.per_rank


def test_fewer_images_than_ranks_is_refused():
    with pytest.raises(ValueError, match="fewer than the 4 ranks"):
        RankSampler(3, 0, 4, seed=0)


def test_batches_do_not_depend_on_loader_processes(faces):
    images = RecordImages(open_dataset(faces), "auto", "face", 112, 10, seed=1)

    def first_batches(workers: int) -> list:
        loader = make_loader(images, RankSampler(len(images), 1, 2, seed=1), 4, workers, 2,
                             pin_memory=False)
        it = iter(loader)
        out = [next(it) for _ in range(5)]  # 5 x 4 > 15 per rank: into the second epoch
        del it
        return out

    for (xa, ya, sa), (xb, yb, sb) in zip(first_batches(0), first_batches(2)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert all(torch.equal(a, b) for a, b in zip(sa, sb))
        assert xa.dtype == torch.uint8 and xa.shape == (4, 112, 112, 3)


def test_labels_follow_identities_and_flips_vary(faces):
    ds = open_dataset(faces)
    images = RecordImages(ds, "auto", "face", 112, 6, seed=0)
    for index in range(len(ds)):
        _, label, _ = images[(0, index)]
        assert label == index // 5  # synth writes identity after identity
    # The same sample is flipped in some epochs and not in others.
    views = {images[(epoch, 0)][0].numpy().tobytes() for epoch in range(8)}
    assert len(views) == 2


def test_feed_normalises_as_insightface(faces):
    feed, info = open_feed(faces, task="face", size=112, num_classes=6, batch_size=4, rank=0,
                           world=1, local_world=1, seed=0, device=torch.device("cpu"),
                           workers=0)
    x, y = next(feed)
    feed.close()
    raw = RecordImages(open_dataset(faces), info["decoder"], "face", 112, 6, 0)
    first_index = RankSampler(30, 0, 1, 0).epoch(0)[0]
    pixels = raw[(0, int(first_index))][0].permute(2, 0, 1).float()
    assert x.shape == (4, 3, 112, 112) and x.dtype == torch.float32
    assert torch.allclose(x[0], (pixels - 127.5) / 128)
    assert info["images"] == 30 and info["num_classes"] == 6 and info["layout"] == "face"
    assert info["steps_per_epoch"] == 7 and info["loader_workers"] == 0


def test_a_record_that_is_not_an_image_fails_in_one_line(tmp_path):
    prefix = tmp_path / "bad"
    with RecordWriter(prefix) as w:
        w.write(0, pack(IRHeader(0, (4.0, 6.0), 0, 0), b""))
        for key in (1, 2):
            buf = io.BytesIO()
            Image.new("RGB", (112, 112), (key * 40, 0, 0)).save(buf, "JPEG")
            w.write(key, pack(IRHeader(0, 0.0, key, 0), buf.getvalue()))
        w.write(3, pack(IRHeader(0, 1.0, 3, 0), b"this is text, not a picture"))
        w.write(4, pack(IRHeader(0, (1.0, 3.0), 4, 0), b""))
        w.write(5, pack(IRHeader(0, (3.0, 4.0), 5, 0), b""))
    feed, _ = open_feed(str(prefix), task="face", size=112, num_classes=2, batch_size=3,
                        rank=0, world=1, local_world=1, seed=0, device=torch.device("cpu"),
                        workers=1)
    with pytest.raises(RecordIOError) as err:
        next(feed)
    feed.close()
    message = str(err.value)
    assert "\n" not in message
    assert "bad.rec record 3 (byte " in message and "not an image" in message


def test_more_classes_than_the_workload_is_refused(faces):
    with pytest.raises(ValueError, match="pass --num-classes 6"):
        open_feed(faces, task="face", size=112, num_classes=4, batch_size=4, rank=0, world=1,
                  local_world=1, seed=0, device=torch.device("cpu"), workers=0)


def test_imagenet_crop_is_inside_the_image_and_sized():
    image = np.arange(300 * 200 * 3, dtype=np.uint8).reshape(300, 200, 3)
    rng = random.Random(0)
    for _ in range(20):
        out = random_resized_crop(image, 64, rng)
        assert out.shape == (64, 64, 3) and out.dtype == np.uint8


def test_default_workers_leave_each_rank_a_core():
    assert default_workers(1, cpus=2) == 1
    assert default_workers(2, cpus=2) == 1
    assert default_workers(1, cpus=16) == 8
    assert default_workers(4, cpus=16) == 3


def test_feed_has_no_wait_to_report_before_a_batch(faces):
    loader = make_loader(RecordImages(open_dataset(faces), "auto", "face", 112, 6, 0),
                         RankSampler(30, 0, 1, 0), 2, 0, 2, pin_memory=False)
    feed = DeviceFeed(loader, torch.device("cpu"), (0.0,) * 3, (1.0,) * 3)
    assert feed.last_wait_s == 0.0
    next(feed)
    assert feed.last_wait_s > 0.0


@pytest.mark.parametrize("real,synth,wait,bound,words", [
    (99.0, 100.0, 0.01, False, "not input-bound: real data runs at 99.0%"),
    (50.0, 100.0, 0.45, True, "input-bound: real data runs at 50.0% of the compute-only rate "
                              "(50.0% slower); steps waited 45.0%"),
    (80.0, 100.0, 0.0, True, "slower by 20.0% though steps waited 0.0%"),
    (80.0, None, 0.30, True, "input-bound: steps waited 30.0%"),
    (80.0, None, 0.01, False, "not input-bound"),
])
def test_input_verdict(real, synth, wait, bound, words):
    v = verdict(real, synth, wait, 2)
    assert v.input_bound is bound
    assert words in v.words
    assert "2 loader processes per rank" in v.words


def test_a_gap_inside_the_spread_is_called_noise():
    assert "within the runs' spread, 12.0%" in verdict(107.0, 100.0, 0.03, 1, 0.12).words
    assert "spread" not in verdict(50.0, 100.0, 0.45, 1, 0.04).words
