"""How the nodes of a multi-node plan stay one job: they meet before every launch (each node's
ports), tell each other how each launch ended (so that one outcome holds on every node, the
cause first wherever it happened), and take node 0's decisions (the mode ``--mode best``
chose), since only node 0 sees the measurements. Imports no framework."""

from __future__ import annotations

import os
import time
from typing import Any

from . import outcome
from .backends.base import COLLECTIVE_TIMEOUT_ENV, Cluster
from .backends.spawn import PORTS_PER_RUN, endpoint as endpoint_text
from .config import Topology
from .plan_model import Plan
from .rendezvous import NodeGroup, RendezvousError, interface_of

PEER_POLL_S = 1.0
"""How often a running node looks whether another node's part of the run has failed (its own
ranks would then wait on the lost peer)."""
FAILED_HEAR_S = 10.0
"""How long a node whose own part failed waits to hear the others (a peer whose rank died
tells within seconds; one that died whole never will). A node whose part succeeded waits
``--rdzv-timeout``, as the others may still be finishing theirs."""


def multinode_env(topo: Topology, group: NodeGroup | None) -> dict[str, str]:
    """What every process of a multi-node run is told beyond its rank."""
    env = {COLLECTIVE_TIMEOUT_ENV: f"{topo.rdzv_timeout_s:g}"}
    # Gloo binds to what the hostname resolves to, which on many clusters (and in network
    # namespaces) is not the network the nodes met on.
    iface = interface_of(group.local_addr) if group else None
    if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


class Nodes:
    """This node's place among the nodes of one plan, for the runner."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.group: NodeGroup | None = None
        self.lost: str | None = None
        """Why the nodes cannot meet any more (the runs left are recorded as not run)."""
        self.is_follower = any(c.topology.node_rank > 0 for c in plan.cases)
        """Rank 0 lives on another node; with ``--rdzv`` known once the nodes have met."""

    def join(self, topo: Topology) -> NodeGroup:
        """Meet the other nodes once (the first time: join them and learn this node's rank).
        RendezvousError when they cannot: every later meeting fails at once."""
        if self.lost:
            raise RendezvousError(f"not run: {self.lost}")
        if self.group is not None:
            return self.group
        # By hand, node 0 hosts the store on the master port: every backend then learns every
        # node's address there, as after a rendezvous.
        endpoint = topo.rdzv or endpoint_text(topo.master_addr, topo.master_port)
        # The plans of a sweep meet one after another at the same endpoint: each its own keys,
        # or a later plan would read an earlier one's meeting.
        plan = self.plan
        words = [plan.framework, plan.data_role, plan.variant or ""]
        group = NodeGroup(endpoint, topo.nnodes, topo.rdzv_timeout_s,
                          run_id="-".join(["trainperf", *" ".join(words).split()]),
                          node_rank=None if topo.rdzv else topo.node_rank)
        try:
            group.join(plan.settings())
        except RendezvousError as exc:
            self.lost = str(exc)
            group.close()
            raise
        self.group = group
        self.is_follower = group.node_rank > 0
        return group

    def meet(self, topo: Topology, label: str) -> Cluster:
        """Meet before launch ``label``: where every node's processes listen."""
        group = self.join(topo)
        try:
            return group.meet(label, topo.devices_per_node, PORTS_PER_RUN + topo.devices_per_node)
        except RendezvousError as exc:
            self.lost = f"the nodes lost each other before {label}: {exc}"
            raise

    def env(self, topo: Topology) -> dict[str, str]:
        return multinode_env(topo, self.group)

    def failed_peers(self, meeting: str) -> dict[int, dict]:
        """The other nodes that have told of a failed part of this run (none where the store is
        lost: the run's own collectives will tell)."""
        try:
            told = self.group.told(meeting)
        except RendezvousError:
            return {}
        return {n: o for n, o in told.items() if o.get("status") != "ok"}

    def agree(self, meeting: str, here: outcome.Outcome, failed: dict[int, dict],
              wait_s: float) -> outcome.Outcome:
        """Tell the other nodes how this node's part ended and hear theirs (waiting ``wait_s``
        at most, as at a meeting): one outcome on every node, the cause first wherever it
        happened. A node whose own part failed waits ``FAILED_HEAR_S`` at most."""
        group = self.group
        if here.status != "ok":
            wait_s = min(wait_s, FAILED_HEAR_S)
        try:
            group.tell(meeting, {"status": here.status, "error": here.error,
                                 "cause": here.cause, "retry": here.retry})
            heard = group.hear(meeting, time.monotonic() + wait_s)
        except RendezvousError as exc:
            self.lost = f"the nodes lost each other after {meeting}: {exc}"
            text = "; ".join(filter(None, (here.error, str(exc))))
            if not here.cause:
                text += " (a peer node stopped or its network failed)"
            return outcome.Outcome("failed" if here.status == "ok" else here.status, text,
                                   here.cause)
        heard.update(failed)
        return outcome.agree(group.node_rank, here, heard, group.nnodes, wait_s)

    def one_decision(self, topo: Topology, label: str, decide) -> dict[str, Any]:
        """A decision every node takes alike: node 0 makes it (``decide()``, from what only it
        measured) and announces it; the others wait for it and take it as it came, never
        deciding alone. RendezvousError where the nodes lost each other."""
        group = self.join(topo)
        try:
            if group.node_rank == 0:
                value = decide()
                group.announce(label, value)
                return value
            return group.announcement(label)
        except RendezvousError as exc:
            self.lost = f"the nodes lost each other at {label}: {exc}"
            raise

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
