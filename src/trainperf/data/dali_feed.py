"""NVIDIA DALI's RecordIO reader as the input pipeline (``--decoder dali``).

DALI reads, decodes (nvJPEG on the GPU: the ``mixed`` decoder; libjpeg-turbo on the CPU),
crops, flips and normalises in its own threads and hands over device tensors, so a GPU host
needs no loader processes at all. It shards the records itself: each rank reads its own part of
every epoch.

- DALI's reader returns every record the index lists, so for insightface's face layout (whose
  index also lists the header and the identity records) it gets an index of the image records
  alone, written to a temporary folder.
- Samples are shuffled through DALI's buffer rather than ``RankSampler``, so the order differs
  from the torch loader's.
- Labels are checked against the class count once, from the face header, not per record.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from . import decode
from .layout import FACE, Dataset
from .recordio import RecordIOError

if TYPE_CHECKING:
    import torch

PIP = "nvidia-dali-cuda120"


def available() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no ``nvidia`` namespace at all
        return False


def require() -> None:
    if not available():
        raise ValueError(f"--decoder dali needs NVIDIA DALI: `pip install {PIP}` (or "
                         "`pip install trainperf[dali]`)")


def choose_decoder(name: str) -> str:
    """The decoder a name stands for (``dali`` included); ValueError when it is not there."""
    if name == "dali":
        require()
        return name
    return decode.resolve(name)


def every_decoder() -> list[str]:
    return decode.available() + (["dali"] if available() else [])


def image_index(dataset: Dataset, folder: Path) -> Path:
    """An index DALI can read whole: the image records only."""
    if dataset.layout != FACE:
        return dataset.reader.idx_path
    path = folder / "images.idx"
    with open(path, "w", encoding="ascii") as f:
        f.writelines(f"{k}\t{dataset.reader.index[k]}\n" for k in dataset.image_keys)
    return path


class DaliFeed:
    """Normalised NCHW batches from a DALI pipeline; the same surface as ``DeviceFeed``."""

    def __init__(self, iterator, folder: Path, where: str, hwc: bool) -> None:
        self._it, self._folder, self._where = iterator, folder, where
        self.hwc = hwc
        """Batches come as NHWC (channels-last): viewed as NCHW, the memory stays
        channels-last, which the backbone then keeps."""
        self.last_wait_s = 0.0

    def __iter__(self) -> "DaliFeed":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        begin = time.perf_counter()
        try:
            try:
                out = next(self._it)
            except StopIteration:  # an epoch ended; the iterator has reset itself
                out = next(self._it)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RecordIOError(f"{self._where}: DALI: {first}") from None
        self.last_wait_s = time.perf_counter() - begin
        images, labels = out[0]["data"], out[0]["label"][:, 0].long()
        return (images.permute(0, 3, 1, 2) if self.hwc else images), labels

    def close(self) -> None:
        self._it = None
        shutil.rmtree(self._folder, ignore_errors=True)


def open_dali_feed(dataset: Dataset, *, task: str, size: int, batch_size: int, rank: int,
                   world: int, seed: int, device: torch.device, threads: int,
                   prefetch_batches: int, mean: tuple[float, ...], std: tuple[float, ...],
                   channels_last: bool, native_size: tuple[int, int] | None
                   ) -> tuple[DaliFeed, dict]:
    """The feed and what differs from the torch loader's description (decoder, threads)."""
    require()
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    gpu = device.type == "cuda"
    folder = Path(tempfile.mkdtemp(prefix="trainperf-dali-"))
    index = image_index(dataset, folder)

    @pipeline_def(batch_size=batch_size, num_threads=max(1, threads),
                  device_id=device.index if gpu else None, seed=seed + rank,
                  prefetch_queue_depth=prefetch_batches)
    def pipeline():
        encoded, labels = fn.readers.mxnet(
            path=[str(dataset.reader.rec_path)], index_path=[str(index)], shard_id=rank,
            num_shards=world, random_shuffle=True, name="reader")
        images = fn.decoders.image(encoded, device="mixed" if gpu else "cpu",
                                   output_type=types.RGB)
        if task == "face":
            if native_size != (size, size):
                images = fn.resize(images, resize_x=size, resize_y=size)
        else:
            images = fn.random_resized_crop(images, size=[size, size])
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="HWC" if channels_last else "CHW",
            mean=list(mean), std=list(std), mirror=fn.random.coin_flip())
        return images, labels.gpu() if gpu else labels

    pipe = pipeline()
    pipe.build()
    iterator = DALIGenericIterator([pipe], ["data", "label"], reader_name="reader",
                                   last_batch_policy=LastBatchPolicy.DROP, auto_reset=True)
    import nvidia.dali as dali

    how = {"decoder": "dali", "dali_version": dali.__version__,
           "dali_decoder": "mixed" if gpu else "cpu", "loader_workers": max(1, threads),
           "loader_kind": "DALI threads", "pin_memory": False}
    return DaliFeed(iterator, folder, str(dataset.reader.rec_path), channels_last), how
