"""The MXNet backend: its environment and how its ranks start (``launch.py``)."""

from __future__ import annotations

from ..base import Backend, EnvSpec, Launch, LaunchRequest

# MXNet 1.9.1 is the last release; numpy 1.24 removed aliases it still uses.
PACKAGES = ("mxnet==1.9.1", "numpy<1.24")
CUDA_PACKAGES = ("mxnet-cu117==1.9.1", "numpy<1.24")
PROBE = ("import json, mxnet, numpy; print(json.dumps({'mxnet': mxnet.__version__, "
         "'numpy': numpy.__version__, 'gpus': mxnet.context.num_gpus()}))")


def launch(req: LaunchRequest) -> Launch:
    """One rank on several nodes still needs the parameter server (``dist_sync``); the
    tuning's ``device`` across nodes is passed on for ``launch.py`` to refuse in one line."""
    from ..spawn import cluster_args, output_args  # not at the top: see spawn's docstring
    nproc = req.topology.devices_per_node
    several = req.cluster is not None and req.cluster.nnodes > 1
    kvstore = "local" if nproc == 1 and not several else req.tuning.mxnet_kvstore
    return Launch([req.python, "-m", "trainperf.backends.mxnet.launch", f"--nproc={nproc}",
                   f"--kvstore={kvstore}", *cluster_args(req), *output_args(req), "--",
                   *req.worker_args])


BACKEND = Backend(name="mxnet", framework="mxnet", launch=launch,
                  env=EnvSpec(PACKAGES, CUDA_PACKAGES, PROBE), fc_modes=("dp", "mp"))
