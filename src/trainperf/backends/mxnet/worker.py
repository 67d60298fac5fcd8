"""Entry point of one measured MXNet run: ``python -m trainperf.backends.mxnet.worker --spec S
--events E``, started by ``launch.py`` (one process per rank, or one for all contexts).

It follows ``trainperf.protocol`` as the torch worker does: rank 0 writes ``start``, one ``step``
per step and ``end``; any rank that fails writes an ``error`` (kind ``oom`` or ``exception``) and
exits non-zero (3 for an out-of-memory, 1 otherwise). For tests, TRAINPERF_FAULT injects
failures at steps (``trainperf.faults``).

Timing. MXNet runs every operation asynchronously on its engine, so a step's call returns long
before its work is done. The analogue of torch's CUDA events is a watcher thread: after each step
the loop hands it that step's markers (small arrays that become ready when the step's last
update has run, ``TrainStep.markers``); the watcher waits on them in step order
(``wait_to_read`` releases the GIL while it blocks) and stamps the host clock when they are
ready, so a step's time is the gap between consecutive stamps. The loop itself reads nothing
back: it only lets at most ``MAX_STEPS_IN_FLIGHT`` steps be outstanding (one running, one
queued: the device never waits for the host, and queued steps do not pile up memory), and
writes the ``step`` events of the steps the watcher has timed. At the window's edges it calls
``mx.nd.waitall()``, lets the watcher catch up, and (at the start) meets the other ranks at a
barrier. Every step has its time before ``end`` is written.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

import mxnet as mx
import numpy as np

from ...faults import inject, parse_faults
from ...protocol import End, Error, EventWriter, RunSpec, Start, Step
from ...config import Tuning
from . import models
from .comm import Comm, comm_from_env
from .step import TrainStep, init_batch, synthetic_batch

MAX_STEPS_IN_FLIGHT = 2
SWITCH_INTERVAL_S = 2e-4
"""How long the main thread may hold the GIL while the watcher waits to stamp a finished step
(Python's default, 5 ms, would blur per-step times)."""
OOM_TEXTS = ("out of memory", "std::bad_alloc", "failed to allocate", "cannot allocate memory",
             "memory allocation failed", "cudaerrormemoryallocation")

StepTimes = list[tuple[int, float]]


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return any(t in text for t in OOM_TEXTS)


# ---------------------------------------------------------------------------------- timing

class StepWatcher:
    """Stamps the host clock when each submitted step's arrays are ready, in step order."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 max_in_flight: int = MAX_STEPS_IN_FLIGHT) -> None:
        self.clock = clock
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(max_in_flight)
        self._lock = threading.Lock()
        self._done: StepTimes = []
        self._last = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trainperf-step-watcher",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                kind, value, arrays = item
                if kind == "reset":
                    self._last = value
                    continue
                try:
                    if self.error is None:
                        for array in arrays:
                            array.wait_to_read()
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    self.error = exc
                now = self.clock()
                with self._lock:
                    self._done.append((value, now - self._last))
                self._last = now
                self._slots.release()
            finally:
                self._queue.task_done()

    def reset(self, t: float) -> None:
        """The next step's time counts from ``t``."""
        self._queue.put(("reset", t, ()))

    def submit(self, index: int, arrays: Sequence[mx.nd.NDArray]) -> None:
        """Hand over step ``index``; blocks while ``max_in_flight`` steps are not yet done."""
        self._slots.acquire()
        self._queue.put(("step", index, list(arrays)))

    def drain(self) -> StepTimes:
        with self._lock:
            done, self._done = self._done, []
        return done

    def catch_up(self) -> None:
        """Wait until every submitted step is stamped."""
        self._queue.join()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, wait: bool = True) -> None:
        """Stop the thread; ``wait=False`` after a failure, when it may be blocked on a step
        that never finishes (a daemon thread does not hold up the exit)."""
        self._queue.put(None)
        if wait:
            self._thread.join()


def timed_loop(step: Callable[[int], mx.nd.NDArray], markers: Callable[[], list],
               iters: int, warmup: int, on_steps: Callable[[StepTimes], None],
               barrier: Callable[[], None], clock: Callable[[], float] = time.perf_counter
               ) -> tuple[float, list[mx.nd.NDArray]]:
    """Run ``iters`` steps; returns (wall seconds of the steps from index ``warmup`` on, the
    losses). ``on_steps`` has received every step's time, in order, when this returns."""
    watcher = StepWatcher(clock)
    losses: list[mx.nd.NDArray] = []
    ok = False
    try:
        window_start = clock()
        watcher.reset(window_start)
        for i in range(iters):
            if i == warmup:
                # Deliberate sync and barrier: the window starts with every rank idle and
                # aligned, so no warm-up work or a late rank is billed to the measured steps.
                # The watcher first, so that only one thread at a time waits on MXNet's
                # engine (and an error the watcher met is raised here, before waitall).
                watcher.catch_up()
                watcher.check()
                mx.nd.waitall()
                on_steps(watcher.drain())
                barrier()
                window_start = clock()
                watcher.reset(window_start)
            losses.append(step(i))
            watcher.submit(i, markers())
            watcher.check()
            on_steps(watcher.drain())
        watcher.catch_up()
        watcher.check()
        mx.nd.waitall()  # deliberate: the window ends when the device has finished its work
        window_end = clock()
        on_steps(watcher.drain())
        ok = True
    finally:
        watcher.close(wait=ok)
    return window_end - window_start, losses


# ---------------------------------------------------------------------------------- memory

def _gpu_used(ctx: mx.Context) -> int:
    free, total = mx.context.gpu_memory_info(ctx.device_id)
    return int(total - free)


def current_memory(comm: Comm) -> int:
    """Memory in use now: device memory in use on the first GPU, or this process's resident
    set on CPU."""
    if comm.device_type == "gpu":
        return _gpu_used(comm.contexts[0])
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def limit_memory(limit_bytes: int | None, comm: Comm) -> None:
    """Cap this process's data segment on CPU (as the torch worker): a run that needs more
    fails with an allocation error instead of taking the machine down."""
    if limit_bytes and comm.device_type == "cpu":
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))


def peak_memory(comm: Comm) -> list[tuple[int, int]]:
    """(peak, reserved) per context of this process. CPU: the process's peak resident set.
    GPU: MXNet 1.9 keeps no allocation peak; its pool holds on to freed blocks, so the device
    memory in use after the run (cudaMemGetInfo: the pool's high-water mark plus the CUDA
    context) is the figure for both."""
    if comm.device_type == "gpu":
        return [(_gpu_used(ctx), _gpu_used(ctx)) for ctx in comm.contexts]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return [(rss, rss)]


def memory_over_ranks(comm: Comm) -> dict:
    """The largest figures over ranks, and every rank's peak (a collective call)."""
    values = mx.nd.array(peak_memory(comm), ctx=mx.cpu(), dtype="float64")
    per_rank = comm.all_gather("worker/memory", values).asnumpy()
    out: dict = {"peak_memory_bytes": int(per_rank[:, 0].max()),
                 "peak_memory_bytes_per_rank": [int(v) for v in per_rank[:, 0]]}
    if comm.device_type == "gpu":
        out["peak_reserved_bytes"] = int(per_rank[:, 1].max())
    return out


# ---------------------------------------------------------------------------- environment

def _gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _cuda_version() -> str | None:
    """From the wheel's name (``mxnet-cu117`` -> ``11.7``)."""
    from importlib import metadata
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("mxnet-cu") and name[8:].isdigit():
            digits = name[8:]
            return f"{digits[:-1]}.{digits[-1]}"
    return None


def _cudnn_version() -> int | None:
    """cudnnGetVersion() of the cuDNN the wheel ships, when it ships one as a library."""
    libdir = os.path.dirname(mx.libinfo.find_lib_path()[0])
    for path in sorted(glob.glob(os.path.join(libdir, "libcudnn*.so*"))):
        try:
            lib = ctypes.CDLL(path)
            lib.cudnnGetVersion.restype = ctypes.c_size_t
            return int(lib.cudnnGetVersion())
        except (OSError, AttributeError):
            continue
    return None


def framework_env(comm: Comm, threads: int | None) -> dict:
    gpu = comm.device_type == "gpu"
    env: dict = {
        "framework": "mxnet",
        "framework_version": mx.__version__,
        "numpy_version": np.__version__,
        "device_type": "cuda" if gpu else "cpu",
        "device_names": [],
        "device_count": mx.context.num_gpus() if gpu else 0,
        "cuda_version": None,
        "cudnn_version": None,
        "nccl_version": None,
        "kvstore": comm.mode,
        "omp_threads": threads or os.environ.get("OMP_NUM_THREADS"),
        "cpu_worker_threads": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "1"),
        "cudnn_autotune": os.environ.get("MXNET_CUDNN_AUTOTUNE_DEFAULT") if gpu else None,
        "memory_measure": ("device memory in use after the run (MXNet keeps no allocation "
                           "peak; its pool keeps its high-water mark)") if gpu
        else "peak resident set (ru_maxrss)",
    }
    if gpu:
        env["device_names"] = _gpu_names()
        env["cuda_version"] = _cuda_version()
        env["cudnn_version"] = _cudnn_version()
    return env


def configure(tuning: Tuning, threads: int | None) -> None:
    """Speed settings, before any network is built."""
    # 1: MXNet's default autotuning within its workspace limit; 0: none.
    os.environ["MXNET_CUDNN_AUTOTUNE_DEFAULT"] = "1" if tuning.cudnn_benchmark else "0"
    if threads:
        mx.base.check_call(mx.base._LIB.MXSetNumOMPThreads(ctypes.c_int(int(threads))))


# ------------------------------------------------------------------------------------ run

def run(spec: RunSpec, events: EventWriter, comm: Comm) -> None:
    workload, measure = spec.workload, spec.measure
    baseline = current_memory(comm)
    limit_memory(measure.memory_limit_bytes, comm)
    configure(spec.tuning, spec.threads)
    init = np.load(spec.init) if spec.init else None
    step = TrainStep(workload, comm, spec.tuning, init=init)
    batches = [init_batch(workload, init, rank, ctx) if init is not None
               else synthetic_batch(workload, rank, ctx)
               for ctx, rank in zip(comm.contexts, comm.ranks)]
    global_batch = workload.batch_size * comm.world_size
    if comm.rank == 0:
        settings = dict(step.settings)
        settings["cudnn_benchmark"] = spec.tuning.cudnn_benchmark \
            if comm.device_type == "gpu" else None
        settings["ddp"] = None
        settings["max_steps_in_flight"] = MAX_STEPS_IN_FLIGHT
        events.emit(Start(
            world_size=comm.world_size, global_batch=global_batch, device=comm.device,
            env=framework_env(comm, spec.threads), workload=workload.to_dict(),
            settings=settings, backbone_params=models.param_count(step.net),
            pfc_update="full" if workload.task == "face" else None,
            baseline_memory_bytes=baseline))
    faults = parse_faults(comm.world_size)

    def one_step(index: int) -> mx.nd.NDArray:
        inject(faults, index, comm.rank, lambda msg: mx.base.MXNetError(msg))
        return step(batches)

    timed: list[int] = []

    def on_steps(done: StepTimes) -> None:
        timed.extend(index for index, _ in done)
        if comm.rank == 0:
            for index, seconds in done:
                events.emit(Step(index=index, seconds=seconds, samples=global_batch,
                                 warmup=index < measure.warmup))

    window_s, losses = timed_loop(one_step, lambda: step.markers, measure.iters,
                                  measure.warmup, on_steps, comm.barrier)
    assert timed == list(range(measure.iters)), "every step must have its time, in order"
    # Read-backs after the window.
    loss_values = [float(v) for v in
                   mx.nd.concat(*[l.reshape((1,)).as_in_context(mx.cpu()) for l in losses],
                                dim=0).asnumpy()]
    memory = memory_over_ranks(comm)
    if comm.rank == 0:
        events.emit(End.of_window(window_s, measure, global_batch, loss_values,
                                  step.skipped_steps, final_loss_scale=step.loss_scale,
                                  baseline_memory_bytes=baseline, **memory))
    # No rank tears the kvstore down while another still talks to it.
    comm.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON file: workload, measure, device")
    parser.add_argument("--events", required=True, help="JSON-lines file to append events to")
    args = parser.parse_args(argv)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Until the kvstore names this process's rank, the launch index stands in for it.
    events = EventWriter(args.events, int(os.environ.get("TRAINPERF_LOCAL_RANK", "0")))
    comm = None
    try:
        spec = RunSpec.load(args.spec)
        comm = comm_from_env(spec.device)
        events.rank = comm.rank
        run(spec, events, comm)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes an event
        error = Error.of_exception(exc, is_oom(exc))
        events.emit(error)
        code = error.exit_code
        if comm is not None and comm.distributed:
            # Leaving normally would finalize the kvstore, which waits for every other rank:
            # a failed rank exits at once and the launcher stops the rest.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
