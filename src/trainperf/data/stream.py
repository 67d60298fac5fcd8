"""One rank's stream of training samples, without torch: which (epoch, sample) pairs a rank
reads (``RankSampler``) and what one sample becomes (``SampleReader``: read, decoded and
augmented into a uint8 HWC image). torch's ``DataLoader`` path (``pipeline``) and the loader
processes that feed every other framework (``loader_process``) both draw from here, so a
batch is the same pixels whichever framework trains on it.

numpy, the standard library and the decoders only: the loader processes run it in trainperf's
own interpreter, never in a framework's environment.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Iterator

import numpy as np

from . import decode
from .layout import Dataset, label_of
from .recordio import RecordIOError


class RankSampler:
    """(epoch, sample) pairs for one rank, epoch after epoch.

    Every rank draws the same permutation of an epoch (seeded by seed and epoch), drops its
    tail so it splits evenly, and takes every ``world``-th entry from its rank on.
    """

    def __init__(self, size: int, rank: int, world: int, seed: int, shuffle: bool = True,
                 start: int = 0) -> None:
        if size < world:
            raise ValueError(f"the dataset holds {size} images, fewer than the {world} ranks")
        self.size, self.rank, self.world = size, rank, world
        self.seed, self.shuffle = seed, shuffle
        self.per_rank = size // world
        self.start = start
        """Samples of this rank's stream to skip (a resumed training run goes on from there)."""

    def epoch(self, epoch: int) -> np.ndarray:
        order = (np.random.default_rng([self.seed, epoch]).permutation(self.size)
                 if self.shuffle else np.arange(self.size))
        return order[:self.per_rank * self.world][self.rank::self.world]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        first_epoch, skip = divmod(self.start, self.per_rank)
        for epoch in itertools.count(first_epoch):
            for index in self.epoch(epoch)[skip:]:
                yield epoch, int(index)
            skip = 0


def random_resized_crop(image: np.ndarray, size: int, rng: random.Random,
                        scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
    """ImageNet training crop: a random area and aspect ratio, resized to size x size (the
    centre crop after ten misses, as the usual recipe does)."""
    height, width = image.shape[:2]
    area = height * width
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return decode.resize(image[top:top + h, left:left + w], size, size)
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    return decode.resize(image[top:top + side, left:left + side], size, size)


class SampleReader:
    """Sample (epoch, index) of a dataset as a C-contiguous uint8 HWC image of the workload's
    size and its label. Face images are resized to the input size where they differ;
    classification images get the ImageNet crop; both a horizontal flip half the time. Each
    sample's draw is seeded by (seed, epoch, sample), so it does not depend on which process
    reads it."""

    def __init__(self, dataset: Dataset, decoder: str, task: str, size: int,
                 num_classes: int, seed: int) -> None:
        self.dataset = dataset
        self.decoder_name = decode.resolve(decoder)
        self._decode = None  # made on first use: decoder modules are not picklable
        self.task, self.size, self.num_classes, self.seed = task, size, num_classes, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def read(self, epoch: int, index: int) -> tuple[np.ndarray, int]:
        key = self.dataset.image_keys[index]
        reader = self.dataset.reader
        header, payload = reader.read_image(key)
        where = f"{reader.rec_path} record {key} (byte {reader.index[key]})"
        label = label_of(header)
        if not 0 <= label < self.num_classes:
            raise RecordIOError(f"{where}: label {label} is outside the workload's "
                                f"{self.num_classes} classes (pass --num-classes)")
        if self._decode is None:
            self._decode = decode.get_decoder(self.decoder_name)
        try:
            image = self._decode(payload)
        except ValueError as exc:
            raise RecordIOError(f"{where}: not an image ({exc})") from None
        # The stdlib's generator is seeded several times faster than numpy's.
        draw = random.Random(hash((self.seed, epoch, index)))
        if self.task == "face":
            if image.shape[:2] != (self.size, self.size):
                image = decode.resize(image, self.size, self.size)
        else:
            image = random_resized_crop(image, self.size, draw)
        if draw.random() < 0.5:
            image = decode.flip_horizontal(image)
        return np.ascontiguousarray(image), label
