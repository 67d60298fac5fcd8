"""Plans the case matrix, runs each (case, run) as its own launcher subprocess, and records it.

The runner imports no framework. It reads the events a run's workers write (``protocol``),
copies them into the output folder's ``events.jsonl`` as they arrive (so a killed runner loses
nothing measured), decides each run's status and rewrites ``results.json`` after every run. A
crash, an out-of-memory and a timeout are results; the matrix goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from . import breakdown, envs, mode_choice, outcome, protocol, results
from .backends import get_backend, ports
from .backends.base import COLLECTIVE_TIMEOUT_ENV, Cluster, LaunchRequest
from .backends.spawn import PORTS_PER_RUN, endpoint as endpoint_text
from .config import (LOADER_PYTHON_ENV, LOCAL_WORLD_ENV, MODE_BEST, AlignSpec, DataSpec,
                     Measure, ProfileSpec, Topology, TrainSpec, Tuning, Workload)
from .env import host_env
from .procs import POLL_S, EventTail, cpu_threads_per_process, kill_tree, log_tail
from .progress import Progress, QuietProgress
from .protocol import (LAUNCHED_AT_ENV, End, Eval, Event, Phases, ProtocolError, RunSpec,
                       Start, Step)
from .rendezvous import NodeGroup, RendezvousError, interface_of

PEER_POLL_S = 1.0
"""Several nodes: how often a running node looks whether another node's part of the run has
failed (its own ranks would then wait on the lost peer)."""
MAX_ATTEMPTS = 3
"""Launches of one run at most: a run whose ports were taken by another process before its own
processes bound them (``ports``) starts again on fresh ones, twice at most."""
FAILED_HEAR_S = 10.0
"""Several nodes: how long a node whose own part failed waits to hear the others (a peer
whose rank died tells within seconds; one that died whole never will). A node whose part
succeeded waits ``--rdzv-timeout``, as the others may still be finishing theirs."""


@dataclass
class Watched:
    """What one launch of a run left: its events, the warnings they raised, how it ended."""

    seen: list[Event] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    timed_out: bool = False
    stalled: bool = False
    """Stopped for going ``Measure.stall_timeout_s`` without a step (``timed_out`` too)."""
    peers_failed: dict[int, dict] = field(default_factory=dict)
    """Several nodes: the other nodes whose part failed while this one ran."""
    returncode: int | None = None


@dataclass
class Attempt:
    """One launch of a run and its outcome (agreed with the other nodes)."""

    here: outcome.Outcome
    seen: list[Event]
    warnings: list[str]
    returncode: int | None
    retry: str | None
    """Why the run should start again on fresh ports (``outcome.with_port_retry``), or None."""


def keep_attempt(run_dir: Path, attempt: int) -> str:
    """Move what an attempt given up wrote (its events, every process's output, its ports)
    into ``attempt-N/`` of the run's folder, out of the next attempt's way; the folder's name."""
    keep = run_dir / f"attempt-{attempt}"
    keep.mkdir(exist_ok=True)
    for path in run_dir.iterdir():
        if path.is_file() and path.name != "spec.json":
            path.replace(keep / path.name)
    return keep.name


@dataclass(frozen=True)
class Case:
    topology: Topology
    batch_size: int

    @property
    def key(self) -> results.CaseKey:
        return results.CaseKey(self.topology.nnodes, self.topology.devices_per_node,
                               self.batch_size)


@dataclass
class Plan:
    recipe: str
    workload: Workload
    measure: Measure
    cases: list[Case]
    out_dir: Path
    tuning: Tuning = field(default_factory=Tuning)
    model: str | None = None
    """The model's key in DLPerf's tables and exports (``r100``, ``y1``, ``r50``, ``rn50``)."""
    framework: str = "torch"
    """The backend that runs it (``trainperf.backends``)."""
    align: AlignSpec | None = None
    """Alignment: the start every run loads its weights and batches from, its dtype and where
    it writes its steps (``RunSpec.align``)."""
    data: DataSpec | None = None
    """Real data: the RecordIO dataset and loader every run reads (None: synthetic)."""
    data_role: str = "synthetic"
    """``real``; ``synthetic`` (a plain run); ``synthetic baseline`` (the compute-only twin of a
    real-data plan, which the report sets beside it)."""
    train: TrainSpec | None = None
    """Train to a verification accuracy instead of timing a fixed number of steps; each run
    keeps its checkpoints in its own folder, so ``--resume`` goes on from them."""
    variant: str | None = None
    """What sets this plan apart in a training matrix (``mp fp32``, ``pfc0.1 bf16``)."""
    profile_steps: int | None = None
    """``--breakdown``: after each case's timed runs, one profiled run of this many steps
    (``RunSpec.profile``), kept apart from the runs; None: none. Not a setting of the runs
    (``settings``): a folder measured without it can be resumed with it."""
    trace: bool = False
    """``--trace``: the profiled run also writes the framework's trace into its folder."""

    def data_record(self) -> dict[str, Any]:
        """What the results say of the data: its source, and the loader settings asked for."""
        if self.data is None:
            return {"source": "synthetic", "role": self.data_role}
        return {"source": "recordio", "role": self.data_role, **self.data.to_dict()}

    def settings(self) -> dict[str, Any]:
        """Every setting that changes a run's work or limits; a folder's runs all share them."""
        topo = self.cases[0].topology
        data = {} if self.data_role == "synthetic" else {"data": self.data_record()}
        if self.train is not None:
            data["train"] = self.train.to_dict()
        if self.align is not None:
            data["align"] = self.align.to_dict()
        return {"recipe": self.recipe, "framework": self.framework, **data,
                "workload": self.workload.to_dict(),
                "measure": self.measure.to_dict(), "tuning": self.tuning.to_dict(),
                "device": topo.device, "nnodes": topo.nnodes,
                "cases": [[c.topology.devices_per_node, c.batch_size] for c in self.cases]}


def plan_cases(devices: list[int], batch_sizes: list[int], base: Topology) -> list[Case]:
    """Every (batch, devices) pair, batches outermost so each batch's 1-device base runs first."""
    return [Case(replace(base, devices_per_node=d), b) for b in batch_sizes for d in devices]


def device_kind(device: str) -> str:
    """``cpu`` or ``cuda``: where a run asked for as ``auto``, ``cuda`` or ``cpu`` goes (auto: a
    GPU where this machine has one)."""
    if device == "auto":
        from .env import gpu_count

        return "cuda" if gpu_count() else "cpu"
    return device


def check_plan(plan: Plan) -> None:
    """ValueError, in one line, when the plan's backend does not run one of its cases (its
    declaration, ``Backend.capabilities``): refused before anything starts."""
    backend = get_backend(plan.framework)
    kind = device_kind(plan.cases[0].topology.device)
    for case in plan.cases:
        backend.check(plan.workload.replace(batch_size=case.batch_size), case.topology,
                      plan.tuning, kind, train=plan.train is not None,
                      real_data=plan.data is not None)


def multinode_env(topo: Topology, group: NodeGroup | None) -> dict[str, str]:
    """What every process of a multi-node run is told beyond its rank."""
    env = {COLLECTIVE_TIMEOUT_ENV: f"{topo.rdzv_timeout_s:g}"}
    # Gloo binds to what the hostname resolves to, which on many clusters (and in network
    # namespaces) is not the network the nodes met on.
    iface = interface_of(group.local_addr) if group else None
    if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = iface
    return env


def interleave(runners: list["Runner"], resume: list[bool]) -> list[dict]:
    """Run several plans turn by turn, one run each, so that a slow spell of a shared machine
    falls on all of them alike (the real-data runs and their synthetic twin are compared run
    against run). Every plan is checked before the first run starts."""
    live = [r.run_steps(again) for r, again in zip(runners, resume)]
    while live:
        for s in list(live):
            if next(s, StopIteration) is StopIteration:
                live.remove(s)
    return [r.write_results() for r in runners]


class Runner:
    def __init__(self, plan: Plan, progress: Progress | None = None) -> None:
        self.plan = plan
        self.progress = progress or QuietProgress()
        self.out = plan.out_dir
        self.events_path = self.out / "events.jsonl"
        self.records: dict[tuple[str, int], list[dict]] = {}
        self.breakdowns: dict[tuple[str, int], dict] = {}
        """Each case's profiled run, summarized (``breakdown.summarize``)."""
        self.probes: dict[tuple[str, int], dict] = {}
        """``--mode best``: each case's probe of the framework's modes (``mode_choice``)."""
        self.start_events: dict[tuple[str, int], Start] = {}
        self.env: dict[str, Any] = {}
        self.is_follower = any(c.topology.node_rank > 0 for c in plan.cases)
        """Rank 0 lives on another node; with ``--rdzv`` known once the nodes have met."""
        self.group: NodeGroup | None = None
        self.group_lost: str | None = None
        """Why the nodes cannot meet any more (the runs left are recorded as not run)."""
        self.backend = get_backend(plan.framework)
        check_plan(plan)
        self.python = envs.interpreter(plan.framework)
        self.pythonpath: str | None = None
        """A backend in its own environment gets this trainperf, and nothing else of trainperf's
        environment, through this folder (made once, when running starts)."""

    # -- bookkeeping ------------------------------------------------------------------------
    def _append_event(self, event: dict) -> None:
        with open(self.events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

    def _restore(self) -> None:
        """Take back finished runs from an earlier, interrupted ``run`` into the same folder."""
        results.uncompress_events(self.out)
        for line in results.event_lines(self.out):
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = (e.get("case"), e.get("batch"))
            if e.get("event") == "run_end":
                self.records.setdefault(key, []).append(e["record"])
            elif e.get("event") == "profile_end":
                self.breakdowns[key] = e["breakdown"]
            elif e.get("event") == "mode_probe":
                self.probes[key] = e["probe"]
            elif e.get("event") == "start" and key not in self.start_events and "probe" not in e:
                self.start_events[key] = protocol.decode(e)
            elif e.get("event") == "runner_start":
                self.env = e.get("env", {})

    def _check_same_plan(self) -> None:
        meta_path = self.out / "plan.json"
        meta = json.loads(json.dumps(self.plan.settings()))  # tuples as JSON has them
        if meta_path.exists():
            old = json.loads(meta_path.read_text(encoding="utf-8"))
            if old != meta:
                changed = sorted(k for k in meta.keys() | old.keys() if meta.get(k) != old.get(k))
                raise ValueError(f"{self.out} holds runs of another plan (differs in "
                                 f"{', '.join(changed)}); resume with the same options or use a "
                                 "new --out folder")
        else:
            results.write_json_atomic(meta_path, meta)

    def write_results(self) -> dict:
        cases = []
        w = self.plan.workload
        for case in self.plan.cases:
            key = (case.key.name, case.batch_size)
            if key not in self.records:
                continue
            runs = sorted(self.records[key], key=lambda r: r["run"])
            cases.append(results.case_record(case.key, w.precision, runs,
                                             self.start_events.get(key),
                                             head=(w.num_classes, w.fc, w.sample_ratio)))
            if key in self.breakdowns:
                cases[-1]["breakdown"] = self.breakdowns[key]
            if key in self.probes:
                cases[-1]["mode_probe"] = self.probes[key]
        env = dict(self.env)
        if self.start_events:
            env.update(next(iter(self.start_events.values())).env)
        workload = self.plan.workload.to_dict()
        pfc_updates = {e.pfc_update for e in self.start_events.values()}
        if len(pfc_updates) == 1:
            workload["pfc_update_ran"] = pfc_updates.pop()
        doc = results.document(self.plan.recipe, workload, self.plan.measure.to_dict(), env,
                               cases, model=self.plan.model, tuning=self.plan.tuning.to_dict())
        doc["framework"] = self.plan.framework
        doc["data"] = self.plan.data_record()
        if self.plan.train is not None:
            doc["train"] = {**self.plan.train.to_dict(), "variant": self.plan.variant}
            doc["train"].pop("checkpoint_dir", None)
        inputs = [e.settings.get("input") for e in self.start_events.values()
                  if e.settings.get("input")]
        if inputs:
            doc["data"].update({k: v for k, v in inputs[0].items() if k != "source"})
        if self.is_follower:
            doc["role"] = "follower"  # rank 0 lives on node 0; this node only records exits
        results.write_json_atomic(self.out / "results.json", doc)
        return doc

    # -- running ----------------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict:
        for _ in self.run_steps(resume):
            pass
        return self.write_results()

    def run_steps(self, resume: bool = False) -> Iterator[None]:
        """The plan one run at a time: each ``next`` runs and records one more run, so that
        several runners can take turns (``interleave``). The folder and plan are checked now,
        before any runner's first turn."""
        self._prepare(resume)
        return self._each_run()

    def _prepare(self, resume: bool) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if not resume and results.has_events(self.out):
            raise ValueError(f"{self.out} already holds a run; pass --resume to finish it or "
                             "choose another --out")
        self._check_same_plan()
        if self.backend.env is not None:
            self.pythonpath = str(envs.package_link_dir(self.out / "runs"))
        if resume:
            self._restore()
        if not self.env:
            self.env = host_env()
            self._append_event({"event": "runner_start", "t": time.time(), "env": self.env})

    def _each_run(self) -> Iterator[None]:
        try:
            for case in self.plan.cases:
                key = (case.key.name, case.batch_size)
                runs = self.records.setdefault(key, [])
                # A training run that failed or was stopped goes on from its last checkpoint
                # on --resume; a throughput run that failed stays a result.
                done = {r["run"] for r in runs
                        if self.plan.train is None or r["status"] == "ok"}
                if self.plan.tuning.mode == MODE_BEST and key not in self.probes:
                    yield from self._probe(case, key)
                for run in range(1, self.plan.measure.runs + 1):
                    if run in done:
                        continue
                    record = self._run_one(case, run)
                    earlier = [r for r in runs if r["run"] == run]
                    if earlier:
                        record["earlier_attempts"] = [
                            {"status": r["status"], "error": r["error"]} for r in earlier]
                        runs[:] = [r for r in runs if r["run"] != run]
                    runs.append(record)
                    self.write_results()
                    yield
                if self.plan.profile_steps and key not in self.breakdowns:
                    self.breakdowns[key] = self._run_one(case, 0, profile=True)
                    self.write_results()
                    yield
        finally:
            if self.group is not None:
                self.group.close()

    def _probe(self, case: Case, key: tuple[str, int]) -> Iterator[None]:
        """``--mode best``: a short run of each mode the framework declares on the device, in
        alternating rounds (``mode_choice``); the choice is kept (a ``mode_probe`` event)
        before the case's timed runs, which then run in it. A mode the case is refused in is
        not probed; one whose probe fails is not chosen while another ran."""
        kind = device_kind(case.topology.device)
        workload = self.plan.workload.replace(batch_size=case.batch_size)
        modes = list(self.backend.modes_on(kind))
        refused = {}
        for mode in modes:
            why = self.backend.refusal(workload, case.topology,
                                       replace(self.plan.tuning, mode=mode), kind,
                                       train=self.plan.train is not None,
                                       real_data=self.plan.data is not None)
            if why:
                refused[mode] = why
        probed = [m for m in modes if m not in refused]
        rates: dict[str, list[float | None]] = {m: [] for m in probed}
        errors: dict[str, str] = {}
        if len(probed) > 1:
            for round_, mode in mode_choice.probe_order(probed):
                record = self._run_one(case, round_ + 1, probe=mode)
                rates[mode].append(record["samples_per_s"] if record["status"] == "ok"
                                   else None)
                if record["status"] != "ok":
                    errors[mode] = outcome.one_line(record["error"]) or record["status"]
                yield
        probe = mode_choice.choose(modes, rates, errors, refused)
        self.probes[key] = probe
        self._append_event({"event": "mode_probe", "t": time.time(), "case": key[0],
                            "batch": key[1], "probe": probe})

    def _tuning(self, key: tuple[str, int]) -> Tuning:
        """The speed settings a case's runs go with: under ``--mode best`` in the mode its
        probe chose."""
        if self.plan.tuning.mode == MODE_BEST:
            return replace(self.plan.tuning, mode=self.probes[key]["chosen"])
        return self.plan.tuning

    def _meet(self, case: Case, label: str) -> Cluster:
        """Meet the other nodes before this run (the first time, join them and learn this
        node's rank). RendezvousError when they cannot: that run, and every later one, is
        recorded as failed without starting."""
        if self.group_lost:
            raise RendezvousError(f"not run: {self.group_lost}")
        topo = case.topology
        if self.group is None:
            # By hand, node 0 hosts the store on the master port: every backend then learns
            # every node's address there, as after a rendezvous.
            endpoint = topo.rdzv or endpoint_text(topo.master_addr, topo.master_port)
            # The plans of a sweep meet one after another at the same endpoint: each its
            # own keys, or a later plan would read an earlier one's meeting.
            words = [self.plan.framework, self.plan.data_role, self.plan.variant or ""]
            group = NodeGroup(endpoint, topo.nnodes, topo.rdzv_timeout_s,
                              run_id="-".join(["trainperf", *" ".join(words).split()]),
                              node_rank=None if topo.rdzv else topo.node_rank)
            try:
                group.join(self.plan.settings())
            except RendezvousError as exc:
                self.group_lost = str(exc)
                group.close()
                raise
            self.group = group
            self.is_follower = group.node_rank > 0
        try:
            return self.group.meet(label, topo.devices_per_node,
                                   PORTS_PER_RUN + topo.devices_per_node)
        except RendezvousError as exc:
            self.group_lost = f"the nodes lost each other before {label}: {exc}"
            raise

    def _run_one(self, case: Case, run: int, profile: bool = False,
                 probe: str | None = None) -> dict:
        """Run ``run`` of ``case`` and return its record; with ``profile``, the case's profiled
        run instead (outside the runs), and return its breakdown; with ``probe`` (a mode),
        round ``run`` of the case's mode probe, short, outside the runs. A run whose ports
        were taken before its processes bound them starts again on fresh ports
        (``MAX_ATTEMPTS`` in all), and its record lists each attempt given up."""
        what = ("profile" if profile else f"probe {probe} {run}" if probe else f"run {run}")
        label = " ".join(filter(None, (self.plan.variant, case.key.name,
                                      f"b{case.batch_size} {what}")))
        name = ("profile" if profile else f"probe-{probe}-{run}" if probe else f"run{run}")
        run_dir = self.out / "runs" / f"{case.key.name}_b{case.batch_size}_{name}"
        run_dir.mkdir(parents=True, exist_ok=True)
        measure = self.plan.measure
        key = (case.key.name, case.batch_size)
        tuning = replace(self.plan.tuning, mode=probe) if probe else self._tuning(key)
        if probe:
            warmup, steps = mode_choice.probe_shape(measure.warmup, measure.window_steps)
            measure = replace(measure, runs=1, iters=warmup + steps, warmup=warmup)
        profile_spec = None
        if profile:
            steps = self.plan.profile_steps or ProfileSpec().steps
            profile_spec = ProfileSpec(steps, str((run_dir / "trace").resolve())
                                       if self.plan.trace else None)
            measure = replace(measure, runs=1, iters=measure.warmup + steps)
        train = self.plan.train
        if train is not None:
            train = train.replace(checkpoint_dir=str((run_dir / "checkpoints").resolve()))
        spec = RunSpec(self.plan.workload.replace(batch_size=case.batch_size), measure,
                       tuning, case.topology.device,
                       measure.threads or cpu_threads_per_process(case.topology.devices_per_node),
                       self.plan.align,
                       self.plan.data, train, profile_spec)
        results.write_json_atomic(run_dir / "spec.json", spec.to_dict())
        tags = {"case": case.key.name, "batch": case.batch_size, "run": run}
        if profile:
            tags["profile"] = True
        if probe:
            tags["probe"] = probe
        self._append_event({"event": "run_start", "t": time.time(), **tags})
        retries: list[dict] = []
        while True:
            attempt = len(retries) + 1
            try:
                done = self._attempt(case, run_dir, spec, label, tags, attempt)
            except RendezvousError as exc:
                record = results.run_record(run, [], "failed", str(exc))
                if retries:
                    record["retries"] = retries
                if profile:
                    return breakdown.summarize({}, record)
                if probe:
                    return record
                self._append_event({"event": "run_end", "t": time.time(), **tags,
                                    "record": record})
                self.progress.run_finished(label, record)
                return record
            if done.retry is None or attempt == MAX_ATTEMPTS:
                break
            given_up = {"attempt": attempt, "reason": done.retry,
                        "error": outcome.one_line(done.here.error),
                        "folder": str(run_dir.relative_to(self.out) / keep_attempt(run_dir,
                                                                                attempt))}
            retries.append(given_up)
            self._append_event({"event": "run_retry", "t": time.time(), **tags, **given_up})
        here, seen = done.here, done.seen
        record = results.run_record(run, seen, here.status, here.error, done.returncode)
        if here.status == "ok" and done.returncode != 0:
            done.warnings.append(f"processes exited with code {done.returncode} after the "
                                 f"measurement: {log_tail(run_dir / 'worker.log', 3)}")
        record["warnings"] += done.warnings
        if retries:
            record["retries"] = retries
        if done.retry is not None:
            record["warnings"].append(f"gave up after {MAX_ATTEMPTS} attempts, each stopped by "
                                      f"a taken port ({done.retry})")
        self.progress.run_finished(label, record)
        if profile:
            phases = next((e for e in seen if isinstance(e, Phases)), None)
            summary = breakdown.summarize(phases.to_dict() if phases else {}, record)
            summary["folder"] = str(run_dir.relative_to(self.out))
            if summary.get("trace"):  # the folder may move: where it lies inside it
                summary["trace"] = os.path.relpath(summary["trace"], self.out.resolve())
            self._append_event({"event": "profile_end", "t": time.time(), **tags,
                                "breakdown": summary})
            return summary
        if probe:
            return record  # the probe's figures are kept together, in its ``mode_probe``
        self._append_event({"event": "run_end", "t": time.time(), **tags, "record": record})
        return record

    def _ports(self, case: Case, meeting: str) -> tuple[Cluster, ports.Reservation | None, str]:
        """Where this attempt's processes listen: the ports the nodes published when they met
        (held by the node group until the next meeting), or, on one node, ports reserved here
        for the attempt. Returns the cluster, the reservation this method made (to release
        after the attempt) and the address the ports are on."""
        topo = case.topology
        if topo.nnodes > 1:
            cluster = self._meet(case, meeting)
            return cluster, None, self.group.local_addr
        held = ports.reserve(PORTS_PER_RUN + topo.devices_per_node, ports.LOOPBACK)
        return (Cluster(0, topo.devices_per_node, (ports.LOOPBACK,), (held.ports,)), held,
                ports.LOOPBACK)

    def _attempt(self, case: Case, run_dir: Path, spec: RunSpec, label: str, tags: dict,
                 attempt: int) -> "Attempt":
        """One launch of the run, watched to its end: its outcome, agreed with the other nodes
        where there are some. RendezvousError where the nodes could not meet for it."""
        measure = spec.measure
        worker_events, log_path = run_dir / "events.jsonl", run_dir / "worker.log"
        worker_events.unlink(missing_ok=True)
        # What the nodes call this attempt when they meet: each attempt meets afresh.
        meeting = run_dir.name if attempt == 1 else f"{run_dir.name}-attempt{attempt}"
        cluster, held, addr = self._ports(case, meeting)
        try:
            cluster_path = run_dir / "cluster.json"
            cluster_path.write_text(cluster.to_json(), encoding="utf-8")
            launch = self.backend.launch(LaunchRequest(
                self.python, case.topology, spec.tuning, run_dir / "spec.json",
                worker_events, cluster, cluster_path, run_dir.resolve()))
            env = self._run_env(case, spec, run_dir, launch.env)
            if attempt > 1:
                tags = {**tags, "attempt": attempt}
            self.progress.run_started(label, measure.iters)
            done = self._watch(launch.argv, env, worker_events, log_path, tags, measure,
                               meeting)
            # Every line is in the folder's stream now, tagged with its run: one copy is kept.
            worker_events.unlink(missing_ok=True)
            here = outcome.decide(done.seen, done.timed_out, has_rank0=not self.is_follower,
                                  memory_capped=measure.memory_limit_bytes is not None,
                                  stalled_s=measure.stall_timeout_s if done.stalled else None)
            if self.is_follower and here.status == "failed" and here.error is None and (
                    done.returncode == 0):
                # Rank 0 is on another node: a clean exit is all this node can report.
                here = outcome.Outcome("ok", None)
            if here.status == "failed" and here.error is None and done.peers_failed:
                here = outcome.Outcome("failed", "its ranks were stopped when another node's "
                                                 "part failed")
            if here.status == "failed" and here.error is None:
                words = outcome.last_words(log_path)
                here = outcome.Outcome("failed", " | ".join(words) if words else
                                       f"launcher exited with code {done.returncode}",
                                       bool(words))
            own = (held.ports if held else cluster.ports[cluster.node_rank])
            here = outcome.with_port_retry(here, done.seen, lambda: ports.taken(own, addr))
        finally:
            if held is not None:
                held.release()
        if self.group is not None:
            wait_s = case.topology.rdzv_timeout_s
            if here.status != "ok":
                wait_s = min(wait_s, FAILED_HEAR_S)
            here = self._agree(meeting, here, done.peers_failed, wait_s)
        return Attempt(here, done.seen, done.warnings, done.returncode, here.retry)

    def _run_env(self, case: Case, spec: RunSpec, run_dir: Path,
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
            env.update(multinode_env(case.topology, self.group))
        return env

    def _watch(self, argv: list[str], env: dict[str, str], worker_events: Path,
               log_path: Path, tags: dict, measure: Measure, meeting: str) -> "Watched":
        """Start the launcher and follow its events until it ends, its time is up, it has gone
        ``stall_timeout_s`` without a step after its first, or another node's part of the run
        has failed."""
        tail = EventTail(worker_events)
        done = Watched()
        deadline = time.monotonic() + measure.timeout_s
        # A profiled run reports its profiled steps together, after them: only the timeout.
        stall = None if tags.get("profile") else measure.stall_timeout_s
        next_look = time.monotonic() + PEER_POLL_S
        with open(log_path, "wb") as log:
            # Where every rank's start-up counts from (``End.startup_s``).
            env = {**env, LAUNCHED_AT_ENV: repr(time.time())}
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                progressed, last_step = 0, None
                while True:
                    exited = proc.poll() is not None
                    self._take(tail.read(), done.seen, done.warnings, tags)
                    if exited:
                        break
                    if len(done.seen) > progressed:
                        new = done.seen[progressed:]
                        progressed = len(done.seen)
                        if any(isinstance(e, (Step, Eval)) for e in new):
                            last_step = time.monotonic()
                        if any(isinstance(e, End) for e in new):
                            stall = None  # measured: what is left is leaving
                    done.stalled = (stall is not None and last_step is not None
                                    and time.monotonic() - last_step > stall)
                    if time.monotonic() > deadline or done.stalled:
                        done.timed_out = True
                        kill_tree(proc)
                        self._take(tail.read(), done.seen, done.warnings, tags)
                        break
                    if self.group is not None and time.monotonic() > next_look:
                        next_look = time.monotonic() + PEER_POLL_S
                        done.peers_failed = self._failed_peers(meeting)
                        if done.peers_failed:
                            # This node's ranks would wait on the lost peer until a collective
                            # gives up on it: the run has failed already.
                            kill_tree(proc)
                            self._take(tail.read(), done.seen, done.warnings, tags)
                            break
                    time.sleep(POLL_S)
            except BaseException:
                kill_tree(proc)  # Ctrl-C: leave no process behind; what was read is kept
                self._take(tail.read(), done.seen, done.warnings, tags)
                raise
        done.returncode = proc.returncode
        return done

    def _failed_peers(self, meeting: str) -> dict[int, dict]:
        """The other nodes that have told of a failed part of this run (none where the store is
        lost: the run's own collectives will tell)."""
        try:
            told = self.group.told(meeting)
        except RendezvousError:
            return {}
        return {n: o for n, o in told.items() if o.get("status") != "ok"}

    def _agree(self, meeting: str, here: outcome.Outcome, failed: dict[int, dict],
               wait_s: float) -> outcome.Outcome:
        """Tell the other nodes how this node's part ended and hear theirs (waiting ``wait_s``
        at most, as at a meeting): one outcome on every node, the cause first wherever it
        happened."""
        group = self.group
        try:
            group.tell(meeting, {"status": here.status, "error": here.error,
                                 "cause": here.cause, "retry": here.retry})
            heard = group.hear(meeting, time.monotonic() + wait_s)
        except RendezvousError as exc:
            self.group_lost = f"the nodes lost each other after {meeting}: {exc}"
            text = "; ".join(filter(None, (here.error, str(exc))))
            if not here.cause:
                text += " (a peer node stopped or its network failed)"
            return outcome.Outcome("failed" if here.status == "ok" else here.status, text,
                                   here.cause)
        heard.update(failed)
        return outcome.agree(group.node_rank, here, heard, group.nnodes, wait_s)

    def _take(self, new: list[dict], seen: list[Event], warnings: list[str], tags: dict) -> None:
        steps = 0
        for raw in new:
            self._append_event({**raw, **tags})  # kept as written, even if malformed
            try:
                event = protocol.decode(raw)
            except ProtocolError as exc:
                warnings.append(f"worker broke the protocol ({exc}); the event was ignored")
                continue
            seen.append(event)
            if isinstance(event, Start) and "probe" not in tags:
                self.start_events.setdefault((tags["case"], tags["batch"]), event)
            elif isinstance(event, Step):
                steps += 1
        if steps:
            self.progress.steps_done(steps)
