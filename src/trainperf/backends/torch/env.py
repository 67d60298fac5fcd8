"""What the torch worker knows about its framework and devices (merged into the run's env)."""

from __future__ import annotations

import torch

from ..workerkit import tf32_ran


TF32_SWITCHES = "torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32"


def tf32_fields() -> dict:
    """Whether fp32 convolutions and matrix products run in TF32 on a GPU: torch's two switches,
    unless the process's NVIDIA_TF32_OVERRIDE=0 turns TF32 off beneath them."""
    conv, switch = tf32_ran(torch.backends.cudnn.allow_tf32, TF32_SWITCHES)
    matmul, _ = tf32_ran(torch.backends.cuda.matmul.allow_tf32, TF32_SWITCHES)
    return {"tf32_cudnn": conv, "tf32_matmul": matmul, "tf32_switch": switch}


def framework_env(device: torch.device) -> dict:
    env: dict = {
        "framework": "pytorch",
        "framework_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": None,
        "nccl_version": None,
        "device_type": device.type,
        "device_names": [],
        "device_count": 0,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "tf32_matmul": None,
        "tf32_cudnn": None,
        "tf32_switch": None,
        "cudnn_benchmark": None,
        "memory_measure": "peak resident set (ru_maxrss)",
        "memory_kind": "resident_set_peak",
    }
    if device.type == "cuda":
        env["cudnn_version"] = torch.backends.cudnn.version()
        try:
            env["nccl_version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            pass
        count = torch.cuda.device_count()
        env["device_count"] = count
        env["device_names"] = [torch.cuda.get_device_name(i) for i in range(count)]
        env.update(tf32_fields())
        env["memory_measure"] = "CUDA caching allocator's peak (torch.cuda.max_memory_allocated)"
        env["memory_kind"] = "allocator_peak"
        env["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    return env
