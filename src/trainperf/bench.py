"""``make bench``: the default suite, sized to the machine it runs on."""

from __future__ import annotations


def bench_arguments(gpus: int, out: str) -> list[str]:
    """`trainperf` arguments of the default suite: the seeds' main recipe on GPUs (one device,
    and all of them where there are several), a small multi-process run on a CPU-only machine."""
    if gpus:
        devices = "1" if gpus == 1 else f"1,{gpus}"
        return ["run", "r100-arcface-emore", "--devices", devices, "--runs", "5",
                "--device", "cuda", "--out", out]
    return ["run", "tiny-arcface", "--devices", "1,2", "--fc", "mp", "--runs", "3",
            "--iters", "40", "--warmup", "10", "--device", "cpu", "--timeout", "600",
            "--out", out]
