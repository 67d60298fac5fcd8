"""One rank of ``trainperf commbench``; ``trainperf.backends.spawn`` starts one per device, with
the variables ``torch.distributed.run`` would set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...).

Message size is nccl-tests' size: all_reduce, the bytes of the buffer on each rank (reduced in
place); all_gather, the bytes of the whole gathered output, world x each rank's input;
reduce_scatter, the bytes of the whole input, world x each rank's output. Every size is a
multiple of world x element size, and the bytes actually moved are the ones recorded.

Per size: ``warmup`` untimed calls, a barrier, then ``iters`` timed calls, each timed alone
(CUDA events on the GPU, the host clock on CPU). A rank's time is its median; the point is
the slowest rank's median (MAX all-reduce), as nccl-tests reports the slowest rank. On a CPU,
the largest size is timed once more with a thread of matrix products beside the calls
(``ComputeProbe``): how much slower the calls go, and how much of the probe's speed they take
(the busiest rank's figures), which is what they cost a backward they overlap. Every
node's local rank 0 writes the same JSON, so each node's folder holds the curve.

Each rank prints a line to its own output before every collective it sizes (``progress_line``),
so that a rank that dies without a word is still placed in the sweep. A rank that fails in
Python says so in one line there and writes an ``error`` event (``protocol.Error``) to
``--events``, where the launcher writes how each process ended.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from .. import faults
from ..backends.spawn import STACK_SIGNAL
from ..protocol import Error, EventWriter
from ..results import write_json_atomic
from .commbench import DTYPE_BYTES, OPS, message_sizes, progress_line

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
assert set(DTYPES) == set(DTYPE_BYTES)
PROBE_SIDE = 192
"""The probe's square matrices: 14 MFLOP a product, well under a millisecond on a core, so
that it shares the cores at the grain a training step's kernels do."""
PROBE_CALIBRATION_S = 0.3

# torch 2.13 renamed the tensor forms (the old names still work, with a warning); the list
# forms come last, for a backend that has only them.
CALLS = {
    "all_reduce": ["all_reduce"],
    "all_gather": [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)
                   ][:1] + ["all_gather"],
    "reduce_scatter": [n for n in ("reduce_scatter_single", "reduce_scatter_tensor")
                       if hasattr(dist, n)][:1] + ["reduce_scatter"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="commbench_worker")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=2**24)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--events", default=None, help="JSON-lines file for this rank's error event")
    return p.parse_args(argv)


def make_call(call: str, size_bytes: int, world: int, dtype: torch.dtype,
              device: torch.device) -> Callable[[], None]:
    """One collective of ``size_bytes`` (the module's definition) on buffers made once."""
    numel = size_bytes // torch.empty((), dtype=dtype).element_size()
    part = numel // world

    # Zeros: an in-place all_reduce repeated many times stays finite, and the value never
    # changes what the fabric does.
    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=device)

    fn = getattr(dist, call)
    if call == "all_reduce":
        buf = zeros(numel)
        return lambda: fn(buf)
    if call == "all_gather":
        outs, inp = [zeros(part) for _ in range(world)], zeros(part)
        return lambda: fn(outs, inp)
    if call == "reduce_scatter":
        out, inps = zeros(part), [zeros(part) for _ in range(world)]
        return lambda: fn(out, inps)
    if call.startswith("all_gather"):
        out, inp = zeros(numel), zeros(part)
        return lambda: fn(out, inp)
    out, inp = zeros(part), zeros(numel)
    return lambda: fn(out, inp)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


def choose_call(op: str, size_bytes: int, world: int, dtype: torch.dtype,
                device: torch.device) -> tuple[str | None, str]:
    """The first call the backend runs for ``op``, or None and why none does. A backend lacks
    an op on every rank alike, so all ranks fail the same try and stay in step."""
    reasons = []
    for call in CALLS[op]:
        try:
            make_call(call, size_bytes, world, dtype, device)()
            return call, ""
        except dist.DistError:
            raise  # a broken peer or a timeout, not a missing op
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            reasons.append(f"{call}: {first_line(exc)}")
    return None, "; ".join(reasons)


def time_calls(run: Callable[[], None], iters: int, warmup: int, device: torch.device
               ) -> list[float]:
    for _ in range(warmup):
        run()
    dist.barrier()  # so that no rank's first timed call includes waiting for a late peer
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return times
    # Events on the stream time each call without a host sync between calls, which would
    # add the host's round trip to every small message.
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


class ComputeProbe(threading.Thread):
    """Matrix products in a loop on this rank's cores: counted alone and then while
    collectives run, they tell how much of the cores the collectives take from computation
    beside them (gloo's copies and sums, the kernel's TCP, its threads' wake-ups), as a
    training step's backward has them beside it."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.count = 0
        self.done = threading.Event()

    def run(self) -> None:
        a = torch.rand(PROBE_SIDE, PROBE_SIDE)
        b, c = a.clone(), torch.empty_like(a)
        while not self.done.is_set():
            torch.mm(a, b, out=c)
            self.count += 1

    def rate(self, seconds: float | None = None, during: Callable[[], None] | None = None
             ) -> float:
        """Products per second while sleeping ``seconds``, or while ``during`` runs."""
        c0, t0 = self.count, time.perf_counter()
        if during is None:
            time.sleep(seconds)
        else:
            during()
        return (self.count - c0) / (time.perf_counter() - t0)


def beside_compute(run: Callable[[], None], iters: int) -> tuple[list[float], float]:
    """``iters`` timed calls with the probe computing beside them: their seconds, and the
    share of the probe's speed they took."""
    probe = ComputeProbe()
    probe.start()
    try:
        alone = probe.rate(PROBE_CALIBRATION_S)
        dist.barrier()
        times: list[float] = []

        def calls() -> None:
            for _ in range(iters):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)

        beside = probe.rate(during=calls)
    finally:
        probe.done.set()
        probe.join()
    return times, max(0.0, 1.0 - beside / alone) if alone > 0 else 0.0


def worker_env(device: torch.device) -> dict:
    env = {"torch_version": torch.__version__, "host": socket.gethostname()}
    if device.type == "cuda":
        env["cuda_version"] = torch.version.cuda
        env["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["device_names"] = [torch.cuda.get_device_name(i)
                               for i in range(torch.cuda.device_count())]
    return env


def bench(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    sizes = message_sizes(args.min_bytes, args.max_bytes, args.factor,
                          world * DTYPE_BYTES[args.dtype])
    planned = faults.parse_faults(world)  # tests make a rank fail mid-sweep this way
    measured, records = 0, []
    for op in args.ops.split(","):
        print(progress_line(rank, op, sizes[0]), flush=True)  # choosing runs the smallest size
        call, reason = choose_call(op, sizes[0], world, dtype, device)
        if call is None:
            records.append({"op": op, "unsupported": f"{dist.get_backend()}: {reason}"})
            continue
        medians = []
        for size in sizes:
            print(progress_line(rank, op, size), flush=True)
            faults.inject(planned, measured, rank, torch.OutOfMemoryError)
            medians.append(statistics.median(
                time_calls(make_call(call, size, world, dtype, device), args.iters,
                           args.warmup, device)))
            measured += 1
        if device.type != "cuda":  # a GPU's collectives leave the host's cores to the host
            times, taken = beside_compute(make_call(call, sizes[-1], world, dtype, device),
                                          args.iters)
            medians += [statistics.median(times), taken]
        slowest = torch.tensor(medians, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        found = slowest.tolist()
        record = {"op": op, "call": call, "points": [{"bytes": s, "time_s": t}
                                                      for s, t in zip(sizes, found)]}
        if len(found) > len(sizes):
            record["beside_compute"] = {"bytes": sizes[-1], "time_s": found[-2],
                                        "compute_share_taken": found[-1]}
        records.append(record)
    return {"backend": dist.get_backend(), "world_size": world, "dtype": args.dtype,
            "env": worker_env(device), "ops": records}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # A launcher stopping a hung benchmark first asks each rank where it is; unanswered, that
    # signal would kill the rank and read as a death of its own.
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    try:
        if args.device == "cuda":
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
                torch.set_num_threads(1)  # ranks sharing the cores; more threads only contend
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank,
                                world_size=world, timeout=timedelta(seconds=args.timeout_s),
                                device_id=device if device.type == "cuda" else None)
        doc = bench(args, rank, world, device)
        if local_rank == 0:
            write_json_atomic(args.out, doc)
        dist.destroy_process_group()
    except Exception as exc:
        report_failure(args.events, rank, exc)
        # Not the interpreter's teardown: gloo's destructors, racing with its threads still
        # waiting on peers, can abort the process (a SIGABRT that would read as a native
        # death) or hang; the exit status is the one the error event explains.
        os._exit(1)


def report_failure(events: str | None, rank: int, exc: Exception) -> None:
    """Say why this rank failed: its traceback and one line in its own output, and an
    ``error`` event (call it inside ``except``)."""
    message = f"{type(exc).__name__}: {first_line(exc)}"
    traceback.print_exc()
    print(f"commbench rank {rank} failed: {message}", file=sys.stderr, flush=True)
    if events:
        EventWriter(events, rank).emit(Error(
            kind="exception", message=message,
            traceback=traceback.format_exc().strip().splitlines()[-12:]))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
