"""The machine ceiling (stage 1): what this device can do at best, measured, so that every MFU
can be given against it as well as against the datasheet.

Dense square matrix products in bf16, fp16, TF32 and fp32 (the best of a few timed rounds), and
a device-to-device copy. A copy reads and writes every byte, so its rate counts both: that is
what the memory system moved, comparable with the datasheet's bandwidth.
"""

from __future__ import annotations

import torch

from ..backends.torch.timing import make_timer
from ..env import cpu_model
from ..devices import PEAKS, TFLOPS, device_bandwidth, device_peaks
from .record import NOT_RUN, PASS, StageLog

FORMATS = ("bf16", "fp16", "tf32", "fp32")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32,
          "fp32": torch.float32}
SIZES = {"gpu": {"matmul_n": 8192, "copy_bytes": 2**30, "reps": 10, "rounds": 2},
         "cpu": {"matmul_n": 384, "copy_bytes": 64 * 2**20, "reps": 3, "rounds": 2}}


def burst_s(fn, reps: int, device: torch.device) -> float:
    """Wall time of one of ``reps`` calls: the host clock around the device's synchronize (the
    work is queued, so only its end tells), as the measured loop's window is timed."""
    timer = make_timer(device)
    timer.sync()
    start = timer.now()
    for _ in range(reps):
        fn()
    timer.sync()  # deliberate: the burst ends when the device has finished it
    return (timer.now() - start) / reps


def matmul_rate(fmt: str, n: int, device: torch.device, reps: int, rounds: int) -> float:
    """Best FLOP/s of an n x n x n product in ``fmt`` over ``rounds`` rounds."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=gen).to(DTYPES[fmt])
    b = torch.randn(n, n, device=device, generator=gen).to(DTYPES[fmt])
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = fmt == "tf32"
    try:
        burst_s(lambda: a @ b, 2, device)  # warm-up: the library picks its kernel
        best = min(burst_s(lambda: a @ b, reps, device) for _ in range(rounds))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return 2 * n ** 3 / best


def copy_rate(nbytes: int, device: torch.device, reps: int, rounds: int) -> float:
    """Best bytes/s moved (read + written) by a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    burst_s(lambda: dst.copy_(src), 2, device)
    best = min(burst_s(lambda: dst.copy_(src), reps, device) for _ in range(rounds))
    return 2 * nbytes / best


def run(log: StageLog, mode: str) -> None:
    device = torch.device("cuda" if mode == "gpu" else "cpu")
    size = SIZES[mode]
    name = torch.cuda.get_device_name(device) if mode == "gpu" else None
    datasheet = device_peaks(name) or {}
    log.set(device_name=name or cpu_model(), datasheet_peaks=datasheet,
            datasheet_bandwidth=device_bandwidth(name))
    for fmt in FORMATS:
        if fmt == "tf32" and mode != "gpu":
            log.add("ceiling", format=fmt, flops_per_s=None, datasheet=None,
                    status=NOT_RUN, why="TF32 exists only on NVIDIA GPUs (Ampere and later)")
            continue
        rate = matmul_rate(fmt, size["matmul_n"], device, size["reps"], size["rounds"])
        peak = datasheet.get(fmt)
        log.add("ceiling", format=fmt, flops_per_s=rate, datasheet=peak, status=PASS,
                n=size["matmul_n"], of_datasheet=rate / peak if peak else None,
                why=None)
        print(f"matmul {fmt}: {rate / TFLOPS:.1f} TFLOP/s", flush=True)
    rate = copy_rate(size["copy_bytes"], device, size["reps"], size["rounds"])
    bw = device_bandwidth(name)
    log.add("copy", bytes=size["copy_bytes"], bytes_per_s=rate, datasheet=bw,
            of_datasheet=rate / bw if bw else None)
    print(f"device-to-device copy: {rate / 1e9:.1f} GB/s", flush=True)
    if name and not datasheet:
        log.note(f"{name} is not in trainperf's table of datasheet peaks "
                 f"({', '.join(k for k, _ in PEAKS)}): MFU is given against the "
                 "measured ceiling only")


def measured_peaks(stage: dict | None) -> dict[str, float]:
    """The measured ceiling by number format, from a stage 1 record."""
    out = {}
    for item in (stage or {}).get("items", []):
        if item.get("kind") == "ceiling" and item.get("flops_per_s"):
            out[item["format"]] = item["flops_per_s"]
    return out
