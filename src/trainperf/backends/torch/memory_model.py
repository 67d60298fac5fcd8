"""Predicted peak memory of one rank's training step, by component.

Backbone: fp32 parameters, gradients and SGD momentum (12 bytes a parameter); under DDP the
gradients are views into its all-reduce buckets (gradient_as_bucket_view), so no more.
Activations: the bytes autograd saves per sample, counted by a forward pass on the meta device
(nothing runs); halved under fp16/bf16 autocast, where convolution outputs are 16-bit. Head: per
class of the rank's shard, the weight, gradient and momentum (sparse Partial FC keeps no
whole-matrix gradient); per class computed in a step, the normalised (or sampled) rows, their
gradients and the temporaries of normalisation's backward and the optimizer, and the [N, C]
logits and probabilities. The CPU adds the process's resident baseline (interpreter, libraries),
measured before the model is built, and a runtime workspace.

The constants differ by device kind and, on a GPU, by precision (``constants_for``). On the
CPU they were fitted to measured peaks of tiny-arcface with torch 2.13
(benchmarks/memory_model.py records the table). On a GPU they were fitted to the H200 record's
peaks (benchmarks/memory_model_gpu.py; the CUDA context and cuBLAS's workspace lie outside the
allocator's count, so no runtime bytes). In fp32 the GPU's peaks hold more: a workspace that
grows with the activations, present only where free memory allows it, and absent where the
backbone's convolutions are depthwise. That is the signature of cuDNN's autotuning trying and
keeping workspace-hungry algorithms for TF32 convolutions; it is modelled as elastic
(``DeviceConstants.workspace_bytes``), and gpucheck part 3 measures it with autotuning off.
The report shows how far every run's prediction was from its measured peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

from ...config import Workload
from ..layouts import shard_of
from .backbones import build_backbone

F32 = 4


@dataclass(frozen=True)
class DeviceConstants:
    backward_factor: float
    """Peak activation memory of the backward over what autograd saves in the forward: the
    activation gradients and reordered copies held next to the saved activations."""
    runtime_bytes: int
    """Memory the runtime allocates beside the model (CPU: oneDNN / ATen caches and thread
    pools that the first step allocates)."""
    source: str
    """Where the figures come from."""
    workspace_bytes: int = 0
    workspace_per_activation: float = 0.0
    """An elastic workspace of ``workspace_bytes`` plus this share of the activation bytes: it
    is taken only where the device has it free, so it never decides whether a step fits."""

    def workspace(self, activation_bytes: int) -> int:
        return self.workspace_bytes + int(self.workspace_per_activation * activation_bytes)


CONSTANTS = {
    "cpu": DeviceConstants(1.5, 128 * 2**20, "fitted to tiny-arcface peaks on a 2-core CPU, "
                                             "torch 2.13"),
    # benchmarks/memory_model_gpu.py fits these to benchmarks/results/gpu-h200-2026-11-26/;
    # tests/test_gpu_records.py holds them to its fit.
    "cuda": DeviceConstants(1.02, 0, "fitted to 17 fp16/bf16 peaks on one H200, torch 2.11"),
    "cuda-fp32": DeviceConstants(1.02, 0, "fitted to 8 fp32 peaks of R100 and ResNet50 on one "
                                          "H200, torch 2.11 (TF32 convolutions, cuDNN "
                                          "autotuning)",
                                 workspace_bytes=4_152_360_960,
                                 workspace_per_activation=0.074),
}


def constants_for(device_type: str, precision: str = "fp32") -> DeviceConstants:
    if device_type == "cpu":
        return CONSTANTS["cpu"]
    return CONSTANTS["cuda-fp32" if precision == "fp32" else "cuda"]
# Copies of a computed class row alive beyond the static ones (the fused normalised linear
# keeps no normalised copy). Forward: the gathered rows of a sampled head. Backward: full
# softmax, the optimizer's weight-decay temporary; sparse, the rows, their gradient and the
# gathered momentum; dense, the gathered rows and their gradient.
FORWARD_ROW_COPIES = {"full": 0, "sparse": 1, "dense": 1}
BACKWARD_ROW_COPIES = {"full": 1, "sparse": 3, "dense": 2}


@dataclass
class MemoryEstimate:
    backbone_static_bytes: int
    activation_bytes_per_sample: int
    activation_bytes: int
    input_bytes: int
    head_static_bytes: int
    head_step_bytes: int
    head_bytes_per_class: float
    """Static head bytes per class of the whole problem, on this rank."""
    total_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def activation_bytes_per_sample(workload: Workload) -> int:
    """Bytes autograd saves per sample in the backbone's forward (fp32), from two meta passes."""
    return _saved_per_sample(*_backbone_key(workload))


def _backbone_key(workload: Workload) -> tuple:
    """What a backbone's size depends on. Only classification backbones have classes of their
    own (a face head is not part of the backbone), so a search over the class count builds the
    backbone once."""
    classes = workload.num_classes if workload.task == "classification" else 2
    return (workload.backbone, workload.embedding_size, classes, workload.input_size,
            workload.output_block)


def _meta_backbone(backbone: str, embedding_size: int, num_classes: int, input_size: int,
                   output_block: str) -> torch.nn.Module:
    with torch.device("meta"):
        return build_backbone(backbone, embedding_size=embedding_size, num_classes=num_classes,
                              input_size=input_size, output_block=output_block)


@lru_cache(maxsize=64)
def _params(*key) -> int:
    return sum(p.numel() for p in _meta_backbone(*key).parameters())


@lru_cache(maxsize=64)
def _saved_per_sample(backbone: str, embedding_size: int, num_classes: int, input_size: int,
                      output_block: str) -> int:
    model = _meta_backbone(backbone, embedding_size, num_classes, input_size, output_block)
    model.train()

    def saved(batch: int) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            storages[st._cdata] = st.nbytes()
            return t

        x = torch.empty(batch, 3, input_size, input_size, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        return sum(storages.values())

    # The slope between two batch sizes leaves out saved parameters (counted as static).
    return (saved(4) - saved(2)) // 2


def estimate(workload: Workload, world_size: int, rank: int = 0,
             backbone_params: int | None = None, device_type: str = "cpu",
             limit_bytes: int | None = None) -> MemoryEstimate:
    """``limit_bytes``: what the device's allocator can hold, where an elastic workspace stops
    (None: no limit)."""
    if backbone_params is None:
        backbone_params = _params(*_backbone_key(workload))
    backbone = backbone_params * F32 * 3
    act_fp32 = activation_bytes_per_sample(workload)
    act = act_fp32 // 2 if workload.precision in ("fp16", "bf16") else act_fp32
    batch = workload.batch_size
    inputs = batch * 3 * workload.input_size ** 2 * F32

    head_static = head_step = 0
    per_class = 0.0
    if workload.task == "face":
        d = workload.embedding_size
        sharded = workload.fc != "dp"
        local = shard_of(workload.num_classes, rank, world_size)[1] if sharded else (
            workload.num_classes)
        sampling = workload.fc == "pfc" and workload.sample_ratio < 1.0
        computed = max(1, int(workload.sample_ratio * local)) if sampling else local
        rows = batch * world_size if sharded else batch
        copies = 3  # weight, gradient, momentum
        if sampling and workload.pfc_update == "sparse":
            copies = 2  # no whole-matrix gradient
        head_static = copies * local * d * F32
        per_class = head_static / workload.num_classes
        row_bytes = computed * d * F32
        logits = rows * computed * F32
        half_cos = rows * computed * 2 if workload.precision != "fp32" else 0
        # Forward: cosines and probabilities together. Backward: row gradients and temporaries
        # next to the probabilities (reused as the logits' gradient).
        update = workload.pfc_update if sampling else "full"
        forward = FORWARD_ROW_COPIES[update] * row_bytes + 2 * logits + half_cos
        backward = BACKWARD_ROW_COPIES[update] * row_bytes + logits
        head_step = max(forward, backward)
    parts = {"backbone_static_bytes": backbone, "activation_bytes": act * batch,
             "input_bytes": inputs, "head_static_bytes": head_static,
             "head_step_bytes": head_step}
    constants = constants_for(device_type, workload.precision)
    return MemoryEstimate(backbone, act, act * batch, inputs, head_static, head_step, per_class,
                          combine(parts, constants, limit_bytes))


def combine(parts: dict, constants: DeviceConstants, limit_bytes: int | None = None) -> int:
    """Predicted bytes from an estimate's components (``MemoryEstimate.to_dict()`` holds them)
    under a device's constants: what a refit of the constants evaluates. The elastic workspace
    fills what ``limit_bytes`` leaves, no more."""
    activation = parts["activation_bytes"]
    # The head's transients are freed before the backbone's backward allocates its own.
    backward_extra = int((constants.backward_factor - 1) * activation)
    need = (parts["backbone_static_bytes"] + activation + parts["input_bytes"]
            + parts["head_static_bytes"] + max(parts["head_step_bytes"], backward_extra)
            + constants.runtime_bytes)
    with_workspace = need + constants.workspace(activation)
    if limit_bytes is None:
        return with_workspace
    return max(need, min(with_workspace, limit_bytes))
