"""The MXNet launcher: a scheduler, a server and N workers over loopback, taken down together
when one fails, and nothing left behind."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil

SRC = Path(__file__).resolve().parents[1] / "src"

# A worker stand-in: joins the store, sums its rank + 1 with the others', records its pid and
# the servers' pids, and fails (as a crashed rank does) when asked to.
WORKER = '''
import os, sys
import mxnet as mx
kv = mx.kv.create("dist_sync")
out = mx.nd.zeros((2,))
kv.init(7, mx.nd.zeros((2,)))
kv.pushpull(7, mx.nd.ones((2,)) * (kv.rank + 1), out=out)
folder = sys.argv[1]
with open(os.path.join(folder, f"rank{kv.rank}"), "w") as f:
    f.write(f"{os.getpid()} {os.getppid()} {out.asnumpy()[0]}")
if sys.argv[2] == "fail" and kv.rank == 1:
    os._exit(5)  # a crash: no goodbye to the scheduler
kv.pushpull(7, mx.nd.ones((2,)), out=out)  # rank 0 waits here for a peer that is gone
out.wait_to_read()
'''


def launch(mxnet_python: str, tmp_path: Path, mode: str) -> tuple[int, list[str]]:
    (tmp_path / "standin.py").write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=f"{SRC}:{tmp_path}", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([mxnet_python, "-m", "trainperf.backends.mxnet.launch", "--nproc=2",
                             "--kvstore=dist_sync", "--module=standin", "--", str(tmp_path),
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


def test_two_ranks_sum_through_the_server(mxnet_python, tmp_path):
    code, ranks = launch(mxnet_python, tmp_path, "ok")
    assert code == 0 and len(ranks) == 2
    assert all(r.split()[2] == "3.0" for r in ranks)  # 1 + 2 on both ranks


def test_a_crashed_rank_takes_down_its_peers_scheduler_and_server(mxnet_python, tmp_path):
    code, ranks = launch(mxnet_python, tmp_path, "fail")
    assert code == 5 and len(ranks) == 2


# float64 collectives (comm.py): each rank's arrays span 35 decades; what reaches the server
# is recorded, since MXNet 1.9.1's server sums float64 in float32 in some launches only, so
# that exact results alone could pass by chance.
FLOAT64_RANK = '''
import sys
import numpy as np
import mxnet as mx
from trainperf.backends.mxnet.comm import comm_from_env

comm = comm_from_env("cpu")
pushed = set()
for name in ("init", "pushpull", "pull"):
    real = getattr(comm.kv, name)
    def spy(key, value=None, *args, _real=real, **kwargs):
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            for a in (v if isinstance(v, (list, tuple)) else [v]):
                if a is not None:
                    pushed.add(np.dtype(a.dtype).name)
        return _real(key, value, *args, **kwargs)
    setattr(comm.kv, name, spy)
r = comm.rank
base = np.random.RandomState(5).standard_normal((5, 7)) * 10.0 ** np.arange(-20, 15).reshape(5, 7)
mine = lambda rank: base * (rank + 1) + rank / 3.0
params = [[mx.nd.array(mine(r), dtype="float64")]]
keys = comm.register(params)
grads = [[mx.nd.array(mine(r), dtype="float64")]]
comm.sum_(keys, grads)
out = {"registered": params[0][0].asnumpy(), "summed": grads[0][0].asnumpy(),
       "reduced": comm.allreduce_sum_("t", mx.nd.array(mine(r), dtype="float64")).asnumpy(),
       "gathered": comm.all_gather("g", mx.nd.array(mine(r), dtype="float64")).asnumpy(),
       "largest": comm.allreduce_max("m", mx.nd.array(mine(r), dtype="float64")).asnumpy()}
np.savez(f"{sys.argv[1]}/rank{r}.npz", pushed=sorted(pushed), mine=mine(r), **out)
mx.nd.waitall()
comm.barrier()
'''


def test_float64_collectives_are_exact_and_never_reach_the_server_as_float64(
        mxnet_python, tmp_path):
    (tmp_path / "f64rank.py").write_text(FLOAT64_RANK)
    env = dict(os.environ, PYTHONPATH=f"{SRC}:{tmp_path}", OMP_NUM_THREADS="1")
    proc = subprocess.run([mxnet_python, "-m", "trainperf.backends.mxnet.launch", "--nproc=2",
                           "--kvstore=dist_sync", "--module=f64rank", "--", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Each rank's own input, as its numpy computed it (this side's numpy may round a power
    # differently).
    mine = [np.load(tmp_path / f"rank{rank}.npz")["mine"] for rank in range(2)]
    for rank in range(2):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert list(got["pushed"]) == ["float32"]
        np.testing.assert_array_equal(got["registered"], mine[0])  # rank 0's, bit for bit
        np.testing.assert_array_equal(got["summed"], mine[0] + mine[1])
        np.testing.assert_array_equal(got["reduced"], mine[0] + mine[1])
        np.testing.assert_array_equal(got["gathered"], np.concatenate(mine))
        np.testing.assert_array_equal(got["largest"], np.maximum(*mine))
