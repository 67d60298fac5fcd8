"""The framework-neutral feed of real-data runs: one rank's batches as numpy uint8 NHWC images
and int64 labels, read, decoded and augmented by loader processes (``loader_process``) that
share memory with the worker. Every framework but torch trains from it; each worker moves a
batch to its device and normalises it there (``mean_std``).

The standard library and numpy only, as every worker: the decoders live in the loader
processes, which run trainperf's own interpreter (``TRAINPERF_LOADER_PYTHON``, which the
runner sets; else this one). A batch's pixels are the same as torch's feed gives for the same
seed (``stream``), whatever the number of loaders.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ..config import LOADER_PYTHON_ENV, LOCAL_WORLD_ENV, DataSpec, Workload
from .layout import open_dataset
from .loading import default_workers, mean_std
from .shared_batches import slot_layout, slot_views

TRACE_ENV = "TRAINPERF_DATA_TRACE"
"""Tests: a folder where each rank writes the (epoch, sample) pairs it was fed."""


class LoaderError(RuntimeError):
    """A loader process failed (its own one-line message) or died."""


class LoaderFeed:
    """Rank ``rank``'s batches, in stream order: ``next`` gives (images [B, H, W, 3] uint8,
    labels [B] int64), arrays of its own (the slot is handed back at once). ``last_wait_s``
    is how long it waited for that batch; ``info`` describes the feed for the results."""

    def __init__(self, data: DataSpec, workload: Workload, rank: int, world: int,
                 local_world: int | None = None, start: int = 0) -> None:
        dataset = open_dataset(data.prefix)  # a truncated or foreign file fails here, in one line
        dataset.check_classes(workload.num_classes)
        dataset.check_batches(world, workload.batch_size)
        local_world = local_world or int(os.environ.get(LOCAL_WORLD_ENV, "1"))
        # At least one loader: the worker's own thread does not decode.
        self.loaders = max(1, default_workers(local_world) if data.loader_workers is None
                           else data.loader_workers)
        self.slots = data.prefetch_batches
        self.batch_size, self.size = workload.batch_size, workload.input_size
        self.mean, self.std = mean_std(workload.task)
        self.rank = rank
        self.count = 0
        self.last_wait_s = 0.0
        self.procs: list[subprocess.Popen] = []
        self.buffers: list[mmap.mmap] = []
        trace_dir = os.environ.get(TRACE_ENV)
        self.trace = (os.path.join(trace_dir, f"w{world}_rank{rank}.txt") if trace_dir
                      else None)
        per_rank = len(dataset) // world
        self.info: dict[str, Any] = {
            "source": "recordio", **dataset.describe(), "feed": "loader processes (numpy)",
            "loader_workers": self.loaders, "prefetch_batches": self.slots,
            "images_per_rank_per_epoch": per_rank,
            "steps_per_epoch": per_rank // workload.batch_size, "pin_memory": False}
        slot_bytes = sum(slot_layout(self.batch_size, self.size))
        python = os.environ.get(LOADER_PYTHON_ENV) or sys.executable
        try:
            for k in range(self.loaders):
                self._start(k, python, data, workload, rank, world, start, slot_bytes)
            decoders = {self._read_line(k).partition(" ")[2] for k in range(self.loaders)}
        except BaseException:
            self.close()
            raise
        self.info["decoder"] = ",".join(sorted(decoders))
        for proc in self.procs:
            proc.stdin.write("".join(f"{s}\n" for s in range(self.slots)))
            proc.stdin.flush()

    def _start(self, k: int, python: str, data: DataSpec, workload: Workload, rank: int,
               world: int, start: int, slot_bytes: int) -> None:
        # An anonymous file, passed as a descriptor: nothing is left in /dev/shm whatever
        # way either side ends.
        fd = os.memfd_create(f"trainperf-feed-r{rank}-l{k}", 0)
        try:
            os.ftruncate(fd, slot_bytes * self.slots)
            job = {"prefix": data.prefix, "decoder": data.decoder, "task": workload.task,
                   "size": workload.input_size, "num_classes": workload.num_classes,
                   "seed": workload.seed, "rank": rank, "world": world, "start": start,
                   "batch_size": workload.batch_size, "loader": k, "loaders": self.loaders,
                   "fd": fd}
            proc = subprocess.Popen(
                [python, "-m", "trainperf.data.loader_process", json.dumps(job)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                pass_fds=(fd,), env=dict(os.environ, OMP_NUM_THREADS="1"))
            self.procs.append(proc)
            self.buffers.append(mmap.mmap(fd, 0))
        finally:
            os.close(fd)

    def _read_line(self, k: int) -> str:
        proc = self.procs[k]
        line = proc.stdout.readline().strip()
        if line.startswith("error "):
            raise LoaderError(line[len("error "):])
        if not line:
            code = proc.wait(timeout=30)
            raise LoaderError(f"data loader {k} of rank {self.rank} exited with status {code} "
                              "before it gave its batch (its output is in the run's log)")
        return line

    def __iter__(self) -> "LoaderFeed":
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        k = self.count % self.loaders
        begin = time.perf_counter()
        slot = int(self._read_line(k))
        images, labels, pairs = slot_views(self.buffers[k], slot, self.batch_size, self.size)
        images, labels, pairs = images.copy(), labels.copy(), pairs.copy()
        try:
            self.procs[k].stdin.write(f"{slot}\n")
            self.procs[k].stdin.flush()
        except BrokenPipeError:
            pass  # it died after this batch, which is whole: its next read says how it ended
        self.last_wait_s = time.perf_counter() - begin
        self.count += 1
        if self.trace:
            with open(self.trace, "a", encoding="ascii") as f:
                f.writelines(f"{e} {i}\n" for e, i in pairs.tolist())
        return images, labels

    def close(self) -> None:
        """End every loader (each leaves when its input closes) and wait for them."""
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        for buffer in self.buffers:
            buffer.close()
        self.buffers = []
