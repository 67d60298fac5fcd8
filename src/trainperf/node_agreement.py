"""How the nodes of a multi-node plan stay one job: they meet before every launch (each node's
ports), tell each other how each launch ended (so that one outcome holds on every node, the
cause first wherever it happened), and take node 0's decisions (the mode ``--mode best``
chose), since only node 0 sees the measurements. Imports no framework.

While a launch runs, each node's runner also watches the network (``RunWatch``): it beats on
the store (node 0 with rank 0's step count) and hears the others' beats, so that a node gone
silent is named with the step it was last heard at; it reads its own interface's carrier, so
that a node can tell its own link down from a peer gone silent; and node 0 probes each other
node's link (a block sent, its acknowledgement timed), so that a run whose steps change speed
part-way (``step_change``) can be told a link that changed from a model that did
(``link_verdict``).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from typing import Any

from . import outcome
from .outcome import step_words
from .backends.base import COLLECTIVE_TIMEOUT_ENV, Cluster
from .backends.spawn import PORTS_PER_RUN, endpoint as endpoint_text
from .config import Topology
from .plan_model import Plan
from .rendezvous import (LinkState, NodeGroup, ProbeLink, RendezvousError, interface_of,
                         link_state)

PEER_POLL_S = 1.0
"""How often a running node looks whether another node's part of the run has failed (its own
ranks would then wait on the lost peer)."""
FAILED_HEAR_S = 10.0
"""How long a node whose own part failed waits to hear the others (a peer whose rank died
tells within seconds; one that died whole never will). A node whose part succeeded waits
``--rdzv-timeout``, as the others may still be finishing theirs."""
BEAT_S = 0.25
"""How often, while a launch runs, a node tells the others through the store that it is there
(node 0 with rank 0's steps so far) and hears them: node 0 hears every node, the others node 0
(a star, so the store serves a few calls per node and beat, not one per pair)."""
SILENT_S = 2.0
"""A node not heard from for this long (eight beats) is unreachable; a busy store or machine
delays a beat by far less."""
PROBE_BYTES = 1 << 20
"""A link probe's block: long enough that a token bucket's burst (a switch's, tc's) does not
carry all of it at line rate, and that the link's time, not the hosts' scheduling, dominates
its seconds on links up to tens of Gbit/s."""
PROBE_S = 1.0
PROBE_SHARE = 0.005
"""Node 0 probes each other node's link as a run starts, every ``PROBE_S`` while it goes or,
where probes take longer, so that they hold at most this share of the link's time, and once
more when its steps are over (``RunWatch.closing_probe``): a run's collectives share the link
with the probes, and 5% of it (the share first chosen) cost a 2-node run at 50 Mbit/s 3.8% of
its speed (``benchmarks/link_probe_cost.sh``)."""
PROBE_MAX_S = 60.0
"""The longest wait between probes while a run goes: on a link of 10 Mbit/s or more, probes
take under 1.5% of its time."""
CLOSING_PROBE_S = 10.0
"""The longest the closing probe may hold up a run's end, beyond the longest probe before it."""
PROBE_TIMEOUT_S = 30.0
"""The longest a probe may take (a block at 1 Mbit/s takes about 9 s); a probe that times out
is none."""
CHANGE_RATIO = 1.5
CHANGE_MIN_STEPS = 4
CHANGE_SHARE = 0.75
"""A run's steps changed speed when the median step after some step differs from the median
before it by ``CHANGE_RATIO`` or more, with ``CHANGE_MIN_STEPS`` steps at least on either side
and ``CHANGE_SHARE`` of each side's steps on its own side of the two medians' geometric mean (a
lasting change, not a few slow steps)."""
LINK_RATIO = 2.0
LINK_SAME = 1.25
"""Across such a change, a link whose probes' median moved by ``LINK_RATIO`` or more the same
way changed; links that all moved by less than ``LINK_SAME`` did not, and the model (the
nodes' compute, their input) changed instead; anything between says nothing either way."""


def multinode_env(topo: Topology, group: NodeGroup | None) -> dict[str, str]:
    """What every process of a multi-node run is told beyond its rank."""
    env = {COLLECTIVE_TIMEOUT_ENV: f"{topo.rdzv_timeout_s:g}"}
    # Gloo binds to what the hostname resolves to, which on many clusters (and in network
    # namespaces) is not the network the nodes met on.
    iface = interface_of(group.local_addr) if group else None
    if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


class RunWatch:
    """What this node sees of the network while one launch of a run goes (``BEAT_S``): its own
    link's state, when the other nodes were last heard on the store and at which of rank 0's
    steps, which of them told of a failed part, and, on node 0, its probes of each other node's
    link. Its threads never hold up the runner's loop: a store call across a link that is down
    would hang until the link returns or the store's timeout, so none is made while this node's
    link is down, and whatever hangs, hangs in the watch's own thread."""

    def __init__(self, group: NodeGroup, meeting: str, probe: bool) -> None:
        self.group, self.meeting, self.rank = group, meeting, group.node_rank
        self.iface = interface_of(group.local_addr)
        others = [n for n in range(group.nnodes) if n != self.rank]
        self.listens_to = others if self.rank == 0 else [0]
        started = time.monotonic()
        self.steps = 0
        self.progress = 0
        """Node 0: rank 0's steps so far, and its steps and evaluations (what a stall is
        measured against), which the runner's loop sets."""
        self.ended = False
        """Node 0: rank 0 wrote ``end``; nothing is left to stall."""
        self.stall_s: float | None = None
        """Node 0: the stall limit its steps sized (``stall``), which the other nodes hold
        rank 0's steps to: they see no step times of their own."""
        self.heard_at = {n: started for n in self.listens_to}
        self.heard_steps: dict[int, int | None] = {n: None for n in self.listens_to}
        """Rank 0's steps when each node was last heard (node 0's own count, or the count
        node 0's beat carried)."""
        self._last_beat: dict[int, str | None] = {n: None for n in self.listens_to}
        self.finished: set[int] = set()
        """Nodes whose part of the launch is over (their last beat said so): silent since."""
        self.gaps: dict[int, tuple[float, int | None]] = {}
        """Each node's longest silence of ``SILENT_S`` or more that ended: seconds, and the
        steps it was last heard at before it."""
        self.node0_steps: int | None = None
        self.node0_ended = False
        self.node0_advanced_at: float | None = None
        self._node0_progress: int | None = None
        """Other nodes: rank 0's steps as node 0 last told them, and when they (or its
        evaluations) last moved."""
        self.node0_stall_s: float | None = None
        """Other nodes: node 0's stall limit as it last told it (None: not told)."""
        self.failed: dict[int, dict] = {}
        self.down_since: float | None = None
        self.down_steps: int | None = None
        self.down_state: LinkState | None = None
        self.down_longest: tuple[float, int | None] | None = None
        """This node's link: since when it is down, at which step it went, how it read; the
        longest outage that ended during the launch (seconds, step)."""
        self.probes: dict[int, list[list[float]]] = {}
        """Node 0: each node's link probes, ``[rank 0's steps at the probe's start, seconds]``."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set with ``_stop`` or ``_closing``: the probe thread's wait between probes ends."""
        self._closing = threading.Event()
        self._closed = threading.Event()
        self._longest_probe = 0.0
        self._threads = [threading.Thread(target=self._beat, daemon=True, name="node-beat")]
        self._probing = probe and self.rank == 0
        if self._probing:
            self._threads.append(threading.Thread(target=self._probe, daemon=True,
                                                  name="link-probe"))
        for t in self._threads:
            t.start()

    # -- read by the runner's loop ---------------------------------------------------------
    def known_steps(self) -> int | None:
        return self.steps if self.rank == 0 else self.node0_steps

    def link_down_s(self) -> float:
        """How long this node's link has been down (0 while it is up)."""
        since = self.down_since
        return time.monotonic() - since if since is not None else 0.0

    def finding(self) -> dict[str, Any] | None:
        """What went wrong with the network, as this node saw it during the launch: its own
        link down (``link_down``), or else the node silent the longest (now, or in a silence
        that ended), with the step it went at; None where nothing did."""
        now = time.monotonic()
        since, state = self.down_since, self.down_state
        if since is not None or self.down_longest is not None:
            seconds, step = ((now - since, self.down_steps) if since is not None
                             else self.down_longest)
            return {"node": self.rank, "step": step, "link_down": True, "still": since is not None,
                    "link": state.text() if state else self.iface, "seconds": round(seconds, 2),
                    "seen_by": self.rank}
        worst = None
        for node in self.listens_to:
            silent = now - self.heard_at[node]
            if silent >= SILENT_S and node not in self.finished:
                found = (silent, self.heard_steps[node], True)
            elif node in self.gaps:
                found = (*self.gaps[node], False)
            else:
                continue
            if worst is None or found[0] > worst[1][0]:
                worst = (node, found)
        if worst is None:
            return None
        node, (seconds, step, still) = worst
        return {"node": node, "step": step, "link_down": False, "still": still,
                "link": self.iface, "seconds": round(seconds, 2), "seen_by": self.rank}

    def closing_probe(self) -> None:
        """Node 0, once a run's steps are over: each link probed once more, where no step
        shares it, so that a link that changed late in the run is measured after the change.
        Waits for it, ``CLOSING_PROBE_S`` beyond the longest probe so far at most."""
        if not self._probing or self._stop.is_set():
            return
        self._closing.set()
        self._wake.set()
        self._closed.wait(self._longest_probe + CLOSING_PROBE_S)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=2 * BEAT_S)  # one hung on the store finishes on its own

    # -- the threads -----------------------------------------------------------------------
    def _beat(self) -> None:
        count, next_told = 0, 0.0
        while True:
            last = self._stop.wait(BEAT_S)
            now = time.monotonic()
            state = link_state(self.iface)
            if state is not None and state.down:
                if self.down_since is None:
                    self.down_since, self.down_steps, self.down_state = (
                        now, self.known_steps(), state)
                if last:
                    return
                continue  # the store lies across that link
            if self.down_since is not None:
                outage = now - self.down_since
                if self.down_longest is None or outage > self.down_longest[0]:
                    self.down_longest = (outage, self.down_steps)
                self.down_since = None
            count += 1
            # The last beat says this node's part is over, so that its silence from then on
            # is not taken for a lost node.
            beat = {"n": count, "done": last}
            if self.rank == 0:
                beat.update(steps=self.steps, progress=self.progress, ended=self.ended,
                            stall_s=self.stall_s)
            try:
                self.group.beat(self.meeting, beat)
                if last:
                    return
                for node in self.listens_to:
                    self._heard(node, self.group.beat_of(self.meeting, node))
                if now >= next_told:
                    next_told = now + PEER_POLL_S
                    told = self.group.told(self.meeting)
                    self.failed = {n: o for n, o in told.items() if o.get("status") != "ok"}
            except RendezvousError:
                if last:
                    return
                continue  # the store is lost; the run's own collectives will tell

    def _heard(self, node: int, beat: dict | None) -> None:
        if beat is None:
            return
        key = repr(sorted(beat.items()))
        if key == self._last_beat[node]:
            return
        now = time.monotonic()
        silence = now - self.heard_at[node]
        if self._last_beat[node] is not None and silence >= SILENT_S and (
                node not in self.gaps or silence > self.gaps[node][0]):
            self.gaps[node] = (silence, self.heard_steps[node])
        self._last_beat[node], self.heard_at[node] = key, now
        if beat.get("done"):
            self.finished.add(node)
        if self.rank == 0:
            self.heard_steps[node] = self.steps
            return
        steps, progress = beat.get("steps"), beat.get("progress")
        if progress and progress != self._node0_progress:  # a stall counts from step 1
            self.node0_advanced_at = now
        self._node0_progress = progress
        self.node0_steps, self.node0_ended = steps, bool(beat.get("ended"))
        self.node0_stall_s = beat.get("stall_s")
        self.heard_steps[node] = steps

    def _probe(self) -> None:
        group = self.group
        links = {n: ProbeLink(group.addrs[n], port, PROBE_TIMEOUT_S)
                 for n, port in enumerate(group.probe_ports) if n != self.rank and port}
        block = bytes(PROBE_BYTES)
        try:
            while links and not self._stop.is_set():
                closing = self._closing.is_set()
                longest = 0.0
                for node, link in links.items():
                    steps = self.steps
                    seconds = link.measure(block)
                    if seconds is not None:
                        self.probes.setdefault(node, []).append([steps, round(seconds, 6)])
                    longest = max(longest, PROBE_MAX_S if seconds is None else seconds)
                self._longest_probe = max(self._longest_probe, longest)
                if closing:
                    break
                self._wake.wait(min(PROBE_MAX_S, max(PROBE_S, longest / PROBE_SHARE)))
                self._wake.clear()
        finally:
            self._closed.set()
            for link in links.values():
                link.close()


def finding_text(found: dict[str, Any], rank: int) -> str:
    """This node's finding in words, naming the node and the step."""
    step = step_words(found.get("step"))
    if found["link_down"]:
        told = " or later (the last step node 0 told)" if rank != 0 and found.get("step") else ""
        if found.get("still"):
            return (f"this node's link is down ({found['link']}): it went down {step}{told}, "
                    f"{found['seconds']:g} s before the run was stopped; no other node can "
                    f"be reached")
        return (f"this node's link was down for {found['seconds']:g} s ({found['link']}), "
                f"{step}{told}")
    own = f"this node's link ({found['link']}) was up" if found.get("link") else "this node up"
    if found.get("still"):
        return (f"node {found['node']} unreachable {step}: not heard from for "
                f"{found['seconds']:g} s while {own}")
    return (f"node {found['node']} was unreachable for {found['seconds']:g} s {step}, while "
            f"{own}")


def step_change(times: list[float], first_step: int) -> dict[str, Any] | None:
    """A lasting change of a run's step time (``CHANGE_RATIO``...): the first step after it
    (``first_step`` is the index of ``times[0]``), the medians before and after and their
    ratio; None where the steps kept one speed. The split is the one that leaves the steps
    closest to their side's median (least absolute deviations)."""
    n = len(times)
    if n < 2 * CHANGE_MIN_STEPS:
        return None
    splits = range(CHANGE_MIN_STEPS, n - CHANGE_MIN_STEPS + 1)
    stride = max(1, len(splits) // 100)  # a long run: a coarse pass, then around its best

    def cost(k: int) -> float:
        a, b = times[:k], times[k:]
        ma, mb = statistics.median(a), statistics.median(b)
        return sum(abs(x - ma) for x in a) + sum(abs(x - mb) for x in b)

    best = min(splits[::stride], key=cost)
    near = range(max(splits.start, best - stride), min(splits.stop, best + stride + 1))
    k = min(near, key=cost)
    before, after = statistics.median(times[:k]), statistics.median(times[k:])
    if before <= 0 or after <= 0:
        return None
    ratio = after / before
    if 1 / CHANGE_RATIO < ratio < CHANGE_RATIO:
        return None
    mid, slower = math.sqrt(before * after), ratio > 1
    kept = min(sum((x < mid) == slower for x in times[:k]) / k,
               sum((x > mid) == slower for x in times[k:]) / (n - k))
    if kept < CHANGE_SHARE:
        return None
    return {"at_step": first_step + k, "before_s": before, "after_s": after, "ratio": ratio}


def link_verdict(change: dict[str, Any], probes: dict[str, list[list[float]]],
                 probes_share_path: bool = True) -> dict[str, Any]:
    """``change`` with what the link probes measured on either side of it, each node's
    (``probes``: ``{node: [[steps at the probe's start, seconds], ...]}``), and the verdict:
    ``link`` (a link changed the same way, ``LINK_RATIO``), ``model`` (every link measured
    alike, ``LINK_SAME``) or ``unclear`` (no probes on both sides, or a change between).
    ``probes_share_path``: the run's collectives cross the network the probes do (CPU runs:
    every rank reaches the others at the addresses the nodes met on); where they may not
    (NCCL over InfiniBand or another interface), links that measured alike say nothing."""
    at = change["at_step"]
    links = {}
    for node, samples in probes.items():
        before = [s for steps, s in samples if steps < at]
        after = [s for steps, s in samples if steps >= at]
        if before and after:
            b, a = statistics.median(before), statistics.median(after)
            links[str(node)] = {"before_s": b, "after_s": a, "ratio": a / b,
                                "probes": [len(before), len(after)]}
    slower = change["ratio"] > 1
    moved = sorted(n for n, m in links.items()
                   if (m["ratio"] >= LINK_RATIO if slower else m["ratio"] <= 1 / LINK_RATIO))
    if moved:
        verdict = "link"
    elif (probes_share_path and links
          and all(1 / LINK_SAME < m["ratio"] < LINK_SAME for m in links.values())):
        verdict = "model"
    else:
        verdict = "unclear"
    return {**change, "links": links, "probe_bytes": PROBE_BYTES,
            "probes_share_path": probes_share_path, "verdict": verdict,
            "nodes": [int(n) for n in moved]}


class Nodes:
    """This node's place among the nodes of one plan, for the runner."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.group: NodeGroup | None = None
        self.lost: str | None = None
        """Why the nodes cannot meet any more (the runs left are recorded as not run)."""
        self.is_follower = any(c.topology.node_rank > 0 for c in plan.cases)
        """Rank 0 lives on another node; with ``--rdzv`` known once the nodes have met."""
        self.holds: str | None = None
        """What this node's folder holds from an earlier run it resumes: ``leader`` (the
        measurements), ``follower`` (a follower's records) or None (nothing)."""

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
                          node_rank=None if topo.rdzv else topo.node_rank, probe=True)
        try:
            group.join(plan.settings(), self.holds)
            role = "follower" if group.node_rank > 0 else "leader"
            if self.holds is not None and self.holds != role:
                # Node 0 on a follower's records would take runs without figures as done;
                # a follower on the measurements would rewrite them as a follower's.
                held = ("the measurements" if self.holds == "leader"
                        else "a follower node's records")
                raise RendezvousError(
                    f"this node is node {group.node_rank} of the plan, but its folder "
                    f"{plan.out_dir} holds {held}: resume each node's own folder with --rdzv "
                    "(the node with the measurements becomes node 0)")
        except RendezvousError as exc:
            self.lost = str(exc)
            group.close()
            if self.holds is not None:
                # Never met again: the folder keeps the role it had, so a follower's records
                # are not rewritten as a leader's.
                self.is_follower = self.holds == "follower"
            else:
                self.is_follower = group.rank_as_far_as_known() > 0
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

    def watch(self, meeting: str, probe: bool) -> RunWatch:
        """Watch the network while launch ``meeting`` runs (``RunWatch``); ``probe``: node 0
        probes the other nodes' links too."""
        return RunWatch(self.group, meeting, probe)

    def agree(self, meeting: str, here: outcome.Outcome, failed: dict[int, dict],
              wait_s: float) -> outcome.Outcome:
        """Tell the other nodes how this node's part ended and hear theirs (waiting ``wait_s``
        at most, as at a meeting): one outcome on every node, the cause first wherever it
        happened. A node whose own part failed waits ``FAILED_HEAR_S`` at most; one whose own
        link is down waits that long for it to come back before it tells (the store lies
        across it), and keeps its own outcome where it does not."""
        group = self.group
        if here.status != "ok":
            wait_s = min(wait_s, FAILED_HEAR_S)
        deadline = time.monotonic() + wait_s
        iface = interface_of(group.local_addr)
        while (state := link_state(iface)) is not None and state.down:
            if time.monotonic() > deadline:
                return outcome.Outcome(
                    "failed" if here.status == "ok" else here.status,
                    f"{here.error or here.status}; the other nodes were not told how this "
                    f"node's part ended: its link is still down ({state.text()})", here.cause,
                    unreachable=here.unreachable)
            time.sleep(BEAT_S)
        try:
            group.tell(meeting, {"status": here.status, "error": here.error,
                                 "cause": here.cause, "retry": here.retry,
                                 "unreachable": here.unreachable})
            heard = group.hear(meeting, max(deadline, time.monotonic() + 1.0))
        except RendezvousError as exc:
            self.lost = f"the nodes lost each other after {meeting}: {exc}"
            text = "; ".join(filter(None, (here.error, str(exc))))
            if not here.cause:
                text += " (a peer node stopped or its network failed)"
            return outcome.Outcome("failed" if here.status == "ok" else here.status, text,
                                   here.cause, unreachable=here.unreachable)
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
