"""Running ``trainperf commbench``: its ranks started as ``trainperf run`` starts torch's, one
process per rank under ``trainperf.backends.spawn`` (see ``backends/torch/backend.py`` for why
not torchrun), on several nodes after the nodes meet through ``rendezvous.NodeGroup``; what
``commbench`` makes of their times is in ``commbench.py``.

A rank that fails is named in one line (``outcome``'s rules): a death by a signal or an
unexplained exit code first, with where in the sweep the rank was and its last words, then a
rank's own exception, then a peer's broken connection. On several nodes a node whose part
failed tells the others at once, and a node that hears it stops its own ranks rather than
leave them waiting on the dead peer until the collective timeout; every node then reports the
same error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .. import protocol
from ..backends.base import Cluster
from ..backends.spawn import PORTS_PER_RUN
from ..env import host_env
from ..outcome import Outcome, agree, deaths, how_it_ended, is_lost_peer, last_words
from ..procs import POLL_S, EventTail, cpu_threads_per_process, kill_tree
from ..protocol import Error, Event, Exit
from ..rendezvous import NodeGroup, RendezvousError, interface_of
from ..results import write_json_atomic
from .commbench import (WORKER_MODULE, CommbenchError, CommbenchSpec, document, human_bytes,
                        markdown, plot, write_text_atomic)

MEETING = "commbench"
"""What the nodes call the benchmark's one run when they meet on the store."""
RDZV_TIMEOUT_S = 300.0
"""How long a node waits for the others to arrive (capped by ``--timeout``). A scheduler starts
the nodes of one job together, but a node may take minutes to start Python and import torch
from a cold shared file system; five minutes is also ``trainperf run``'s ``--rdzv-timeout``
default, so the two commands wait alike for the same cluster."""
PEER_POLL_S = 1.0
"""Several nodes: how often a running node looks whether another node's part has failed."""
FAILED_HEAR_S = 10.0
"""Several nodes: how long a node whose part failed waits to hear the others (a peer whose rank
died tells within seconds; one that died whole never will)."""
OK_HEAR_S = 60.0
"""Several nodes: how long a node whose part succeeded waits to hear the others. Its ranks
finished the last collective with every other rank, so the others are only writing their
results and exiting."""

def launch_argv(spec: CommbenchSpec, work: Path, cluster_path: Path | None = None,
                python: str = sys.executable) -> list[str]:
    """The launcher this node runs: ``trainperf.backends.spawn`` starting this node's ranks as
    torch's (so they get its variables), each writing its output into ``work/logs`` and its
    error event, beside the launcher's exit events, into ``work/events.jsonl``."""
    argv = [python, "-m", "trainperf.backends.spawn", "--backend=torch",
            f"--nproc={spec.devices_per_node}", f"--module={WORKER_MODULE}",
            f"--logs={work / 'logs'}", f"--events={work / 'events.jsonl'}"]
    if cluster_path is not None:
        argv.append(f"--cluster={cluster_path}")
    return argv + ["--", "--out", str(work / "worker.json"), "--events",
                   str(work / "events.jsonl"), "--ops", ",".join(spec.ops),
                   "--min-bytes", str(spec.min_bytes), "--max-bytes", str(spec.max_bytes),
                   "--factor", repr(spec.factor), "--iters", str(spec.iters),
                   "--warmup", str(spec.warmup), "--dtype", spec.dtype, "--device", spec.device,
                   "--timeout-s", repr(spec.collective_timeout_s)]


PROGRESS = re.compile(r"^commbench rank \d+ at (\w+), (\d+) bytes$")


def death_text(x: Exit) -> str:
    """``rank 1 died of SIGKILL (signal 9) at all_reduce, 4 KiB: <its last words>``: how the
    process ended, its last place in the sweep, and the last lines of its own output that say
    why (a fault handler's stack cut to its innermost frame)."""
    lines = last_words(x.log, 200)
    seen = [m for m in map(PROGRESS.match, lines) if m]
    where = (f"at {seen[-1][1]}, {human_bytes(int(seen[-1][2]))}" if seen
             else "before its first collective")
    words = [line for line in lines if not PROGRESS.match(line)][-3:]
    text = f"{x.name} {how_it_ended(x.returncode)} {where}"
    return f"{text}: {' | '.join(words)}" if words else text


def ranks_outcome(events: list[Event]) -> Outcome | None:
    """How this node's ranks failed, the cause first (a death, then a rank's own exception,
    then a peer's broken connection); None when none did."""
    dead = deaths(events)
    errors = sorted((e for e in events if isinstance(e, Error)),
                    key=lambda e: (is_lost_peer(e.message), e.rank))
    texts = [death_text(x) for x in dead] + [f"rank {e.rank}: {e.message}" for e in errors]
    if not texts:
        return None
    # The first consequence is enough; with many ranks the rest say the same.
    shown = texts[:len(dead) + 1]
    if dead and errors:
        shown[-1] = f"then {shown[-1]}"
    if len(texts) > len(shown):
        shown[-1] += f" (and {len(texts) - len(shown)} more rank(s) after it)"
    cause = bool(dead) or not is_lost_peer(errors[0].message)
    return Outcome("failed", "; ".join(shown), cause)


def read_events(path: Path) -> list[Event]:
    events = []
    for raw in EventTail(path).read():
        try:
            events.append(protocol.decode(raw))
        except protocol.ProtocolError:
            continue  # a torn or foreign line says nothing about how a rank ended
    return events


def meet(spec: CommbenchSpec) -> tuple[NodeGroup, Cluster]:
    """Join the other nodes at ``spec.rdzv`` as ``trainperf run`` does: this node's rank, and
    every node's address and free ports for the ranks. CommbenchError when they do not meet."""
    group = NodeGroup(str(spec.rdzv), spec.nnodes, min(RDZV_TIMEOUT_S, spec.timeout_s),
                      run_id=spec.rdzv_id)
    # What the ranks run must be the same on every node; where each node found the endpoint
    # (a name or an address) and its own bound on the whole need not.
    settings = {k: v for k, v in asdict(spec).items() if k not in ("rdzv", "timeout_s")}
    settings["collective_timeout_s"] = spec.collective_timeout_s
    try:
        group.join(settings)
        cluster = group.meet(MEETING, spec.devices_per_node,
                             PORTS_PER_RUN + spec.devices_per_node)
    except RendezvousError as exc:
        group.close()
        raise CommbenchError(str(exc)) from None
    except BaseException:
        group.close()  # Ctrl-C while waiting for the others
        raise
    return group, cluster


def run_commbench(spec: CommbenchSpec, out_dir: str | Path) -> dict[str, Any]:
    """Run the ranks of this node, then write OUT/commbench.json, .md and .png; returns the
    document. Raises CommbenchError when a rank fails (on any node), the nodes do not meet, or
    the ranks run past ``spec.timeout_s``.

    On several nodes every node's first rank writes the same all-reduced curve, so every
    node's folder gets the same results (a shared folder is written whole, atomically); each
    node's own files (its launcher's output, the ranks' output, their events, the cluster it
    was told) go into OUT/node<R>."""
    out = Path(out_dir)
    if (out / "commbench.json").exists():
        raise ValueError(f"{out} already holds a commbench; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + spec.timeout_s
    group, work, cluster_path = None, out, None
    if spec.nnodes > 1:
        group, cluster = meet(spec)
    try:
        if group is not None:
            work = out / f"node{group.node_rank}"
            work.mkdir(exist_ok=True)
            cluster_path = work / "cluster.json"
            cluster_path.write_text(cluster.to_json(), encoding="utf-8")
        here, peers_failed = run_ranks(spec, out, work, cluster_path, group, deadline)
        if group is not None:
            here = agree_nodes(group, here, peers_failed)
    finally:
        if group is not None:
            group.close()
    if here.status != "ok":
        raise CommbenchError(f"{here.error} (each rank's output: {work / 'logs'})")
    doc = document(spec, json.loads((work / "worker.json").read_text(encoding="utf-8")),
                   host_env())
    write_json_atomic(out / "commbench.json", doc)
    write_text_atomic(out / "commbench.md", markdown(doc))
    plot(doc, out / "commbench.png")
    return doc


def run_ranks(spec: CommbenchSpec, out: Path, work: Path, cluster_path: Path | None,
              group: NodeGroup | None, deadline: float) -> tuple[Outcome, dict[int, dict]]:
    """Start this node's launcher and wait for it: until it ends, ``deadline`` passes, or
    another node tells that its part failed (then this node's ranks, waiting on a dead peer,
    are stopped at once). This node's outcome, and the failed parts heard of."""
    events_path, worker_out = work / "events.jsonl", work / "worker.json"
    for stale in (events_path, worker_out):
        stale.unlink(missing_ok=True)
    log_path = work / "launcher.log"
    # Every process inherits the tag, so that what a benchmark left behind can be found; the
    # fault handler prints where Python was when a rank dies of a signal, into its own output.
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               TRAINPERF_RUN_ID=str(out.resolve()))
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_process(spec.devices_per_node)))
    if group is not None and "GLOO_SOCKET_IFNAME" not in env:
        # Gloo binds to what the hostname resolves to, which may not be the network the
        # nodes met on.
        iface = interface_of(group.local_addr)
        if iface:
            env["GLOO_SOCKET_IFNAME"] = iface
    timed_out, peers_failed = False, {}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(launch_argv(spec, work, cluster_path), stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            next_look = time.monotonic() + PEER_POLL_S
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    kill_tree(proc)
                    break
                if group is not None and time.monotonic() > next_look:
                    next_look = time.monotonic() + PEER_POLL_S
                    peers_failed = failed_peers(group)
                    if peers_failed:
                        kill_tree(proc)
                        break
                time.sleep(POLL_S)
        except BaseException:
            kill_tree(proc)  # Ctrl-C: leave no rank behind, and let no other node wait
            if group is not None:
                tell_quietly(group, Outcome("failed", "interrupted (Ctrl-C or SIGTERM)", True))
            raise
    here = part_outcome(spec, work, proc.returncode, timed_out, bool(peers_failed))
    return here, peers_failed


def part_outcome(spec: CommbenchSpec, work: Path, returncode: int, timed_out: bool,
                 stopped_for_peers: bool) -> Outcome:
    """How this node's part ended, from its ranks' events and its launcher's exit."""
    failed = ranks_outcome(read_events(work / "events.jsonl"))
    log_path, worker_out = work / "launcher.log", work / "worker.json"
    if timed_out:
        text = (f"no result within {spec.timeout_s:g} s; every process was stopped "
                f"(launcher log: {log_path})")
        return Outcome("timeout", f"{failed.error}; then {text}" if failed else text,
                       bool(failed and failed.cause))
    if failed is not None:
        return failed
    if stopped_for_peers:
        return Outcome("failed", "its ranks were stopped when another node's part failed")
    if returncode != 0:
        words = last_words(log_path)
        return Outcome("failed", f"launcher exited with code {returncode}"
                       + (f": {' | '.join(words)}" if words else ""))
    try:
        json.loads(worker_out.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        return Outcome("failed", f"the ranks exited cleanly but left no readable {worker_out} "
                                 f"({exc})", True)
    return Outcome("ok", None)


def failed_peers(group: NodeGroup) -> dict[int, dict]:
    """The other nodes that have told of a failed part (none where the store is lost: this
    node's own collectives will tell)."""
    try:
        told = group.told(MEETING)
    except RendezvousError:
        return {}
    return {n: o for n, o in told.items() if o.get("status") != "ok"}


def tell_quietly(group: NodeGroup, here: Outcome) -> None:
    try:
        group.tell(MEETING, {"status": here.status, "error": here.error, "cause": here.cause})
    except RendezvousError:
        pass  # the store is gone with its node; the others' collectives will tell them


def agree_nodes(group: NodeGroup, here: Outcome, failed: dict[int, dict]) -> Outcome:
    """Tell the other nodes how this node's part ended and hear theirs: one outcome on every
    node, the cause first wherever it happened."""
    wait_s = OK_HEAR_S if here.status == "ok" else FAILED_HEAR_S
    try:
        group.tell(MEETING, {"status": here.status, "error": here.error, "cause": here.cause})
        heard = group.hear(MEETING, time.monotonic() + wait_s)
    except RendezvousError as exc:
        text = "; ".join(filter(None, (here.error, str(exc))))
        return Outcome("failed" if here.status == "ok" else here.status, text, here.cause)
    heard.update(failed)
    return agree(group.node_rank, here, heard, group.nnodes, wait_s)


