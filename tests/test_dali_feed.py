"""`--decoder dali`: NVIDIA DALI's RecordIO reader, run CPU-only here (its CPU decoder, the
same pipeline code as on a GPU but for the device). Every batch pairs each image with its own
label, normalised as insightface's, and two ranks read disjoint samples of an epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainperf.data import decode
from trainperf.data.layout import label_of, open_dataset
from trainperf.data.pipeline import open_feed
from trainperf.data.synth import synthesize

IDENTITIES, PER_IDENTITY, BATCH = 4, 6, 4


@pytest.fixture(scope="module")
def faces(tmp_path_factory, dali_site) -> str:
    prefix = str(tmp_path_factory.mktemp("dali") / "faces")
    synthesize(prefix, IDENTITIES, PER_IDENTITY, seed=11)
    return prefix


def references(prefix: str) -> list[tuple[np.ndarray, int]]:
    """Each image record's pixels (normalised as the feed does) and label, in key order."""
    ds = open_dataset(prefix)
    out = []
    for key in ds.image_keys:
        header, payload = ds.reader.read_image(key)
        pixels = decode.get_decoder("pillow")(payload).astype(np.float32)
        out.append(((pixels.transpose(2, 0, 1) - 127.5) / 128, label_of(header)))
    return out


def identify(image: torch.Tensor, refs) -> tuple[int, int]:
    """(sample, label) of the reference this image is, flipped or not."""
    x = image.numpy()
    for index, (ref, label) in enumerate(refs):
        if np.abs(x - ref).max() < 1e-5 or np.abs(x - ref[:, :, ::-1]).max() < 1e-5:
            return index, label
    raise AssertionError("a batch image matches no record of the dataset")


def test_dali_batches_pair_images_with_their_labels_on_disjoint_shards(faces):
    refs = references(faces)
    seen = {}
    for rank in (0, 1):
        feed, info = open_feed(faces, task="face", size=112, num_classes=IDENTITIES,
                               batch_size=BATCH, rank=rank, world=2, local_world=2, seed=0,
                               device=torch.device("cpu"), decoder="dali", workers=1)
        assert info["decoder"] == "dali" and info["dali_decoder"] == "cpu"
        assert info["steps_per_epoch"] == IDENTITIES * PER_IDENTITY // 2 // BATCH
        samples = []
        for _ in range(info["steps_per_epoch"]):
            x, y = next(feed)
            assert x.shape == (BATCH, 3, 112, 112) and x.dtype == torch.float32
            assert y.dtype == torch.int64
            for image, label in zip(x, y.tolist()):
                index, true_label = identify(image, refs)
                assert label == true_label
                samples.append(index)
        next(feed)  # into the next epoch: the reader resets itself
        feed.close()
        assert len(set(samples)) == len(samples)
        seen[rank] = set(samples)
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == IDENTITIES * PER_IDENTITY


def test_dali_channels_last_is_a_view_of_nhwc(faces):
    feed, _ = open_feed(faces, task="face", size=112, num_classes=IDENTITIES, batch_size=BATCH,
                        rank=0, world=1, local_world=1, seed=0, device=torch.device("cpu"),
                        decoder="dali", workers=1, channels_last=True)
    x, _ = next(feed)
    feed.close()
    assert x.shape == (BATCH, 3, 112, 112)
    assert x.is_contiguous(memory_format=torch.channels_last)
