"""`trainperf emulate`: run a multi-node `run` or `commbench` on emulated nodes of this machine,
each a network namespace with its own address and a link of a chosen rate, which can be cut or
slowed while it runs (``trainperf.emulated_nodes``)."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..emulated_nodes import EmulatedNodes, EmulationError, parse_rate, rate_text
from ..env import gpu_count
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
        "share of the cores and GPUs; node k writes OUT/node-k. Needs root. Everything made "
        "is removed at the end, and what a killed earlier call left is removed at the start.")
    p.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    p.add_argument("--rate", help="each node's link rate, both ways, e.g. 100mbit, 1gbit "
                   "(default: unshaped)")
    p.add_argument("--gpus-per-node", type=int,
                   help="GPUs each node gets (default: the visible GPUs shared out equally; "
                        "0 on a machine without any)")
    p.add_argument("--cut-link", action="append", default=[], metavar="NODE@WHEN",
                   help="pull node NODE's cable at WHEN: node 0's steps so far, every run "
                        "of the plan counted (e.g. 1@30), or seconds (1@20s); repeatable")
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


def node_argv(command: str, args: list[str], cluster: EmulatedNodes, node: int,
              out: Path) -> list[str]:
    if command == "run":
        meet = ["--node-rank", str(node), "--master-addr", cluster.addr(0),
                "--master-port", str(MASTER_PORT)]
    else:  # commbench meets only through a rendezvous
        meet = ["--rdzv", f"{cluster.addr(0)}:{MASTER_PORT}"]
    return [sys.executable, "-m", "trainperf.cli", command, *args, "--nnodes",
            str(cluster.nodes), *meet, "--out", str(out / f"node-{node}")]


def steps_so_far(events: Path) -> int:
    try:
        return events.read_text(errors="replace").count(STEP_MARK)
    except OSError:
        return 0


class FaultPlan(threading.Thread):
    """Applies the faults when due, and puts cut links back after ``restore_after_s``."""

    def __init__(self, cluster: EmulatedNodes, faults: list[Fault], events: Path,
                 restore_after_s: float | None) -> None:
        super().__init__(daemon=True)
        self.cluster, self.pending, self.events = cluster, list(faults), events
        self.restore_after_s = restore_after_s
        self.done: list[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        restores: list[tuple[float, Fault]] = []
        while not self.stop.wait(0.1) and (self.pending or restores):
            elapsed, steps = time.monotonic() - start, steps_so_far(self.events)
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


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_emulate(args: argparse.Namespace) -> int:
    if args.clean:
        from ..emulated_nodes import clean_leftovers, missing_privilege

        why = missing_privilege()
        if why:
            print(f"trainperf: error: {why}", file=sys.stderr)
            return EXIT_USAGE
        removed = clean_leftovers()
        print(f"removed {len(removed)} leftover set(s) of emulated nodes"
              + (f": {', '.join(removed)}" if removed else ""))
        return EXIT_OK
    command, rest, out = split_command(args.argv)
    rate = parse_rate(args.rate) if args.rate else None
    faults = ([Fault.parse("cut", t, args.nodes) for t in args.cut_link]
              + [Fault.parse("slow", t, args.nodes) for t in args.slow_link])
    gpus = gpu_count() if args.gpus_per_node is None else args.gpus_per_node * args.nodes
    per_node = gpus // max(1, args.nodes)
    cluster = EmulatedNodes(args.nodes, rate, tuple(range(per_node * args.nodes)))
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        cluster.make()
    except EmulationError as exc:
        print(f"trainperf: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out.mkdir(parents=True, exist_ok=True)
    record = {"tag": cluster.tag, "nodes": args.nodes, "rate": rate_text(rate),
              "subnet": f"{cluster.subnet}.0/24",
              "addrs": [cluster.addr(n) for n in range(args.nodes)],
              "gpus": [cluster.node_gpus(n) for n in range(args.nodes)],
              "cores": [cluster.node_cores(n) for n in range(args.nodes)],
              "command": [command, *rest], "faults": []}
    print(f"emulated {args.nodes} node(s) at {', '.join(record['addrs'])}, links "
          f"{rate_text(rate)}; node k writes {out}/node-k", flush=True)
    plan = FaultPlan(cluster, faults, out / "node-0" / "events.jsonl", args.restore_after)
    codes: list[int | None] = []
    try:
        procs = []
        for node in range(args.nodes):
            log = None if node == 0 else open(out / f"node-{node}.log", "wb")
            procs.append(cluster.start(node, node_argv(command, rest, cluster, node, out),
                                       stdout=log,
                                       stderr=None if log is None else subprocess.STDOUT))
        plan.start()
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        print("trainperf: interrupted; the emulated nodes are removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        plan.stop.set()
        record["faults"] = plan.done
        record["exit_codes"] = codes
        (out / "emulation.json").write_text(json.dumps(record, indent=2) + "\n")
        cluster.remove()
    worst = max((c for c in codes if c), default=0)
    if worst:
        print(f"node exit codes {codes}; node 1's and later logs: {out}/node-k.log",
              file=sys.stderr)
    return EXIT_OK if not worst else (EXIT_USAGE if worst == EXIT_USAGE else EXIT_RUN_FAILED)
