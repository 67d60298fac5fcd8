"""What the torch backend's scenarios share around the step: out-of-memory recognition, memory
figures and limits, backend speed settings, and rank 0's ``start`` event. The throughput run
(``worker.py``) and training to accuracy (``train_loop.py``) both build on it, so neither
imports the other."""

from __future__ import annotations

import torch

from ...config import Tuning, Workload
from ...protocol import EventWriter, Start
from ..workerkit import is_oom as reads_as_oom
from ..workerkit import rss_now_bytes, rss_peak_bytes, tf32_setting, tf32_wanted
from .dist import DistContext, all_gather
from .env import framework_env, tf32_fields
from .flops import backbone_profile, train_flops_per_sample
from .memory_model import estimate
from .step import TrainStep


def is_oom(exc: BaseException, memory_capped: bool = False) -> bool:
    """``memory_capped``: the process runs under ``--memory-limit``, where oneDNN reports an
    allocation the cap refused as a primitive it could not create (seen in capacity searches
    on CPU); without a cap that message means something else."""
    if isinstance(exc, torch.OutOfMemoryError) or reads_as_oom(exc):
        return True
    text = str(exc).lower()
    return "can't allocate memory" in text or "defaultcpuallocator" in text or (
        memory_capped and "could not create a primitive" in text)


def current_memory(device: torch.device) -> int:
    """Memory in use now: allocated device memory, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return rss_now_bytes()


def start_window_peak(device: torch.device) -> tuple[int, int] | None:
    """On a GPU: the peaks so far (allocated, reserved), and the allocator's peaks counted
    afresh from here. The window's own peak is what the steady state holds, apart from the
    first steps (where cuDNN's autotuning tries its algorithms)."""
    if device.type != "cuda":
        return None
    before = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
    torch.cuda.reset_peak_memory_stats(device)
    return before


def peak_memory(device: torch.device, before_window: tuple[int, int] | None = None
                ) -> dict[str, int]:
    """The run's peaks; with ``before_window`` (``start_window_peak``'s), the window's own
    allocated peak too."""
    if device.type == "cuda":
        allocated, reserved = (torch.cuda.max_memory_allocated(device),
                               torch.cuda.max_memory_reserved(device))
        free, total = torch.cuda.mem_get_info(device)
        used = {"device_used_bytes": total - free}
        if before_window is None:
            return {"peak_memory_bytes": allocated, "peak_reserved_bytes": reserved, **used}
        return {"peak_memory_bytes": max(allocated, before_window[0]),
                "peak_reserved_bytes": max(reserved, before_window[1]),
                "window_peak_memory_bytes": allocated, **used}
    return {"peak_memory_bytes": rss_peak_bytes()}


def memory_over_ranks(values: dict[str, int], ctx: DistContext) -> dict:
    """The largest of each figure across ranks, and every rank's peak."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=ctx.device)
    per_rank = all_gather(t[None], ctx)
    out: dict = {k: int(v) for k, v in zip(values, per_rank.max(dim=0).values.tolist())}
    out["peak_memory_bytes_per_rank"] = [int(v) for v in per_rank[:, 0].tolist()]
    return out


def waits_over_ranks(window_wait_s: float, ctx: DistContext) -> list[float]:
    """Every rank's seconds of the window spent waiting for batches."""
    t = torch.tensor([[window_wait_s]], dtype=torch.float64, device=ctx.device)
    return all_gather(t, ctx)[:, 0].tolist()


def classes_computed(workload: Workload, step: TrainStep, ctx: DistContext) -> int:
    """Classes each sample's logits are computed over, summed over shards."""
    head = step.head
    if head is None or not head.sampling:
        return workload.num_classes
    return head.num_sample * ctx.world_size


def configure_backend(tuning: Tuning, device: torch.device) -> None:
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = tuning.cudnn_benchmark
        # torch's own default differs (convolutions in TF32, matrix products not); trainperf's
        # rule is one for every framework (Tuning.tf32).
        on = tf32_wanted(tuning, True)
        torch.backends.cudnn.allow_tf32 = on
        torch.backends.cuda.matmul.allow_tf32 = on


def applied_tuning(tuning: Tuning, device: torch.device, step: TrainStep) -> dict:
    """The ``Tuning`` settings this run applied, as applied (``Capabilities.tuning``)."""
    out: dict = {}
    if device.type == "cuda":
        out["cudnn_benchmark"] = torch.backends.cudnn.benchmark
        ran = tf32_fields()
        out["tf32"] = tf32_setting(ran["tf32_cudnn"], ran["tf32_matmul"])
    ddp = step.ddp_settings
    if ddp is not None:
        out.update(ddp_bucket_mb=ddp["bucket_cap_mb"], ddp_static_graph=ddp["static_graph"],
                   ddp_broadcast_buffers=ddp["broadcast_buffers"])
    return out


def step_settings(step: TrainStep, device: torch.device) -> dict:
    """The speed settings this run's step actually runs with."""
    return {"cudnn_benchmark": torch.backends.cudnn.benchmark if device.type == "cuda" else None,
            "ddp": step.ddp_settings,
            "torch_compile": step.compile_settings,
            "loss_scaling": "dynamic, one overflow decision for all ranks"
            if step.workload.precision == "fp16" else None}


def start_fields(ctx: DistContext, step: TrainStep, baseline: int, input_info: dict | None,
                 **settings) -> dict:
    """What only the torch worker knows for rank 0's ``start`` event: its environment and
    settings, and what it predicts of the run (FLOPs per sample, the memory model's peak)."""
    workload = step.workload
    params, fwd_flops = backbone_profile(
        workload.backbone, workload.input_size, embedding_size=workload.embedding_size,
        num_classes=workload.num_classes, output_block=workload.output_block)
    flops = train_flops_per_sample(
        fwd_flops, workload.embedding_size if workload.task == "face" else 0,
        classes_computed(workload, step, ctx))
    # What the allocator can hold: an elastic workspace (cuDNN's, in fp32) stops there.
    limit = (torch.cuda.mem_get_info(ctx.device)[0] + torch.cuda.memory_allocated(ctx.device)
             if ctx.device.type == "cuda" else None)
    model = estimate(workload, ctx.world_size, ctx.rank, params, ctx.device.type, limit)
    return {"env": framework_env(ctx.device),
            "settings": {**step_settings(step, ctx.device), "input": input_info, **settings},
            "backbone_params": params, "train_flops_per_sample": sum(flops.values()),
            "train_flops_by_op": flops, "pfc_update": step.pfc_update,
            "predicted_peak_bytes": baseline + model.total_bytes,
            "memory_model": model.to_dict()}


def emit_start(events: EventWriter, ctx: DistContext, step: TrainStep, baseline: int,
               input_info: dict | None, **settings) -> None:
    """Rank 0's ``start`` event: what runs, and what the worker predicts of it."""
    if ctx.rank != 0:  # only rank 0 reports; rank 0 also holds the largest class shard
        return
    workload = step.workload
    events.emit(Start(world_size=ctx.world_size, global_batch=workload.batch_size * ctx.world_size,
                      device=str(ctx.device), workload=workload.to_dict(),
                      baseline_memory_bytes=baseline,
                      **start_fields(ctx, step, baseline, input_info, **settings)))
