"""One run's launches: where its processes listen, the environment they start with, the
launcher followed to its end, the run's outcome agreed with the other nodes, and a fresh start
on new ports when another process took one of them before the run's own processes bound it
(``MAX_ATTEMPTS`` in all). Imports no framework."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import outcome, protocol
from .backends import ports
from .backends.base import Backend, Cluster, LaunchRequest
from .backends.spawn import PORTS_PER_RUN
from .config import LOADER_PYTHON_ENV, LOCAL_WORLD_ENV, Measure
from .node_agreement import Nodes, RunWatch, finding_text, link_verdict, step_change
from .plan_model import Case, device_kind
from .procs import POLL_S, EventTail, kill_tree, log_tail
from .progress import Progress
from .protocol import LAUNCHED_AT_ENV, End, Eval, Event, ProtocolError, RunSpec, Step
from .rendezvous import RendezvousError
from .run_energy import RunEnergy, RunMeter
from .stall import StallSizing

MAX_ATTEMPTS = 3
"""Launches of one run at most: a run whose ports were taken by another process before its own
processes bound them (``ports``) starts again on fresh ones, twice at most."""


@dataclass
class Watched:
    """What one launch of a run left: its events, the warnings they raised, how it ended."""

    seen: list[Event] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    timed_out: bool = False
    stalled: bool = False
    """Stopped for going ``stall_limit_s`` without a step (``timed_out`` too)."""
    stall_limit_s: float | None = None
    """The stall limit the launch was last under before its steps ended (``stall``); None
    where none applied."""
    link_limit_s: float = 0.0
    """Several nodes: how long this node's own link could stay down before its ranks were
    stopped, when the launch ended."""
    peers_failed: dict[int, dict] = field(default_factory=dict)
    """Several nodes: the other nodes whose part failed while this one ran."""
    link_down: bool = False
    """Several nodes: stopped because this node's own link stayed down (``link_limit_s``)."""
    finding: dict | None = None
    """Several nodes: what went wrong with the network, as this node saw it when the launch
    ended (``RunWatch.finding``)."""
    probes: dict[int, list] | None = None
    """Several nodes, node 0: its probes of each other node's link (``RunWatch.probes``)."""
    returncode: int | None = None


@dataclass
class Launched:
    """A run's last launch and what came before it."""

    here: outcome.Outcome
    """How the run ended, agreed with the other nodes."""
    seen: list[Event]
    warnings: list[str]
    returncode: int | None
    retries: list[dict] = field(default_factory=list)
    """Each attempt given up before the last: its number, reason, error and folder."""
    probes: dict[int, list] | None = None
    """Several nodes: node 0's link probes (empty elsewhere); None on one node."""
    probes_share_path: bool = True
    """The run's collectives cross the network the probes do (``link_verdict``)."""
    nodes_lost: bool = False
    """The nodes could not meet for it (nothing launched)."""
    energy: RunEnergy | None = None
    """A timed run: its boards' energy over its window (``run_energy``)."""
    stall_limit_s: float | None = None
    """The stall limit the run ran under (``Watched.stall_limit_s``)."""

    def record(self, run: int, run_dir: Path) -> dict:
        """The run's record (``results.run_record``) with what its launches add: on several
        nodes, the node that became unreachable, node 0's link probes, and a lasting change of
        the step time with what the probes say of it (``node_agreement.link_verdict``)."""
        from .results import run_record

        record = run_record(run, self.seen, self.here.status, self.here.error, self.returncode)
        record["stall_timeout_s"] = self.stall_limit_s
        if self.here.unreachable is not None:
            record["unreachable"] = self.here.unreachable
        if self.here.status != "ok" and (self.nodes_lost or (self.probes is not None and (
                self.here.unreachable is not None
                or (not self.here.cause and outcome.is_lost_peer(self.here.error))))):
            # Failed because a node went away, not for anything of the work's own: a resumed
            # plan runs it again (``Runner._done_runs``).
            record["nodes_lost"] = True
        if self.probes is not None:
            probes = {str(n): samples for n, samples in sorted(self.probes.items())}
            if probes:
                record["link_probes"] = probes
            change = step_change(record["step_times_s"],
                                 len(record["warmup_step_times_s"]))
            if change is not None:
                record["step_change"] = link_verdict(change, probes, self.probes_share_path)
        warnings = list(self.warnings)
        if self.here.status == "ok" and self.returncode not in (0, None):
            warnings.append(f"processes exited with code {self.returncode} after the "
                            f"measurement: {log_tail(run_dir / 'worker.log', 3)}")
        if self.here.retry is not None:
            warnings.append(f"gave up after {MAX_ATTEMPTS} attempts, each stopped by a taken "
                            f"port ({self.here.retry})")
        record["warnings"] += warnings
        if self.retries:
            record["retries"] = self.retries
        if self.energy is not None:
            record.update(self.energy.fields(record["window_samples"]))
        return record


def keep_attempt(run_dir: Path, attempt: int) -> str:
    """Move what an attempt given up wrote (its events, every process's output, its ports)
    into ``attempt-N/`` of the run's folder, out of the next attempt's way; the folder's name."""
    keep = run_dir / f"attempt-{attempt}"
    keep.mkdir(exist_ok=True)
    for path in run_dir.iterdir():
        if path.is_file() and path.name != "spec.json":
            path.replace(keep / path.name)
    return keep.name


class RunLauncher:
    """Launches the runs of one plan: each as the backend's launcher subprocess in the
    framework's environment, its events copied into the folder's stream (``append``) as they
    come, tagged with the run."""

    def __init__(self, backend: Backend, python: str, nodes: Nodes, out: Path,
                 append: Callable[[dict], None], progress: Progress) -> None:
        self.backend, self.python, self.nodes, self.out = backend, python, nodes, out
        self.append = append
        self.progress = progress
        self.pythonpath: str | None = None
        """A backend in its own environment gets this trainperf, and nothing else of
        trainperf's environment, through this folder."""

    def launch(self, case: Case, run_dir: Path, spec: RunSpec, label: str,
               tags: dict, energy: bool = False,
               known_step_s: tuple[float, ...] = ()) -> Launched:
        """The run, started again on fresh ports after a port was taken, ``MAX_ATTEMPTS`` in
        all; failed, without a launch, where the nodes could not meet for it. ``energy``: read
        its boards' energy over its window (a timed run). ``known_step_s``: the case's step
        times so far, which size its stall limit."""
        retries: list[dict] = []
        while True:
            attempt = len(retries) + 1
            try:
                done = self._attempt(case, run_dir, spec, label, tags, attempt, energy,
                                     known_step_s)
            except RendezvousError as exc:
                done = failed_to_meet(exc)
            if done.here.retry is None or attempt == MAX_ATTEMPTS:
                done.retries = retries
                return done
            given_up = {"attempt": attempt, "reason": done.here.retry,
                        "error": outcome.one_line(done.here.error),
                        "folder": str(run_dir.relative_to(self.out) / keep_attempt(run_dir,
                                                                                attempt))}
            retries.append(given_up)
            self.append({"event": "run_retry", "t": time.time(), **tags, **given_up})

    def _ports(self, case: Case, meeting: str) -> tuple[Cluster, ports.Reservation | None, str]:
        """Where this attempt's processes listen: the ports the nodes published when they met
        (held by the node group until the next meeting), or, on one node, ports reserved here
        for the attempt. Returns the cluster, the reservation this method made (to release
        after the attempt) and the address the ports are on."""
        topo = case.topology
        if topo.nnodes > 1:
            cluster = self.nodes.meet(topo, meeting)
            return cluster, None, self.nodes.group.local_addr
        held = ports.reserve(PORTS_PER_RUN + topo.devices_per_node, ports.LOOPBACK)
        return (Cluster(0, topo.devices_per_node, (ports.LOOPBACK,), (held.ports,)), held,
                ports.LOOPBACK)

    def _attempt(self, case: Case, run_dir: Path, spec: RunSpec, label: str, tags: dict,
                 attempt: int, energy: bool = False,
                 known_step_s: tuple[float, ...] = ()) -> Launched:
        """One launch of the run, watched to its end: its outcome, agreed with the other nodes
        where there are some."""
        measure = spec.measure
        worker_events, log_path = run_dir / "events.jsonl", run_dir / "worker.log"
        worker_events.unlink(missing_ok=True)
        # What the nodes call this attempt when they meet: each attempt meets afresh.
        meeting = run_dir.name if attempt == 1 else f"{run_dir.name}-attempt{attempt}"
        cluster, held, addr = self._ports(case, meeting)
        topo = case.topology
        stall = StallSizing(measure, list(known_step_s), sized=spec.train is None)
        watch = None
        # The boards' counters are read from before the launch until the window is known:
        # on several nodes, until node 0 has told it, after the outcome's agreement.
        meter = RunMeter(topo, energy)
        try:
            cluster_path = run_dir / "cluster.json"
            cluster_path.write_text(cluster.to_json(), encoding="utf-8")
            launch = self.backend.launch(LaunchRequest(
                self.python, case.topology, spec.tuning, run_dir / "spec.json",
                worker_events, cluster, cluster_path, run_dir.resolve()))
            env = self._env(case, spec, run_dir, launch.env)
            if attempt > 1:
                tags = {**tags, "attempt": attempt}
            self.progress.run_started(label, measure.iters)
            if self.nodes.group is not None:
                watch = self.nodes.watch(meeting, probe=True)
            meter.start(env)
            done = self._watch(launch.argv, env, worker_events, log_path, tags, measure,
                               watch, stall, topo.rdzv_timeout_s)
            # Every line is in the folder's stream now, tagged with its run: one copy is kept.
            worker_events.unlink(missing_ok=True)
            here = self._outcome(done, log_path, measure, done.link_limit_s, watch)
            own = (held.ports if held else cluster.ports[cluster.node_rank])
            here = outcome.with_port_retry(here, done.seen, lambda: ports.taken(own, addr))
        except BaseException:
            meter.stop()
            raise
        finally:
            if held is not None:
                held.release()
            if watch is not None:
                watch.stop()
        try:
            if self.nodes.group is not None:
                here = self.nodes.agree(meeting, here, done.peers_failed, topo.rdzv_timeout_s)
            used = meter.settle(done.seen, here.status == "ok", self.nodes.group, meeting)
        finally:
            meter.stop()
        # On a CPU every rank reaches the others at the addresses the nodes met on, which the
        # probes cross too; NCCL may take InfiniBand or another interface.
        return Launched(here, done.seen, done.warnings, done.returncode, probes=done.probes,
                        probes_share_path=device_kind(topo.device) == "cpu", energy=used,
                        stall_limit_s=done.stall_limit_s)

    def _outcome(self, done: Watched, log_path: Path, measure: Measure, link_limit_s: float,
                 watch: RunWatch | None) -> outcome.Outcome:
        """How this node's part ended, from its events, exits and output, and on several nodes
        from what it saw of the network: a link that went down or a node gone silent leads
        the error, naming the node and the step."""
        here = self._own_outcome(done, log_path, measure,
                                 watch.node0_steps if watch is not None else None)
        found = done.finding
        if found is None:
            return here
        said = finding_text(found, self.nodes.group.node_rank)
        if here.status == "ok":
            done.warnings.append(f"{said}; the run went on")
            return here
        if done.link_down:
            stacks = outcome.stacks_at_stop(done.seen)
            error = (f"{said}; its ranks were stopped after {link_limit_s:g} s without it"
                     + (f"; where each rank was: {stacks}" if stacks else ""))
            return outcome.Outcome("failed", error, True, unreachable=found)
        if found["link_down"]:
            return outcome.Outcome("failed", f"{said}; then {here.error}", True,
                                   unreachable=found)
        return dataclasses.replace(here, error=f"{said}; then {here.error}", unreachable=found)

    def _own_outcome(self, done: Watched, log_path: Path, measure: Measure,
                     rank0_steps: int | None) -> outcome.Outcome:
        """How this node's part ended, from its events, exits and output alone (and, on a
        node without rank 0, rank 0's steps as node 0 told them)."""
        follower = self.nodes.is_follower
        here = outcome.decide(done.seen, done.timed_out, has_rank0=not follower,
                              memory_capped=measure.memory_limit_bytes is not None,
                              stalled_s=done.stall_limit_s if done.stalled else None,
                              rank0_steps=rank0_steps)
        if follower and here.status == "failed" and here.error is None and done.returncode == 0:
            # Rank 0 is on another node: a clean exit is all this node can report.
            return outcome.Outcome("ok", None)
        if here.status == "failed" and here.error is None and done.peers_failed:
            return outcome.Outcome("failed", "its ranks were stopped when another node's part "
                                             "failed")
        if here.status == "failed" and here.error is None:
            words = outcome.last_words(log_path)
            return outcome.Outcome("failed", " | ".join(words) if words else
                                   f"launcher exited with code {done.returncode}", bool(words))
        return here

    def _env(self, case: Case, spec: RunSpec, run_dir: Path,
             launch_env: dict[str, str]) -> dict[str, str]:
        """The environment every process of the run starts with."""
        # Every process of the run inherits the tag, helpers such as a parameter server
        # included, so what a run left behind can be found. The fault handler prints where
        # Python was when a process dies of a signal, into that process's own output file.
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
                   TRAINPERF_RUN_ID=str(run_dir.resolve()), **launch_env)
        # Real data in a framework's own environment: its loader processes run this
        # interpreter, which has the decoders (``data.feed``), and share this node's cores.
        env.update({LOADER_PYTHON_ENV: sys.executable,
                    LOCAL_WORLD_ENV: str(case.topology.devices_per_node)})
        if spec.measure.threads:
            env["OMP_NUM_THREADS"] = str(spec.threads)  # asked for: over the caller's own
        else:
            env.setdefault("OMP_NUM_THREADS", str(spec.threads))
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        if case.topology.nnodes > 1:
            env.update(self.nodes.env(case.topology))
        return env

    def _watch(self, argv: list[str], env: dict[str, str], worker_events: Path,
               log_path: Path, tags: dict, measure: Measure, watch: RunWatch | None,
               sizing: StallSizing, rdzv_timeout_s: float) -> Watched:
        """Start the launcher and follow its events until it ends, its time is up, it has gone
        its stall limit (``sizing``, node 0's on a node without rank 0) without a step after
        its first (on a node without rank 0: without rank 0's steps moving, as node 0's beats
        tell them), another node's part of the run has failed, or this node's own link has
        been down for as long as the stall limit, or ``rdzv_timeout_s`` without one."""
        tail = EventTail(worker_events)
        done = Watched()
        deadline = time.monotonic() + measure.timeout_s
        # A profiled run reports its profiled steps together, after them: only the timeout.
        profiled = bool(tags.get("profile"))
        follower = self.nodes.is_follower
        # What holds until the first look at the run (one that ends before it keeps them).
        done.link_limit_s = sizing.limit_s() or rdzv_timeout_s
        done.stall_limit_s = None if profiled else sizing.limit_s()
        with open(log_path, "wb") as log:
            # Where every rank's start-up counts from (``End.startup_s``).
            env = {**env, LAUNCHED_AT_ENV: repr(time.time())}
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                progressed, last_step, steps, moves, ended = 0, None, 0, 0, False
                while True:
                    exited = proc.poll() is not None
                    self._take(tail.read(), done, tags)
                    if exited:
                        break
                    if len(done.seen) > progressed:
                        new = done.seen[progressed:]
                        progressed = len(done.seen)
                        steps += sum(isinstance(e, Step) for e in new)
                        moves += sum(isinstance(e, (Step, Eval)) for e in new)
                        sizing.saw(new)
                        if any(isinstance(e, (Step, Eval)) for e in new):
                            last_step = time.monotonic()
                        if any(isinstance(e, End) for e in new):
                            ended = True  # measured: what is left is leaving
                    limit = sizing.limit_s()
                    if watch is not None:
                        watch.steps, watch.progress, watch.ended = steps, moves, ended
                        watch.stall_s = limit
                        if follower:
                            # Rank 0's steps are node 0's to see; its beats carry them here,
                            # and the limit node 0 sized from them.
                            last_step = watch.node0_advanced_at
                            ended = watch.node0_ended
                            if watch.node0_stall_s is not None:
                                limit = watch.node0_stall_s
                    # A node's ranks wait on an unreachable peer until their collective's
                    # timeout, or until the stall limit: a node whose own link is down waits
                    # as long for it to come back before it stops them.
                    done.link_limit_s = limit or rdzv_timeout_s
                    stall = None if profiled or ended else limit
                    if stall is not None:
                        done.stall_limit_s = stall
                    done.stalled = (stall is not None and last_step is not None
                                    and time.monotonic() - last_step > stall)
                    if watch is not None and not done.stalled:
                        done.peers_failed = dict(watch.failed)
                        done.link_down = watch.link_down_s() > done.link_limit_s
                    if time.monotonic() > deadline or done.stalled:
                        done.timed_out = True
                    if done.timed_out or done.peers_failed or done.link_down:
                        # Another node's failed part, or a link down, leaves this node's ranks
                        # waiting on a lost peer until a collective gives up: the run has
                        # failed already. What the network looked like is taken first.
                        done.finding = watch.finding() if watch is not None else None
                        kill_tree(proc)
                        self._take(tail.read(), done, tags)
                        break
                    time.sleep(POLL_S)
                if exited and watch is not None:
                    done.finding = watch.finding()
                    if proc.returncode == 0 and done.finding is None:
                        watch.steps = sum(isinstance(e, Step) for e in done.seen)
                        watch.closing_probe()  # the link as the steps left it
            except BaseException:
                kill_tree(proc)  # Ctrl-C: leave no process behind; what was read is kept
                self._take(tail.read(), done, tags)
                raise
        if watch is not None:
            done.probes = {n: list(p) for n, p in watch.probes.items()}
        done.returncode = proc.returncode
        return done

    def _take(self, new: list[dict], done: Watched, tags: dict) -> None:
        steps = 0
        for raw in new:
            self.append({**raw, **tags})  # kept as written, even if malformed
            try:
                event = protocol.decode(raw)
            except ProtocolError as exc:
                done.warnings.append(f"worker broke the protocol ({exc}); the event was "
                                     "ignored")
                continue
            done.seen.append(event)
            if isinstance(event, Step):
                steps += 1
        if steps:
            self.progress.steps_done(steps)


def failed_to_meet(exc: RendezvousError) -> Launched:
    """A run whose nodes could not meet: failed, nothing launched."""
    return Launched(outcome.Outcome("failed", str(exc)), [], [], None, nodes_lost=True)
