"""`trainperf emulate`: run a multi-node `run` or `commbench` on emulated nodes of this machine,
each a network namespace with its own address and a link of a chosen rate, which can be cut or
slowed while it runs (``trainperf.emulated_nodes``)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..emulated_nodes import EmulatedNodes, EmulationError, parse_rate, rate_text
from ..env import gpu_count
from ..result_files import JOB
from ..results import write_json_atomic
from ..scale.node_sweep import (JOB_SCHEMA, Step, all_runs_ok, collect, is_sweep, step_dir,
                                steps_of)
from .common import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE

COMMANDS = ("run", "commbench")
MASTER_PORT = 29400
"""Each node has a network of its own, so one fixed port is free on every node."""
SET_BY_EMULATE = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--rdzv")
STEP_MARK = '"event": "step"'


def register(sub) -> None:
    p = sub.add_parser(
        "emulate", help="run a multi-node `run` or `commbench` on emulated nodes of this "
        "machine: a network namespace per node, its own address and a link of a chosen rate",
        description="Every node runs the command as it would on a cluster (--nnodes, its "
        "node rank, node 0's address), in a network namespace of its own on one bridge, on its "
        "share of the cores and GPUs; node k writes OUT/node-k (OUT/nodes-N/node-k for each "
        "count N of a list). A `run` ends with one document per plan at the top of OUT, as "
        "run lays them out, with OUT/job.json and OUT/report.md. Needs root. Everything made "
        "is removed at the end, and what a killed earlier call left is removed at the start.")
    p.add_argument("--nodes", metavar="N[,N...]",
                   help="emulated nodes (default 2); a list (1,2) runs `run` at each node "
                        "count in turn, on nodes 0..N-1 of the largest, and joins them into "
                        "one document per plan with every count's speedups")
    p.add_argument("--cases", metavar="NnGg[,...]",
                   help="with `run`: exactly these cases, named as DLPerf and the results name "
                        "them (1n1g,1n2g,2n1g: nodes, processes per node), instead of run's "
                        "--devices at every node count")
    p.add_argument("--rate", help="each node's link rate, both ways, e.g. 100mbit, 1gbit "
                   "(default: unshaped)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs each node gets, from the inherited CUDA_VISIBLE_DEVICES or "
                        "every GPU (default: those shared out equally; 0 on a machine without "
                        "any); too few for every node is refused")
    p.add_argument("--cut-link", action="append", default=[], metavar="NODE@WHEN",
                   help="pull node NODE's cable at WHEN: node 0's steps so far, every run "
                        "of every plan counted (e.g. 1@30), or seconds (1@20s, the only kind "
                        "commbench takes); repeatable; one that never fires fails the call")
    p.add_argument("--slow-link", action="append", default=[], metavar="NODE@WHEN:RATE",
                   help="change node NODE's link to RATE at WHEN (e.g. 1@30:100mbit)")
    p.add_argument("--restore-after", type=float, metavar="S",
                   help="put a cut link back S seconds later (default: never); a slowed "
                        "link keeps its rate until another --slow-link changes it")
    p.add_argument("--clean", action="store_true",
                   help="only remove what earlier calls left behind, and say what")
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS",
                   help="`run ...` or `commbench ...`, as on one node, without --nnodes, "
                        "--node-rank or --rdzv; its --out becomes the folder of the nodes' "
                        "folders")
    p.set_defaults(handler=cmd_emulate)


@dataclass
class Fault:
    action: str
    """``cut`` or ``slow``."""
    node: int
    at_step: int | None
    at_s: float | None
    rate_bps: int | None = None

    @classmethod
    def parse(cls, action: str, text: str, nodes: int) -> "Fault":
        flag = f"--{action}-link"
        node, at, when = text.partition("@")
        rate = None
        if action == "slow":
            when, _, rate_text_ = when.partition(":")
            if not rate_text_:
                raise ValueError(f"{flag} takes NODE@WHEN:RATE, got {text!r}")
            rate = parse_rate(rate_text_)
        if not at or not node.isdigit() or not when:
            raise ValueError(f"{flag} takes NODE@WHEN (a step count or seconds such as 20s), "
                             f"got {text!r}")
        if not int(node) < nodes:
            raise ValueError(f"{flag}: there is no node {node} of {nodes}")
        try:
            step, secs = (None, float(when[:-1])) if when.endswith("s") else (int(when), None)
        except ValueError:
            raise ValueError(f"{flag}: WHEN is a step count or seconds (20s), got {when!r}"
                             ) from None
        return cls(action, int(node), step, secs, rate)

    def due(self, elapsed_s: float, steps: int) -> bool:
        return (elapsed_s >= self.at_s) if self.at_s is not None else steps >= self.at_step


def split_command(argv: list[str]) -> tuple[str, list[str], Path]:
    """``-- COMMAND ARGS`` -> the command, its arguments without --out, and the out folder."""
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv or argv[0] not in COMMANDS:
        raise ValueError(f"emulate runs one of {', '.join(COMMANDS)} after `--`, e.g. "
                         "`trainperf emulate --nodes 2 -- run tiny-arcface`")
    command, args = argv[0], argv[1:]
    given = [a.split("=")[0] for a in args if a.split("=")[0] in SET_BY_EMULATE]
    if given:
        raise ValueError(f"emulate gives every node {', '.join(sorted(set(given)))} itself")
    out = None
    rest: list[str] = []
    it = iter(args)
    for a in it:
        if a == "--out":
            out = next(it, None)
        elif a.startswith("--out="):
            out = a.split("=", 1)[1]
        else:
            rest.append(a)
    if out is None:
        out = f"results/{command}-emulated-{time.strftime('%Y%m%d-%H%M%S')}"
    return command, rest, Path(out)


def take_option(args: list[str], flag: str) -> tuple[list[str], str | None]:
    """``args`` without ``flag``'s value (``--flag V`` or ``--flag=V``), and the value."""
    value, rest = None, []
    it = iter(args)
    for a in it:
        if a == flag:
            value = next(it, None)
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
    return rest, value


def node_argv(command: str, args: list[str], cluster: EmulatedNodes, node: int,
              out: Path, nnodes: int | None = None, port: int = MASTER_PORT) -> list[str]:
    """What node ``node`` runs: the command as on a cluster of ``nnodes`` (all of the
    cluster's by default), writing ``out/node-<node>``."""
    nnodes = cluster.nodes if nnodes is None else nnodes
    if command == "run":
        meet = ["--node-rank", str(node), "--master-addr", cluster.addr(0),
                "--master-port", str(port)]
    else:  # commbench meets only through a rendezvous
        meet = ["--rdzv", f"{cluster.addr(0)}:{port}"]
    return [sys.executable, "-m", "trainperf.cli", command, *args, "--nnodes",
            str(nnodes), *meet, "--out", str(out / f"node-{node}")]


def check_run(args: list[str], steps: list[Step], out: Path) -> bool:
    """Plan every step's `run` here, where its nodes run, so that a usage error or a refused
    case is told before anything is made; whether its plans run ``--mode best`` (then every
    step after the first takes the first one's choice)."""
    from ..config import MODE_BEST
    from .run import add_run_command_arguments, run_plans_of

    parser = argparse.ArgumentParser(prog="trainperf run")
    add_run_command_arguments(parser)
    best = False
    for step in steps:
        parsed = parser.parse_args([*args, "--devices", ",".join(map(str, step.devices)),
                                    "--nnodes", str(step.nodes), "--out", str(out / "node-0")])
        best |= any(p.tuning.mode == MODE_BEST for p in run_plans_of(parsed))
    return best


def steps_so_far(node0: Path) -> int:
    """Node 0's steps so far, in every plan's folder under its own (one plan's, several
    frameworks', a mode list's, ``--data``'s real and synthetic), every run counted."""
    total = 0
    for folder, subfolders, files in os.walk(node0):
        # A plan's folder holds its plan.json. Its runs/ hold each run's own folder (the
        # workers' events while they run, the same steps again; traces, checkpoints): never a
        # plan, and not walked every tenth of a second.
        subfolders[:] = [d for d in subfolders if d != "runs"]
        if "plan.json" in files:
            try:
                total += (Path(folder) / "events.jsonl").read_text(
                    errors="replace").count(STEP_MARK)
            except OSError:
                pass
    return total


class FaultPlan(threading.Thread):
    """Applies the faults when due, and puts cut links back after ``restore_after_s``."""

    def __init__(self, cluster: EmulatedNodes, faults: list[Fault], node0: Path,
                 restore_after_s: float | None) -> None:
        super().__init__(daemon=True)
        self.cluster, self.pending, self.node0 = cluster, list(faults), node0
        self.restore_after_s = restore_after_s
        self.done: list[dict] = []
        self.stop = threading.Event()
        self.steps_seen = 0

    def not_fired(self) -> list[dict]:
        """The faults that never came due, each with why: the command ended first."""
        return [{"action": f.action, "node": f.node, "at_step": f.at_step, "at_s": f.at_s,
                 "rate": rate_text(f.rate_bps) if f.rate_bps else None,
                 "why": (f"node 0 made {self.steps_seen} step(s) in all" if f.at_step
                         is not None else "the command ended first")}
                for f in self.pending]

    def run(self) -> None:
        start = time.monotonic()
        restores: list[tuple[float, Fault]] = []
        while not self.stop.wait(0.1) and (self.pending or restores):
            elapsed, steps = time.monotonic() - start, steps_so_far(self.node0)
            self.steps_seen = steps
            for fault in [f for f in self.pending if f.due(elapsed, steps)]:
                self.pending.remove(fault)
                if fault.action == "cut":
                    self.cluster.cut(fault.node)
                else:
                    self.cluster.set_rate(fault.node, fault.rate_bps)
                # ``t``: the wall clock, which the nodes' events use too (one machine).
                self.done.append({"action": fault.action, "node": fault.node,
                                  "rate": rate_text(fault.rate_bps) if fault.rate_bps
                                  else None, "at_s": round(elapsed, 2), "t": time.time(),
                                  "node0_steps": steps})
                if self.restore_after_s is not None and fault.action == "cut":
                    restores.append((elapsed + self.restore_after_s, fault))
            for when, fault in [r for r in restores if r[0] <= elapsed]:
                restores.remove((when, fault))
                self.cluster.restore(fault.node)
                self.done.append({"action": "restore", "node": fault.node,
                                  "at_s": round(elapsed, 2), "t": time.time(),
                                  "node0_steps": steps})


def node_gpus(nodes: int, per_node: int | None) -> tuple[str, ...]:
    """The GPUs handed out, ``per_node`` to each node (None: the visible ones shared out
    equally), by the names this process was given: the entries of an inherited
    ``CUDA_VISIBLE_DEVICES`` (a scheduler's ``4,5``), else every GPU's index. Refused in one
    line where there are too few for every node to have its share, or a share of none where
    GPUs are there (a node would run on the CPU without saying so)."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = ([d.strip() for d in inherited.split(",") if d.strip()] if inherited is not None
               else [str(i) for i in range(gpu_count())])
    if per_node is None:
        if visible and len(visible) < nodes:
            raise ValueError(f"{len(visible)} visible GPU(s) cannot give each of {nodes} nodes "
                             "one; pass --gpus-per-node 0 to run the nodes on the CPU")
        per_node = len(visible) // nodes
    if per_node < 0:
        raise ValueError(f"--gpus-per-node must be >= 0, got {per_node}")
    if per_node * nodes > len(visible):
        where = (f"CUDA_VISIBLE_DEVICES={inherited}" if inherited is not None
                 else "this machine")
        raise ValueError(f"--gpus-per-node {per_node} on {nodes} nodes needs "
                         f"{per_node * nodes} GPUs; {where} has {len(visible)}")
    return tuple(visible[:per_node * nodes])


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_emulate(args: argparse.Namespace) -> int:
    if args.clean:
        from ..emulated_nodes import clean_leftovers, missing_privilege

        why = missing_privilege()
        if why:
            print(f"trainperf: error: {why}", file=sys.stderr)
            return EXIT_USAGE
        removed, left_alone = clean_leftovers()
        print(f"removed {len(removed)} leftover set(s) of emulated nodes"
              + (f": {', '.join(removed)}" if removed else ""))
        for line in left_alone:
            print(f"trainperf: error: refused {line}", file=sys.stderr)
        return EXIT_USAGE if left_alone else EXIT_OK
    command, rest, out = split_command(args.argv)
    rest, devices = take_option(rest, "--devices")
    steps = steps_of(args.nodes or ("" if args.cases else "2"),
                     devices if command == "run" else None, args.cases)
    if command != "run" and (args.cases or is_sweep(steps)):
        raise ValueError("a list of node counts and --cases are for `run`; commbench measures "
                         "one node count")
    if is_sweep(steps) and (args.cut_link or args.slow_link):
        raise ValueError("--cut-link and --slow-link count node 0's steps in one node count: "
                         "give --nodes one count")
    if command == "commbench" and devices is not None:
        rest += ["--devices", devices]
    nodes = steps[-1].nodes
    rate = parse_rate(args.rate) if args.rate else None
    faults = ([Fault.parse("cut", t, nodes) for t in args.cut_link]
              + [Fault.parse("slow", t, nodes) for t in args.slow_link])
    if command == "commbench" and any(f.at_step is not None for f in faults):
        raise ValueError("commbench takes no training steps: give a fault's WHEN in seconds "
                         "(e.g. --cut-link 1@20s)")
    if command == "run" and (out / JOB).exists():
        raise ValueError(f"{out} already holds a job's folders; choose another --out")
    mode_from_first = check_run(rest, steps, out) and is_sweep(steps) if command == "run" \
        else False
    cluster = EmulatedNodes(nodes, rate, node_gpus(nodes, args.gpus_per_node))
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        cluster.make()
    except EmulationError as exc:
        print(f"trainperf: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in cluster.left_alone:
        print(f"trainperf: warning: left alone {line}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    if command == "run":
        write_json_atomic(out / JOB, {"schema": JOB_SCHEMA, "kind": "emulated",
                                      "steps": [s.to_dict() for s in steps], "documents": [],
                                      "plans": []})
    record = {"tag": cluster.tag, "nodes": nodes, "rate": rate_text(rate),
              "subnet": f"{cluster.subnet}.0/24",
              "addrs": [cluster.addr(n) for n in range(nodes)],
              "gpus": [cluster.node_gpus(n) for n in range(nodes)],
              "cores": [cluster.node_cores(n) for n in range(nodes)],
              "command": [command, *rest], "steps": [s.to_dict() for s in steps],
              "faults": []}
    print(f"emulated {nodes} node(s) at {', '.join(record['addrs'])}, links "
          f"{rate_text(rate)}; node k writes {step_dir(out, steps, steps[0])}/node-k"
          + (f" (each node count: {out}/nodes-N/node-k)" if is_sweep(steps) else ""),
          flush=True)
    plan = FaultPlan(cluster, faults, step_dir(out, steps, steps[0]) / "node-0",
                     args.restore_after)
    codes: list[list[int | None]] = []
    try:
        for index, step in enumerate(steps):
            where = step_dir(out, steps, step)
            argv = list(rest)
            if command == "run":
                argv += ["--devices", ",".join(map(str, step.devices))]
                if mode_from_first and index > 0:
                    argv += ["--mode-from", str(step_dir(out, steps, steps[0]))]
            if is_sweep(steps):
                print(f"-- {step.nodes} node(s), {','.join(map(str, step.devices))} "
                      f"process(es) per node: {where}", flush=True)
            where.mkdir(parents=True, exist_ok=True)
            procs = []
            for node in range(step.nodes):
                log = None if node == 0 else open(where / f"node-{node}.log", "wb")
                # Each count meets on a port of its own: a store an earlier count left
                # behind is never met again.
                procs.append(cluster.start(node, node_argv(command, argv, cluster, node, where,
                                                           step.nodes, MASTER_PORT + index),
                                           stdout=log,
                                           stderr=None if log is None else subprocess.STDOUT))
            if index == 0:
                plan.start()
            codes.append([p.wait() for p in procs])
    except KeyboardInterrupt:
        print("trainperf: interrupted; the emulated nodes are removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        plan.stop.set()
        plan.join(timeout=5)
        record["faults"] = plan.done
        record["faults_not_fired"] = plan.not_fired()
        record["exit_codes"] = codes[0] if not is_sweep(steps) and codes else codes
        (out / "emulation.json").write_text(json.dumps(record, indent=2) + "\n")
        cluster.remove()
    worst = max((c for step_codes in codes for c in step_codes if c), default=0)
    for fault in record["faults_not_fired"]:
        when = (str(fault["at_step"]) if fault["at_step"] is not None
                else f"{fault['at_s']:g}s")
        print(f"trainperf: error: --{fault['action']}-link {fault['node']}@{when} never fired "
              f"({fault['why']}); see emulation.json", file=sys.stderr)
        worst = worst or EXIT_RUN_FAILED
    if worst:
        print(f"node exit codes {codes}; node 1's and later logs: node-k.log beside node 0's "
              "folder", file=sys.stderr)
    if command == "run":
        try:
            docs, report, missing = collect(out, steps, "emulated")
        except ValueError as exc:
            print(f"trainperf: {exc}", file=sys.stderr)
            return EXIT_RUN_FAILED if worst != EXIT_USAGE else EXIT_USAGE
        for line in missing:
            print(f"trainperf: not measured: {line}", file=sys.stderr)
        for doc in docs:
            print(f"results: {doc}")
        print(f"report: {report}")
        if not worst and not all_runs_ok(docs, missing):
            worst = EXIT_RUN_FAILED
    return EXIT_OK if not worst else (EXIT_USAGE if worst == EXIT_USAGE else EXIT_RUN_FAILED)
