"""The JAX backend (flax, optax): its environment, and its ranks started one process each by
``trainperf.backends.spawn``, meeting at a coordinator (``jax.distributed.initialize``)."""

from __future__ import annotations

from ..base import Backend, EnvSpec, Launch, LaunchRequest

PACKAGES = ("jax==0.10.2", "flax==0.12.8", "optax==0.2.8")
CUDA_PACKAGES = ("jax[cuda12]==0.10.2", "flax==0.12.8", "optax==0.2.8")
PROBE = ("import json, jax, flax, optax, numpy; print(json.dumps({'jax': jax.__version__, "
         "'flax': flax.__version__, 'optax': optax.__version__, "
         "'numpy': numpy.__version__}))")


def rank_env(rank: int, nproc: int, ports: list[int]) -> dict[str, str]:
    return {"TRAINPERF_COORDINATOR": f"127.0.0.1:{ports[0]}",
            "TRAINPERF_NUM_PROCESSES": str(nproc), "TRAINPERF_PROCESS_ID": str(rank),
            # One GPU per process, as torch's workers; JAX would otherwise take them all.
            "CUDA_VISIBLE_DEVICES": str(rank)}


def launch(req: LaunchRequest) -> Launch:
    return Launch([req.python, "-m", "trainperf.backends.spawn", "--backend=jax",
                   f"--nproc={req.topology.devices_per_node}", "--", *req.worker_args])


BACKEND = Backend(name="jax", framework="jax", launch=launch,
                  env=EnvSpec(PACKAGES, CUDA_PACKAGES, PROBE), max_nodes=1)
