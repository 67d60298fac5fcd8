"""The PaddlePaddle backend: its environment, and its ranks started one process each by
``trainperf.backends.spawn`` with the variables Paddle's own launcher would set, on one node or
several."""

from __future__ import annotations

from ..base import Backend, Capabilities, Cluster, EnvSpec, Launch, LaunchRequest
from ..catalog import FAMILIES

PACKAGES = ("paddlepaddle==3.3.1", "numpy>=1.26,<3")
# Paddle's CUDA wheels of 3.x are published on its own index, not on PyPI.
CUDA_PACKAGES = ("--extra-index-url=https://www.paddlepaddle.org.cn/packages/stable/cu126/",
                 "paddlepaddle-gpu==3.3.1", "numpy>=1.26,<3")
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


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    return spawn_launch(req, "paddle",
                        {CUDNN_SEARCH_FLAG: "1" if req.tuning.cudnn_benchmark else "0"})


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
    name="paddle", framework="paddle", launch=launch, env=EnvSpec(PACKAGES, CUDA_PACKAGES, PROBE),
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
        rule_differences=RULE_DIFFERENCES,
        why_not={p: "Paddle's CPU build has no half-precision matrix "
                    "products" for p in ("fp16", "bf16")}),
    runs_as="dynamic graph, AMP O1; pfc by PLSC's rule, sparse or dense update",
    ranks_start="one process per rank, `PADDLE_*` variables; gloo on CPU")
