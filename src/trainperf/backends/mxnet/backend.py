"""The MXNet backend: its environment and how its ranks start (``launch.py``)."""

from __future__ import annotations

from ...config import Topology, Tuning, Workload
from ..base import Backend, Capabilities, EnvSpec, Launch, LaunchRequest
from ..catalog import FAMILIES

# MXNet 1.9.1 is the last release; numpy 1.24 removed aliases it still uses.
PACKAGES = ("mxnet==1.9.1", "numpy<1.24")
CUDA_PACKAGES = ("mxnet-cu117==1.9.1", "numpy<1.24")
PROBE = ("import json, mxnet, numpy; print(json.dumps({'mxnet': mxnet.__version__, "
         "'numpy': numpy.__version__, 'gpus': mxnet.context.num_gpus()}))")

RULE_DIFFERENCES = {
    "running_var": "MXNet's BatchNorm (its CPU kernel, the one alignment runs on) moves the "
                   "running variance with the biased batch variance (sum of squares / n); "
                   "torch with the unbiased one (/ (n - 1))",
}
"""Where MXNet's own kernels train by another rule than torch's (``Capabilities.
rule_differences``); alignment runs follow MXNet's (``alignment.py``)."""

HYBRID, IMPERATIVE = "hybrid", "imperative"
MODES = (HYBRID, IMPERATIVE)
"""How the backbone executes, on either device kind; the first is the default. ``hybrid``
is the seeds' MXNet (insightface's symbolic Module and gluon-cv's hybridized Gluon each run one
cached graph); the head, the collectives and the update are NDArray operations in both. The
mode changes nothing else, so each runs every case the other does (every head, both kvstores,
real data, fp16 AMP, whose casts wrap MXNet's imperative operators as they wrap its symbols):
no case is refused for its mode."""
MODE_WORDS = {
    HYBRID: "Gluon hybridize(static_alloc=True, static_shape=True): the backbone as one "
            "cached graph (CachedOp), built at the first step",
    IMPERATIVE: "Gluon imperative: the backbone's operators one by one under "
                "autograd.record(), no hybridize",
}


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


def kvstore_rules(workload: Workload, topology: Topology, tuning: Tuning) -> str | None:
    """kvstore ``device`` is one process driving every device of one node, data parallel."""
    if tuning.mxnet_kvstore != "device":
        return None
    if topology.nnodes > 1:
        return ("--mxnet-kvstore device runs in one process on one node; several nodes use "
                "dist_sync")
    if topology.devices_per_node > 1 and workload.task == "face" and workload.fc != "dp":
        return (f"kvstore device runs data parallel only (--fc dp); use dist_sync for "
                f"--fc {workload.fc}")
    return None


BACKEND = Backend(
    name="mxnet", framework="mxnet", launch=launch, env=EnvSpec(PACKAGES, CUDA_PACKAGES, PROBE),
    capabilities=Capabilities(
        modes={"cpu": MODES, "cuda": MODES},
        mode_words=MODE_WORDS,
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32",), "cuda": ("fp32", "fp16")},
        families=FAMILIES, real_data=True,
        rule_differences=RULE_DIFFERENCES,
        why_not={"bf16": "MXNet 1.9's bfloat16 AMP is a oneDNN CPU path, "
                         "not benchmarked here"}),
    runs_as="Gluon (the mode: hybridized or imperative); fp16 through AMP; pfc as "
            "insightface's memory bank, sparse or dense update",
    ranks_start="a scheduler and server (`dist_sync`) or one process (`device`)",
    refuse_more=kvstore_rules)
