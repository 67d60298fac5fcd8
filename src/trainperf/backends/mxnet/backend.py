"""The MXNet backend: its environment and how its ranks start (``launch.py``)."""

from __future__ import annotations

from ...config import Topology, Tuning, Workload
from ..base import Backend, Capabilities, EnvSpec, Launch, LaunchRequest, SourceBuild
from ..catalog import FAMILIES

# MXNet 1.9.1 is the last release; numpy 1.24 removed aliases it still uses. Horovod's NCCL
# operations link the NCCL of a CUDA 11 wheel (the CUDA build below).
PACKAGES = ("mxnet==1.9.1", "numpy<1.24")
CUDA_PACKAGES = ("mxnet-cu117==1.9.1", "numpy<1.24", "nvidia-nccl-cu11==2.21.5")
NCCL_LIB = "{site}/nvidia/nccl/lib"
# Read from the wheels: libmxnet.so has cubins for sm_50 to sm_86 and no PTX, so that no
# GPU of compute capability 9.0 or later runs it.
GPU_WHEELS = ("mxnet-cu117==1.9.1", "nvidia-nccl-cu11==2.21.5")
NO_NEWER_CUDA = ("none: 1.9.1 is MXNet's last release and cu117 its newest CUDA build (PyPI "
                 "has no mxnet-cu118 or later); its CPU build runs anywhere (`trainperf "
                 "env create mxnet --cpu`, `--device cpu`)")
# numpy<1.24 has wheels up to Python 3.11 (pip finds none for 3.12 or 3.13): on a newer
# trainperf Python the environment is made from one of these, found on PATH or in pyenv.
PYTHONS = ("3.11", "3.10", "3.9")
HOROVOD = SourceBuild(
    # The last release; it has no wheels, and its MXNet extension compiles against the
    # headers and libmxnet.so of the MXNet it is built beside. setup.py imports packaging;
    # setuptools 69 is what it was built and tested with here.
    requirement="horovod==0.28.1",
    build_packages=("setuptools<70", "wheel", "packaging"),
    tools=("cmake", "c++"),
    env={"HOROVOD_WITH_MXNET": "1", "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MPI": "1",
         "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_PYTORCH": "1",
         "HOROVOD_CPU_OPERATIONS": "gloo"},
    # NCCL's wheel ships libnccl.so.2 only; Horovod's FindNCCL asks for libnccl.so (the link)
    # and its extension then loads libnccl.so.2 from the wheel's folder (the run path). A CUDA
    # MXNet's mshadow headers include cuBLAS's and cuRAND's: the toolkit must hold them.
    cuda_env={"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_LINK": "SHARED",
              "HOROVOD_NCCL_INCLUDE": "{site}/nvidia/nccl/include",
              "HOROVOD_NCCL_LIB": NCCL_LIB, "LDFLAGS": f"-Wl,-rpath,{NCCL_LIB}"},
    cuda_links={f"{NCCL_LIB}/libnccl.so": "libnccl.so.2"}, cuda_home_var="HOROVOD_CUDA_HOME",
    cuda_headers=("cuda_runtime.h", "cuda.h", "cublas_v2.h", "curand.h"))
PROBE = ("import json, mxnet, numpy, horovod, horovod.mxnet as hvd; nccl = hvd.nccl_built(); "
         "print(json.dumps({'mxnet': mxnet.__version__, 'numpy': numpy.__version__, "
         "'gpus': mxnet.context.num_gpus(), 'horovod': horovod.__version__, "
         "'horovod_gloo': bool(hvd.gloo_built()), 'horovod_nccl': nccl or None}))")
"""The versions an environment holds, and Horovod's: whether it has gloo, and the NCCL it was
built with (``NCCL_VERSION_CODE``, e.g. 22105 for 2.21.5; None: built without NCCL)."""

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
mode changes nothing else, so each runs every case the other does (every head, every kvstore,
real data, fp16 AMP, whose casts wrap MXNet's imperative operators as they wrap its symbols):
no case is refused for its mode."""
MODE_WORDS = {
    HYBRID: "Gluon hybridize(static_alloc=True, static_shape=True): the backbone as one "
            "cached graph (CachedOp), built at the first step",
    IMPERATIVE: "Gluon imperative: the backbone's operators one by one under "
                "autograd.record(), no hybridize",
}


TF32_OFF = {"NVIDIA_TF32_OVERRIDE": "0"}
"""``--tf32 off``: MXNet 1.9.1 has no TF32 switch of its own (cuDNN's default math runs fp32
convolutions in TF32, and its linalg GEMMs set ``CUBLAS_TF32_TENSOR_OP_MATH`` themselves), so
the variable cuBLAS and cuDNN read turns TF32 off in every process, set before any starts."""


def launch(req: LaunchRequest) -> Launch:
    """One rank on one node needs no collectives (``local``); one rank on each of several
    still does. The tuning's ``device`` across nodes is passed on for ``launch.py`` to refuse
    in one line."""
    from ..spawn import cluster_args, output_args  # not at the top: see spawn's docstring
    nproc = req.topology.devices_per_node
    several = req.cluster is not None and req.cluster.nnodes > 1
    kvstore = "local" if nproc == 1 and not several else req.tuning.mxnet_kvstore
    return Launch([req.python, "-m", "trainperf.backends.mxnet.launch", f"--nproc={nproc}",
                   f"--kvstore={kvstore}", *cluster_args(req), *output_args(req), "--",
                   *req.worker_args], dict(TF32_OFF) if req.tuning.tf32 == "off" else {})


def kvstore_rules(workload: Workload, topology: Topology, tuning: Tuning) -> str | None:
    """kvstore ``device`` is one process driving every device of one node, data parallel."""
    if tuning.mxnet_kvstore != "device":
        return None
    if topology.nnodes > 1:
        return ("--mxnet-kvstore device runs in one process on one node; several nodes use "
                "horovod (the default) or dist_sync")
    if topology.devices_per_node > 1 and workload.task == "face" and workload.fc != "dp":
        return (f"kvstore device runs data parallel only (--fc dp); use horovod (the "
                f"default) for --fc {workload.fc}")
    return None


BACKEND = Backend(
    name="mxnet", framework="mxnet", launch=launch,
    env=EnvSpec(PACKAGES, CUDA_PACKAGES, PROBE, pythons=PYTHONS, source_builds=(HOROVOD,),
                cuda="11.7", gpu_wheels=GPU_WHEELS, gpu_library="mxnet/libmxnet.so",
                cuda_instead=NO_NEWER_CUDA),
    capabilities=Capabilities(
        modes={"cpu": MODES, "cuda": MODES},
        mode_words=MODE_WORDS,
        heads=("dp", "mp", "pfc"),
        precisions={"cpu": ("fp32",), "cuda": ("fp32", "fp16")},
        families=FAMILIES, real_data=True,
        rule_differences=RULE_DIFFERENCES,
        tuning={"cudnn_benchmark": "MXNET_CUDNN_AUTOTUNE_DEFAULT",
                "mxnet_kvstore": "horovod.mxnet or mx.kv.create('dist_sync' or 'device'), "
                                 "as launch.py lays the ranks out",
                "tf32": "NVIDIA_TF32_OVERRIDE=0 for off (MXNet 1.9.1 has no TF32 switch: "
                        "cuDNN's default math and its linalg GEMMs run TF32 on their own)"},
        why_not={"bf16": "MXNet 1.9's bfloat16 AMP is a oneDNN CPU path, "
                         "not benchmarked here",
                 "float64": "its float64 stand-ins and the BatchNorm rule it declares are "
                            "those of MXNet's CPU kernels; a GPU runs other kernels, whose "
                            "rule it does not declare"}),
    runs_as="Gluon (the mode: hybridized or imperative); fp16 through AMP; pfc as "
            "insightface's memory bank, sparse or dense update",
    ranks_start="one process per rank over Horovod (gloo on a CPU, NCCL on GPUs), or a "
                "scheduler and server (`dist_sync`), or one process (`device`)",
    refuse_more=kvstore_rules)
