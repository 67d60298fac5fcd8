"""The PaddlePaddle backend: its environment, and its ranks started one process each by
``trainperf.backends.spawn`` with the variables Paddle's own launcher would set, on one node or
several."""

from __future__ import annotations

from ...config import Tuning
from ..base import Backend, Capabilities, Cluster, EnvSpec, Launch, LaunchRequest
from ..catalog import FAMILIES

PACKAGES = ("paddlepaddle==3.3.1", "numpy>=1.26,<3")
# Paddle's CUDA wheels of 3.x are published on its own index, not on PyPI.
CUDA_PACKAGES = ("--extra-index-url=https://www.paddlepaddle.org.cn/packages/stable/cu126/",
                 "paddlepaddle-gpu==3.3.1", "numpy>=1.26,<3")
# The layout of Paddle's CPU wheel (its CUDA wheel, on Paddle's own index, could not be
# read where this was written).
GPU_LIBRARY = "paddle/base/libpaddle.so"
PROBE = ("import json, paddle, numpy; print(json.dumps({'paddle': paddle.__version__, "
         "'numpy': numpy.__version__, 'cuda': paddle.device.is_compiled_with_cuda()}))")


def rank_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    from ..spawn import coordinator, rank_endpoints  # not at the top: see spawn's docstring
    endpoints = rank_endpoints(cluster)
    rank = cluster.global_rank(local_rank)
    return {"PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(cluster.world_size),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank], "PADDLE_MASTER": coordinator(cluster),
            "PADDLE_RANK_IN_NODE": str(local_rank),
            "PADDLE_LOCAL_SIZE": str(cluster.nproc_per_node),
            "FLAGS_selected_gpus": str(local_rank)}


CUDNN_SEARCH_FLAG = "FLAGS_cudnn_exhaustive_search"
"""Paddle's analogue of torch's ``cudnn.benchmark`` (time every cuDNN algorithm per layer
shape, keep the fastest). Given through the environment, which Paddle reads when it starts:
``paddle.set_flags`` refuses this flag in some builds. A CPU build ignores it."""


TF32_OVERRIDE = "NVIDIA_TF32_OVERRIDE"
"""cuBLAS's and cuDNN's own variable: 0 keeps every fp32 product of theirs off TF32 whatever
the caller asked. Paddle's own default for it moved in the 3.3 cycle: PaddlePaddle/Paddle PR
75476 (October 2025; reverted, reopened as 75972) turned it to 0, PR 77781 (February 2026,
cherry-picked as 77842) took that out again for its flags (``tuning.py``); which of them the
pinned GPU wheel holds could not be read here. ``--tf32 on`` gives 1, as PaddlePaddle's own
benchmark CI does to keep TF32 under that default (PaddlePaddle/benchmark PR 1828), which
leaves the libraries to Paddle's switches; ``off`` gives 0 beside the switches, for any fp32
product of a Paddle kernel that no switch of Paddle's reaches."""


def launch_env(tuning: Tuning) -> dict[str, str]:
    """The variables a Paddle run starts with: read by Paddle and cuDNN when they start, before
    the worker could set anything (a CPU build ignores both)."""
    return {CUDNN_SEARCH_FLAG: "1" if tuning.cudnn_benchmark else "0",
            TF32_OVERRIDE: "1" if tuning.tf32 == "on" else "0"}


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    return spawn_launch(req, "paddle", launch_env(req.tuning))


TUNING = {
    "cudnn_benchmark": CUDNN_SEARCH_FLAG,
    "ddp_bucket_mb": "the size of the flat buckets trainperf's all-reduce sums the gradients "
                     "in after the backward (paddle.distributed.all_reduce; Paddle's "
                     "DataParallel is not used)",
    "tf32": "paddle.base.core.set_cublas_switch and set_cudnn_switch (and FLAGS_cublas_allow_"
            "tf32, FLAGS_cudnn_allow_tf32 where the build has them); NVIDIA_TF32_OVERRIDE 1 "
            "(on) or 0 (off) beside them"}
"""The speed settings Paddle honours, each by the switch that does it (``tuning.py``)."""


DYGRAPH, STATIC = "dygraph", "static"
"""The execution modes (``Capabilities.modes``): Paddle's dynamic graph, and its backbone turned
into a static program by ``paddle.jit.to_static`` (``step.py`` says what runs where)."""


RULE_DIFFERENCES = {
    "running_var": "Paddle's batch_norm moves the running variance with the biased batch "
                   "variance (the squared deviations' sum over n); torch's with the unbiased one "
                   "(over n - 1)."}
"""Where Paddle's kernels train by another rule than torch's (``Capabilities.rule_differences``):
every run, an alignment run's too, keeps Paddle's rule (``alignment``)."""


BACKEND = Backend(
    name="paddle", framework="paddle", launch=launch, env=EnvSpec(
        PACKAGES, CUDA_PACKAGES, PROBE, cuda="12.6",
        gpu_wheels=("paddlepaddle-gpu==3.3.1",), gpu_library=GPU_LIBRARY),
    capabilities=Capabilities(
        # Dygraph first on both: on a CPU to_static measured 0.73-0.75x dygraph on ResNet50
        # (issue 43); `--mode best` measures them on the device at hand.
        modes={"cpu": (DYGRAPH, STATIC), "cuda": (DYGRAPH, STATIC)},
        mode_words={DYGRAPH: "dynamic graph (dygraph)",
                    STATIC: "paddle.jit.to_static(backbone, full_graph=True): the backbone's "
                            "forward and backward as static programs; head, gradient "
                            "all-reduce and optimizer in dygraph"},
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32",), "cuda": ("fp32", "fp16", "bf16")},
        families=FAMILIES, real_data=True,
        rule_differences=RULE_DIFFERENCES, tuning=TUNING,
        why_not={**{p: "Paddle's CPU build has no half-precision matrix "
                       "products" for p in ("fp16", "bf16")},
                 "float64": "the 32-bit constants its float64 stand-ins replace were found "
                            "in Paddle's CPU kernels; its CUDA kernels are not measured"}),
    runs_as="dynamic graph, AMP O1; pfc by PLSC's rule, sparse or dense update",
    ranks_start="one process per rank, `PADDLE_*` variables; gloo on CPU")
