"""Each timed run's energy, for the runner (``attempts``): the GPU boards the run was given on
this node, their energy counters read from before its launch until its window is known
(``energy.CounterSampler``), the window's edges from its worker's events, and, on several
nodes, every node's joules brought to node 0 through the nodes' store. Imports no framework;
NVML only where a GPU run is read (``energy``).

Which boards: the first ``devices_per_node`` entries of the ``CUDA_VISIBLE_DEVICES`` the run's
processes inherit (from the user's shell or a scheduler; every board where it is unset), the
devices its local ranks take (``energy.run_entries``). A CPU run draws on no board: its energy
is "not measured", never a GPU's.

The window's edges: a worker stamps every event with the Unix time it wrote it, and writes the
window's last ``step`` event once the step's time is known, which is when the device has
finished it (a few events' writing after the synchronisation that closes the window). So the
window ends at that event's time and starts ``End.window_s`` (the worker's own clock) before.
The runner reads events up to ``procs.POLL_S`` (0.2 s) after they are written; reading the
counter when it sees them would move each edge by up to that much, about 0.2 s x the boards'
power at each edge (1% of a 40 s window, and always the same way at the end, where the boards
go idle). The counter is read on a thread instead, every ``energy.SAMPLE_S``, and placed at
the worker's own times, so the runner's latency costs nothing; what is left is the counter's
own resolution (``energy``) and the few milliseconds between the device finishing the last
step and the worker writing its event, which move both edges alike.

Several nodes: each node's runner reads its own boards only. Once the nodes have agreed that a
run ended ok, node 0 announces the window's edges (its worker's times) through the store, each
other node reads its boards over them and tells its joules, and node 0's record holds the sum
over every node with samples per joule, or, where a node could not read its boards or told
nothing, what was read (``energy_scope``: which nodes) and no samples per joule: a part is
never scaled up to the whole. Nodes' clocks are assumed to agree to a few milliseconds (NTP):
a skew of ``d`` seconds moves another node's edges by ``d``, about ``d`` x its boards' power.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import Topology
from .energy import METHOD, CounterSampler, NotMeasured, Nvml, run_entries
from .plan_model import device_kind
from .protocol import End, Event, Step
from .rendezvous import NodeGroup, RendezvousError

EXCHANGE_S = 10.0
"""How long node 0 waits for the other nodes' joules, and they for the window's edges. Every
node is past its launch and the outcome's agreement by then: this is a few store calls."""
SKEW_S = 1.0
"""The longest a node waits for its own clock to pass the window's end that node 0 told it (the
nodes' clocks may differ by a little), so that its last reading falls after it."""
RECORD_KEYS = ("energy_j", "energy_error_j", "samples_per_j", "energy_scope", "energy_devices",
               "energy_method", "energy_note")
"""What a timed run's record says of its energy (``RunEnergy.fields``)."""


def window_edges(seen: Sequence[Event]) -> tuple[float, float] | None:
    """(start, end) of the run's window in Unix time, from its worker's events: the end is when
    rank 0 wrote the window's last step, the start ``End.window_s`` before; None without an
    ``end`` event and a step of the window."""
    end = next((e for e in seen if isinstance(e, End)), None)
    last = max((e for e in seen if isinstance(e, Step) and not e.warmup),
               key=lambda e: e.index, default=None)
    if end is None or last is None or not end.window_s or not last.t:
        return None
    return last.t - end.window_s, last.t


@dataclass
class Part:
    """One node's reading of a run's boards."""

    joules: float | None = None
    error_j: float | None = None
    devices: list[str] = field(default_factory=list)
    """The boards read (UUIDs)."""
    note: str | None = None
    """Why there are no joules."""

    def to_dict(self) -> dict[str, Any]:
        return {"joules": self.joules, "error_j": self.error_j, "devices": self.devices,
                "note": self.note}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Part":
        return cls(d.get("joules"), d.get("error_j"), list(d.get("devices") or []),
                   d.get("note"))


@dataclass
class RunEnergy:
    """A run's energy as this node knows it: node 0 every node's part it heard, another node
    its own."""

    parts: dict[int, Part]
    nnodes: int = 1
    node_rank: int = 0

    def fields(self, window_samples: int | None) -> dict[str, Any]:
        """The run record's energy fields (``RECORD_KEYS``)."""
        read = {n: p for n, p in sorted(self.parts.items()) if p.joules is not None}
        joules = sum(p.joules for p in read.values()) if read else None
        whole = len(read) == self.nnodes
        notes = [(n, self.parts[n].note if n in self.parts else
                  f"told nothing within {EXCHANGE_S:g} s")
                 for n in range(self.nnodes) if n not in read]
        if self.node_rank != 0:
            notes = [(n, note) for n, note in notes if n == self.node_rank]
            if read:
                notes.append((0, "holds the run's energy over every node"))
        words = [f"node {n}: {note}" if self.nnodes > 1 else str(note) for n, note in notes]
        return {
            "energy_j": joules,
            "energy_error_j": sum(p.error_j or 0.0 for p in read.values()) if read else None,
            "samples_per_j": (window_samples / joules
                              if whole and joules and window_samples else None),
            "energy_scope": scope(sorted(read), self.nnodes) if read else None,
            "energy_devices": [d for p in read.values() for d in p.devices],
            "energy_method": METHOD if read else None,
            "energy_note": "; ".join(words) or None,
        }


def scope(nodes: list[int], nnodes: int) -> str:
    """Which nodes' boards a figure covers: ``1 node``, ``all 2 nodes``, ``node 0 of 2``."""
    if len(nodes) == nnodes:
        return "1 node" if nnodes == 1 else f"all {nnodes} nodes"
    return f"node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} of {nnodes}"


class RunMeter:
    """The energy counters of this node's boards of one timed run: ``start`` before its
    launch, ``settle`` once its outcome is known. ``reads``: False for a launch that is not a
    timed run (a probe round, a profiled run, a training run), which records nothing."""

    def __init__(self, topo: Topology, reads: bool) -> None:
        self.topo, self.reads = topo, reads
        self.note: str | None = None
        """Why this node reads nothing (a CPU run, no NVML, ...)."""
        self.cpu = False
        """A CPU run: every node of the plan knows it alike, and none reads a board."""
        self.devices: list[str] = []
        self._nvml: Nvml | None = None
        self._sampler: CounterSampler | None = None

    def start(self, env: Mapping[str, str]) -> None:
        """Start reading the boards a run started with ``env`` drives (its
        ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``)."""
        if not self.reads:
            return
        if device_kind(self.topo.device) != "cuda":
            self.cpu = True
            self.note = "not measured: a CPU run draws on no GPU board"
            return
        try:
            self._nvml = Nvml()
            boards = self._nvml.resolve(
                run_entries(env.get("CUDA_VISIBLE_DEVICES"), self.topo.devices_per_node),
                env.get("CUDA_DEVICE_ORDER"))
            self.devices = [b.uuid for b in boards]
            self._sampler = CounterSampler(self._nvml, boards).start()
        except NotMeasured as exc:
            self.note = f"not measured: {exc}"
            self.stop()

    def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.stop()
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def part(self, window: tuple[float, float] | None, why: str) -> Part:
        """This node's joules over ``window`` (Unix times); ``why`` there is no window."""
        if self.note is not None:
            return Part(note=self.note)
        if self._sampler is None:
            return Part(note="not measured: the counters were not read")
        if window is None:
            return Part(note=f"not measured: {why}")
        # The readings must reach past the window's end: the last one is taken as the readings
        # stop, once this node's clock has passed that end.
        late_s = window[1] - time.time()
        if late_s > 0:
            time.sleep(min(late_s, SKEW_S))
        self._sampler.stop()
        try:
            joules, error_j = self._sampler.between(*window)
        except NotMeasured as exc:
            return Part(devices=self.devices, note=f"not measured: {exc}")
        return Part(joules, error_j, self.devices)

    def settle(self, seen: Sequence[Event], ok: bool, group: NodeGroup | None,
               meeting: str) -> RunEnergy | None:
        """The run's energy once its outcome (``ok``, agreed by every node) is known; the
        counters stop. On several nodes every node calls it for the same launch: node 0
        announces the window and hears the others' parts (``EXCHANGE_S`` at most)."""
        if not self.reads:
            return None
        try:
            if group is None:
                window = window_edges(seen) if ok else None
                return RunEnergy({0: self.part(window, self._no_window(ok))})
            return self._across_nodes(seen, ok, group, meeting)
        finally:
            self.stop()

    @staticmethod
    def _no_window(ok: bool) -> str:
        return ("the worker's events do not give the window's edges" if ok
                else "the run did not end ok")

    def _across_nodes(self, seen: Sequence[Event], ok: bool, group: NodeGroup,
                      meeting: str) -> RunEnergy:
        rank, nnodes = group.node_rank, group.nnodes
        # Every node knows the agreed outcome and the plan's device kind alike: all of them
        # exchange, or none does.
        if not ok or self.cpu:
            # No node reads anything: this node's reason is the run's, as on one node.
            return RunEnergy({0: self.part(None, self._no_window(ok))})
        label = f"{meeting}/energy"
        try:
            if rank == 0:
                window = window_edges(seen)
                group.announce(label, {"window": list(window) if window else None})
                own = self.part(window, self._no_window(ok))
                group.tell(label, own.to_dict())
                heard = group.hear(label, time.monotonic() + EXCHANGE_S)
                parts = {0: own, **{n: Part.from_dict(p) for n, p in heard.items()}}
                return RunEnergy(parts, nnodes, rank)
            try:
                told = group.announcement(label, EXCHANGE_S).get("window")
            except RendezvousError as exc:
                told, why = None, f"node 0 told no window ({exc})"
            else:
                why = "node 0 had no window's edges"
            own = self.part(tuple(told) if told else None, why)
            group.tell(label, own.to_dict())
            return RunEnergy({rank: own}, nnodes, rank)
        except RendezvousError as exc:
            # The store is gone: this node's own part, whatever the others read.
            own = self.part(window_edges(seen) if rank == 0 else None,
                            f"the nodes lost each other ({exc})")
            return RunEnergy({rank: own}, nnodes, rank)
