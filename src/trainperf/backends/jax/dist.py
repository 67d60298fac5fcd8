"""The distributed layout of a JAX run: one mesh axis of ranks, and global arrays on it.

``spawn`` starts one process per rank, on one node or several, with ``TRAINPERF_COORDINATOR``
(host:port of rank 0's coordination service, on the first node), ``TRAINPERF_NUM_PROCESSES`` and
``TRAINPERF_PROCESS_ID`` (the global rank); :func:`initialize_from_env` calls
``jax.distributed.initialize`` with them (CPU collectives then run over gloo, on the interface
``GLOO_SOCKET_IFNAME`` names where it is set; GPU ones over NCCL). Every process drives one
device, and the mesh is the 1-D axis ``"r"`` of all devices in rank order. gloo runs a tuple
all-reduce one element at a time, so the step reduces its gradients as one buffer there, and
sizes its sockets' send buffers to its first small reduce-scatter, so the layout sizes them
first (:func:`widen_gloo_send_buffers`).

The same layout also describes one process driving several devices (tests force several CPU
devices with ``--xla_force_host_platform_device_count``): rank r is the r-th mesh device,
whichever process owns it, and every helper below builds a global array from the shards of
the devices this process can address. The training step never needs to know which case runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "r"
"""The mesh axis of ranks."""
GLOO_SEND_BYTES = 1 << 20
"""What each process's gloo sockets are sized to send at once (``widen_gloo_send_buffers``)."""


@dataclass
class Layout:
    """The devices of a run as one mesh axis, and this process's part of it."""

    mesh: Mesh
    distributed: bool = False
    """Whether ranks live in other processes (jax.distributed is initialised)."""
    gloo_send_bytes: int | None = None
    """What gloo's sockets were sized to send at once (``widen_gloo_send_buffers``); None where
    nothing was sized."""

    @property
    def world_size(self) -> int:
        return self.mesh.devices.size

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    @property
    def local_ranks(self) -> list[int]:
        """Ranks of the devices this process drives, in rank order."""
        return [r for r, d in enumerate(self.devices) if d.process_index == jax.process_index()]

    @property
    def rank(self) -> int:
        """The first rank of this process (its only one with one device per process)."""
        return self.local_ranks[0]

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu``, as the protocol spells it."""
        return "cuda" if self.devices[0].platform == "gpu" else "cpu"

    @property
    def device(self) -> str:
        """Rank 0's device as the protocol spells devices: ``cuda:0`` or ``cpu``."""
        d = self.devices[self.rank]
        return f"cuda:{d.local_hardware_id}" if self.device_type == "cuda" else "cpu"

    # --------------------------------------------------------------------- global arrays

    def replicated_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def rank_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(AXIS))

    def replicated(self, tree: Any) -> Any:
        """Every leaf (a numpy or single-device array, the same in every process) as a global
        array held whole by every device."""
        sharding = self.replicated_sharding()

        def put(x):
            x = jax.numpy.asarray(x)
            shards = [jax.device_put(x, self.devices[r]) for r in self.local_ranks]
            return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)
        return jax.tree.map(put, tree)

    def per_rank(self, make: Callable[[int], Any]) -> Any:
        """Global arrays whose leading axis is split over the ranks: ``make(rank)`` gives rank
        ``rank``'s block (a pytree; the same shapes on every rank), made on that rank's device;
        the global leading dimension is the world size times the block's."""
        sharding = self.rank_sharding()
        blocks = {}
        for r in self.local_ranks:
            with jax.default_device(self.devices[r]):
                blocks[r] = jax.tree.map(lambda x, r=r: jax.device_put(x, self.devices[r]),
                                         make(r))
        first = blocks[self.local_ranks[0]]
        leaves = [jax.tree.leaves(blocks[r]) for r in self.local_ranks]
        out = []
        for i, leaf in enumerate(jax.tree.leaves(first)):
            shape = (leaf.shape[0] * self.world_size, *leaf.shape[1:])
            out.append(jax.make_array_from_single_device_arrays(
                shape, sharding, [ls[i] for ls in leaves]))
        return jax.tree.unflatten(jax.tree.structure(first), out)

    def zeros(self, shape: tuple[int, ...], dtype: Any, spec: P) -> jax.Array:
        """A global array of zeros laid out by ``spec``, each device's block made on the host
        (nothing to compile)."""
        def block(index: tuple[slice, ...]) -> np.ndarray:
            return np.zeros([len(range(*s.indices(n))) for s, n in zip(index, shape)], dtype)
        return jax.make_array_from_callback(tuple(shape), NamedSharding(self.mesh, spec), block)

    def local_value(self, array: jax.Array, rank: int | None = None) -> np.ndarray:
        """The block of ``rank`` (default: this process's first) of a rank-split array, or
        the value of a replicated one, read back to the host."""
        rank = self.rank if rank is None else rank
        device = self.devices[rank]
        for shard in array.addressable_shards:
            if shard.device == device:
                return np.asarray(shard.data)
        raise ValueError(f"rank {rank}'s shard is not addressable from this process")

    # ---------------------------------------------------------------------- host syncs

    def barrier(self, name: str = "trainperf") -> None:
        """Every process got here (a tiny collective over all devices). Deliberate host sync:
        call only at the edges of the measured window."""
        if self.distributed:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(name)

    def gather_host(self, values: np.ndarray) -> np.ndarray:
        """Every process's ``values`` stacked along a new leading axis (process order)."""
        if not self.distributed:
            return np.asarray(values)[None]
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(np.asarray(values)))


def local_mesh(count: int | None = None) -> Layout:
    """One process, its first ``count`` devices (default all) as the ranks."""
    devices = jax.local_devices()
    devices = devices[:count] if count else devices
    return Layout(Mesh(np.array(devices), (AXIS,)), distributed=False)


def initialize_from_env() -> bool:
    """``jax.distributed.initialize`` from the launcher's variables when there are several
    processes; returns whether it did. Call before any other JAX call."""
    nproc = int(os.environ.get("TRAINPERF_NUM_PROCESSES", "1"))
    if nproc <= 1:
        return False
    jax.distributed.initialize(coordinator_address=os.environ["TRAINPERF_COORDINATOR"],
                               num_processes=nproc,
                               process_id=int(os.environ["TRAINPERF_PROCESS_ID"]))
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        gloo_on_interface(interface)
    return True


def gloo_on_interface(interface: str) -> None:
    """Make the CPU client's gloo collectives listen on ``interface``. JAX's own CPU client
    binds gloo to whatever the hostname resolves to, which on many clusters is not the network
    the nodes met on; torch's and Paddle's gloo read ``GLOO_SOCKET_IFNAME`` (the launcher sets
    it for multi-node runs: ``spawn.gloo_interface_env``), JAX's does not, and takes the
    interface only as an argument of a private factory. So the CPU backend's factory is
    replaced, before any backend starts, by one that passes it. An MPI choice
    (``jax_cpu_collectives_implementation``) is left alone."""
    from jax._src import distributed, xla_bridge
    from jax._src.lib import _jax

    if jax.config.jax_cpu_collectives_implementation not in (None, "gloo"):
        return

    def make_cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, interface=interface)
        return xla_bridge.make_cpu_client(collectives)

    xla_bridge.register_backend_factory("cpu", make_cpu_client, priority=0, fail_quietly=False)


def check_sees_gpu() -> None:
    """ValueError in one line where this process was told ``cuda`` and JAX starts no GPU (a
    CPU build, whose CUDA platform then fails deep inside JAX; an empty
    CUDA_VISIBLE_DEVICES): never a CUDA plan run on the CPU."""
    try:
        platforms = {d.platform for d in jax.local_devices()}
        why = f"its devices: {', '.join(sorted(platforms)) or 'none'}"
    except Exception as exc:  # noqa: BLE001 - JAX_PLATFORMS=cuda without a CUDA backend
        platforms, why = set(), f"{type(exc).__name__} starting its CUDA backend"
    if not platforms & {"gpu", "cuda"}:
        raise ValueError(f"--device cuda was asked for but JAX sees no GPU ({why}; "
                         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}; is "
                         "the environment's jax the CUDA build?)")


def layout_from_env(distributed: bool) -> Layout:
    """The mesh of every process's devices in rank (process) order; one device per process.
    Across processes on a CPU, gloo's sockets are sized first (``widen_gloo_send_buffers``)."""
    if not distributed:
        return local_mesh(1)
    if jax.local_device_count() != 1:
        raise ValueError(f"a jax rank drives one device; this process sees "
                         f"{jax.local_device_count()}")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    layout = Layout(Mesh(np.array(devices), (AXIS,)), distributed=True)
    if layout.device_type == "cpu" and jax.config.jax_cpu_collectives_implementation in (
            None, "gloo"):
        widen_gloo_send_buffers(layout)
    return layout


def widen_gloo_send_buffers(layout: Layout, nbytes: int = GLOO_SEND_BYTES) -> None:
    """One reduce-scatter whose messages are ``nbytes`` long, so that gloo's sockets are sized
    for large sends whatever the step's own reduce-scatters send.

    gloo's reduce-scatter (not its all-reduce or all-gather, as XLA calls them: seen with
    strace) sets a socket's send buffer (``SO_SNDBUF``) to the largest message it has sent on
    it, which also switches the kernel's own sizing off for good. A step whose reduce-scatter
    is small (``mp`` and ``pfc`` scatter the gathered embeddings' gradient: 2 KB on
    tiny-arcface) leaves it at the kernel's minimum, 4.6 KB; from then on a large send (the
    gradient all-reduce) has one 64 KB loopback segment in flight at a time, and each waits for
    the peer's delayed acknowledgement, about 40 ms (seen with strace: a ``writev`` that
    returned EAGAIN resumed 47 ms later). On 2 ranks of a 2-core machine (shared
    with other work) the tiny-arcface ``pfc`` step ran at 0.54x of 1 rank's samples/s without
    this, 1.04x with it (``benchmarks/results/jax-ranks-2026-11-28``). A 1 MB message (the
    kernel doubles it, up to ``net.core.wmem_max``) keeps several segments in flight."""
    world = layout.world_size
    count = world * (nbytes // 4)  # float32 elements per rank: nbytes to each peer in a ring
    block = layout.zeros((world * count,), np.float32, P(AXIS))
    scatter = jax.jit(jax.shard_map(
        lambda x: jax.lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True),
        mesh=layout.mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    jax.block_until_ready(scatter(block))
    layout.gloo_send_bytes = nbytes
