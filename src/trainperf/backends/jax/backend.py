"""The JAX backend (flax, optax): its environment, and its ranks started one process each by
``trainperf.backends.spawn``, meeting at a coordinator on the first node
(``jax.distributed.initialize``)."""

from __future__ import annotations

import os

from ..base import (Backend, Capabilities, Cluster, EnvSpec, Launch, LaunchRequest,
                    rank_gpu)
from ..catalog import FAMILIES

PACKAGES = ("jax==0.10.2", "flax==0.12.8", "optax==0.2.8")
CUDA_PACKAGES = ("jax[cuda12]==0.10.2", "flax==0.12.8", "optax==0.2.8")
# The CUDA build's device code: XLA's GPU runtime (the PJRT plugin) and the plugin's own
# kernels. Their fatbins hold PTX of ISA 8.8, which CUDA 12.9 introduced.
GPU_WHEELS = ("jax-cuda12-pjrt==0.10.2", "jax-cuda12-plugin==0.10.2")
PROBE = ("import json, jax, flax, optax, numpy; print(json.dumps({'jax': jax.__version__, "
         "'flax': flax.__version__, 'optax': optax.__version__, "
         "'numpy': numpy.__version__}))")


def rank_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    from ..spawn import coordinator  # not at the top: see spawn's docstring
    return {"TRAINPERF_COORDINATOR": coordinator(cluster),
            "TRAINPERF_NUM_PROCESSES": str(cluster.world_size),
            "TRAINPERF_PROCESS_ID": str(cluster.global_rank(local_rank)),
            # One GPU per process, as torch's workers; JAX would otherwise take them all. The
            # local rank's entry of the list this node was given, not that index of the host.
            "CUDA_VISIBLE_DEVICES": rank_gpu(local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"))}


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    return spawn_launch(req, "jax")


TUNING = {
    "cudnn_benchmark": "XLA's xla_gpu_autotune_level compile option: XLA's default (4) times "
                       "every convolution's algorithms, 0 when off (it then times no GEMM "
                       "either)",
    "tf32": "jax.config jax_default_matmul_precision: tensorfloat32 (on) or float32 (off), "
            "for dots and convolutions alike"}
"""The speed settings JAX honours, by its own switches (``tuning.py`` says how each works)."""


LAYOUT = "channels_last"
"""The only layout its backbones have (``models.py``: NHWC activations, HWIO kernels), on
every device: the step is written in it, and XLA's CPU client runs its convolutions in it. On a
GPU, XLA's layout assignment still chooses each cuDNN convolution's own layout (its
``HeuristicLayoutAssignment``): NHWC on Hopper and later, NCHW in float32 on older GPUs; no flag
of trainperf's changes that."""


BACKEND = Backend(
    name="jax", framework="jax", launch=launch, env=EnvSpec(
        PACKAGES, CUDA_PACKAGES, PROBE, cuda="12.9", gpu_wheels=GPU_WHEELS,
        gpu_library="jax_plugins/xla_cuda12/xla_cuda_plugin.so"),
    capabilities=Capabilities(
        modes={"cpu": ("jit",), "cuda": ("jit",)},
        mode_words={"jit": "jax.jit of the whole step (JAX has no other training mode)"},
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32", "bf16"),
                    "cuda": ("fp32", "fp16", "bf16")},
        families=FAMILIES, channels_last=True, channels_first=False,
        layouts={"cpu": LAYOUT, "cuda": LAYOUT}, real_data=True, tuning=TUNING,
        # jax_enable_x64 on every device, and a float64 step refuses to run where its lowered
        # program holds a narrower float (``TrainStep.check_program``), whatever the device.
        float64_on=("cpu", "cuda")),
    runs_as="flax linen, optax; one jitted `shard_map` step; pfc's global batch up to the "
            "per-shard sample",
    ranks_start="one process per rank, `jax.distributed` coordinator")
