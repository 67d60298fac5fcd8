"""The distributed layout of one Paddle worker process, and its collectives.

Ranks are started one process each by ``trainperf.backends.spawn`` with the variables Paddle's own
launcher (``paddle.distributed.launch``) would set: ``PADDLE_TRAINER_ID`` (the rank),
``PADDLE_TRAINERS_NUM`` (the world size), ``PADDLE_TRAINER_ENDPOINTS``,
``PADDLE_CURRENT_ENDPOINT``, ``PADDLE_MASTER`` (the TCP store every rank meets at) and
``FLAGS_selected_gpus`` (the GPU of the rank). ``paddle.distributed.init_parallel_env()`` builds
the default process group from them: NCCL on GPUs, gloo on a CPU (``PADDLE_DISTRI_BACKEND=gloo``,
set here before the call; Paddle otherwise insists on a GPU build).

The collectives are Paddle's own (``all_reduce``, ``all_gather``, ``broadcast``, ``barrier``),
synchronous on gloo; on NCCL they are queued on the device like any other kernel. In one process
they are the identity, so every caller can use them without asking.

Start-up: rank 0 opens the TCP store; a rank that knocks before it listens is made to retry
three seconds later by Paddle's client. Ranks other than 0 therefore poll the port every 20 ms
until the store accepts connections, and only then join (a 2-rank CPU run starts about three
seconds sooner).
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import paddle
import paddle.distributed as dist

from ..workerkit import device_kind_for

STORE_WAIT_S = 120.0
STORE_POLL_S = 0.02


def gpu_count() -> int:
    if not paddle.device.is_compiled_with_cuda():
        return 0
    return paddle.device.cuda.device_count()


def resolve_device(kind: str) -> str:
    """``gpu`` or ``cpu`` (Paddle's names) for a spec's ``device``."""
    found = device_kind_for(kind, gpu_count(), "Paddle",
                            " (is the environment's paddle the paddlepaddle-gpu build?)")
    return "gpu" if found == "cuda" else "cpu"


@dataclass
class Comm:
    """The layout of this process and the collectives between ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_type: str = "cpu"
    """``gpu`` or ``cpu``."""
    group: Any = None
    """Paddle's default process group; None in one process."""

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    @property
    def device(self) -> str:
        """As the protocol spells devices (as the torch worker): ``cuda:0`` or ``cpu``."""
        return f"cuda:{self.gpu_index}" if self.device_type == "gpu" else "cpu"

    @property
    def gpu_index(self) -> int:
        return int(os.environ.get("FLAGS_selected_gpus", self.local_rank))

    @property
    def backend(self) -> str | None:
        if not self.distributed:
            return None
        return "nccl" if self.device_type == "gpu" else "gloo"

    def all_reduce_sum_(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum ``x`` over ranks in place; returns ``x``."""
        if self.distributed:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def all_reduce_max_(self, x: paddle.Tensor) -> paddle.Tensor:
        """Elementwise max of ``x`` over ranks, in place; returns ``x``."""
        if self.distributed:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: paddle.Tensor) -> paddle.Tensor:
        """Every rank's ``x`` (same shape on each) concatenated along axis 0 in rank order."""
        if not self.distributed:
            return x
        parts: list[paddle.Tensor] = []
        dist.all_gather(parts, x, group=self.group)
        return paddle.concat(parts, axis=0)

    def broadcast_(self, x: paddle.Tensor) -> paddle.Tensor:
        """Rank 0's ``x`` on every rank, in place; returns ``x``."""
        if self.distributed:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def barrier(self) -> None:
        """Block until every rank got here. A deliberate host sync: call only at the edges."""
        if self.distributed:
            dist.barrier(group=self.group)


def _wait_for_store(address: str, timeout_s: float = STORE_WAIT_S) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0's TCP store at {address} did not open within "
                                   f"{timeout_s:.0f} s") from None
            time.sleep(STORE_POLL_S)


def comm_from_env(device_kind: str) -> Comm:
    """The layout the launcher set up through the ``PADDLE_*`` variables; joins the process
    group when there is more than one rank, and makes this rank's device the default."""
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    world_size = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    local_rank = int(os.environ.get("PADDLE_RANK_IN_NODE", str(rank)))
    device_type = resolve_device(device_kind)
    comm = Comm(rank, world_size, local_rank, device_type)
    if device_type == "gpu":
        gpus = gpu_count()
        if comm.gpu_index >= gpus:
            raise ValueError(f"rank {rank} asks for GPU {comm.gpu_index}; Paddle sees {gpus}")
        paddle.set_device(f"gpu:{comm.gpu_index}")
    else:
        paddle.set_device("cpu")
    if world_size == 1:
        return comm
    if device_type == "cpu":
        os.environ["PADDLE_DISTRI_BACKEND"] = "gloo"
    master = os.environ.get("PADDLE_MASTER")
    if rank != 0 and master:
        _wait_for_store(master)
    comm.group = dist.init_parallel_env()
    if comm.group is None:
        raise RuntimeError("paddle.distributed.init_parallel_env() returned no process group")
    return comm
