"""Runs a plan: each (case, run) as its own launcher subprocess, and records it.

The runner imports no framework. It reads the events a run's workers write (``protocol``),
copies them into the output folder's ``events.jsonl`` as they arrive (so a killed runner loses
nothing measured), decides each run's status and rewrites ``results.json`` after every run. A
crash, an out-of-memory and a timeout are results; the matrix goes on. What it leans on has
rooms of its own: the plan (``plan_model``), one run's launches and retries (``attempts``), the
nodes' agreement (``node_agreement``), the mode probe (``mode_probe``) and what each kind of
launch is for (``run_kinds``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from . import breakdown, envs, protocol, results, stall
from .attempts import RunLauncher
from .backends import get_backend
from .env import host_env
from .mode_probe import PlanModes, SharedChoice
from .node_agreement import Nodes
from .plan_model import Case, Plan, check_plan, device_kind, plan_cases
from .procs import cpu_threads_per_process
from .progress import Progress, QuietProgress
from .rendezvous import RendezvousError
from .result_files import RESULTS, role_of
from .protocol import Event, Phases, RunSpec, Start
from .run_kinds import ProbeRound, ProfiledRun, RunKind, TimedRun

__all__ = ["Case", "Plan", "Runner", "check_plan", "device_kind", "interleave", "plan_cases",
           "shared_choices"]


def shared_choices(plans: list[Plan]) -> list[SharedChoice | None]:
    """For each plan, the mode decision it shares with the plans of its mode group (None: its
    own)."""
    groups: dict[str, SharedChoice] = {}
    return [groups.setdefault(p.mode_group, SharedChoice()) if p.mode_group else None
            for p in plans]


def interleave(runners: list["Runner"], resume: list[bool]) -> list[dict]:
    """Run several plans turn by turn, one run each, so that a slow spell of a shared machine
    falls on all of them alike (the real-data runs and their synthetic twin are compared run
    against run). Every plan is checked before the first run starts. A plan waiting for its
    group's mode probe, which another plan runs, passes its turns until it is decided."""
    live = [r.run_steps(again) for r, again in zip(runners, resume)]
    while live:
        for s in list(live):
            if next(s, StopIteration) is StopIteration:
                live.remove(s)
    return [r.write_results() for r in runners]


class Runner:
    def __init__(self, plan: Plan, progress: Progress | None = None,
                 shared: SharedChoice | None = None) -> None:
        self.plan = plan
        self.progress = progress or QuietProgress()
        self.out = plan.out_dir
        self.events_path = self.out / "events.jsonl"
        self.records: dict[tuple[str, int], list[dict]] = {}
        self.breakdowns: dict[tuple[str, int], dict] = {}
        """Each case's profiled run, summarized (``breakdown.summarize``)."""
        self.start_events: dict[tuple[str, int], Start] = {}
        self.env: dict[str, Any] = {}
        self.backend = get_backend(plan.framework)
        check_plan(plan)
        self.modes = PlanModes(plan, self.backend, shared)
        self.nodes = Nodes(plan)
        self.resuming = False
        # The environment is checked here, with the plan, before any plan's run starts: a
        # CUDA run never goes on with a CPU build.
        python = envs.interpreter(plan.framework, device_kind(plan.cases[0].topology.device))
        self.launcher = RunLauncher(self.backend, python, self.nodes, self.out,
                                    self._append_event, self.progress)

    @property
    def is_follower(self) -> bool:
        """Rank 0 lives on another node (with ``--rdzv`` known once the nodes have met)."""
        return self.nodes.is_follower

    # -- bookkeeping ------------------------------------------------------------------------
    def _append_event(self, event: dict) -> None:
        with open(self.events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")

    def _restore(self) -> None:
        """Take back finished runs from an earlier, interrupted ``run`` into the same folder."""
        results.uncompress_events(self.out)
        probes: list[dict] = []
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
                probes.append(e["probe"])
            elif (e.get("event") == "start" and key not in self.start_events
                  and "probe" not in e and "profile" not in e):
                self.start_events[key] = protocol.decode(e)
            elif e.get("event") == "runner_start":
                self.env = e.get("env", {})
        if probes:
            # The last decision the folder recorded: a resumed node's nodes may have agreed on
            # node 0's since its own (``_agree_resumed_mode``).
            self.modes.restore(probes[-1])

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
        env = dict(self.env)
        if self.start_events:
            env.update(next(iter(self.start_events.values())).env)
        workload = self.plan.workload.to_dict()
        # The layout the workers ran, where a backbone has one layout only (JAX's) and the
        # plan was made without its declaration (an alignment, a check's own plan).
        layouts = {e.workload.get("channels_last") for e in self.start_events.values()}
        if len(layouts) == 1 and None not in layouts:
            workload["channels_last"] = layouts.pop()
        pfc_updates = {e.pfc_update for e in self.start_events.values()}
        if len(pfc_updates) == 1:
            workload["pfc_update_ran"] = pfc_updates.pop()
        doc = results.document(self.plan.recipe, workload, self.plan.measure.to_dict(), env,
                               cases, model=self.plan.model, tuning=self.plan.tuning.to_dict())
        doc["framework"] = self.plan.framework
        doc["data"] = self.plan.data_record()
        probe = self.modes.record()
        if probe is not None:
            doc["mode_probe"] = probe
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
            self.launcher.pythonpath = str(envs.package_link_dir(self.out / "runs"))
        self.resuming = resume
        if resume:
            self.nodes.holds = role_of(self.out / RESULTS)
            self._restore()
        if not self.env:
            self.env = host_env()
            self._append_event({"event": "runner_start", "t": time.time(), "env": self.env})

    def _done_runs(self) -> dict[str, list[int]]:
        """The runs of each case this folder holds as done: a training run that failed or was
        stopped goes on from its last checkpoint; a throughput run that failed stays a result,
        unless it failed because the nodes lost each other (a node killed, a link cut: that
        says nothing of the work, and the run goes again)."""
        return {f"{name} {batch}": sorted(
            r["run"] for r in runs
            if (r["status"] == "ok" if self.plan.train is not None
                else r["status"] == "ok" or not r.get("nodes_lost")))
            for (name, batch), runs in self.records.items()}

    def _agreed_done_runs(self) -> dict[str, list[int]]:
        """What is left to run, alike on every node: on several nodes resuming, node 0's
        records decide (a follower's record of a run node 0 never recorded, or recorded as
        lost, would otherwise skip a launch the others make)."""
        topo = self.plan.cases[0].topology
        if not self.resuming or topo.nnodes < 2:
            return self._done_runs()
        try:
            return self.nodes.one_decision(topo, "resume", self._done_runs)
        except RendezvousError:
            return self._done_runs()  # every launch then fails at its meeting, saying why

    def _each_run(self) -> Iterator[None]:
        try:
            yield from self._decide_mode()
            agreed = self._agreed_done_runs()
            for case in self.plan.cases:
                key = (case.key.name, case.batch_size)
                runs = self.records.setdefault(key, [])
                done = set(agreed.get(f"{key[0]} {key[1]}", []))
                for run in range(1, self.plan.measure.runs + 1):
                    if run in done:
                        continue
                    why = self.modes.not_timed()
                    record = (self._timed(case, TimedRun(run)) if why is None
                              else self._not_timed(case, run, why))
                    earlier = [r for r in runs if r["run"] == run]
                    if earlier:
                        record["earlier_attempts"] = [
                            {"status": r["status"], "error": r["error"]} for r in earlier]
                        runs[:] = [r for r in runs if r["run"] != run]
                    runs.append(record)
                    self.write_results()
                    yield
                if self.plan.profile_steps and key not in self.breakdowns:
                    self.breakdowns[key] = self._profiled(case)
                    self.write_results()
                    yield
        finally:
            self.nodes.close()

    def _decide_mode(self) -> Iterator[None]:
        """``--mode best``: the plan's mode before its first timed run, from its probe, or from
        its group's where another plan of the group probes (this plan passes its turns until
        that one has decided)."""
        shared = self.modes.shared
        topo = self.plan.cases[0].topology
        if self.resuming and self.modes.best and topo.nnodes > 1:
            self._agree_resumed_mode(topo)
        while self.modes.pending() and shared.probed_in not in (None, str(self.out)):
            yield  # another plan of the group is probing
        if not self.modes.pending():
            if self.modes.best and not self._has_probe_event():
                self._append_event({"event": "mode_probe", "t": time.time(),
                                    "probe": self.modes.record()})
            return
        shared.probed_in = str(self.out)
        yield from self.modes.run_probe(self._probe_round, self.nodes)
        self._append_event({"event": "mode_probe", "t": time.time(),
                            "probe": self.modes.record()})

    def _agree_resumed_mode(self, topo) -> None:
        """A resumed plan's nodes agree on their mode again: each restored its own folder's
        record, which may differ from node 0's or be missing; node 0's is taken by every node
        (kept as this folder's latest record), and where node 0 holds none, every node probes
        afresh, together."""
        mine = self.modes.shared.probe
        try:
            told = self.nodes.one_decision(topo, "mode_resume", lambda: {"probe": mine})
        except RendezvousError:
            return  # every launch then fails at its meeting, saying why
        agreed = told.get("probe")
        if agreed == mine:
            return
        self.modes.shared.probe = agreed
        self.modes.shared.probed_in = str(self.out) if agreed is not None else None
        if agreed is not None:
            self._append_event({"event": "mode_probe", "t": time.time(), "probe": agreed,
                                "agreed_on_resume": True})

    def _has_probe_event(self) -> bool:
        return any('"event": "mode_probe"' in line for line in results.event_lines(self.out))

    # -- one launch of each kind ------------------------------------------------------------
    def _timed(self, case: Case, kind: TimedRun) -> dict:
        """A timed run of the case: its record, kept as a ``run_end`` event."""
        record, seen = self._launch(case, kind)
        key = (case.key.name, case.batch_size)
        start = next((e for e in seen if isinstance(e, Start)), None)
        if start is not None:
            self.start_events.setdefault(key, start)
        # A probe ran this mode's step on this machine first: caches it filled on disk were
        # warm for this run's start-up and compilation.
        probe = self.modes.probe
        record["after_mode_probe"] = bool(probe and probe.get("rounds"))
        self._append_event({"event": "run_end", "t": time.time(), "case": key[0],
                            "batch": key[1], "run": kind.run, "record": record})
        return record

    def _not_timed(self, case: Case, run: int, why: str) -> dict:
        """A run the plan cannot time, recorded as failed with why, and never launched."""
        record = results.run_record(run, [], "failed", why)
        self._append_event({"event": "run_end", "t": time.time(), "case": case.key.name,
                            "batch": case.batch_size, "run": run, "record": record})
        return record

    def _probe_round(self, case: Case, kind: ProbeRound) -> tuple[dict, list[Event]]:
        """A round of the mode probe: kept in the probe's record, never among the runs."""
        return self._launch(case, kind)

    def _profiled(self, case: Case) -> dict:
        """The case's profiled run (``--breakdown``): its breakdown, kept as a
        ``profile_end`` event, outside the runs."""
        kind = ProfiledRun(self.plan.profile_steps, self.plan.trace)
        record, seen = self._launch(case, kind)
        phases = next((e for e in seen if isinstance(e, Phases)), None)
        summary = breakdown.summarize(phases.to_dict() if phases else {}, record)
        summary["folder"] = str(self._run_dir(case, kind).relative_to(self.out))
        if summary.get("trace"):  # the folder may move: where it lies inside it
            summary["trace"] = os.path.relpath(summary["trace"], self.out.resolve())
        self._append_event({"event": "profile_end", "t": time.time(), "case": case.key.name,
                            "batch": case.batch_size, "run": kind.run, "profile": True,
                            "breakdown": summary})
        return summary

    def _run_dir(self, case: Case, kind: RunKind) -> Path:
        return self.out / "runs" / f"{case.key.name}_b{case.batch_size}_{kind.name}"

    def _launch(self, case: Case, kind: RunKind) -> tuple[dict, list[Event]]:
        """Launch ``kind`` of ``case`` in its own folder (``launcher``, retries included):
        its record and the events it saw."""
        label = " ".join(filter(None, (self.plan.variant, case.key.name,
                                      f"b{case.batch_size} {kind.label}")))
        run_dir = self._run_dir(case, kind)
        run_dir.mkdir(parents=True, exist_ok=True)
        measure = kind.measure(self.plan.measure)
        mode = kind.mode(self.modes.mode)
        train = self.plan.train if kind.trains else None
        if train is not None:
            train = train.replace(checkpoint_dir=str((run_dir / "checkpoints").resolve()))
        # The device is decided here, once, as the plan was checked for it: the worker is told
        # ``cuda`` or ``cpu``, never ``auto``, and fails in one line where its framework does not
        # see what it was told (a CPU build, an empty CUDA_VISIBLE_DEVICES), rather than running
        # a CUDA plan on the CPU.
        spec = RunSpec(self.plan.workload.replace(batch_size=case.batch_size), measure,
                       replace(self.plan.tuning, mode=mode), device_kind(case.topology.device),
                       measure.threads or cpu_threads_per_process(case.topology.devices_per_node),
                       self.plan.align, self.plan.data, train, kind.profile(run_dir))
        results.write_json_atomic(run_dir / "spec.json", spec.to_dict())
        tags = {"case": case.key.name, "batch": case.batch_size, "run": kind.run, **kind.tags()}
        self._append_event({"event": "run_start", "t": time.time(), **tags})
        # The case's step times so far size the run's stall limit (``stall``). A timed
        # throughput run's window is one stretch of steps, whose energy is read; a training
        # run's steps are timed apart from its evaluations.
        known = tuple(s for r in self.records.get((case.key.name, case.batch_size), [])
                      for s in stall.steady_steps(r))
        launched = self.launcher.launch(case, run_dir, spec, label, tags,
                                        energy=isinstance(kind, TimedRun) and train is None,
                                        known_step_s=known)
        record = launched.record(kind.run, run_dir)
        if record.get("mode") is None and launched.here.status == "ok":
            # A follower node reads no start event (rank 0 writes it): the mode it ran is its
            # spec's, so that its record says it too.
            record["mode"] = get_backend(self.plan.framework).resolve_mode(
                mode, device_kind(case.topology.device))
        self.progress.run_finished(label, record)
        return record, launched.seen
