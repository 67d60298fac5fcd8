"""Run a function on several CPU ranks over gloo and collect what each rank returns."""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainperf.backends.torch.dist import DistContext


def _entry(rank: int, world_size: int, outdir: str, fn, args) -> None:
    # Several ranks with two threads each are slower than with one on a 2-core machine.
    torch.set_num_threads(1)
    # A file in this call's own folder, not a TCP port: no other process can take it between
    # choosing and binding, however many test sessions share the machine.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'rendezvous')}",
                            rank=rank, world_size=world_size)
    try:
        ctx = DistContext(rank, world_size, rank, torch.device("cpu"), dist.group.WORLD)
        result = fn(ctx, *args)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> list:
    """Call ``fn(ctx, *args)`` on ``world_size`` gloo ranks; returns the per-rank results."""
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(_entry, args=(world_size, outdir, fn, args), nprocs=world_size,
                           start_method="fork")
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]
