"""Entry point of one torch run, started on every rank by ``trainperf.backends.spawn``:
``python -m trainperf.backends.torch.worker --spec S --events E``.

The entry, failures and the ``start``/``step``/``end`` events are ``workerkit``'s, as for every
framework; this module is torch's side of a measured run. Its step times come from CUDA events
on a GPU and the host clock on a CPU (``timing.py``), never from a sync inside the window. A
spec with ``train`` trains to a verification accuracy instead (``train_loop.py``). The step runs
in the mode the spec resolves to (``modes.py``: eager, or ``torch.compile``'d, which compiles
in the first step, inside the warm-up); the run's compile time (``End.compile_s``) is torch's
own timing of its compilations (``modes.compile_seconds``), never a step's excess. For tests,
TRAINPERF_FAULT injects failures at steps (``trainperf.faults``), and
TRAINPERF_TEST_RECOMPILE_AT=STEP drops the compiled graphs before that step
(``modes.RECOMPILE_AT_ENV``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..phases import NO_COMM, PhaseClock
from ..workerkit import (FrameworkRun, StepState, StepTimes, align_dtype, breaks_margin,
                         dumps_state, leave, measured_run, worker_entry)
from . import profiling
from .alignment import load_start, step_state
from .backend import BACKEND
from .data import real_feed, synthetic_batch
from .dist import init_from_env
from .modes import (CUDA_GRAPH_MODES, compile_measure, compile_seconds, cudagraph_skips,
                    force_recompile, graphs_compiled, recompile_step)
from .runtime import (applied_tuning, configure_backend, current_memory, is_oom,
                      memory_over_ranks, peak_memory, start_fields, start_window_peak,
                      waits_over_ranks)
from .step import ONE_GRAPH_PHASE, ONE_GRAPH_WHY, TrainStep
from .timing import make_timer, timed_loop


class TorchRun(FrameworkRun):
    backend = BACKEND

    @classmethod
    def rank_before_connect(cls) -> int:
        return int(os.environ.get("RANK", "0"))

    def connect(self) -> None:
        if self.spec.threads:
            # This rank's share of the cores, for both of torch's pools: the intra-op one (and
            # OpenMP's, which inductor's CPU kernels size from it) and the inter-op one.
            torch.set_num_threads(self.spec.threads)
            torch.set_num_interop_threads(self.spec.threads)
        self.ctx = ctx = init_from_env(self.spec.device)
        self.rank, self.world_size, self.distributed = ctx.rank, ctx.world_size, ctx.distributed
        self.device, self.device_kind = str(ctx.device), ctx.device.type

    def run(self, events) -> None:
        if self.spec.train is not None:
            from .train_loop import train  # the time-to-accuracy scenario

            train(self.spec, events, self.ctx)
        else:
            measured_run(self, events)

    def is_oom(self, exc: BaseException) -> bool:
        return is_oom(exc, self.spec.measure.memory_limit_bytes is not None)

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()

    def memory_now(self) -> int:
        return current_memory(self.ctx.device)

    def build(self) -> None:
        spec, ctx = self.spec, self.ctx
        configure_backend(spec.tuning, ctx.device)
        align = spec.align
        self.train_step = TrainStep(spec.workload, ctx, spec.tuning,
                                    getattr(torch, align_dtype(spec)),
                                    keep_grad_norm=dumps_state(align), mode=self.mode)
        if breaks_margin(align) and self.train_step.head:
            self.train_step.head.straight_through = True
        self.recompile_at = recompile_step()
        # Nothing has been compiled yet (a module compiles on its first call); what the process
        # compiled before, if anything, is not this run's.
        self.compile_s_before = compile_seconds(self.mode)
        # CUDA graphs are captured in the first step, or skipped there: ``start`` waits for it
        # to say how many graphs ran without one.
        self.start_after_first_step = self.mode in CUDA_GRAPH_MODES
        self.feed, self.input_info = None, None
        self.waits: list[float] = []
        if spec.data:
            self.feed, self.input_info = real_feed(spec.data, spec.workload, ctx)
        elif align:
            self.images, self.labels = load_start(self.train_step, align.start, ctx)
        else:
            self.images, self.labels = synthetic_batch(spec.workload, ctx)

    def start_fields(self, baseline: int) -> dict:
        return start_fields(self.ctx, self.train_step, baseline, self.input_info,
                            cudagraph_skips=cudagraph_skips(self.mode))

    def applied_tuning(self) -> dict:
        return applied_tuning(self.spec.tuning, self.ctx.device, self.train_step)

    def compile_count(self) -> int | None:
        return graphs_compiled(self.mode)

    def compile_seconds(self) -> float | None:
        return compile_seconds(self.mode) - self.compile_s_before

    def compile_measure(self) -> str | None:
        return compile_measure(self.mode, self.ctx.device.type)

    def step(self, index: int) -> torch.Tensor:
        if index == self.recompile_at:
            force_recompile()
        if self.feed is None:
            return self.train_step(self.images, self.labels)
        batch = next(self.feed)
        self.waits.append(self.feed.last_wait_s)
        return self.train_step(*batch)

    def timed_loop(self, step: Callable[[int], Any], on_steps: Callable[[StepTimes], None]
                   ) -> tuple[float, list[Any]]:
        measure, indices = self.spec.measure, iter(range(self.spec.measure.iters))

        def window_begins() -> None:
            self.barrier()
            self.before_window = start_window_peak(self.ctx.device)

        return timed_loop(lambda: step(next(indices)), measure.iters, measure.warmup,
                          make_timer(self.ctx.device), on_steps, window_begins)

    def loop_settings(self) -> dict:
        return {}  # torch's timers need no watcher thread

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.ctx.group)

    def oom_error(self, message: str) -> BaseException:
        return torch.OutOfMemoryError(f"CUDA {message}")

    def data_wait(self, index: int) -> float | None:
        return self.waits[index] if self.feed is not None else None

    def read_losses(self, outputs: list) -> list[float]:
        return torch.stack(outputs).double().tolist()

    # -- profiled runs ------------------------------------------------------------------------
    @property
    def merged_phases(self) -> dict[str, str]:  # type: ignore[override]
        return {ONE_GRAPH_PHASE: ONE_GRAPH_WHY} if self.train_step.one_graph else {}

    @property
    def phase_method(self) -> str:
        return profiling.method(self.ctx, self.train_step)

    def phase_stamp(self) -> Any:
        return profiling.stamp(self.ctx.device)

    def phase_elapsed(self, begin: Any, end: Any) -> float:
        return profiling.elapsed(begin, end)

    def annotate(self, name: str) -> contextlib.AbstractContextManager:
        return torch.profiler.record_function(f"trainperf/{name}")

    def profiler(self, trace_dir: str | None) -> contextlib.AbstractContextManager:
        return profiling.Profiler(self, trace_dir)

    def can_skip_comm(self) -> bool:
        return self.distributed

    def head_has_backward(self) -> bool | None:
        step = self.train_step
        if step.head is None:
            return None
        return not step.head_with_backbone  # dp under DDP or compiled: it runs in backward

    def profiled_step(self, index: int, clock: PhaseClock, variant: str) -> torch.Tensor:
        with clock.phase("data"):
            if self.feed is None:
                images, labels = self.images, self.labels
            else:
                images, labels = next(self.feed)
                self.waits.append(self.feed.last_wait_s)
        return self.train_step.profiled(images, labels, clock, skip_comm=variant == NO_COMM)

    def matmul_rate(self) -> tuple[float, str]:
        return profiling.matmul_rate(self.ctx.device, self.spec.workload.precision)

    def collectives_by_phase(self) -> dict[str, list[str]] | None:
        return self.collectives

    collectives: dict[str, list[str]] | None = None

    def align_state(self) -> StepState:
        return step_state(self.train_step)

    before_window: tuple[int, int] | None = None

    def memory_over_ranks(self) -> dict:
        return memory_over_ranks(peak_memory(self.ctx.device, self.before_window), self.ctx)

    def end_fields(self) -> dict:
        if self.feed is None:
            return {}
        self.feed.close()
        window_wait = sum(self.waits[self.spec.measure.warmup:])
        return {"data_wait_s_per_rank": waits_over_ranks(window_wait, self.ctx)}


def main(argv: list[str] | None = None) -> int:
    return worker_entry(argv, __doc__, TorchRun)


if __name__ == "__main__":
    leave(main())
