"""The JAX backend (flax, optax): its environment, and its ranks started one process each by
``trainperf.backends.spawn``, meeting at a coordinator on the first node
(``jax.distributed.initialize``)."""

from __future__ import annotations

from ..base import Backend, Cluster, EnvSpec, Launch, LaunchRequest

PACKAGES = ("jax==0.10.2", "flax==0.12.8", "optax==0.2.8")
CUDA_PACKAGES = ("jax[cuda12]==0.10.2", "flax==0.12.8", "optax==0.2.8")
PROBE = ("import json, jax, flax, optax, numpy; print(json.dumps({'jax': jax.__version__, "
         "'flax': flax.__version__, 'optax': optax.__version__, "
         "'numpy': numpy.__version__}))")


def rank_env(local_rank: int, cluster: Cluster) -> dict[str, str]:
    from ..spawn import coordinator  # not at the top: see spawn's docstring
    return {"TRAINPERF_COORDINATOR": coordinator(cluster),
            "TRAINPERF_NUM_PROCESSES": str(cluster.world_size),
            "TRAINPERF_PROCESS_ID": str(cluster.global_rank(local_rank)),
            # One GPU per process, as torch's workers; JAX would otherwise take them all.
            "CUDA_VISIBLE_DEVICES": str(local_rank)}


def launch(req: LaunchRequest) -> Launch:
    from ..spawn import spawn_launch  # not at the top: see spawn's docstring
    return spawn_launch(req, "jax")


BACKEND = Backend(name="jax", framework="jax", launch=launch,
                  env=EnvSpec(PACKAGES, CUDA_PACKAGES, PROBE))
