"""The input pipeline of real-data runs (torch): RecordIO -> decode -> augment -> device.

- Loader processes read, decode and augment; they hand over uint8 HWC batches, a quarter of
  the bytes of float ones, and the normalisation runs on the device after the copy.
- Each sample's augmentation is drawn from (seed, epoch, sample), so a batch is the same
  whatever the number of loader processes.
- ``RankSampler`` walks epochs without end: every epoch is one shuffle shared by all ranks, and
  each rank takes its own disjoint part of it, so the stream never restarts its processes at
  an epoch's edge.
- ``DeviceFeed`` keeps the next batch's copy in flight on a side stream (GPU) while the current
  step runs, and measures how long the host waited for each batch.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader

from . import decode
from .dali_feed import open_dali_feed
from .layout import Dataset, label_of, open_dataset
from .recordio import RecordIOError

FACE_MEAN, FACE_STD = (127.5,) * 3, (128.0,) * 3  # insightface: (x - 127.5) / 128
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def default_workers(local_ranks: int, cpus: int | None = None) -> int:
    """The host's cores per rank less one (the training process keeps a core), 1 to 8."""
    per_rank = (cpus or os.cpu_count() or 1) // max(1, local_ranks)
    return max(1, min(8, per_rank - 1))


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


class RecordImages(torch.utils.data.Dataset):
    """Decoded, augmented images of a RecordIO dataset, as uint8 HWC tensors and int labels."""

    def __init__(self, dataset: Dataset, decoder: str, task: str, size: int,
                 num_classes: int, seed: int) -> None:
        self.dataset = dataset
        self.decoder_name = decode.resolve(decoder)
        self._decode = None  # made in each loader process: decoder modules are not picklable
        self.task, self.size, self.num_classes, self.seed = task, size, num_classes, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> tuple[torch.Tensor, int, tuple[int, int]]:
        epoch, index = item
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
        # A generator per sample, seeded by the sample: the draw does not depend on which
        # process serves it. The stdlib's is seeded several times faster than numpy's.
        draw = random.Random(hash((self.seed, epoch, index)))
        if self.task == "face":
            if image.shape[:2] != (self.size, self.size):
                image = decode.resize(image, self.size, self.size)
        else:
            image = random_resized_crop(image, self.size, draw)
        if draw.random() < 0.5:
            image = decode.flip_horizontal(image)
        return torch.from_numpy(np.ascontiguousarray(image)), label, item


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


def first_image_size(dataset: Dataset) -> tuple[int, int]:
    """(height, width) of the first image: face datasets hold one size throughout."""
    header, payload = dataset.reader.read_image(dataset.image_keys[0])
    return tuple(decode.get_decoder("auto")(payload).shape[:2])


def make_loader(images: RecordImages, sampler: RankSampler, batch_size: int, workers: int,
                prefetch_batches: int, pin_memory: bool) -> DataLoader:
    extra = ({"persistent_workers": True, "prefetch_factor": prefetch_batches}
             if workers > 0 else {})
    return DataLoader(images, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=pin_memory, drop_last=True, **extra)


def stop_loader(iterator) -> None:
    """Stop a loader iterator's processes now rather than at interpreter exit."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown:
        shutdown()


def one_line(exc: ValueError) -> ValueError:
    """A loader process's error as its own one line: torch re-raises it with the process's
    whole traceback as the message."""
    lines = str(exc).strip().splitlines()
    if len(lines) > 1 and lines[0].startswith("Caught "):
        return type(exc)(lines[-1].split(": ", 1)[-1])
    return exc


class DeviceFeed:
    """Normalised NCHW batches on the device; ``last_wait_s`` is how long the host waited for
    the loader's latest batch (on the CPU, its normalisation included: that too is time the
    step does not compute)."""

    def __init__(self, loader: DataLoader, device: torch.device, mean: tuple[float, ...],
                 std: tuple[float, ...], channels_last: bool = False,
                 trace: str | None = None) -> None:
        self.loader, self.device = loader, device
        self.trace = trace
        """A file that gets the (epoch, sample) pairs of every batch (for tests)."""
        self.channels_last = channels_last
        self._it = iter(loader)
        self.mean = torch.tensor(mean, device=device).view(1, 3, 1, 1)
        self.inv_std = 1.0 / torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.last_wait_s = 0.0
        self._ready = None
        if self.stream is not None:
            self._ready = self._stage(*self._fetch())  # one batch ahead: its copy overlaps

    def _fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        begin = time.perf_counter()
        try:
            images, labels, samples = next(self._it)
        except ValueError as exc:
            raise one_line(exc) from None
        self.last_wait_s = time.perf_counter() - begin
        if self.trace:
            epochs, indices = samples
            with open(self.trace, "a", encoding="ascii") as f:
                f.writelines(f"{e} {i}\n" for e, i in zip(epochs.tolist(), indices.tolist()))
        return images, labels

    def _normalise(self, images: torch.Tensor) -> torch.Tensor:
        # NHWC uint8 viewed as NCHW is already channels-last in memory.
        x = images.permute(0, 3, 1, 2).float().sub_(self.mean).mul_(self.inv_std)
        return x if self.channels_last else x.contiguous()

    def _stage(self, images: torch.Tensor, labels: torch.Tensor):
        with torch.cuda.stream(self.stream):
            x = self._normalise(images.to(self.device, non_blocking=True))
            y = labels.to(self.device, non_blocking=True)
        return x, y

    def __iter__(self) -> "DeviceFeed":
        return self

    def close(self) -> None:
        stop_loader(self._it)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stream is None:
            # On the CPU the normalisation holds the step back as much as the wait does.
            begin = time.perf_counter()
            images, labels = self._fetch()
            x = self._normalise(images)
            self.last_wait_s = time.perf_counter() - begin
            return x, labels
        x, y = self._ready
        self._ready = self._stage(*self._fetch())
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        # The caching allocator must not hand these blocks to the side stream while the step
        # that reads them still runs.
        x.record_stream(current)
        y.record_stream(current)
        return x, y


def open_feed(prefix: str, *, task: str, size: int, num_classes: int, batch_size: int,
              rank: int, world: int, local_world: int, seed: int, device: torch.device,
              decoder: str = "auto", workers: int | None = None, prefetch_batches: int = 4,
              channels_last: bool = False, trace: str | None = None, start: int = 0
              ) -> tuple[DeviceFeed, dict]:
    """The feed of one rank and a description of it (what the results record); ``start``
    samples of the rank's stream are skipped."""
    dataset = open_dataset(prefix)
    dataset.check_classes(num_classes)
    dataset.check_batches(world, batch_size)
    workers = default_workers(local_world) if workers is None else workers
    mean, std = (FACE_MEAN, FACE_STD) if task == "face" else (IMAGENET_MEAN, IMAGENET_STD)
    per_rank = len(dataset) // world
    info = {"source": "recordio", **dataset.describe(), "loader_workers": workers,
            "prefetch_batches": prefetch_batches, "images_per_rank_per_epoch": per_rank,
            "steps_per_epoch": per_rank // batch_size}
    if decoder == "dali":
        if start:
            raise ValueError("the DALI feed cannot start mid-stream: resume a training run "
                             "with another --decoder")
        feed, how = open_dali_feed(
            dataset, task=task, size=size, batch_size=batch_size, rank=rank, world=world,
            seed=seed, device=device, threads=workers, prefetch_batches=prefetch_batches,
            mean=mean, std=std, channels_last=channels_last,
            native_size=first_image_size(dataset))
        return feed, {**info, **how}
    images = RecordImages(dataset, decoder, task, size, num_classes, seed)
    loader = make_loader(images, RankSampler(len(dataset), rank, world, seed, start=start),
                         batch_size,
                         workers, prefetch_batches, pin_memory=device.type == "cuda")
    feed = DeviceFeed(loader, device, mean, std, channels_last, trace)
    return feed, {**info, "decoder": images.decoder_name, "pin_memory": device.type == "cuda"}
