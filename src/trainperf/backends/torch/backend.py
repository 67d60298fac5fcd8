"""The torch backend's launch: its ranks started one process each by ``trainperf.backends.spawn``
in trainperf's own interpreter, with the variables ``torch.distributed.run`` would set
(``MASTER_ADDR``/``MASTER_PORT`` on node 0's first free port, ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``...), which ``init_process_group``'s ``env://`` reads.

Not torchrun itself: its elastic agent adds nothing to a run that never restarts, and costs two
things. An agent whose ranks all finished waits up to 300 s at its exit barrier for the agents
of the other nodes, so one node waits that long on a node whose rank crashed; and it reports a
rank's death in a summary of its own, not in the rank's own words.
"""

from __future__ import annotations

from ..base import Backend, Capabilities, Cluster, Launch, LaunchRequest
from ..catalog import FAMILIES


def rank_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    from ..spawn import torch_style_env  # not at the top: see spawn's docstring
    return {**torch_style_env(local_rank, cluster),
            "LOCAL_WORLD_SIZE": str(cluster.nproc_per_node),
            "GROUP_RANK": str(cluster.node_rank)}


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    return spawn_launch(req, "torch")


BACKEND = Backend(
    name="torch", framework="pytorch", launch=launch,
    capabilities=Capabilities(
        modes={"cpu": ("eager", "compile"),
               "cuda": ("eager", "compile", "compile-cudagraphs")},
        mode_words={"eager": "eager nn.Modules",
                    "compile": "torch.compile, inductor",
                    "compile-cudagraphs": 'torch.compile(mode="reduce-overhead"), inductor '
                                          "kernels replayed as CUDA graphs"},
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32", "fp16", "bf16"), "cuda": ("fp32", "fp16", "bf16")},
        families=FAMILIES, channels_last=True, real_data=True, trains=True,
        # The H200 record (benchmarks/results/gpu-h200-2026-11-26/): R100 channels-last ran
        # 1.47x (fp32) to 1.97x (bf16) NCHW. On a CPU torch's convolutions stay channels-first.
        layouts={"cuda": "channels_last"},
        # align's reference: torch's CUDA kernels take float64 for every operation of the
        # step, and its optimizer and BatchNorm hold their hyperparameters as doubles.
        float64_on=("cpu", "cuda"),
        tuning={"cudnn_benchmark": "torch.backends.cudnn.benchmark",
                "ddp_bucket_mb": "DistributedDataParallel(bucket_cap_mb=)",
                "ddp_static_graph": "DistributedDataParallel(static_graph=)",
                "ddp_broadcast_buffers": "DistributedDataParallel(forward_sync_buffers=), "
                                         "broadcast_buffers= before torch 2.13",
                "tf32": "torch.backends.cudnn.allow_tf32, "
                        "torch.backends.cuda.matmul.allow_tf32"}),
    runs_as="eager modules or torch.compile (inductor; CUDA graphs on a GPU), DDP; pfc with a "
            "sparse (default) or dense update",
    ranks_start="one process per rank, `torch.distributed.run`'s variables")
