"""The TensorFlow 2 backend: its environment (TensorFlow 2.21, which brings Keras 3; the models
are written on ``tf.Variable`` and ``tf.nn``, see ``models.py``), and its ranks started one
process each by ``trainperf.backends.spawn`` as the workers of a ``MultiWorkerMirroredStrategy``
(``TF_CONFIG``: every rank of every node, each on its own port, this process's task index = its
global rank)."""

from __future__ import annotations

import json

from ..base import Backend, Capabilities, Cluster, EnvSpec, Launch, LaunchRequest

PACKAGES = ("tensorflow-cpu==2.21.0",)
CUDA_PACKAGES = ("tensorflow[and-cuda]==2.21.0",)
PROBE = ("import json, tensorflow as tf, numpy; print(json.dumps({'tensorflow': tf.__version__,"
         " 'keras': tf.keras.__version__, 'numpy': numpy.__version__}))")


def rank_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    from ..spawn import rank_endpoints  # not at the top: see spawn's docstring
    config = {"cluster": {"worker": rank_endpoints(cluster)},
              "task": {"type": "worker", "index": cluster.global_rank(local_rank)}}
    return {"TF_CONFIG": json.dumps(config), "CUDA_VISIBLE_DEVICES": str(local_rank),
            "TF_CPP_MIN_LOG_LEVEL": "2"}


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    # Set either way, so that a value left in the user's shell cannot change what the results
    # say ran (``Tuning.tf_onednn``; the worker records what TensorFlow made of it).
    return spawn_launch(req, "tf", {"TF_ENABLE_ONEDNN_OPTS": "1" if req.tuning.tf_onednn
                                    else "0"})


# The three head modes, pfc with either update (heads.py, step.py). Its convolutions are NHWC,
# so --channels-last is what it runs anyway. No ``rule_differences``:
# the fused BatchNorm kernel moves its running variance with the unbiased batch variance and
# momentum 0.1, torch's rule (tests/test_tf_models_heads.py measures it on the CPU kernel).
BACKEND = Backend(
    name="tf", framework="tensorflow", launch=launch, env=EnvSpec(PACKAGES, CUDA_PACKAGES, PROBE),
    capabilities=Capabilities(
        modes={"cpu": ("function",), "cuda": ("function",)},
        mode_words={"function": "tf.function, jit_compile off"},
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32",), "cuda": ("fp32", "fp16")},
        families=("iresnet", "resnet_v1b"), channels_last=True,
        real_data=True,
        why_not={"fp16": "TensorFlow's mixed float16 is not run on a CPU"}),
    runs_as="tf.Variable and tf.nn in one tf.function; pfc with a sparse (default) or dense "
            "update",
    ranks_start="`MultiWorkerMirroredStrategy` (`TF_CONFIG`, RING on CPU)")
