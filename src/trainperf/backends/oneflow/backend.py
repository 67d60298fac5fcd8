"""The OneFlow backend, opt-in (``trainperf env create oneflow``): its environment, and its ranks
started one process each by ``trainperf.backends.spawn`` with the variables OneFlow's own
launcher (``oneflow.distributed.launch``) sets: torch-style ``MASTER_ADDR``/``MASTER_PORT`` (node
0's first port), ``WORLD_SIZE``, ``RANK`` (global) and ``LOCAL_RANK``. OneFlow learns the other
ranks' addresses at that rendezvous; it sets no node rank or per-rank endpoint.

OneFlow (the seeds' other system) published its last wheel, 0.9.0, for Python 3.8-3.10 only, as
a ~1 GB CUDA build that imports (on CPU too) only with cuDNN and cuBLAS libraries it does not
declare; with them the environment is about 3.9 GB, which is why it is not built unless asked.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from ...config import Topology, Tuning, Workload
from ..base import Backend, Capabilities, Cluster, EnvSpec, Launch, LaunchRequest

PORT_VARIABLE = "TRAINPERF_DEPARTURE_PORT"
"""Where rank 0 waits for the other ranks to leave (``rendezvous.Departure``)."""
PYTHONS = ("3.10", "3.9", "3.8")
PACKAGES = ("oneflow==0.9.0", "numpy<2")
# Loaded by OneFlow's library at import, undeclared by its wheel; their ``lib`` folders go on
# LD_LIBRARY_PATH.
NO_DEPS = ("nvidia-cudnn-cu11==8.5.0.96", "nvidia-cublas-cu11==11.10.3.66")
# Read from the wheels: liboneflow has cubins for sm_60 to sm_86 and no PTX (CUDA 11.7).
GPU_WHEELS = ("oneflow==0.9.0", *NO_DEPS)
NO_NEWER_CUDA = ("none on PyPI: 0.9.0, OneFlow's last release there, is this CUDA 11.7 "
                 "build (PyPI has no oneflow-cu118 or oneflow-cu12x); it runs on the CPU "
                 "too (`--device cpu`)")
# Read from the installed metadata: importing oneflow needs LD_LIBRARY_PATH, which runs set.
PROBE = ("import json, numpy; from importlib import metadata; print(json.dumps({'oneflow': "
         "metadata.version('oneflow'), 'numpy': numpy.__version__}))")


def library_path(python: str) -> str:
    """LD_LIBRARY_PATH with the environment's NVIDIA library folders first."""
    env = Path(python).parent.parent
    folders = sorted(glob.glob(str(env / "lib/python3*/site-packages/nvidia/*/lib")))
    return os.pathsep.join(folders + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p])


def rank_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    # No CUDA_VISIBLE_DEVICES: OneFlow places a global tensor of rank r on its node's device
    # r % ranks-per-node, so every process must see all of its node's GPUs.
    from ..spawn import torch_style_env  # not at the top: see spawn's docstring
    # Node 0's last port, which no rank listens on otherwise (spawn.PORTS_PER_RUN).
    return {**torch_style_env(local_rank, cluster), PORT_VARIABLE: str(cluster.ports[0][-1])}


TF32_MATMUL_VAR = "ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION"
"""OneFlow 0.9's own TF32 switch, for cuBLAS only: read (default true) when each CUDA stream is
made, which then puts its cuBLAS handle in ``CUBLAS_TF32_TENSOR_OP_MATH``
(``oneflow/core/ep/cuda/cuda_stream.cpp``); the fused MLP's cuBLASLt calls read it too
(``oneflow/user/kernels/cublas_fused_mlp_util.cuh``). OneFlow 0.9 sets no math type of its own
on a float32 convolution (``oneflow/core/device/cudnn_conv_util.cpp``): cuDNN's default, which
allows TF32, governs, and only ``TF32_OVERRIDE`` turns it off."""
TF32_OVERRIDE = "NVIDIA_TF32_OVERRIDE"
"""cuBLAS's and cuDNN's own variable: 0 keeps every fp32 product of theirs off TF32."""


def launch_env(tuning: Tuning) -> dict[str, str]:
    """The TF32 variables a OneFlow run starts with (read when OneFlow makes its CUDA streams
    and when cuDNN starts, before the worker could set anything; a CPU run reads neither).
    ``--tf32 on`` leaves cuDNN alone (any other value of the override is reserved)."""
    if tuning.tf32 == "on":
        return {TF32_MATMUL_VAR: "1"}
    return {TF32_MATMUL_VAR: "0", TF32_OVERRIDE: "0"}


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    return spawn_launch(req, "oneflow", {"LD_LIBRARY_PATH": library_path(req.python),
                                         **launch_env(req.tuning)})


TUNING = {
    "cudnn_benchmark": "flow.backends.cudnn.enable_conv_heuristic_search_algo(False), which "
                       "only nn.Graph reads (--mode graph): eager convolutions always take "
                       "cuDNN's heuristic, recorded as cudnn_benchmark false",
    "ddp_broadcast_buffers": "nn.parallel.DistributedDataParallel(broadcast_buffers=)",
    "tf32": f"{TF32_MATMUL_VAR} (cuBLAS); {TF32_OVERRIDE}=0 beside it for off (cuDNN's "
            f"convolutions, which OneFlow 0.9 has no switch for)"}
"""The speed settings OneFlow honours, each by the switch that does it (``tuning.py``)."""


GRAPH_FLOAT64 = ("the oneflow backend's --mode graph computes in float32 only: OneFlow 0.9's "
                 "nn.Graph has no float64 update (no sgd_update kernel for float64 weights); "
                 "align it with --mode eager")
"""Why a float64 alignment run cannot run in graph mode (``graph_step.py`` has the measurement)."""


def graph_refusal(workload: Workload) -> str | None:
    """Why ``--mode graph`` cannot run the workload, or None (``graph_step.py`` says more)."""
    if workload.task == "face" and workload.fc == "pfc" and workload.sample_ratio < 1.0:
        return ("the oneflow backend runs --fc pfc with sampling (--sample-ratio below 1) in "
                "--mode eager only: its sparse update writes the sampled rows outside any "
                "optimizer, which an nn.Graph's job cannot hold, and the sample grows to hold "
                "every positive, a shape known only when the step runs")
    if any(scale > 1.0 for scale in workload.lr_scales):
        return ("the oneflow backend's --mode graph runs a rate that only falls (lr scales in "
                "[0, 1]): the graph's schedule is OneFlow's ConstantLR, whose factor is at most 1")
    return None


GRAPH_BUFFERS = ("the oneflow backend's --mode graph has no DDP: each rank keeps its own "
                 "BatchNorm statistics, so --ddp-broadcast-buffers runs in --mode eager only")


def mode_rules(workload: Workload, topology: Topology, tuning: Tuning) -> str | None:
    """Why the case's ``--mode`` cannot run it, or None. ``best`` probes ``graph`` only where
    this says None for it."""
    if tuning.mode != "graph":
        return None
    several = topology.devices_per_node * topology.nnodes > 1
    if several and tuning.ddp_broadcast_buffers:
        return GRAPH_BUFFERS
    return graph_refusal(workload)


BACKEND = Backend(
    name="oneflow", framework="oneflow", launch=launch,
    env=EnvSpec(PACKAGES, PACKAGES, PROBE, pythons=PYTHONS, no_deps_packages=NO_DEPS,
                cuda="11.7", gpu_wheels=GPU_WHEELS, gpu_library="oneflow.libs/liboneflow-*.so",
                cuda_instead=NO_NEWER_CUDA),
    capabilities=Capabilities(
        float32_modes={"graph": GRAPH_FLOAT64},
        modes={"cpu": ("eager", "graph"), "cuda": ("eager", "graph")},
        mode_words={"eager": "eager nn.Modules",
                    "graph": "nn.Graph with the graph's own optimizer, clipping and LR "
                             "schedule; global tensors on several ranks (the seeds' lazy "
                             "OneFlow)"},
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32",), "cuda": ("fp32",)},
        families=("iresnet", "mobilefacenet", "resnet_v1b"), real_data=True, tuning=TUNING,
        why_not={"fp16": "OneFlow 0.9's eager mode has no dynamic loss "
                         "scaler",
                 "float64": "its float64 stand-ins are bridged to OneFlow's CPU kernels "
                            "only"}),
    runs_as="eager; mp and pfc as global tensors, `split(0)`; `--mode graph`: one nn.Graph",
    ranks_start="one process per rank, torch-style variables",
    refuse_more=mode_rules)
