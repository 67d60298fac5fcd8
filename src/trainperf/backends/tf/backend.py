"""The TensorFlow 2 backend: its environment (TensorFlow 2.21, which brings Keras 3; the models
are written on ``tf.Variable`` and ``tf.nn``, see ``models.py``), and its ranks started one
process each by ``trainperf.backends.spawn`` as the workers of a ``MultiWorkerMirroredStrategy``
(``TF_CONFIG``: every rank of every node, each on its own port, this process's task index = its
global rank)."""

from __future__ import annotations

import json
import os

from ...config import Topology, Tuning, Workload
from ..base import (AUTOTUNE_FLAG, Backend, Capabilities, Cluster, EnvSpec, Launch,
                    LaunchRequest, rank_gpu)

PACKAGES = ("tensorflow-cpu==2.21.0",)
CUDA_PACKAGES = ("tensorflow[and-cuda]==2.21.0",)
# Its CUDA libraries come as the and-cuda extra's dependencies, from 12.5.82 on; its own
# kernels' PTX is of ISA 8.5 at most, which CUDA 12.5 introduced.
GPU_WHEELS = ("tensorflow==2.21.0",)
PROBE = ("import json, tensorflow as tf, numpy; print(json.dumps({'tensorflow': tf.__version__,"
         " 'keras': tf.keras.__version__, 'numpy': numpy.__version__}))")

QUIET_LOG = {"TF_CPP_MIN_LOG_LEVEL": "2"}
XLA_COMPILE_LOG = {"TF_CPP_MIN_LOG_LEVEL": "0", "TF_CPP_VMODULE": "device_compilation_profiler=1"}
"""TensorFlow's C++ log as an xla run needs it: the one line TensorFlow writes per XLA
compilation with the seconds it timed around it (``device_compilation_profiler.cc``, a
``VLOG(1)``, so INFO must pass too), which the worker reads back as its compile time
(``compiling.py``). Both are read once, when TensorFlow loads: they are the launch's."""


def log_env(mode: str) -> dict[str, str]:
    """TensorFlow's C++ logging for a run in ``mode``: warnings and errors only, except under
    ``xla`` (``XLA_COMPILE_LOG``; ``default`` is ``function``, which compiles no XLA)."""
    return dict(XLA_COMPILE_LOG if mode == "xla" else QUIET_LOG)


def tuning_env(tuning: Tuning, caller_env: dict[str, str]) -> dict[str, str]:
    """The variables that carry ``tuning`` to TensorFlow, which reads them when it loads or
    builds a kernel: oneDNN's custom CPU ops, cuDNN's autotuning of convolutions (``--mode
    function``) and, under ``--mode xla`` without it, XLA's autotuning turned off, after the
    caller's own ``XLA_FLAGS``. Set either way, so that a value left in the user's shell cannot
    change what the results say ran (the worker records what TensorFlow made of them)."""
    env = {"TF_ENABLE_ONEDNN_OPTS": "1" if tuning.tf_onednn else "0",
           "TF_CUDNN_USE_AUTOTUNE": "1" if tuning.cudnn_benchmark else "0"}
    if tuning.mode == "xla" and not tuning.cudnn_benchmark:
        kept = [f for f in caller_env.get("XLA_FLAGS", "").split()
                if not f.startswith(AUTOTUNE_FLAG + "=")]
        env["XLA_FLAGS"] = " ".join([*kept, AUTOTUNE_FLAG + "=0"])
    return env


DEPARTURE_ENV = "TRAINPERF_DEPARTURE"
"""``host:port`` where rank 0 waits for the other ranks to be past the last barrier before any
leaves (``departure.py``)."""


def rank_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    from ..spawn import endpoint, rank_endpoints  # not at the top: see spawn's docstring
    config = {"cluster": {"worker": rank_endpoints(cluster)},
              "task": {"type": "worker", "index": cluster.global_rank(local_rank)}}
    # Node 0's last port, which no rank listens on otherwise (spawn.PORTS_PER_RUN).
    # The local rank's entry of the list this node was given, not that index of the host.
    gpu = rank_gpu(local_rank, os.environ.get("CUDA_VISIBLE_DEVICES"))
    return {"TF_CONFIG": json.dumps(config), "CUDA_VISIBLE_DEVICES": gpu,
            DEPARTURE_ENV: endpoint(cluster.addrs[0], cluster.ports[0][-1])}


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    # The log is set either way too, for what the worker reads of it.
    return spawn_launch(req, "tf", {**tuning_env(req.tuning, dict(os.environ)),
                                    **log_env(req.tuning.mode)})


def xla_refusal(workload: Workload, world_size: int, device_kind: str) -> str | None:
    """Why ``--mode xla`` cannot run this work on ``world_size`` ranks of ``device_kind``, or
    None. XLA compiles static shapes only, and a sampling pfc's sample grows on the device to
    hold every positive of the batch (``heads.py``). TensorFlow 2.21 compiles a collective
    inside ``jit_compile`` only as NCCL ("Collectives are not yet implemented for CPU devices
    when compiling with XLA", b/194942685; RING: "Only compiling NCCL/auto collective is
    supported"), so several CPU ranks cannot run one compiled step. Several GPU ranks can: the
    one collective XLA lowers is the all-reduce, and the step uses nothing else there
    (``comm.XLA_COLLECTIVES``: a sharded head's gathers are sums)."""
    if workload.task == "face" and workload.fc == "pfc" and workload.sample_ratio < 1.0:
        return ("the tf backend runs --fc pfc with sampling (--sample-ratio below 1) in --mode "
                "function only: XLA compiles static shapes, and pfc's sample grows on the device "
                "to hold every positive")
    if world_size > 1 and device_kind == "cpu":
        return ("the tf backend runs --mode xla on one CPU rank only: TensorFlow compiles no "
                "collective for CPU devices inside jit_compile (b/194942685); run --mode "
                "function on several CPU ranks")
    return None


def mode_rules(workload: Workload, topology: Topology, tuning: Tuning) -> str | None:
    """``xla_refusal`` for a case asked for in ``--mode xla``. The device must be known here
    (``cpu`` or ``cuda``): a topology still on ``auto`` is let through, and its worker refuses
    the same case when it starts (``step.TrainStep``). ``best`` probes ``xla`` only where this
    is None for ``xla``."""
    if tuning.mode != "xla" or topology.device not in ("cpu", "cuda"):
        return None
    return xla_refusal(workload, topology.nnodes * topology.devices_per_node, topology.device)


# The three head modes, pfc with either update (heads.py, step.py). Its convolutions are NHWC,
# so --memory-format channels_last is what it runs anyway. Two modes (step.py): the step as a
# graph, or compiled by XLA where ``mode_rules`` lets it. No ``rule_differences``:
# the fused BatchNorm kernel moves its running variance with the unbiased batch variance and
# momentum 0.1, torch's rule (tests/test_tf_models_heads.py measures it on the CPU kernel).
BACKEND = Backend(
    name="tf", framework="tensorflow", launch=launch, env=EnvSpec(
        PACKAGES, CUDA_PACKAGES, PROBE, cuda="12.5", gpu_wheels=GPU_WHEELS,
        gpu_library="tensorflow/libtensorflow_cc.so.2"),
    capabilities=Capabilities(
        modes={"cpu": ("function", "xla"), "cuda": ("function", "xla")},
        mode_words={"function": "tf.function, jit_compile off",
                    "xla": "tf.function(jit_compile=True), the whole step one XLA program"},
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32",), "cuda": ("fp32", "fp16")},
        families=("iresnet", "mobilefacenet", "resnet_v1b"), channels_last=True,
        channels_first=False,
        # NHWC is the only layout its backbones have (models.py), on every device.
        layouts={"cpu": "channels_last", "cuda": "channels_last"},
        real_data=True,
        tuning={"cudnn_benchmark": "TF_CUDNN_USE_AUTOTUNE; under --mode xla, XLA_FLAGS="
                                   "--xla_gpu_autotune_level=0 when off (GEMMs too)",
                "ddp_bucket_mb": "tf.distribute.experimental.CommunicationOptions("
                                 "bytes_per_pack=) of the gradient all-reduce",
                "tf_onednn": "TF_ENABLE_ONEDNN_OPTS",
                "tf32": "tf.config.experimental.enable_tensor_float_32_execution"},
        why_not={"fp16": "TensorFlow's mixed float16 is not run on a CPU",
                 "float64": "its float64 step, BatchNorm of tf.nn operations in place of the "
                            "fused kernel, is measured against TensorFlow's CPU kernels only"}),
    runs_as="tf.Variable and tf.nn in one tf.function (XLA-compiled in --mode xla); pfc with "
            "a sparse (default) or dense update",
    ranks_start="`MultiWorkerMirroredStrategy` (`TF_CONFIG`, RING on CPU)",
    refuse_more=mode_rules)
