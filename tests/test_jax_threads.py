"""A JAX rank on a CPU runs on its share of the cores and says so in its start event; across
processes its gradients cross in one collective on sockets sized for them (issue 43: JAX's
2-rank CPU collapse).

- The share: the worker sizes XLA's CPU thread pools to ``spec.threads`` (``PJRT_NPROC``, read
  when JAX's CPU client starts) and, with one thread, keeps Eigen's kernels on the calling
  thread; what each rank runs with is counted in the process (the pool's threads by name) and
  recorded in the start event's ``env``. Checked in a bare process for 3 threads and for 1, and
  through the CLI on two ranks with 2 threads each (N > 1 per rank). The default share (the
  runner's cores per rank) is checked on ``test_jax_runs``' two-rank run.
- The collectives: across processes the step reduces its gradients as one flat buffer
  (``step._reduce_flat``: gloo runs XLA's tuple all-reduce one element at a time), on gloo
  sockets sized before the step (``dist.widen_gloo_send_buffers``), both recorded. Here, on
  two devices of one process, the flat reduction gives exactly the tuple's gradients, for dp
  (means, class matrix included) and pfc (sums); ``test_jax_runs``' strict alignment on two
  ranks holds it to torch in float64 across processes.

Nothing here depends on how fast anything ran.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from trainperf.cli import main

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

SHARE_SIDE = r"""
import json, os, sys
from trainperf.config import Measure, Workload
from trainperf.protocol import RunSpec
from trainperf.backends.jax import worker

threads = int(sys.argv[1])
spec = RunSpec(Workload(backbone="iresnet_tiny", num_classes=10, batch_size=2), Measure(),
               device="cpu", threads=threads)
worker.configure_process(spec)
import jax
jax.block_until_ready(jax.numpy.ones(4) + 1)   # the CPU client and its pools start here
print(json.dumps(worker.thread_settings(threads)))
"""

REDUCE_SIDE = r"""
import json, sys
import jax, numpy as np
from flax import linen as nn
from trainperf.config import Workload
from trainperf.backends.jax import dist, models
from trainperf.backends.jax.step import TrainStep, synthetic_batch

assert jax.device_count() == 2, jax.devices()

class Micro(nn.Module):
    embedding_size: int

    @nn.compact
    def __call__(self, x):
        x = models.PReLU(name="prelu")(models.BatchNorm(name="bn")(
            models.Conv(4, 3, 2, 1, name="conv")(x)))
        x = models.Dense(self.embedding_size, name="fc")(x.reshape(x.shape[0], -1))
        return models.BatchNorm(gamma="fixed", name="features")(x)

# "micro" is no catalogue backbone: the step finds it through the two functions it asks.
models.backbone_task = lambda name: "face"
models.build_backbone = lambda name, *, embedding_size, **_: Micro(embedding_size)
layout = dist.local_mesh(2)
unequal, weight_error = [], 0.0
for fc, ratio in (("dp", 1.0), ("pfc", 0.5)):
    wl = Workload(backbone="micro", num_classes=40, batch_size=4, embedding_size=8,
                  input_size=16, dropout=0.0, fc=fc, sample_ratio=ratio)
    images, labels = layout.per_rank(lambda r: synthetic_batch(wl, r))
    grads, weights = {}, {}
    for flat in (False, True):
        step = TrainStep(wl, layout, expose_grads=True)
        step.flat_reduce = flat   # read when the step is traced, at its first call
        step(images, labels)
        exposed = {k: v for k, v in step.last_grads.items() if k != "rows"}
        grads[flat] = [np.asarray(v) for v in jax.tree.leaves(exposed)]
        weights[flat] = [np.asarray(v) for v in jax.tree.leaves(step.state["params"])]
    assert len(grads[False]) == len(grads[True]) > 0
    unequal += [f"{fc}:{i}" for i, (a, b) in enumerate(zip(grads[False], grads[True]))
                if a.shape != b.shape or not np.array_equal(a, b)]
    for a, b in zip(weights[False], weights[True]):
        weight_error = max(weight_error, float(np.max(np.abs(a - b)) / np.max(np.abs(a))))
print(json.dumps({"unequal": unequal, "weight_error": weight_error}))
"""


def _jax_side(jax_python: str, script: str, *args: str, **env: str) -> dict:
    """Run ``script`` in JAX's environment; its last line of output, as JSON."""
    full = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", **env)
    for name in ("PJRT_NPROC", "NPROC"):
        full.pop(name, None)
    proc = subprocess.run([jax_python, "-c", script, *args], env=full, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_share_sizes_xla_pools_before_jax_starts(jax_python):
    """3 threads: XLA's pool has 3 threads and Eigen's kernels run on it; 1 thread: a pool of
    one and the kernels on the calling thread. Both recorded as they are in the process."""
    three = _jax_side(jax_python, SHARE_SIDE, "3", XLA_FLAGS="")
    assert three["threads"] == 3 and three["threads_asked"] == 3
    assert three["pjrt_nproc"] == "3" and three["xla_pool_threads"] == 3
    assert three["eigen_kernels"] == "intra-op pool"
    assert three["cpu_affinity"] == sorted(os.sched_getaffinity(0))
    one = _jax_side(jax_python, SHARE_SIDE, "1", XLA_FLAGS=FAST_COMPILE)
    assert one["threads"] == 1 and one["pjrt_nproc"] == "1" and one["xla_pool_threads"] == 1
    assert one["eigen_kernels"] == "calling thread"


def test_two_ranks_with_two_threads_each_record_their_share(tmp_path, jax_python,
                                                             monkeypatch):
    """``--threads 2`` on two ranks (more threads than this machine's share, which is the
    point: the flag is the user's): every rank's pool has 2 threads, as recorded in the start
    event per rank; the gradients crossed the processes over gloo as one buffer, on sockets
    sized first (``dist.widen_gloo_send_buffers``)."""
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE)
    monkeypatch.delenv("TRAINPERF_FAULT", raising=False)
    out = tmp_path / "r"
    code = main(["run", "tiny-arcface", "--framework", "jax", "--devices", "2", "--fc", "pfc",
                 "--runs", "1", "--iters", "2", "--warmup", "1", "--device", "cpu",
                 "--threads", "2", "--out", str(out)])
    assert code == 0
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    (start,) = [e for e in events if e.get("event") == "start"]
    env = start["env"]
    assert env["threads"] == 2 and env["threads_asked"] == 2 and env["pjrt_nproc"] == "2"
    assert env["eigen_kernels"] == "intra-op pool" and env["omp_num_threads"] == "2"
    assert env["threads_per_rank"] == [
        {"pjrt_nproc": 2, "xla_pool_threads": 2, "eigen_kernels": "intra-op pool",
         "cpu_cores": len(os.sched_getaffinity(0))}] * 2
    assert env["cpu_collectives"] == "gloo"
    assert start["settings"]["grad_reduce"].startswith("one flat buffer")
    assert start["settings"]["gloo_send_buffer_bytes"] == 1 << 20


def test_the_flat_reduction_gives_the_tuples_numbers(jax_python):
    """A step of dp and of pfc on two devices: the reduced gradients are the same arrays, bit
    for bit, whether reduced as XLA's tuple or as one buffer; the weights after the update
    agree to float32's rounding (XLA fuses the update with the buffer's slices, so one weight
    in a few may round the other way: 1.5e-8 on a conv weight of 0.25, measured)."""
    got = _jax_side(jax_python, REDUCE_SIDE,
                    XLA_FLAGS=f"{FAST_COMPILE} --xla_force_host_platform_device_count=2")
    assert got["unequal"] == []
    assert got["weight_error"] < 1e-6
