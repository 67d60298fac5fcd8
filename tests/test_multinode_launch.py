"""Every non-torch backend started across nodes from a ``Cluster``: what each rank is told (global
rank, every rank's endpoint, the coordinator on node 0, the GPU by local rank, the interface
that holds its node's address), which processes the MXNet launcher starts on which node, when it
refuses Horovod across nodes, and how TensorFlow's ranks leave together.

Real runs across nodes, each node's launcher started with its own cluster file in a network
namespace of its own, are in ``test_emulated_frameworks.py``: every framework, dp and pfc (Paddle's
sharded head and its all-gathers, MXNet's dist_sync and Horovod among them), over a link that
loopback cannot stand in for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from run_util import reserved_ports
from trainperf.backends import BACKENDS
from trainperf.backends.base import Cluster, LaunchRequest
from trainperf.backends.jax import backend as jax_backend
from trainperf.backends.mxnet import launch as mxnet_launch
from trainperf.backends.oneflow import backend as oneflow_backend
from trainperf.backends.paddle import backend as paddle_backend
from trainperf.backends.spawn import PORTS_PER_RUN, gloo_interface_env, local_cluster
from trainperf.backends.tf import backend as tf_backend
from trainperf.backends.tf.departure import Departure
from trainperf.config import Topology, Tuning

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


def test_jax_meets_at_node_zeros_coordinator(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = jax_backend.rank_env(1, two_nodes(1))
    assert env == {"TRAINPERF_COORDINATOR": "10.0.0.1:1000", "TRAINPERF_NUM_PROCESSES": "4",
                   "TRAINPERF_PROCESS_ID": "3", "CUDA_VISIBLE_DEVICES": "1"}
    # A node given GPUs 4 and 6 (a scheduler, an emulated node): local rank 1 drives GPU 6.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert jax_backend.rank_env(1, two_nodes(1))["CUDA_VISIBLE_DEVICES"] == "6"


def test_tf_config_names_every_worker_and_the_global_task(monkeypatch):
    """And node 0's last port, which no rank listens on otherwise: where rank 0 waits for the
    others to be past the last barrier (``tf/departure.py``)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa,GPU-bb")
    assert tf_backend.rank_env(1, two_nodes(1))["CUDA_VISIBLE_DEVICES"] == "GPU-bb"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    env = tf_backend.rank_env(1, two_nodes(1))
    assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": ENDPOINTS},
                                            "task": {"type": "worker", "index": 3}}
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert env["TRAINPERF_DEPARTURE"] == f"10.0.0.1:{PORTS[0][-1]}"


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


def test_several_nodes_tell_gloo_the_interface_of_the_nodes_address(monkeypatch):
    """Gloo otherwise binds what the host name resolves to. Loopback "nodes" are on lo; an
    interface named by the caller (the runner's) stands; one node, or an address that no
    interface holds, leaves gloo its own choice."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    loopback = (("127.0.0.1", "127.0.0.2"), PORTS)
    assert gloo_interface_env(Cluster(1, 2, *loopback)) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert gloo_interface_env(Cluster(1, 2, *loopback), {"GLOO_SOCKET_IFNAME": "ib0"}) == {}
    assert gloo_interface_env(local_cluster(2)) == {}
    assert gloo_interface_env(Cluster(0, 2, ("192.0.2.1", "192.0.2.2"), PORTS)) == {}


def test_the_spawned_ranks_get_the_interface_too(tmp_path, monkeypatch):
    (tmp_path / "standin.py").write_text(
        "import os, sys\n"
        "open(os.path.join(sys.argv[1], 'ifname'), 'w').write(os.environ['GLOO_SOCKET_IFNAME'])")
    path = tmp_path / "cluster.json"
    path.write_text(Cluster(1, 1, ("127.0.0.1", "127.0.0.2"), PORTS).to_json())
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    done = subprocess.run([sys.executable, "-m", "trainperf.backends.spawn", "--backend=paddle",
                           "--module=standin", "--nproc=1", f"--cluster={path}", "--",
                           str(tmp_path)], env=dict(os.environ, PYTHONPATH=f"{SRC}:{tmp_path}"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ifname").read_text() == "lo"


def test_horovod_across_nodes_is_refused_where_the_host_name_is_loopback():
    """Horovod 0.28.1 binds its collectives to the host name's address: loopback cannot carry
    them to another node, and an address that does not bind at all fails in gloo. Loopback
    "nodes" reach each other there, and a name that resolves to a routable address is left to
    work."""
    two = two_nodes(1)
    why = mxnet_launch.horovod_host_refusal(two, lambda: "127.0.1.1")
    assert why.startswith("Horovod 0.28.1 runs its gloo collectives on the address of this "
                          "host's name, whatever HOROVOD_GLOO_IFACE says, and ")
    assert why.endswith("resolves to 127.0.1.1, which the other nodes cannot reach: make the "
                        "name resolve to this node's address (10.0.0.2), or use "
                        "--mxnet-kvstore dist_sync")
    assert "resolves to no address a socket can bind" in mxnet_launch.horovod_host_refusal(
        two, lambda: None)
    assert mxnet_launch.horovod_host_refusal(two, lambda: "10.0.0.2") is None
    loopback = Cluster(1, 1, ("127.0.0.1", "127.0.0.2"), PORTS)
    assert mxnet_launch.horovod_host_refusal(loopback, lambda: "127.0.0.1") is None
    assert mxnet_launch.horovod_host_refusal(Cluster(0, 1, ADDRS[:1], PORTS[:1]),
                                             lambda: "127.0.0.1") is None
    assert mxnet_launch.gloo_host_address("127.0.0.1") == "127.0.0.1"


def departures(world: int) -> list[Departure]:
    port = reserved_ports(1)[0]
    config = {"cluster": {"worker": [f"127.0.0.1:{port + 1 + r}" for r in range(world)]}}
    return [Departure.from_env({"TF_CONFIG": json.dumps(dict(config, task={"index": r})),
                                "TRAINPERF_DEPARTURE": f"127.0.0.1:{port}"})
            for r in range(world)]


def test_tensorflow_ranks_leave_only_once_every_rank_is_past_the_last_barrier():
    """Rank 1 is past the barrier first and waits: it returns only after rank 0 has come too
    (the order, not the time, is what is asserted)."""
    first, second = departures(2)
    arrived = threading.Event()
    seen = {}

    def rank1():
        seen["unheard"] = second.leave_together(wait_s=60)
        seen["rank 0 had arrived"] = arrived.is_set()

    waiter = threading.Thread(target=rank1)
    waiter.start()
    waiter.join(timeout=0.5)  # a rank 1 that left without rank 0 would be done by now
    arrived.set()
    assert first.leave_together(wait_s=60) == []
    waiter.join(timeout=60)
    assert seen == {"unheard": [], "rank 0 had arrived": True}


def test_tensorflow_ranks_never_heard_from_are_named_and_nothing_waits_on_a_gone_rank():
    first, second = departures(2)
    assert first.leave_together(wait_s=0.2) == [1]  # rank 1 never came
    assert second.leave_together(wait_s=60) == [0]  # rank 0 has gone: refused at once
    alone, = departures(1)
    assert alone.address is None and alone.leave_together() == []
