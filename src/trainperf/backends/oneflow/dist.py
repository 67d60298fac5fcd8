"""The distributed layout of one OneFlow worker process.

``backend.py`` starts one process per rank with torch-style variables (``MASTER_ADDR``,
``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``); OneFlow reads them when it is
imported and joins every process into one group, so there is no init call here. The rank and the
world size come from ``oneflow.env``.

Two kinds of tensors meet in a step. The backbone is *local*: each rank holds its own copy and
its own batch, as torch's DDP runs it. The sharded head is *global*: one logical tensor over
:attr:`Dist.placement` (all ranks), whose SBP says how it lies across them: ``split(0)`` rows
sharded, ``broadcast`` replicated, ``partial_sum`` a sum of per-rank parts. OneFlow's boxing
turns one SBP into another (all-gather, all-reduce, reduce-scatter) where an operation needs it.

Nothing here reads a device value back to the host except :meth:`Dist.barrier` and
:meth:`Dist.gather_host`, which the worker calls at the edges of the measured window only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import oneflow as flow

from ..base import own_gpu_ordinal
from ..workerkit import device_kind_for


def resolve_device(kind: str) -> str:
    """``cuda`` or ``cpu`` for a spec's ``device``."""
    return device_kind_for(kind, int(flow.cuda.is_available()), "OneFlow")


@dataclass
class Dist:
    """Where this process runs and how it reaches the other ranks."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_type: str = "cpu"
    """``cuda`` or ``cpu``."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> flow.device:
        """This rank's device for local tensors."""
        if self.device_type == "cuda":
            return flow.device("cuda", self.gpu_index)
        return flow.device("cpu")

    @property
    def gpu_index(self) -> int:
        """This rank's GPU as the process numbers them (it sees all of its node's)."""
        return own_gpu_ordinal(self.local_rank, flow.cuda.device_count(), "OneFlow")

    @property
    def device_name(self) -> str:
        """As the protocol spells devices (``cuda:0`` or ``cpu``)."""
        return str(self.device) if self.device_type == "cuda" else "cpu"

    @property
    def placement(self) -> flow.placement:
        """Every rank, each on its own device: where global tensors live."""
        return flow.placement(self.device_type, ranks=list(range(self.world_size)))

    def barrier(self) -> None:
        """Block until every rank got here. Deliberate host sync: call at the edges only."""
        if self.distributed:
            flow.comm.barrier()

    def sync(self) -> None:
        """Wait until this process's queued device work (collectives included) has run."""
        flow._oneflow_internal.eager.Sync()
        if self.device_type == "cuda":
            flow.cuda.synchronize()

    def gather_host(self, values: list[float]) -> np.ndarray:
        """Every rank's ``values`` (same length on each) as a [world, len] float64 array on the
        host (a collective call; it reads back)."""
        local = flow.tensor([values], dtype=flow.float64, device=self.device)
        if not self.distributed:
            return local.numpy()
        gathered = local.to_global(placement=self.placement, sbp=flow.sbp.split(0))
        return gathered.to_global(sbp=flow.sbp.broadcast).to_local().numpy()


def dist_from_env(device_kind: str) -> Dist:
    """The layout the launcher set up (OneFlow has already read the variables)."""
    return Dist(rank=flow.env.get_rank(), world_size=flow.env.get_world_size(),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                device_type=resolve_device(device_kind))
