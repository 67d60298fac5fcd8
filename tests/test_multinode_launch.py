"""Every non-torch backend started across nodes from a ``Cluster``: what each rank is told (global
rank, every rank's endpoint, the coordinator on node 0, the GPU by local rank), which processes
the MXNet launcher starts on which node, and real two-"node" runs over loopback (Paddle, the
cheapest framework to start, MXNet's dist_sync, the one with the most moving parts, and MXNet
over Horovod, its default, whose rendezvous node 0's launcher serves).

The real runs start one launcher per "node", each with its own cluster file and events file, one
rank each; node 1 lives at 127.0.0.2 (loopback too on Linux), so every address a node is told is
its own. The events rank 0 writes land on node 0's side only, as on real nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_util import reserved_ports
from trainperf.backends import BACKENDS
from trainperf.backends.base import Cluster, LaunchRequest
from trainperf.backends.jax import backend as jax_backend
from trainperf.backends.mxnet import launch as mxnet_launch
from trainperf.backends.oneflow import backend as oneflow_backend
from trainperf.backends.paddle import backend as paddle_backend
from trainperf.backends.spawn import PORTS_PER_RUN, local_cluster
from trainperf.backends.tf import backend as tf_backend
from trainperf.config import Measure, Topology, Tuning
from trainperf.protocol import RunSpec
from trainperf.recipes import get_recipe

SRC = Path(__file__).resolve().parents[1] / "src"
ADDRS = ("10.0.0.1", "10.0.0.2")
PORTS = ((1000, 1001, 1002, 1003, 1004, 1005), (2000, 2001, 2002, 2003, 2004, 2005))
ENDPOINTS = ["10.0.0.1:1001", "10.0.0.1:1002", "10.0.0.2:2001", "10.0.0.2:2002"]
"""Global ranks 0-3 of two nodes with two ranks each: node n's local rank r at ports[n][1 + r]."""
NON_TORCH = ("mxnet", "paddle", "jax", "tf", "oneflow")


def two_nodes(node_rank: int) -> Cluster:
    return Cluster(node_rank, 2, ADDRS, PORTS)


# ------------------------------------------------------------------------------- unit tests

def test_a_cluster_survives_json():
    cluster = two_nodes(1)
    again = Cluster.from_json(cluster.to_json())
    assert again == cluster
    assert (again.nnodes, again.world_size, again.master) == (2, 4, ("10.0.0.1", 1000))
    assert [again.global_rank(r) for r in range(2)] == [2, 3]


def test_paddle_lists_every_rank_of_every_node():
    env = paddle_backend.rank_env(1, two_nodes(1))
    assert env == {"PADDLE_TRAINER_ID": "3", "PADDLE_TRAINERS_NUM": "4",
                   "PADDLE_TRAINER_ENDPOINTS": ",".join(ENDPOINTS),
                   "PADDLE_CURRENT_ENDPOINT": "10.0.0.2:2002",
                   "PADDLE_MASTER": "10.0.0.1:1000", "PADDLE_RANK_IN_NODE": "1",
                   "PADDLE_LOCAL_SIZE": "2", "FLAGS_selected_gpus": "1"}


def test_jax_meets_at_node_zeros_coordinator():
    env = jax_backend.rank_env(1, two_nodes(1))
    assert env == {"TRAINPERF_COORDINATOR": "10.0.0.1:1000", "TRAINPERF_NUM_PROCESSES": "4",
                   "TRAINPERF_PROCESS_ID": "3", "CUDA_VISIBLE_DEVICES": "1"}


def test_tf_config_names_every_worker_and_the_global_task():
    env = tf_backend.rank_env(1, two_nodes(1))
    assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": ENDPOINTS},
                                            "task": {"type": "worker", "index": 3}}
    assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_oneflow_gets_what_its_own_launcher_sets():
    """And node 0's last port, which no rank listens on otherwise: where rank 0 waits for the
    others to leave (``oneflow/rendezvous.Departure``)."""
    env = oneflow_backend.rank_env(1, two_nodes(1))
    assert env == {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1000", "WORLD_SIZE": "4",
                   "RANK": "3", "LOCAL_RANK": "1",
                   "TRAINPERF_DEPARTURE_PORT": str(PORTS[0][-1])}
    assert PORTS[0][-1] not in PORTS[0][:3]  # the master's and each local rank's


def test_one_node_is_loopback_with_global_equal_to_local():
    cluster = local_cluster(2)
    assert cluster.addrs == ("127.0.0.1",) and len(cluster.ports[0]) == PORTS_PER_RUN + 2
    port = cluster.ports[0]
    paddle = paddle_backend.rank_env(1, cluster)
    assert paddle["PADDLE_TRAINER_ID"] == paddle["PADDLE_RANK_IN_NODE"] == "1"
    assert paddle["PADDLE_TRAINER_ENDPOINTS"] == f"127.0.0.1:{port[1]},127.0.0.1:{port[2]}"
    assert jax_backend.rank_env(1, cluster)["TRAINPERF_COORDINATOR"] == f"127.0.0.1:{port[0]}"
    assert oneflow_backend.rank_env(1, cluster)["WORLD_SIZE"] == "2"


def by_role(processes) -> dict[str, list]:
    roles: dict[str, list] = {}
    for p in processes:
        roles.setdefault(p.role, []).append(p)
    return roles


def test_mxnet_runs_the_scheduler_on_node_zero_and_a_server_on_every_node():
    args = ["--spec", "s.json"]
    first = by_role(mxnet_launch.plan(2, "dist_sync", args, two_nodes(0)))
    second = by_role(mxnet_launch.plan(2, "dist_sync", args, two_nodes(1)))
    assert {k: len(v) for k, v in first.items()} == {"scheduler": 1, "server": 1, "worker": 2}
    assert {k: len(v) for k, v in second.items()} == {"server": 1, "worker": 2}
    for node, roles in enumerate((first, second)):
        for p in sum(roles.values(), []):
            assert p.env["DMLC_PS_ROOT_URI"] == "10.0.0.1"
            assert p.env["DMLC_PS_ROOT_PORT"] == "1000"
            assert p.env["DMLC_NUM_SERVER"] == "2" and p.env["DMLC_NUM_WORKER"] == "4"
            assert p.env["DMLC_NODE_HOST"] == ADDRS[node]
            assert "DMLC_INTERFACE" not in p.env  # lo would be unreachable from the other node
            assert bool(p.helper) == (p.role != "worker")
            assert p.rank == (-1 if p.helper else int(p.env["TRAINPERF_RANK"]))
    assert [h.helper for h in second["server"]] == ["server on node 1"]
    assert [(w.env["TRAINPERF_RANK"], w.env["TRAINPERF_LOCAL_RANK"]) for w in second["worker"]
            ] == [("2", "0"), ("3", "1")]
    assert second["worker"][0].argv[-2:] == args


def test_mxnet_on_one_node_is_as_before():
    roles = by_role(mxnet_launch.plan(2, "dist_sync", []))
    assert {k: len(v) for k, v in roles.items()} == {"scheduler": 1, "server": 1, "worker": 2}
    worker = roles["worker"][1]
    assert worker.env["DMLC_PS_ROOT_URI"] == worker.env["DMLC_NODE_HOST"] == "127.0.0.1"
    assert worker.env["DMLC_INTERFACE"] == "lo"
    assert (worker.env["DMLC_NUM_SERVER"], worker.env["DMLC_NUM_WORKER"]) == ("1", "2")
    assert worker.env["TRAINPERF_RANK"] == worker.env["TRAINPERF_LOCAL_RANK"] == "1"
    (device,) = mxnet_launch.plan(2, "device", [])
    assert device.env["TRAINPERF_KVSTORE"] == "device" and not device.helper
    with pytest.raises(ValueError, match="kvstore device runs on one node"):
        mxnet_launch.plan(2, "device", [], two_nodes(0))


@pytest.mark.parametrize("name", NON_TORCH)
def test_every_backend_takes_several_nodes_and_passes_the_cluster_file(name, tmp_path):
    backend = BACKENDS[name]
    assert backend.capabilities.several_nodes
    path = tmp_path / "cluster.json"
    topo = Topology(devices_per_node=1)
    one = backend.launch(LaunchRequest("py", topo, Tuning(), tmp_path / "s", tmp_path / "e"))
    several = backend.launch(LaunchRequest("py", topo, Tuning(), tmp_path / "s",
                                           tmp_path / "e", Cluster(1, 1, ADDRS, PORTS), path))
    assert not any(a.startswith("--cluster") for a in one.argv)
    cut = several.argv.index("--")
    assert f"--cluster={path}" in several.argv[:cut]
    assert several.argv[cut:] == one.argv[one.argv.index("--"):]
    if name == "mxnet":  # one rank per node still needs collectives
        assert "--kvstore=local" in one.argv and "--kvstore=horovod" in several.argv


# A worker stand-in for spawn: writes what it was told, one file per global rank.
STANDIN = '''
import json, os, sys
keys = ("PADDLE_TRAINER_ID", "PADDLE_CURRENT_ENDPOINT", "FLAGS_selected_gpus",
        "TRAINPERF_LOCAL_RANK")
with open(os.path.join(sys.argv[1], os.environ["PADDLE_TRAINER_ID"]), "w") as f:
    json.dump({k: os.environ[k] for k in keys}, f)
'''


def test_spawn_starts_this_nodes_ranks_from_the_cluster_file(tmp_path):
    (tmp_path / "standin.py").write_text(STANDIN)
    path = tmp_path / "cluster.json"
    path.write_text(two_nodes(1).to_json())
    env = dict(os.environ, PYTHONPATH=f"{SRC}:{tmp_path}")
    spawn = [sys.executable, "-m", "trainperf.backends.spawn", "--backend=paddle",
             "--module=standin"]
    done = subprocess.run([*spawn, "--nproc=2", f"--cluster={path}", "--", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    told = {int(p.name): json.loads(p.read_text()) for p in tmp_path.iterdir()
            if p.name.isdigit()}
    assert told == {2: {"PADDLE_TRAINER_ID": "2", "PADDLE_CURRENT_ENDPOINT": ENDPOINTS[2],
                        "FLAGS_selected_gpus": "0", "TRAINPERF_LOCAL_RANK": "0"},
                    3: {"PADDLE_TRAINER_ID": "3", "PADDLE_CURRENT_ENDPOINT": ENDPOINTS[3],
                        "FLAGS_selected_gpus": "1", "TRAINPERF_LOCAL_RANK": "1"}}
    refused = subprocess.run([*spawn, "--nproc=3", f"--cluster={path}", "--", str(tmp_path)],
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "2 ranks per node" in refused.stderr


# -------------------------------------------------------------------- real two-node runs

def two_node_run(python: str, launcher: list[str], fc: str, tmp_path: Path
                 ) -> tuple[list[int], list[dict], str]:
    """Both nodes' launchers, started together: their exit codes, node 0's events (rank 0's),
    and node 1's event file's text (empty: rank 1 writes only errors)."""
    spec = RunSpec(get_recipe("tiny-arcface").workload.replace(fc=fc),
                   Measure(runs=1, iters=2, warmup=1), device="cpu", threads=1)
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    ports = (reserved_ports(PORTS_PER_RUN + 1), reserved_ports(PORTS_PER_RUN + 1))
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TRAINPERF_FAULT", None)
    procs = []
    for node in range(2):
        cluster = tmp_path / f"cluster{node}.json"
        cluster.write_text(Cluster(node, 1, ("127.0.0.1", "127.0.0.2"), ports).to_json())
        with open(tmp_path / f"node{node}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [python, "-m", *launcher, "--nproc=1", f"--cluster={cluster}", "--",
                 "--spec", str(tmp_path / "spec.json"),
                 "--events", str(tmp_path / f"events{node}.jsonl")],
                env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 240
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:  # a launcher stops its own ranks on SIGTERM
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)
    events = [json.loads(line) for line in
              (tmp_path / "events0.jsonl").read_text().splitlines()]
    second = tmp_path / "events1.jsonl"
    return codes, events, second.read_text() if second.exists() else ""


def assert_ran_on_two_nodes(codes, events, second, tmp_path):
    logs = "\n".join((tmp_path / f"node{n}.log").read_text(errors="replace")[-2000:]
                     for n in range(2))
    assert codes == [0, 0], logs
    assert [e["event"] for e in events] == ["start", "step", "step", "end"], logs
    assert all(e["rank"] == 0 for e in events)
    assert events[0]["world_size"] == 2 and events[0]["global_batch"] == 16
    assert second == ""


def test_paddle_two_nodes_over_loopback(paddle_python, tmp_path):
    """mp: the sharded head's all-gathers and all-reduces cross the two nodes."""
    launcher = ["trainperf.backends.spawn", "--backend=paddle"]
    assert_ran_on_two_nodes(*two_node_run(paddle_python, launcher, "mp", tmp_path), tmp_path)


def test_mxnet_dist_sync_two_nodes_over_loopback(mxnet_python, tmp_path):
    """A scheduler on node 0, a server on each node, keys spread over both. ps-lite numbers
    workers by host in descending order, so its rank 0 is node 1's worker here: rank 0's
    events are on node 0 only because the worker takes the launcher's rank instead."""
    launcher = ["trainperf.backends.mxnet.launch", "--kvstore=dist_sync"]
    assert_ran_on_two_nodes(*two_node_run(mxnet_python, launcher, "dp", tmp_path), tmp_path)


def test_mxnet_horovod_two_nodes_over_loopback(mxnet_python, tmp_path):
    """mp: the sharded head's gathers and sums cross the nodes through gloo, which the ranks
    joined at node 0's rendezvous, each node named by its own address (127.0.0.2 for node
    1)."""
    launcher = ["trainperf.backends.mxnet.launch", "--kvstore=horovod"]
    assert_ran_on_two_nodes(*two_node_run(mxnet_python, launcher, "mp", tmp_path), tmp_path)
