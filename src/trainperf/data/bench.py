"""The input pipeline alone: decoded, augmented images per second for each decoder and number
of loader processes, so a loader can be sized without a training run.

The loop is the training loader's (same dataset, sampler, augmentation and batching) minus the
device: batches are taken from the loader as fast as it gives them. The first batches (the
processes starting, the page cache filling) are not counted.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

from .dali_feed import choose_decoder, every_decoder
from .layout import Dataset
from .pipeline import RankSampler, RecordImages, make_loader, open_feed, stop_loader


@dataclass
class LoaderFigure:
    decoder: str
    workers: int
    images_per_s: float
    images_per_s_per_worker: float
    batches: int
    seconds: float


def measure(dataset: Dataset, decoder: str, workers: int, *, task: str, size: int,
            num_classes: int, batch_size: int, batches: int, warmup: int,
            seed: int = 0) -> LoaderFigure:
    if decoder == "dali":
        return _measure_dali(dataset.prefix, workers, task=task, size=size,
                             num_classes=num_classes, batch_size=batch_size, batches=batches,
                             warmup=warmup, seed=seed)
    dataset.check_batches(1, batch_size)
    images = RecordImages(dataset, decoder, task, size, num_classes, seed)
    loader = make_loader(images, RankSampler(len(dataset), 0, 1, seed), batch_size, workers,
                         prefetch_batches=4, pin_memory=False)
    it = iter(loader)
    try:
        seconds = _timed(it, warmup, batches)
    finally:
        stop_loader(it)
    return _figure(images.decoder_name, workers, batches, batch_size, seconds)


def _timed(batches_of, warmup: int, batches: int) -> float:
    """Seconds that ``batches`` batches take after ``warmup`` untimed ones."""
    for _ in range(warmup):
        next(batches_of)
    begin = time.perf_counter()
    for _ in range(batches):
        next(batches_of)
    return time.perf_counter() - begin


def _figure(decoder: str, workers: int, batches: int, batch_size: int, seconds: float
            ) -> LoaderFigure:
    rate = batches * batch_size / seconds
    return LoaderFigure(decoder, workers, rate, rate / max(1, workers), batches, seconds)


def _measure_dali(prefix: str, threads: int, *, task: str, size: int, num_classes: int,
                  batch_size: int, batches: int, warmup: int, seed: int) -> LoaderFigure:
    """DALI on the CPU: its threads decode, crop and normalise (the GPU's nvJPEG is not
    measured here)."""
    import torch

    feed, _ = open_feed(prefix, task=task, size=size, num_classes=num_classes,
                        batch_size=batch_size, rank=0, world=1, local_world=1, seed=seed,
                        device=torch.device("cpu"), decoder="dali", workers=threads)
    try:
        seconds = _timed(feed, warmup, batches)
    finally:
        feed.close()
    return _figure("dali", max(1, threads), batches, batch_size, seconds)


def decoders_of(text: str) -> list[str]:
    """``auto``, ``all`` (every installed decoder) or a comma-separated list."""
    if text == "all":
        return every_decoder()
    return [choose_decoder(name.strip()) for name in text.split(",") if name.strip()]


def to_dict(figure: LoaderFigure) -> dict:
    return asdict(figure)


def sweep(dataset: Dataset, decoders: list[str], workers: list[int], *, task: str, size: int,
          batch_size: int, batches: int, warmup: int,
          on_figure: Callable[[LoaderFigure], None] = lambda _: None) -> list[LoaderFigure]:
    """Every (decoder, worker count) the loader is measured at, figures in that order. DALI
    decodes in its own threads: it has no in-process (0 workers) mode."""
    if min(workers) < 0:
        raise ValueError("--workers takes counts >= 0")
    if batches < 1 or warmup < 0:
        raise ValueError("--batches must be >= 1 and --warmup >= 0")
    classes = 2**31 - 1  # nothing is trained: every label is welcome
    figures = []
    for name in decoders:
        for n in [n for n in workers if n > 0] if name == "dali" else workers:
            fig = measure(dataset, name, n, task=task, size=size, num_classes=classes,
                          batch_size=batch_size, batches=batches, warmup=warmup)
            on_figure(fig)
            figures.append(fig)
    return figures


def document(dataset: Dataset, recipe: str, task: str, size: int, batch_size: int,
             batches: int, warmup: int, env: dict, figures: list[LoaderFigure]) -> dict:
    """``data_bench.json``: the figures with what they were measured on."""
    return {"schema": "trainperf.data_bench/v1", "dataset": dataset.describe(),
            "recipe": recipe, "task": task, "input_size": size, "batch_size": batch_size,
            "batches": batches, "warmup": warmup, "env": env,
            "figures": [to_dict(f) for f in figures]}
