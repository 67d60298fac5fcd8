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

import time

import torch
from torch.utils.data import DataLoader

from . import decode
from .dali_feed import open_dali_feed
from .layout import Dataset, open_dataset
# Re-exported: torch's side reads these names from here.
from .loading import (FACE_MEAN, FACE_STD, IMAGENET_MEAN, IMAGENET_STD,  # noqa: F401
                      default_workers, mean_std)
from .stream import RankSampler, SampleReader, random_resized_crop  # noqa: F401

class RecordImages(torch.utils.data.Dataset):
    """Decoded, augmented images of a RecordIO dataset, as uint8 HWC tensors and int labels
    (``stream.SampleReader``'s, item for item)."""

    def __init__(self, dataset: Dataset, decoder: str, task: str, size: int,
                 num_classes: int, seed: int) -> None:
        self.samples = SampleReader(dataset, decoder, task, size, num_classes, seed)
        self.decoder_name = self.samples.decoder_name

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> tuple[torch.Tensor, int, tuple[int, int]]:
        image, label = self.samples.read(*item)
        return torch.from_numpy(image), label, item


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
    mean, std = mean_std(task)
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
