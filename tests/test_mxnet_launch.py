"""The MXNet launcher: over Horovod (the default: N workers meeting at the rendezvous this
launcher serves) and over a scheduler, a server and N workers (dist_sync), all over loopback,
taken down together when one fails, and nothing left behind; what each process is told
(``launch.plan``); and each layout's float64 collectives, exact."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from trainperf.backends.base import Cluster, LaunchRequest
from trainperf.backends.mxnet import backend, launch as mxnet_launch
from trainperf.config import Topology, Tuning
from trainperf.outcome import names_bind_failure

SRC = Path(__file__).resolve().parents[1] / "src"

# A worker stand-in per layout: joins, sums its rank + 1 with the others', records its pid, the
# sum and the GPUs it was shown, and fails (as a crashed rank does) when asked to.
WORKERS = {"dist_sync": '''
import os, sys
import mxnet as mx
kv = mx.kv.create("dist_sync")
out = mx.nd.zeros((2,))
kv.init(7, mx.nd.zeros((2,)))
kv.pushpull(7, mx.nd.ones((2,)) * (kv.rank + 1), out=out)
folder = sys.argv[1]
with open(os.path.join(folder, f"rank{kv.rank}"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()} {out.asnumpy()[0]} {os.environ['CUDA_VISIBLE_DEVICES']}")
if sys.argv[2] == "fail" and kv.rank == 1:
    os._exit(5)  # a crash: no goodbye to the scheduler
kv.pushpull(7, mx.nd.ones((2,)), out=out)  # rank 0 waits here for a peer that is gone
out.wait_to_read()
''', "horovod": '''
import os, sys
import mxnet as mx
import horovod.mxnet as hvd
hvd.init()
out = mx.nd.ones((2,)) * (hvd.rank() + 1)
hvd.allreduce_(out, op=hvd.Sum, name="sum")
folder = sys.argv[1]
with open(os.path.join(folder, f"rank{hvd.rank()}"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()} {out.asnumpy()[0]} {os.environ['CUDA_VISIBLE_DEVICES']}")
if sys.argv[2] == "fail" and hvd.rank() == 1:
    os._exit(5)  # a crash: its gloo connections cut
hvd.allreduce_(out, op=hvd.Sum, name="again").wait_to_read()  # rank 0 waits for a peer gone
hvd.shutdown()
'''}


def launch(mxnet_python: str, tmp_path: Path, mode: str, kvstore: str
           ) -> tuple[int, list[str]]:
    (tmp_path / "standin.py").write_text(WORKERS[kvstore])
    env = dict(os.environ, PYTHONPATH=f"{SRC}:{tmp_path}", OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.Popen([mxnet_python, "-m", "trainperf.backends.mxnet.launch", "--nproc=2",
                             f"--kvstore={kvstore}", "--module=standin", "--", str(tmp_path),
                             mode], env=env)
    children: set[int] = set()
    while proc.poll() is None:  # note every process the launcher starts while it runs
        try:
            children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    assert not [pid for pid in children if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], "left behind"
    return proc.returncode, [(tmp_path / f"rank{r}").read_text() for r in range(2)
                             if (tmp_path / f"rank{r}").exists()]


@pytest.mark.parametrize("kvstore", ["horovod", "dist_sync"])
def test_two_ranks_sum_and_each_sees_its_own_gpu(mxnet_python, tmp_path, kvstore):
    code, ranks = launch(mxnet_python, tmp_path, "ok", kvstore)
    assert code == 0 and len(ranks) == 2
    assert all(r.split()[2] == "3.0" for r in ranks)  # 1 + 2 on both ranks
    assert sorted(r.split()[3] for r in ranks) == ["0", "1"]


@pytest.mark.parametrize("kvstore", ["horovod", "dist_sync"])
def test_a_crashed_rank_takes_down_its_peers_and_helpers(mxnet_python, tmp_path, kvstore):
    code, ranks = launch(mxnet_python, tmp_path, "fail", kvstore)
    assert code == 5 and len(ranks) == 2


# float64 collectives (comm.py): each rank's arrays span 35 decades; what reaches the transport
# is recorded. dist_sync: MXNet 1.9.1's server sums float64 in float32 in some launches only, so
# that exact results alone could pass by chance: nothing float64 may reach it. horovod: gloo
# carries float64 as it is, and every call must hand it float64 (no splitting).
SPIES = {"dist_sync": '''
for name in ("init", "pushpull", "pull"):
    real = getattr(comm.kv, name)
    def spy(key, value=None, *args, _real=real, **kwargs):
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            for a in (v if isinstance(v, (list, tuple)) else [v]):
                if a is not None:
                    pushed.add(np.dtype(a.dtype).name)
        return _real(key, value, *args, **kwargs)
    setattr(comm.kv, name, spy)
''', "horovod": '''
import types
def spying(real):
    def spy(x, *args, **kwargs):
        pushed.add(np.dtype(x.dtype).name)
        return real(x, *args, **kwargs)
    return spy
hvd = comm.hvd
comm.hvd = types.SimpleNamespace(Sum=hvd.Sum, Max=hvd.Max, shutdown=hvd.shutdown, **{
    name: spying(getattr(hvd, name)) for name in ("allreduce_", "allreduce", "broadcast_")})
'''}
FLOAT64_RANK = '''
import sys
import numpy as np
import mxnet as mx
from trainperf.backends.mxnet.comm import comm_from_env

comm = comm_from_env("cpu")
pushed = set()
{spy}
r = comm.rank
base = np.random.RandomState(5).standard_normal((5, 7)) * 10.0 ** np.arange(-20, 15).reshape(5, 7)
mine = lambda rank: base * (rank + 1) + rank / 3.0
params = [[mx.nd.array(mine(r), dtype="float64")]]
keys = comm.register(params)
grads = [[mx.nd.array(mine(r), dtype="float64")]]
comm.sum_(keys, grads)
out = {{"registered": params[0][0].asnumpy(), "summed": grads[0][0].asnumpy(),
       "reduced": comm.allreduce_sum_("t", mx.nd.array(mine(r), dtype="float64")).asnumpy(),
       "gathered": comm.all_gather("g", mx.nd.array(mine(r), dtype="float64")).asnumpy(),
       "largest": comm.allreduce_max("m", mx.nd.array(mine(r), dtype="float64")).asnumpy()}}
np.savez(f"{{sys.argv[1]}}/rank{{r}}.npz", pushed=sorted(pushed), mine=mine(r), **out)
mx.nd.waitall()
comm.barrier()
if comm.hvd is not None:
    comm.hvd.shutdown()
'''


@pytest.mark.parametrize("kvstore,carried", [("horovod", "float64"), ("dist_sync", "float32")])
def test_float64_collectives_are_exact(mxnet_python, tmp_path, kvstore, carried):
    (tmp_path / "f64rank.py").write_text(FLOAT64_RANK.format(spy=SPIES[kvstore]))
    env = dict(os.environ, PYTHONPATH=f"{SRC}:{tmp_path}", OMP_NUM_THREADS="1")
    proc = subprocess.run([mxnet_python, "-m", "trainperf.backends.mxnet.launch", "--nproc=2",
                           f"--kvstore={kvstore}", "--module=f64rank", "--", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    # Each rank's own input, as its numpy computed it (this side's numpy may round a power
    # differently).
    mine = [np.load(tmp_path / f"rank{rank}.npz")["mine"] for rank in range(2)]
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert list(got["pushed"]) == [carried]
        np.testing.assert_array_equal(got["registered"], mine[0])  # rank 0's, bit for bit
        np.testing.assert_array_equal(got["summed"], mine[0] + mine[1])
        np.testing.assert_array_equal(got["reduced"], mine[0] + mine[1])
        np.testing.assert_array_equal(got["gathered"], np.concatenate(mine))
        np.testing.assert_array_equal(got["largest"], np.maximum(*mine))


SLEEPER = "import time; time.sleep(60)"


def test_a_taken_rendezvous_port_fails_the_launch_in_words_the_runner_retries(
        mxnet_python, tmp_path):
    """Another process holds node 0's first port: the rendezvous exits at once saying why, in
    the words ``outcome.names_bind_failure`` knows (the runner then starts the run again), and
    the workers, which wait for it, are stopped."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    thief = socket.socket()
    thief.bind(("127.0.0.1", 0))
    port = thief.getsockname()[1]
    cluster = tmp_path / "cluster.json"
    cluster.write_text(Cluster(0, 2, ("127.0.0.1",), ((port, *range(port + 1, port + 6)),))
                       .to_json())
    env = dict(os.environ, PYTHONPATH=f"{SRC}:{tmp_path}")
    logs, events = tmp_path / "logs", tmp_path / "events.jsonl"
    try:
        proc = subprocess.run([mxnet_python, "-m", "trainperf.backends.mxnet.launch",
                               "--nproc=2", "--kvstore=horovod", f"--cluster={cluster}",
                               "--module=sleeper", f"--logs={logs}", f"--events={events}", "--"],
                              env=env, capture_output=True, text=True, timeout=60)
    finally:
        thief.close()
    assert proc.returncode == 1, proc.stderr
    said = (logs / "gloo-rendezvous.log").read_text().strip().splitlines()[-1]
    assert said.startswith(f"Horovod's gloo rendezvous could not bind 127.0.0.1:{port}: ")
    assert names_bind_failure(said)
    exits = {e["process"] or e["rank"]: e for e in map(json.loads, events.read_text().splitlines())}
    assert exits["gloo rendezvous"]["returncode"] == 1
    assert exits[0]["stopped"] and exits[1]["stopped"]


# ------------------------------------------------------------------------------ the plan

TWO_NODES = ("10.0.0.1", "10.0.0.2")
PORTS = ((1000, 1001, 1002, 1003, 1004, 1005), (2000, 2001, 2002, 2003, 2004, 2005))


def by_rank(processes) -> dict[int, dict[str, str]]:
    return {p.rank: p.env for p in processes if not p.helper}


def test_horovod_ranks_are_told_what_horovodrun_tells_them():
    """Two nodes of two ranks: each worker's HOROVOD_* variables are ``horovodrun --gloo``'s
    for its slot, node 0's first port is the rendezvous, and the launcher's own rank numbering
    is Horovod's."""
    for node in range(2):
        workers = by_rank(mxnet_launch.plan(2, "horovod", ["--spec", "s"],
                                            Cluster(node, 2, TWO_NODES, PORTS), iface="eth7"))
        assert sorted(workers) == [2 * node, 2 * node + 1]
        for local, rank in enumerate(sorted(workers)):
            env = workers[rank]
            assert {k: v for k, v in env.items() if k.startswith(("HOROVOD_", "NCCL_"))} == {
                "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "4",
                "HOROVOD_LOCAL_RANK": str(local), "HOROVOD_LOCAL_SIZE": "2",
                "HOROVOD_CROSS_RANK": str(node), "HOROVOD_CROSS_SIZE": "2",
                "HOROVOD_HOSTNAME": TWO_NODES[node],
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": "1000",
                "HOROVOD_GLOO_IFACE": "eth7", "NCCL_SOCKET_IFNAME": "eth7",
                "HOROVOD_GLOO_TIMEOUT_SECONDS": str(mxnet_launch.GLOO_TIMEOUT_S)}
            assert env["TRAINPERF_KVSTORE"] == "horovod"
            assert env["TRAINPERF_RANK"] == str(rank) and env["TRAINPERF_LOCAL_RANK"] == str(local)
            assert env["CUDA_VISIBLE_DEVICES"] == str(local)
    # What the rendezvous server is told: every slot, as get_host_assignments would make them.
    slots = mxnet_launch.slots(Cluster(1, 2, TWO_NODES, PORTS))
    assert [(s["hostname"], s["rank"], s["local_rank"], s["cross_rank"]) for s in slots] == [
        ("10.0.0.1", 0, 0, 0), ("10.0.0.1", 1, 1, 0), ("10.0.0.2", 2, 0, 1),
        ("10.0.0.2", 3, 1, 1)]
    assert {(s["size"], s["local_size"], s["cross_size"]) for s in slots} == {(4, 2, 2)}


def test_the_rendezvous_is_served_on_node_zero_alone():
    """Node 0 starts the rendezvous beside its workers, told the whole cluster; other nodes
    start their workers only. It sees no GPU and takes one thread."""
    helpers = [[p for p in mxnet_launch.plan(2, "horovod", [], Cluster(n, 2, TWO_NODES, PORTS),
                                             iface="lo") if p.helper] for n in range(2)]
    assert [len(h) for h in helpers] == [1, 0]
    (rendezvous,) = helpers[0]
    assert rendezvous.helper == "gloo rendezvous" and rendezvous.rank == -1
    assert rendezvous.argv[1:3] == ["-m", "trainperf.backends.mxnet.rendezvous"]
    assert Cluster.from_json(rendezvous.argv[3]) == Cluster(0, 2, TWO_NODES, PORTS)
    assert rendezvous.env["CUDA_VISIBLE_DEVICES"] == "" and rendezvous.env["OMP_NUM_THREADS"] == "1"


def test_the_runners_collective_timeout_is_gloos(monkeypatch):
    monkeypatch.setenv("TRAINPERF_COLLECTIVE_TIMEOUT_S", "42.5")
    env = by_rank(mxnet_launch.plan(1, "horovod", [], Cluster(0, 1, TWO_NODES, PORTS),
                                    iface="lo"))[0]
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "42"


@pytest.mark.parametrize("visible,told", [
    (None, ["0", "1"]),  # unset: the local rank
    ("4,6", ["4", "6"]),  # a list the launcher was given: the local rank's entry
    (" 3, 5 ,7", ["3", "5"]),
    ("2", ["2", ""]),  # fewer devices than ranks: none (a CPU run)
    ("", ["", ""]),  # no device visible
])
def test_each_worker_sees_its_own_gpu(visible, told):
    for kvstore in ("horovod", "dist_sync"):
        plan = mxnet_launch.plan(2, kvstore, [], Cluster(0, 2, TWO_NODES[:1], PORTS[:1]),
                                 visible=visible, iface="lo")
        workers = by_rank(plan)
        assert [workers[r]["CUDA_VISIBLE_DEVICES"] for r in range(2)] == told, kvstore
        # The scheduler and server see no GPU: nothing of theirs lands on GPU 0.
        assert {p.env["CUDA_VISIBLE_DEVICES"] for p in plan if p.helper} <= {""}
    (local,) = mxnet_launch.plan(1, "local", [], visible=visible)
    assert local.env["CUDA_VISIBLE_DEVICES"] == told[0]
    (device,) = mxnet_launch.plan(2, "device", [], visible=visible)
    assert "CUDA_VISIBLE_DEVICES" not in device.env  # one process drives them all


def test_gloo_takes_the_interface_that_holds_the_nodes_address(monkeypatch):
    assert mxnet_launch.interface_of("127.0.0.1") == "lo"
    assert mxnet_launch.interface_of("127.0.0.2") == "lo"
    with pytest.raises(ValueError, match="no network interface of this node holds 192.0.2.1"):
        mxnet_launch.interface_of("192.0.2.1")  # TEST-NET-1: on no interface
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "ib0")  # the user's choice wins
    env = by_rank(mxnet_launch.plan(1, "horovod", [], Cluster(0, 1, ("192.0.2.1",), PORTS[:1])))
    assert env[0]["HOROVOD_GLOO_IFACE"] == "ib0"


def test_the_backend_starts_horovod_unless_asked_and_turns_tf32_off_for_every_process(
        tmp_path):
    def argv_env(nproc: int, **tuning) -> tuple[list[str], dict[str, str]]:
        got = backend.launch(LaunchRequest(sys.executable, Topology(devices_per_node=nproc),
                                           Tuning(**tuning), tmp_path / "s", tmp_path / "e"))
        return got.argv, got.env

    assert Tuning().mxnet_kvstore == "horovod"
    argv, env = argv_env(2)
    assert "--kvstore=horovod" in argv and env == {}
    assert "--kvstore=local" in argv_env(1)[0]
    assert "--kvstore=dist_sync" in argv_env(2, mxnet_kvstore="dist_sync")[0]
    assert argv_env(2, tf32="off")[1] == {"NVIDIA_TF32_OVERRIDE": "0"}
