"""The MXNet launcher: a scheduler, a server and N workers over loopback, taken down together
when one fails, and nothing left behind."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

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
