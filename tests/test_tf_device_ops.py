"""What the TensorFlow step puts on a GPU, checked on a CPU: no machine here has a GPU, so the
proof is TensorFlow 2.21's own source (cited where the sets are declared) plus what the CPU
wheel can show.

- A sampling pfc's sparse update (``step.sparse_momentum``) is made of the ops of
  ``step.SPARSE_UPDATE_OPS``, each checked to have a GPU kernel in TensorFlow's source; the
  test traces the update and compares the ops it finds with that set, so a new op cannot slip
  in unchecked. The CPU wheel's registry shows why ``ResourceSparseApplyMomentum`` is gone: it
  lists only a CPU kernel for it (the CPU wheel lists CPU kernels only, so this says nothing
  of the ops kept).
- The update computes what ``ResourceSparseApplyMomentum`` computed, bit for bit, in float32
  and float64, over steps whose rate changes, inside a ``tf.function`` as the step runs it
  (Grappler's rewrites included); the rows never sampled and their momentum stay as they were.
- The collectives a step compiled by XLA may hold (``comm.XLA_COLLECTIVES``) are those with an
  XLA kernel in this binary: TensorFlow registers XLA kernels for every XLA device it has once a
  compilation has run, and ``REGISTER_XLA_OP`` without a device list registers for each, so the
  CPU wheel's XLA_CPU_JIT kernels are XLA_GPU_JIT's too (the CUDA wheel lists the same).
  ``CollectiveGatherV2``, the strategy's all-gather, has none.
- The launch's variables for the tuning settings, and the XLA flag read back (no TensorFlow).

One TensorFlow process for the first three."""

from __future__ import annotations

import json
import subprocess

import pytest

from trainperf.backends.base import xla_autotunes
from trainperf.backends.tf.backend import BACKEND, tuning_env
from trainperf.config import Tuning

from test_tf_models_heads import tf_env


TF_SIDE = r"""
import json, sys
import numpy as np
import tensorflow as tf
from tensorflow.python.framework import kernels
from trainperf.backends.tf.comm import XLA_COLLECTIVES
from trainperf.backends.tf.step import SPARSE_UPDATE_OPS, sparse_momentum

report = {}
plumbing = {"Placeholder", "Const", "Identity", "NoOp"}


def device_types(op):
    return sorted({k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel})


# The ops of the update, as the step traces it (rates and momentum are tensors there).
var, buf = tf.Variable(tf.zeros([7, 3])), tf.Variable(tf.zeros([7, 3]))


@tf.function(autograph=False)
def traced(rows, grad, index, rate, momentum):
    sparse_momentum(var, buf, rows, grad, index, rate, momentum, 5e-4)


graph = traced.get_concrete_function(
    tf.TensorSpec([None, 3]), tf.TensorSpec([None, 3]), tf.TensorSpec([None], tf.int32),
    tf.TensorSpec([]), tf.TensorSpec([])).graph
report["ops"] = sorted({op.type for op in graph.get_operations()} - plumbing)
report["declared"] = sorted(SPARSE_UPDATE_OPS)
report["sparse_apply_kernels"] = device_types("ResourceSparseApplyMomentum")

# Against ResourceSparseApplyMomentum: the same steps on twin variables, in graph mode.
rng = np.random.RandomState(3)
for dtype in (np.float32, np.float64):
    start = (rng.randn(40, 6) * 0.01).astype(dtype)
    new = [tf.Variable(start), tf.Variable(np.zeros_like(start))]
    old = [tf.Variable(start), tf.Variable(np.zeros_like(start))]
    momentum = tf.constant(0.9, dtype)

    @tf.function(autograph=False)
    def step_new(index, grad, rate):
        sparse_momentum(new[0], new[1], tf.gather(new[0], index), grad, index, rate, momentum,
                        5e-4)

    @tf.function(autograph=False)
    def step_old(index, grad, rate):
        rows = tf.gather(old[0], index)
        tf.raw_ops.ResourceSparseApplyMomentum(
            var=old[0].handle, accum=old[1].handle, lr=rate, grad=grad + 5e-4 * rows,
            indices=index, momentum=momentum, use_locking=False, use_nesterov=False)

    touched = np.zeros(40, bool)
    for rate in (0.1, 0.1, 0.01, 0.01, 0.001):
        index = np.sort(rng.choice(30, 9, replace=False)).astype(np.int32)  # rows 30+ never
        touched[index] = True
        grad = tf.constant(rng.randn(9, 6).astype(dtype))
        step_new(tf.constant(index), grad, tf.constant(rate, dtype))
        step_old(tf.constant(index), grad, tf.constant(rate, dtype))
    name = np.dtype(dtype).name
    report[name] = {
        "weight_equal": bool(np.array_equal(new[0].numpy(), old[0].numpy())),
        "momentum_equal": bool(np.array_equal(new[1].numpy(), old[1].numpy())),
        "moved": bool((new[0].numpy()[touched] != start[touched]).all()),
        "untouched_kept": bool(np.array_equal(new[0].numpy()[~touched], start[~touched])
                               and not new[1].numpy()[~touched].any())}

# XLA's kernels are registered when a first compilation needs them.
tf.function(lambda x: x + 1.0, jit_compile=True)(tf.constant(1.0))
report["xla"] = {op: device_types(op) for op in
                 sorted(XLA_COLLECTIVES | {"CollectiveGatherV2", "CollectiveReduceV2"})}
report["xla_collectives"] = sorted(XLA_COLLECTIVES)
json.dump(report, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def tf_report(tmp_path_factory, tf_python):
    out = tmp_path_factory.mktemp("tf_device_ops") / "report.json"
    proc = subprocess.run([tf_python, "-c", TF_SIDE, str(out)], env=tf_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_the_sparse_update_uses_only_ops_checked_for_gpu_kernels(tf_report):
    assert tf_report["ops"] == tf_report["declared"]
    # What it replaced: a CPU kernel, and no other, in TensorFlow's registry.
    assert tf_report["sparse_apply_kernels"] == ["CPU"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_sparse_update_is_resource_sparse_apply_momentum_bit_for_bit(tf_report, dtype):
    assert tf_report[dtype] == {"weight_equal": True, "momentum_equal": True, "moved": True,
                                "untouched_kept": True}


@pytest.mark.slow
def test_a_compiled_step_holds_only_collectives_xla_lowers(tf_report):
    xla = tf_report["xla"]
    assert "XLA_CPU_JIT" in xla["CollectiveReduceV2"]
    assert not [d for d in xla["CollectiveGatherV2"] if d.startswith("XLA_")]
    assert tf_report["xla_collectives"] == ["CollectiveReduceV2"]
    assert all("XLA_CPU_JIT" in xla[op] for op in tf_report["xla_collectives"])


def test_tuning_reaches_tensorflow_through_its_own_variables():
    """Every setting honoured is declared with its switch; oneDNN and cuDNN's autotuning are
    set either way; XLA's autotuning is turned off only for an xla run without it, after the
    caller's own flags (an earlier level of theirs dropped), and read back as such."""
    assert set(BACKEND.capabilities.tuning) == {"cudnn_benchmark", "ddp_bucket_mb", "tf_onednn",
                                                "tf32"}
    assert tuning_env(Tuning(), {}) == {"TF_ENABLE_ONEDNN_OPTS": "0",
                                        "TF_CUDNN_USE_AUTOTUNE": "1"}
    off = Tuning(cudnn_benchmark=False, tf_onednn=True)
    assert tuning_env(off, {}) == {"TF_ENABLE_ONEDNN_OPTS": "1", "TF_CUDNN_USE_AUTOTUNE": "0"}
    caller = {"XLA_FLAGS": "--xla_dump_to=/tmp/d --xla_gpu_autotune_level=3"}
    env = tuning_env(Tuning(cudnn_benchmark=False, mode="xla"), caller)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_autotune_level=0"
    assert "XLA_FLAGS" not in tuning_env(Tuning(mode="xla"), caller)
    assert not xla_autotunes(env["XLA_FLAGS"])
    assert xla_autotunes("") and xla_autotunes(caller["XLA_FLAGS"])
    assert not xla_autotunes("--xla_gpu_autotune_level=2 --xla_gpu_autotune_level=0")
