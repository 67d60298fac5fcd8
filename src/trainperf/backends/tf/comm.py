"""The distributed layout of one TensorFlow worker process, and its collectives.

``trainperf.backends.spawn`` starts one process per rank with ``TF_CONFIG`` naming every worker
of every node (each rank's own port) and this process's task index (``backend.rank_env``); the
task index is the global rank. With several ranks the process joins a
``MultiWorkerMirroredStrategy``: RING collectives on a CPU (gRPC between processes), NCCL on
GPUs. With one rank it uses TensorFlow's default strategy, which puts no collective in the
graph, as torch runs one process without DDP.

Each process drives one device and holds one replica, so the strategy is used for what only it
provides, the collectives: ``all_reduce`` and ``all_gather`` in the replica context of
``strategy.run`` inside a ``tf.function``. Variables are plain per-process ``tf.Variable``s (not
mirrored ones): every rank builds identical initial values from the same seed, applies the same
all-reduced gradients, and so stays identical without mirrored variables' merge calls or their
initial broadcast; BatchNorm running statistics stay per rank, as in torch without SyncBN. A
sharded head's class rows are per rank by design, and its collectives (the gathers and sums of
``heads.py``) are the same ``all_gather`` and ``all_reduce``, differentiated by the strategy's
own gradients. The strategy's all-gather sends each rank's first dimension before its data (it
allows uneven ones), so a gather is two collectives.

Inside ``jit_compile`` (``--mode xla``) a collective must be one XLA lowers, and TensorFlow 2.21
lowers one: ``CollectiveReduceV2`` (``XLA_COLLECTIVES``). The strategy's all-gather is
``CollectiveGatherV2``, which has no XLA kernel, and its size exchange makes the gathered shape
a value known only on the device; so a compiled step gathers with ``all_gather_by_sum``: each
rank's rows placed at its offset in zeros, summed over ranks, which is the same gather, values
and gradient.

Order of set-up matters: thread counts and visible devices must be set, and the strategy
created, before TensorFlow runs its first operation (``Comm.create``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import tensorflow as tf

from ..workerkit import device_kind_for

XLA_COLLECTIVES = frozenset({"CollectiveReduceV2"})
"""The collectives TensorFlow 2.21 compiles inside ``jit_compile``: those with an XLA kernel.
``tensorflow/compiler/tf2xla/kernels/all_reduce_op.cc`` registers ``REGISTER_XLA_OP(Name(
"CollectiveReduceV2")...)`` for every XLA device, lowered to ``xla::AllReduce`` where
``merge_op`` is Add or Mul, ``final_op`` Id and the hint ``nccl`` or ``auto`` (the strategy's
all-reduce: Add, Id, its MEAN a division after it; NCCL on GPUs). No other Collective*V2 op has
one: the 2.21.0 wheels' registry (``kernels.get_registered_kernels_for_op``, after a compile
has registered XLA's kernels) lists ``XLA_CPU_JIT`` and ``XLA_GPU_JIT`` kernels for
``CollectiveReduceV2`` and none for ``CollectiveGatherV2``; tests/test_tf_device_ops.py reads it
from the CPU wheel. Across processes, TensorFlow resolves the group for XLA
(``ResolveDeviceAssignment``, ``tf2xla/xla_helpers.cc``; in the 2.21.0 CUDA wheel it calls
``GpuExecutableRunOptions::set_gpu_global_device_ids`` and ``set_clique_id_callback``), and
``MultiWorkerMirroredStrategy`` calls its collectives without ``merge_call`` when XLA compiles
the replica function on GPUs (``CollectiveAllReduceExtended._use_merge_call``). No GPU here has
run a compiled collective."""


class Comm:
    """Rank, world size, device and collectives of this process."""

    def __init__(self, rank: int, world_size: int, strategy: tf.distribute.Strategy,
                 device_type: str, communication: str | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.strategy = strategy
        self.device_type = device_type
        """``gpu`` or ``cpu``."""
        self.communication = communication
        """``RING`` or ``NCCL`` with several ranks, None in one process."""
        self.distributed = world_size > 1
        self.tf_device = "/GPU:0" if device_type == "gpu" else "/CPU:0"
        self._barrier = None
        self._gathers: dict[tuple, Any] = {}

    @classmethod
    def create(cls, device: str = "auto", threads: int | None = None) -> "Comm":
        """Configure this process (threads, devices) and join the run's ranks. ``device``:
        ``auto`` (a GPU if TensorFlow sees one), ``cuda`` or ``cpu``."""
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(int(threads))
            tf.config.threading.set_inter_op_parallelism_threads(1)
        gpus = tf.config.list_physical_devices("GPU")
        if device_kind_for(device, len(gpus), "TensorFlow",
                           " (tensorflow-cpu, or no CUDA device visible)") == "cpu":
            tf.config.set_visible_devices([], "GPU")
            device_type = "cpu"
        else:
            # One GPU per process (the launcher sets CUDA_VISIBLE_DEVICES to the local rank); the
            # allocator grows on demand instead of taking the whole device up front.
            tf.config.set_visible_devices(gpus[:1], "GPU")
            tf.config.experimental.set_memory_growth(gpus[0], True)
            device_type = "gpu"
        config = json.loads(os.environ.get("TF_CONFIG") or "{}")
        workers = config.get("cluster", {}).get("worker", [])
        world_size = max(1, len(workers))
        rank = int(config.get("task", {}).get("index", 0)) if workers else 0
        if world_size == 1:
            return cls(0, 1, tf.distribute.get_strategy(), device_type, None)
        impl = tf.distribute.experimental.CommunicationImplementation
        chosen = impl.NCCL if device_type == "gpu" else impl.RING
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=chosen))
        if strategy.num_replicas_in_sync != world_size:
            raise RuntimeError(f"the strategy has {strategy.num_replicas_in_sync} replicas for "
                               f"{world_size} workers: one device per process expected")
        return cls(rank, world_size, strategy, device_type, chosen.name)

    @property
    def device(self) -> str:
        """What ``Start.device`` names: ``cuda:<local rank>`` or ``cpu``."""
        if self.device_type == "gpu":
            return f"cuda:{os.environ.get('TRAINPERF_LOCAL_RANK', '0')}"
        return "cpu"

    # --------------------------------------------------------------------- replica context

    def all_reduce_mean(self, values: list[tf.Tensor], pack_bytes: int = 0
                        ) -> list[tf.Tensor]:
        """Mean over ranks of each tensor (call inside ``strategy.run``); the identity in one
        process. The strategy concatenates the tensors into packs of about ``pack_bytes``
        each (``CommunicationOptions.bytes_per_pack``; 0: one pack), one collective a pack."""
        return self._all_reduce(tf.distribute.ReduceOp.MEAN, values, pack_bytes)

    def all_reduce_sum(self, values: list[tf.Tensor], pack_bytes: int = 0
                       ) -> list[tf.Tensor]:
        """Sum over ranks of each tensor, as ``all_reduce_mean``. Its gradient is the sum
        over ranks of the gradients (the strategy's own): what each rank differentiates is
        its share of one objective summed over ranks."""
        return self._all_reduce(tf.distribute.ReduceOp.SUM, values, pack_bytes)

    def _all_reduce(self, op: tf.distribute.ReduceOp, values: list[tf.Tensor],
                    pack_bytes: int) -> list[tf.Tensor]:
        if not self.distributed:
            return list(values)
        # Per call: the strategy packs with the options it is given here, before it merges
        # its own (``CollectiveAllReduce._all_reduce``).
        options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=pack_bytes)
        return tf.distribute.get_replica_context().all_reduce(op, list(values),
                                                               options=options)

    def all_gather(self, value: tf.Tensor) -> tf.Tensor:
        """Every rank's ``value`` [k, ...] concatenated in rank order (call inside
        ``strategy.run``); the identity in one process. Its gradient (the strategy's own) is
        the sum over ranks of the gathered gradient, sliced to this rank's rows."""
        if not self.distributed:
            return value
        # The identity places a ``strategy.run`` argument on the replica's device, where
        # all_gather finds its destination (see ``gather_rows``).
        return tf.distribute.get_replica_context().all_gather(tf.identity(value), axis=0)

    def all_gather_by_sum(self, value: tf.Tensor) -> tf.Tensor:
        """``all_gather`` as an all-reduce, the form XLA compiles (module doc): this rank's
        ``value`` [k, ...] at rows ``rank * k`` of zeros [world_size * k, ...], summed over
        ranks. Every rank's ``k`` must be the same. Adding zeros changes no value, and the
        gradient is the all-gather's: the sum over ranks of the gathered gradient, sliced to
        this rank's rows (the pad's gradient is that slice)."""
        if not self.distributed:
            return value
        k = value.shape[0]
        if k is None:
            raise ValueError("all_gather_by_sum needs the first dimension known when traced")
        padding = [[self.rank * k, (self.world_size - 1 - self.rank) * k]]
        padded = tf.pad(value, padding + [[0, 0]] * (value.shape.rank - 1))
        return self.all_reduce_sum([padded])[0]

    # ---------------------------------------------------------------------- host side

    def barrier(self) -> None:
        """Every rank meets here (an all-reduce of one scalar, read back)."""
        if not self.distributed:
            return
        if self._barrier is None:
            def meet():
                ctx = tf.distribute.get_replica_context()
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(1.0))
            self._barrier = tf.function(lambda: self.strategy.run(meet), autograph=False)
        self._barrier().numpy()

    def gather_rows(self, values: np.ndarray) -> np.ndarray:
        """Every rank's ``values`` [k, ...] stacked in rank order: [world_size * k, ...]."""
        values = np.asarray(values)
        if not self.distributed:
            return values
        key = (values.shape, values.dtype.str)
        fn = self._gathers.get(key)
        if fn is None:
            def gather(x):
                # The identity places the argument on the replica's device: all_gather of the
                # argument itself finds no destination ("destinations can not be empty").
                return tf.distribute.get_replica_context().all_gather(tf.identity(x), axis=0)
            fn = self._gathers[key] = tf.function(lambda x: self.strategy.run(gather, (x,)),
                                                 autograph=False)
        with tf.device(self.tf_device):
            return fn(tf.constant(values)).numpy()
