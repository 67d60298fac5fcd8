"""The distributed layout of one MXNet worker process, and its collectives.

The launcher (``launch.py``) chooses one of four layouts and says which through the environment:

- ``TRAINPERF_KVSTORE=local``: one process, one context, one rank.
- ``TRAINPERF_KVSTORE=device``: one process driving ``TRAINPERF_CONTEXTS`` contexts, gradients
  summed by kvstore ``device`` (as insightface's MXNet ArcFace and gluon-cv trained on one
  machine). Context ``i`` is rank ``i``; data parallel only (no sharded head).
- ``TRAINPERF_KVSTORE=horovod`` (the default): one process per rank whose collectives are
  Horovod's (``horovod.mxnet``; NCCL on GPUs, gloo on a CPU), as the seeds' MXNet ran
  (DLPerf's gluon-cv ResNet50 and insightface's partial_fc). The launcher sets the
  ``HOROVOD_*`` variables (rank, size, the gloo rendezvous) that ``hvd.init()`` reads; the rank
  is Horovod's, which is the launcher's numbering. See "Horovod" below.
- ``TRAINPERF_KVSTORE=dist_sync``: one process per rank, talking through parameter servers
  (the launcher runs the scheduler and the servers and sets the ``DMLC_*`` variables), on one
  node or several. The rank is ``TRAINPERF_RANK``, the launcher's (node rank * ranks per node +
  local rank), not the kvstore's: ps-lite numbers workers by sorting their hosts and ports, so
  its rank 0 may be on any node, while the runner reads the events rank 0 writes on node 0.
  Nothing below depends on which numbering is used as long as every rank has its own: the
  kvstore sums without looking at ranks, and the values it keeps at ``init`` (its own rank 0's)
  are the same on every rank (see :meth:`Comm.register`). ``TRAINPERF_LOCAL_RANK`` is the launch
  index on the node (the GPU it uses).

Collectives run over the ``dist_sync`` kvstore with integer keys, all drawn from one counter so
that gradient keys and collective keys never collide. All-reduce-sum is a pushpull: the server
sums every worker's push and everyone pulls the sum (on a CPU context the kvstore receives it
into the pushed array itself, so it is an in-place operation). All-gather is a pushpull of a
zero-padded buffer in which each rank has written its own rows (the sum is the concatenation,
exactly: adding zeros rounds nothing); max is an all-gather followed by a max. Every one is
pushed to MXNet's engine and returns at once: none reads anything back to the host. In one
process (``local`` and ``device``) they are the identity.

Rounds: in ``dist_sync`` the server completes a key's round when it has as many pushes of that
key as there are workers; it does not look at who sent them. A rank must therefore not push a
key for round k + 1 before every rank's round-k push of it has arrived. MXNet orders operations
only by the arrays they touch, so a collective must depend, through its data, on the previous
round's result: every collective of a training step does (through the weights the previous
step updated), which is why the head gathers labels inside the embeddings' buffer instead of on
their own (constant labels would be pushed as soon as the step is issued).

The server only sums (no optimizer runs on it: ``update_on_kvstore`` is off in Trainer terms),
so the worker decides exactly how gradients are scaled and clipped (``step.py``). The server
accepts floating-point arrays only: integers (labels) travel as float64, exact up to 2**53.

Horovod. Every collective is one of horovod.mxnet's, pushed to MXNet's engine like any
operator (``MXEnginePushAsync``): it runs when the arrays it reads are ready and returns at once.
Horovod matches the ranks' operations by name, whatever order each rank's engine reaches them
in, so every call names its operation, and every rank makes the same calls. A name is never in
flight twice: each one's next use depends, through its data, on its last (the same chains as
the rounds below). Sums are ``allreduce_(op=Sum)`` in place (Horovod averages unless told);
the gradients go one array at a time with the priority Horovod's own ``DistributedTrainer``
gives them, and Horovod fuses them into its buffer. All-gather is the same zero-padded sum as in
``dist_sync`` (insightface's partial_fc did it so with Horovod): ``hvd.allgather`` waits for its
result on the host, which would put a sync inside the step. Max is ``allreduce(op=Max)``.
Registration broadcasts rank 0's values (``broadcast_``). float64 travels as float64: gloo
sums it natively, and NCCL does on GPUs.

float64 through the server. MXNet 1.9.1's ``KVStoreDistServer`` never initialises its
``multi_precision_`` flag (``src/kvstore/kvstore_dist_server.h``: only the optimizer's
``kSetMultiPrecision`` command sets it). Where the heap leaves it nonzero, the server keeps a
float32 copy of every key that is not float32 and sums float64 pushes in float32, silently
(seen here in about one launch in four; which launches depends on the process's heap). float32
keys never take that path. So in ``dist_sync`` every float64 collective travels as float32: the
array is split into three float32 pieces whose float64 sum is the array exactly
(:func:`split_float64`; three times 24 bits hold float64's 53 wherever the pieces stay normal
float32 numbers, i.e. for magnitudes from about 1e-24 up, and below that the error is under
1e-38 absolutely), the pieces are all-gathered (adding the other ranks' zeros rounds nothing),
and every rank puts each rank's array back together in float64 (:func:`join_float64`); a sum
then adds them on the worker, in rank order, in float64. It costs a gather of three float32
copies where a sum would push one array: float64 runs are alignment runs, not timed.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Sequence

import mxnet as mx
import numpy as np

from ..workerkit import device_kind_for

KVSTORES = ("local", "device", "dist_sync", "horovod")
PER_RANK = ("dist_sync", "horovod")
"""The layouts with one process per rank."""
FLOAT64_PIECES = 3
"""float32 pieces that carry one float64 value (module doc)."""


def resolve_device(kind: str) -> str:
    """``gpu`` or ``cpu`` (MXNet's names) for a spec's ``device``."""
    found = device_kind_for(kind, mx.context.num_gpus(), "MXNet",
                            " (is the environment's mxnet a CUDA build?)")
    return "gpu" if found == "cuda" else "cpu"


def _context(device_type: str, index: int) -> mx.Context:
    return mx.gpu(index) if device_type == "gpu" else mx.cpu(index)


def _is_float64(x: mx.nd.NDArray) -> bool:
    return x.dtype == np.float64


def split_float64(x: mx.nd.NDArray) -> mx.nd.NDArray:
    """float32 pieces [FLOAT64_PIECES, x.size] of the float64 array ``x``: each the float32
    nearest to what the ones before leave of ``x`` (each remainder is exact in float64), so
    that :func:`join_float64` gives ``x`` back (module doc)."""
    rest = x.reshape((-1,))
    pieces = []
    for _ in range(FLOAT64_PIECES):
        piece = rest.astype("float32")
        pieces.append(piece)
        rest = rest - piece.astype("float64")
    return mx.nd.stack(*pieces)


def join_float64(pieces: mx.nd.NDArray) -> mx.nd.NDArray:
    """The float64 arrays [R, n] that float32 ``pieces`` [R, FLOAT64_PIECES, n] (each row from
    :func:`split_float64`) carry, added largest piece first, as they were split."""
    rows, _, n = pieces.shape
    total = None
    for i in range(FLOAT64_PIECES):
        piece = mx.nd.slice_axis(pieces, axis=1, begin=i, end=i + 1).reshape((rows, n))
        piece = piece.astype("float64")
        total = piece if total is None else total + piece
    return total


@dataclass
class Comm:
    """The layout of this process and the collectives between ranks."""

    mode: str = "local"
    """``local``, ``device``, ``dist_sync`` or ``horovod``."""
    rank: int = 0
    """Global rank of this process (``device``: 0, the rank of its first context)."""
    world_size: int = 1
    """Ranks in the run: processes in ``dist_sync`` and ``horovod``, contexts in ``device``."""
    local_rank: int = 0
    device_type: str = "cpu"
    """``gpu`` or ``cpu``."""
    contexts: list = field(default_factory=lambda: [mx.cpu()])
    """The contexts this process drives, one per rank it holds (``device``: all of them)."""
    kv: object | None = None
    """The kvstore that sums gradients (``device`` and ``dist_sync``), else None."""
    hvd: object | None = None
    """``horovod.mxnet``, initialised (``horovod``), else None."""
    _keys: dict = field(default_factory=dict)
    _next_key: int = 0

    # ----------------------------------------------------------------------------- layout

    @property
    def ranks(self) -> list[int]:
        """Global rank of each of this process's contexts, in context order."""
        if self.mode == "device":
            return list(range(len(self.contexts)))
        return [self.rank]

    @property
    def distributed(self) -> bool:
        """Whether ranks live in other processes (then the collectives below talk)."""
        return self.mode in PER_RANK and self.world_size > 1

    @property
    def device(self) -> str:
        """The first context as the protocol spells devices (as the torch worker): ``cuda:0``
        for MXNet's ``gpu(0)``, or ``cpu``."""
        ctx = self.contexts[0]
        return f"cuda:{ctx.device_id}" if ctx.device_type == "gpu" else "cpu"

    def new_key(self) -> int:
        """A fresh integer kvstore key; every rank draws the same keys in the same order."""
        key = self._next_key
        self._next_key += 1
        return key

    # ---------------------------------------------------------------------- gradients

    def register(self, arrays: Sequence[Sequence[mx.nd.NDArray]]) -> list[int]:
        """Give each entry (one array per context, e.g. a parameter's copies) a kvstore key
        and make every copy equal to one rank's first one: in ``dist_sync`` the store keeps
        the value the kvstore's own rank 0 initialises a key with (which need not be
        :attr:`rank` 0) and every rank pulls it back (as Gluon's Trainer broadcasts
        parameters). Callers pass the same values on every rank (one seed), so which rank's
        is kept changes nothing; float64 entries take :attr:`rank` 0's, gathered exactly
        (module doc). Call at set-up, on every rank, in the same order. Returns the keys, to
        pass to :meth:`sum_`."""
        keys = [self.new_key() for _ in arrays]
        if self.hvd is not None:
            if self.distributed:
                for key, copies in zip(keys, arrays):
                    self.hvd.broadcast_(copies[0], root_rank=0, name=f"register.{key}")
                # As horovod.mxnet's broadcast_parameters does: every broadcast pushed to the
                # engine is done before the first step queues work on the same arrays.
                mx.nd.waitall()
            return keys
        if self.kv is None or not keys:
            return keys
        if self.mode != "dist_sync":  # device: copy context 0's value to the others
            self.kv.init(keys, [copies[0] for copies in arrays])
            for copies in arrays:
                for other in copies[1:]:
                    copies[0].copyto(other)
            return keys
        through = [(key, copies) for key, copies in zip(keys, arrays)
                   if not _is_float64(copies[0])]
        if through:
            self.kv.init([key for key, _ in through], [copies[0] for _, copies in through])
            self.kv.pull([key for key, _ in through], out=[list(c) for _, c in through])
        for key, copies in zip(keys, arrays):
            if _is_float64(copies[0]):  # rank 0's, gathered exactly (module doc)
                first = self._gather_float64(f"register/{key}", copies[0])[0]
                copies[0][:] = first.reshape(copies[0].shape)
        return keys

    def sum_(self, keys: Sequence[int], arrays: Sequence[Sequence[mx.nd.NDArray]]) -> None:
        """Replace every copy of each entry by the sum over all ranks and contexts (in place,
        asynchronous). Nothing to do with one rank in total."""
        if self.hvd is not None:
            if self.distributed:
                for i, (key, copies) in enumerate(zip(keys, arrays)):
                    self.hvd.allreduce_(copies[0], op=self.hvd.Sum, name=f"grad.{key}",
                                        priority=-i)
            return
        if self.kv is None or self.world_size == 1 or not keys:
            return
        pairs = list(zip(keys, arrays))
        if self.distributed:  # float64 exactly (module doc), one array at a time
            for key, copies in pairs:
                if _is_float64(copies[0]):
                    self.allreduce_sum_(f"sum/{key}", copies[0])
            pairs = [(key, copies) for key, copies in pairs if not _is_float64(copies[0])]
        if pairs:
            lists = [list(copies) for _, copies in pairs]
            self.kv.pushpull([key for key, _ in pairs], lists, out=lists)

    # -------------------------------------------------- collectives of the sharded head

    def _key(self, name: str, like: mx.nd.NDArray) -> int:
        """The key of a named collective buffer of ``like``'s shape and dtype (the server fixes
        a key's size), initialised on first use (a collective call: every rank makes it)."""
        ident = (name, tuple(like.shape), str(like.dtype))
        key = self._keys.get(ident)
        if key is None:
            key = self.new_key()
            self.kv.init(key, mx.nd.zeros(like.shape, ctx=like.context, dtype=like.dtype))
            self._keys[ident] = key
        return key

    def allreduce_sum_(self, name: str, x: mx.nd.NDArray) -> mx.nd.NDArray:
        """Sum ``x`` over ranks, in place; returns ``x``. ``name`` (with the shape and dtype)
        picks the kvstore key: every rank makes the same calls in the same order. float64 is
        gathered exactly and added here, in rank order (module doc)."""
        if not self.distributed:
            return x
        if self.hvd is not None:
            return self.hvd.allreduce_(x, op=self.hvd.Sum, name=name)
        if _is_float64(x):
            ranks = self._gather_float64(name, x)
            total = ranks[0]
            for r in range(1, self.world_size):
                total = total + ranks[r]
            x[:] = total.reshape(x.shape)
            return x
        self.kv.pushpull(self._key(name, x), x, out=x)
        return x

    def all_gather(self, name: str, x: mx.nd.NDArray) -> mx.nd.NDArray:
        """Every rank's ``x`` (same shape on each) concatenated along axis 0 in rank order."""
        if not self.distributed:
            return x
        if _is_float64(x) and self.hvd is None:
            return self._gather_float64(name, x).reshape((-1, *x.shape[1:]))
        return self._gather_rows(name, x)

    def _gather_float64(self, name: str, x: mx.nd.NDArray) -> mx.nd.NDArray:
        """Every rank's float64 ``x`` flattened, [world_size, x.size] in rank order, carried
        exactly as float32 pieces (module doc)."""
        pieces = self._gather_rows(name, split_float64(x).reshape((1, -1)))
        return join_float64(pieces.reshape((self.world_size, FLOAT64_PIECES, -1)))

    def _gather_rows(self, name: str, x: mx.nd.NDArray) -> mx.nd.NDArray:
        """``all_gather`` as a sum of zero-padded buffers, in ``x``'s own dtype."""
        rows = x.shape[0]
        # A fresh zeroed buffer each call: on a CPU context the dist kvstore sends the pushed
        # array itself and receives the sum into it, so last call's buffer holds every row.
        pad = mx.nd.zeros((self.world_size * rows, *x.shape[1:]), ctx=x.context, dtype=x.dtype)
        pad[self.rank * rows:(self.rank + 1) * rows] = x
        if self.hvd is not None:
            return self.hvd.allreduce_(pad, op=self.hvd.Sum, name=name)
        self.kv.pushpull(self._key(name, pad), pad, out=pad)
        return pad

    def allreduce_max(self, name: str, x: mx.nd.NDArray) -> mx.nd.NDArray:
        """Elementwise max of ``x`` over ranks."""
        if not self.distributed:
            return x
        if self.hvd is not None:
            return self.hvd.allreduce(x, op=self.hvd.Max, name=name)
        gathered = self.all_gather(name, x.expand_dims(0))
        return mx.nd.max(gathered, axis=0)

    def barrier(self) -> None:
        """Block until every rank got here (and, before it, finished pushing): a one-number
        sum that every rank waits for. Deliberate host sync: call only at the edges."""
        if not self.distributed:
            return
        self.allreduce_sum_("barrier", mx.nd.ones((1,), ctx=mx.cpu())).wait_to_read()


RENDEZVOUS_POLL_S = 0.2


def wait_for_rendezvous() -> None:
    """Wait until the gloo rendezvous (``HOROVOD_GLOO_RENDEZVOUS_ADDR``/``_PORT``, served by
    node 0's launcher) accepts connections, for as long as gloo itself would wait
    (``HOROVOD_GLOO_TIMEOUT_SECONDS``). Horovod's own client gives up after three tries in
    1.5 s, and a rank (another node's, or one that imports faster) may be ready before the
    server is. TimeoutError naming the address after that."""
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    if not addr:
        return  # one process alone: Horovod needs no rendezvous
    port = int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
    deadline = time.monotonic() + float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30"))
    while True:
        try:
            socket.create_connection((addr, port), timeout=RENDEZVOUS_POLL_S * 5).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"Horovod's gloo rendezvous at {addr}:{port} did not answer "
                                   f"({exc})") from None
            time.sleep(RENDEZVOUS_POLL_S)


def comm_from_env(device_kind: str) -> Comm:
    """The layout the launcher set up through ``TRAINPERF_*`` (and ``DMLC_*`` or
    ``HOROVOD_*``) variables."""
    mode = os.environ.get("TRAINPERF_KVSTORE", "local")
    if mode not in KVSTORES:
        raise ValueError(f"TRAINPERF_KVSTORE must be one of {KVSTORES}, got {mode!r}")
    count = int(os.environ.get("TRAINPERF_CONTEXTS", "1"))
    local_rank = int(os.environ.get("TRAINPERF_LOCAL_RANK", "0"))
    device_type = resolve_device(device_kind)
    gpus = mx.context.num_gpus()
    if mode == "device":
        if device_type == "gpu" and count > gpus:
            raise ValueError(f"kvstore device asks for {count} GPUs; MXNet sees {gpus}")
        contexts = [_context(device_type, i) for i in range(count)]
        kv = mx.kv.create("device") if count > 1 else None
        return Comm("device", 0, count, 0, device_type, contexts, kv)
    index = local_rank % gpus if device_type == "gpu" else 0
    contexts = [_context(device_type, index)]
    if mode == "local":
        return Comm("local", 0, 1, local_rank, device_type, contexts, None)
    if mode == "horovod":
        import horovod.mxnet as hvd  # in the environment's recipe (backend.HOROVOD)

        wait_for_rendezvous()
        hvd.init()
        told = int(os.environ.get("TRAINPERF_RANK", hvd.rank()))
        if told != hvd.rank():
            raise ValueError(f"TRAINPERF_RANK {told} but Horovod's rank is {hvd.rank()}")
        return Comm("horovod", hvd.rank(), hvd.size(), local_rank, device_type, contexts,
                    hvd=hvd)
    kv = mx.kv.create("dist_sync")
    rank = int(os.environ.get("TRAINPERF_RANK", kv.rank))
    if not 0 <= rank < kv.num_workers:
        raise ValueError(f"TRAINPERF_RANK {rank} is outside the kvstore's {kv.num_workers} "
                         f"workers")
    return Comm("dist_sync", rank, kv.num_workers, local_rank, device_type, contexts, kv)
