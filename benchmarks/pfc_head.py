"""Partial FC head step: sparse row update vs arcface_torch's dense update vs full softmax.

One process per variant (so each peak resident set is its own), single rank, the head alone:
forward, backward and the optimizer step over random embeddings. Writes
benchmarks/results/pfc_head-<device>.json.

    python benchmarks/pfc_head.py [--classes 1000000] [--batch 16] [--ratio 0.1] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import time
from pathlib import Path

import torch

from trainperf.backends.torch.dist import DistContext, resolve_device
from trainperf.backends.torch.heads import MarginSoftmaxHead, SampledRowsSGD

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


VARIANTS = {"sparse": ("pfc", "sparse"), "dense": ("pfc", "dense"), "full": ("mp", "sparse")}


def measure(variant: str, args: argparse.Namespace, queue) -> None:
    torch.manual_seed(0)
    device = resolve_device(args.device)
    mode, update = VARIANTS[variant]
    ratio = args.ratio if mode == "pfc" else 1.0
    head = MarginSoftmaxHead(args.classes, args.emb, (1.0, 0.5, 0.0), 64.0,
                             DistContext(device=device), mode=mode, sample_ratio=ratio,
                             update=update).to(device)
    if head.sparse:
        opt = SampledRowsSGD(head, 0.1, 0.9, 5e-4)
    else:
        opt = torch.optim.SGD([head.weight], lr=0.1, momentum=0.9, weight_decay=5e-4)
    emb = torch.randn(args.batch, args.emb, device=device, requires_grad=True)
    labels = torch.randint(0, args.classes, (args.batch,), device=device)
    times = []
    for i in range(args.steps + 2):  # two warm-up steps: momentum buffers, allocator
        synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        head(emb, labels).backward()
        opt.step()
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    queue.put({"variant": variant, "update": head.update, "step_s_median": statistics.median(times),
               "step_s": times, "peak_memory_bytes": peak,
               "classes_computed": head.num_sample if head.sampling else head.num_local})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", type=int, default=1_000_000)
    p.add_argument("--emb", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ratio", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for variant in VARIANTS:
        queue = ctx.Queue()
        proc = ctx.Process(target=measure, args=(variant, args, queue))
        proc.start()
        row = queue.get()
        proc.join()
        rows.append(row)
        print(f"{variant:>6}: {row['step_s_median'] * 1e3:9.1f} ms/step, peak "
              f"{row['peak_memory_bytes'] / 2**30:5.2f} GiB, {row['classes_computed']:,} classes "
              "computed", flush=True)
    out = Path(__file__).parent / "results" / f"pfc_head-{args.device}.json"
    out.write_text(json.dumps({"settings": vars(args), "threads": torch.get_num_threads(),
                               "torch": torch.__version__, "rows": rows,
                               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1)
                   + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
