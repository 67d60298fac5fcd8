"""Every framework's multi-node path over a real link: two emulated nodes of this machine
(``trainperf.emulated_nodes``: a network namespace each, its own address on a bridge, its own
core), one rank each, each node's launcher started in its namespace from its own cluster file,
as a node's runner starts it. A node cannot reach the other over loopback: a rank that listens
on or advertises anything but its node's own interface never meets its peer. The launchers are
told no interface: they take it from the cluster file.

Each case trains 3 SGD steps in float64 from torch's start file (``config.AlignSpec``, with
dumps), and is held to the same framework's run of the same case on one node of 2 ranks over
loopback, started by the runner as `trainperf align` starts it (torch's through the session's
alignment cache, where the alignment tests have filed dp): every dumped tensor of every rank at
every step, and the losses of the ``end`` event, are equal bit for bit. Both runs compute the
same arithmetic with the same threads per rank, and a reduction over two ranks adds one value
to one other, whichever rank adds (a + b == b + a in IEEE arithmetic): where the ranks run
cannot change a bit. The link's counters show that the sums crossed it.

``pfc`` samples half of each rank's classes (``sample_ratio`` 0.5), from each framework's own
generator seeded by the workload's seed and the rank: the same sample over a link as over
loopback, so that the sampled rows and their update are compared too. MXNet's ``dp`` runs over
``dist_sync`` (a scheduler and a server on node 0, a server on node 1), its ``pfc`` over
Horovod: both of its multi-node layouts. Horovod 0.28.1 runs its collectives on the address of
the host's name whatever interface it is told (``mxnet/launch.horovod_host_refusal``): each
emulated node has a name of its own that resolves to its address, as a cluster's nodes have; a
node whose name resolves to loopback is refused in one line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from trainperf import align
from trainperf.align.rules import check_workload
from trainperf.backends import BACKENDS
from trainperf.backends.base import COLLECTIVE_TIMEOUT_ENV, Cluster, LaunchRequest
from trainperf.backends.spawn import PORTS_PER_RUN
from trainperf.config import AlignSpec, Measure, Topology, Tuning
from trainperf.procs import cpu_threads_per_process
from trainperf.protocol import RunSpec
from trainperf.recipes import get_recipe

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[1] / "src"
RECIPE = "tiny-arcface"
STEPS = 3
TIMEOUT_S = 600.0
"""A hang's bound, nothing more: on a loaded 2-core machine a JAX case's two runs took 220 s."""
PORTS = tuple(range(29400, 29401 + PORTS_PER_RUN))
"""Each node has a network of its own, where nothing else listens: the same ports on both."""
SAMPLE_RATIO = 0.5
FRAMEWORKS = ("torch", "mxnet", "paddle", "jax", "tf", "oneflow")
JAX_ALIGN_COMPILE = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
"""As ``test_jax_runs.ALIGN_COMPILE``: XLA emits float64 convolutions as loop nests of its own,
which level 0 leaves unoptimised (tens of seconds a step)."""
NAMED = ("import os, socket, sys; socket.sethostname(sys.argv[1]); "
         "os.execvp(sys.argv[2], sys.argv[2:])")
"""Run in a UTS namespace of its own under another host name."""


def workload(fc: str):
    base = check_workload(get_recipe(RECIPE).workload, STEPS)
    return base.replace(fc=fc, sample_ratio=SAMPLE_RATIO if fc == "pfc" else 1.0)


def tuning(framework: str, fc: str) -> Tuning:
    return Tuning(mxnet_kvstore="dist_sync") if (framework, fc) == ("mxnet", "dp") else Tuning()


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    """torch's start for 2 ranks as `trainperf align` writes it, so that torch's side of dp is
    the one the alignment tests filed in the session's cache."""
    from trainperf.backends.torch.alignment import write_start

    path = tmp_path_factory.mktemp("emulated-start") / "start.npz"
    write_start(check_workload(get_recipe(RECIPE).workload, STEPS), 2, path)
    return path


@pytest.fixture(scope="module")
def jax_env(tmp_path_factory) -> dict[str, str]:
    """JAX's float64 compile flags, and one compilation cache for its runs: the emulated node 0
    loads what the loopback run's process 0 compiled (JAX writes process 0's alone)."""
    cache = tmp_path_factory.mktemp("jax-cache")
    return {"XLA_FLAGS": JAX_ALIGN_COMPILE, "JAX_COMPILATION_CACHE_DIR": str(cache)}


def loopback_reference(framework: str, fc: str, start: Path, out: Path) -> align.Side:
    """The case on one node of 2 ranks over loopback, through the runner."""
    w = workload(fc)
    if framework == "torch":
        req = align.AlignRequest(RECIPE, w, "torch", [2], [fc], STEPS, TIMEOUT_S, out)
        return align.torch_side(req, w, 2, start, out)
    spec = AlignSpec(str(start), align.DTYPE, str(out / "dump"))
    return align.run_from_start(RECIPE, w, spec, out, STEPS, TIMEOUT_S, framework, 2,
                                tuning=tuning(framework, fc))


def start_nodes(nodes, framework: str, fc: str, python: str, start: Path, out: Path,
                env: dict[str, str], name: str | None = None) -> list[subprocess.Popen]:
    """Each node's launcher in its namespace, one rank each (``name``: the host name each
    node's launcher runs under, in place of the node's own)."""
    threads = cpu_threads_per_process(2)  # what the runner gives the loopback run's ranks
    spec = RunSpec(workload(fc), Measure(runs=1, iters=STEPS, warmup=0, timeout_s=TIMEOUT_S),
                   tuning(framework, fc), device="cpu", threads=threads,
                   align=AlignSpec(str(start), align.DTYPE, str(out / "dump")))
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec.to_dict()))
    addrs = (nodes.addr(0), nodes.addr(1))
    run_env = dict(os.environ, PYTHONPATH=str(SRC), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS=str(threads), **{COLLECTIVE_TIMEOUT_ENV: f"{TIMEOUT_S:g}"},
                   **env)
    for var in ("TRAINPERF_FAULT", "GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE"):
        run_env.pop(var, None)  # a fault or an interface named here is not the node's
    procs = []
    for node in range(2):
        cluster = Cluster(node, 1, addrs, (PORTS, PORTS))
        path = out / f"cluster{node}.json"
        path.write_text(cluster.to_json())
        launch = BACKENDS[framework].launch(LaunchRequest(
            python, Topology(devices_per_node=1, nnodes=2, node_rank=node), spec.tuning,
            out / "spec.json", out / f"events{node}.jsonl", cluster, path))
        argv = launch.argv
        if name is not None:
            argv = ["unshare", "--uts", sys.executable, "-c", NAMED, name, *argv]
        with open(out / f"node{node}.log", "wb") as log:
            procs.append(nodes.start(node, argv, env={**run_env, **launch.env}, stdout=log,
                                     stderr=subprocess.STDOUT))
    return procs


def wait(procs: list[subprocess.Popen]) -> list[int]:
    """Both launchers' exit codes; whatever is still running at the deadline is stopped."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:  # a launcher stops its own ranks on SIGTERM
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    return [p.returncode for p in procs]


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def dump_differences(ref: Path, other: Path) -> tuple[int, list[str]]:
    """How many arrays were compared, and each one that is not the same bit for bit."""
    files = sorted(p.name for p in ref.glob("step-*-rank-*.npz"))
    assert files and files == sorted(p.name for p in other.glob("step-*-rank-*.npz"))
    compared, differ = 0, []
    for name in files:
        with np.load(ref / name) as a, np.load(other / name) as b:
            assert sorted(a.files) == sorted(b.files), name
            for key in a.files:
                compared += 1
                if not np.array_equal(a[key], b[key], equal_nan=True):
                    worst = float(np.max(np.abs(a[key].astype(np.float64) - b[key])))
                    differ.append(f"{name} {key}: {worst:.3g}")
    return compared, differ


def sent_bytes(nodes, node: int) -> int:
    """What node ``node`` has sent over its link: what the bridge's end of it received."""
    return int(Path(f"/sys/class/net/{nodes.host_link(node)}/statistics/rx_bytes").read_text())


@pytest.mark.parametrize("fc", ("dp", "pfc"))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_two_emulated_nodes_train_as_one_node_on_loopback(framework, fc, emulated_nodes, start,
                                                          jax_env, request, tmp_path):
    python = sys.executable if framework == "torch" else request.getfixturevalue(
        f"{framework}_python")
    env = jax_env if framework == "jax" else {}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        ref = loopback_reference(framework, fc, start, tmp_path / "loopback")
    assert ref.ok, ref.record.get("error")
    nodes = emulated_nodes(2)
    before = sent_bytes(nodes, 1)
    out = tmp_path / "emulated"
    codes = wait(start_nodes(nodes, framework, fc, python, start, out, env))
    sent = sent_bytes(nodes, 1) - before
    logs = "\n".join((out / f"node{n}.log").read_text(errors="replace")[-3000:]
                     for n in range(2))
    assert codes == [0, 0], logs
    first = events(out / "events0.jsonl")
    assert [e["event"] for e in first] == ["start", *["step"] * STEPS, "end"], logs
    assert all(e["rank"] == 0 for e in first)
    assert first[0]["world_size"] == 2 and first[0]["global_batch"] == 16
    assert events(out / "events1.jsonl") == []  # rank 1 writes errors only
    compared, differ = dump_differences(ref.dump, out / "dump")
    assert compared > 0 and differ == [], differ[:10]
    assert first[-1]["losses"] == ref.record["losses"]
    # Each step sums the backbone's gradients in float64: node 0 cannot add what it never
    # received, so node 1 sends at least 8 bytes a parameter a step, over the link.
    assert sent >= STEPS * first[0]["backbone_params"] * 8, sent


def test_horovod_refuses_a_node_whose_name_resolves_to_loopback(emulated_nodes, mxnet_python,
                                                                tmp_path, start):
    """Each node's launcher runs under the name ``localhost``, which resolves to loopback: it
    says why in one line and starts nothing, where Horovod's ranks would otherwise fail or wait
    in ``hvd.init()``."""
    if shutil.which("unshare") is None:
        pytest.skip("a host name of the test's own needs util-linux's unshare")
    nodes = emulated_nodes(2)
    codes = wait(start_nodes(nodes, "mxnet", "pfc", mxnet_python, start, tmp_path, {},
                             "localhost"))
    assert codes == [1, 1]
    for node in range(2):
        said = (tmp_path / f"node{node}.log").read_text().strip().splitlines()
        assert len(said) == 1 and said[0].startswith(
            "trainperf.backends.mxnet.launch: Horovod 0.28.1 runs its gloo collectives on the "
            "address of this host's name"), said
        assert "'localhost' resolves to 127.0.0.1" in said[0]
        assert f"this node's address ({nodes.addr(node)})" in said[0]
    assert not (tmp_path / "events0.jsonl").exists() and not (tmp_path / "dump").exists()
