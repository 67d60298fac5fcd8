"""Network faults on two emulated nodes (``trainperf emulate``: a network namespace each, its own
address on a bridge, a shaped link, its own core), for torch, Paddle and JAX.

- A node's link cut mid-run: the run ends within the stall timeout (plus ``STOP_MARGIN_S``),
  both nodes record the same node (node 1) and step, node 1 saying its own link is down (its
  interface has no carrier) and node 0 that node 1 is unreachable, nothing of the run is left,
  and the plan's next run, once the link is back, meets again and is ok.
- A node that never joins: the first meeting times out and names it (the rank, by hand; how
  many came of how many, through ``--rdzv``). The nodes meet before any framework starts, so
  this is the same code for every framework: it runs with torch only.
- A link slowed mid-run: node 0's steps show it, and the report says the link got slower, from
  the step times and node 0's probes of the link, not that the model did. The verdict's rules
  are held on made-up step times and probes too (a model that slowed, a few slow steps).

Per framework, one `trainperf emulate` call holds the cut and the slowed link: its plan's run 1
is cut, and its run 2, after the link is back, is slowed halfway (one start of the nodes and
the framework, where two calls took half a minute more each).

The only timed assertions are the stated bounds, which are the configured timeouts plus a
margin for stopping a process tree on a busy machine, not speed targets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from run_util import left_behind
from trainperf import emulated_nodes as emu
from trainperf.node_agreement import (CHANGE_MIN_STEPS, FAILED_HEAR_S, PROBE_S, link_verdict,
                                      step_change)
from trainperf.outcome import agree, Outcome
from trainperf.report.network import change_text

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(emu.missing_privilege() is not None,
                                 reason=str(emu.missing_privilege()))]

FRAMEWORKS = ("torch", "paddle", "jax")
RUN = ["run", "tiny-arcface", "--device", "cpu", "--fc", "dp", "--warmup", "2"]
RATE = "1gbit"
STALL_S = 12
"""The stall timeout of the cut runs: the bound a cut run ends within. Generous: tiny steps
take well under a second, but the tests run at the lowest priority beside other work, which
has been seen to hold a step for several seconds."""
RDZV_S = 60
"""The rendezvous and collective timeout of the cut runs: longer than the cut, so that the
store's connections outlast it and the nodes meet again."""
CUT_STEP = 6
RESTORE_S = STALL_S + 5
"""The cut link comes back this long after the cut: after both nodes have stopped the run
(``STALL_S`` and the seconds a stop takes), before node 0 stops listening for node 1's account
of it (``FAILED_HEAR_S`` after its own part ended)."""
STOP_MARGIN_S = 20
"""What stopping a run's processes may add to its timeout: the runner's look (0.25 s), the
launcher's ask for stacks (1 s) and its ranks' grace (2 s), the runner's grace for the launcher
and then for the rest (5 s each), and slack for a machine busy with other tests."""
NEVER_JOINS_RDZV_S = 4
JOIN_MARGIN_S = 30
"""What a runner adds to the rendezvous timeout before it records a meeting that failed:
importing torch's store, connecting, writing the record, on a busy machine."""
ITERS = 14
"""Each run's timed steps, after RUN's 2 warm-up steps."""
SLOW_STEP = 9
SLOW_RATE = "10mbit"
"""Node 1's link from 1 gbit to 10 Mbit/s at about run 2's step 9 (``--slow-link`` counts node
0's steps over the plan: run 1's, CUT_STEP to 2 more, then run 2's), so that at least 4 timed
steps come before it and 8 after: tiny-arcface's gradients (1.4 MB a step) then take about a
second more to cross it, far more than a step's compute."""
LIMIT_S = 900
"""Stops a hung test; no outcome depends on it."""
JAX_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
"""As ``test_jax_runs.FAST_COMPILE``: the same arithmetic, compiled several times faster."""


@dataclass
class Emulated:
    """What one ``trainperf emulate`` call left: its exit, its record, each node's results and
    events, and what was still alive of run 1 when each node recorded it."""

    out: Path
    code: int
    output: str
    record: dict
    docs: dict[int, dict] = field(default_factory=dict)
    events: dict[int, list[dict]] = field(default_factory=dict)
    alive_at_run1_end: dict[int, list] = field(default_factory=dict)

    def runs(self, node: int) -> list[dict]:
        return [r for c in self.docs[node]["cases"] for r in c["runs"]]

    def fault(self, action: str) -> dict:
        return next(f for f in self.record["faults"] if f["action"] == action)

    def of_run(self, node: int, run: int, kind: str) -> list[dict]:
        return [e for e in self.events[node] if e.get("run") == run and e["event"] == kind
                and "probe" not in e and "profile" not in e]


def event_of(line: str) -> dict | None:
    """A line of a folder's events, or None for a line still being written."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def run1_watcher(out: Path, alive: dict[int, list], stop: threading.Event) -> None:
    """As soon as node k records run 1 (its ``run_end``), what is still alive of run 1's
    processes on node k (every process of a run inherits its folder as TRAINPERF_RUN_ID)."""
    pending = {0, 1}
    while pending and not stop.wait(0.1):
        for node in sorted(pending):
            events = out / f"node-{node}" / "events.jsonl"
            try:
                lines = events.read_text(errors="replace").splitlines()
            except OSError:
                continue
            ends = [e for e in map(event_of, lines)
                    if e and e["event"] == "run_end" and e.get("run") == 1]
            if ends:
                run1 = f"{ends[0]['case']}_b{ends[0]['batch']}_run1"
                alive[node] = left_behind(out / f"node-{node}" / "runs" / run1)
                pending.discard(node)


def emulate(out: Path, faults: list[str], run_args: list[str],
            env: dict[str, str] | None = None) -> Emulated:
    argv = [sys.executable, "-m", "trainperf.cli", "emulate", "--nodes", "2", "--rate", RATE,
            *faults, "--", *RUN, *run_args, "--out", str(out)]
    alive: dict[int, list] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=run1_watcher, args=(out, alive, stop), daemon=True)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    watcher.start()
    try:
        output = proc.communicate(timeout=LIMIT_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()  # the emulated nodes go with it (each node's parent-death signal)
        output = proc.communicate()[0]
    finally:
        stop.set()
        watcher.join()
    done = Emulated(out, proc.returncode, output,
                    json.loads((out / "emulation.json").read_text()), alive_at_run1_end=alive)
    for node in (0, 1):
        folder = out / f"node-{node}"
        done.docs[node] = json.loads((folder / "results.json").read_text())
        done.events[node] = [json.loads(x) for x in
                             (folder / "events.jsonl").read_text().splitlines() if x]
    return done


def framework_env(request, framework: str, tmp_path_factory) -> dict[str, str]:
    """The framework's environment made sure of (built once, never rebuilt), and for JAX its
    fast compilation and a compilation cache the module's JAX runs share."""
    if framework == "torch":
        return {}
    request.getfixturevalue(f"{framework}_python")
    if framework != "jax":
        return {}
    return {"XLA_FLAGS": JAX_FAST_COMPILE,
            "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "jax-cache")}


def assert_nothing_left(done: Emulated) -> None:
    """No process of the call alive (runner, launcher, rank: every one of them names the out
    folder, in its arguments or its TRAINPERF_RUN_ID), and none of its namespaces or links."""
    out = str(done.out.resolve())
    runners = [p.pid for p in psutil.process_iter(["cmdline"])
               if any(out in a or str(done.out) in a for a in p.info["cmdline"] or [])]
    assert runners == [] and left_behind(done.out) == []
    tag = f"{emu.PREFIX}{done.record['tag']}"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert tag not in netns and tag not in links


# ------------------------------------------------------------------------ a cut link

@pytest.fixture(scope="module", params=FRAMEWORKS)
def cut(request, tmp_path_factory) -> Emulated:
    """Node 1's cable pulled at node 0's step ``CUT_STEP`` of run 1 and put back ``RESTORE_S``
    later; the plan's run 2 follows, and its link is slowed at about its step ``SLOW_STEP``."""
    framework = request.param
    env = framework_env(request, framework, tmp_path_factory)
    return emulate(tmp_path_factory.mktemp(f"faults-{framework}"),
                   ["--cut-link", f"1@{CUT_STEP}", "--restore-after", str(RESTORE_S),
                    "--slow-link", f"1@{CUT_STEP + SLOW_STEP}:{SLOW_RATE}"],
                   ["--framework", framework, "--runs", "2", "--iters", str(ITERS),
                    "--stall-timeout", str(STALL_S), "--rdzv-timeout", str(RDZV_S)], env)


def test_a_cut_link_fails_the_run_on_both_nodes_naming_node_and_step(cut):
    cut_at = cut.fault("cut")["node0_steps"]
    records = {n: cut.runs(n)[0] for n in (0, 1)}
    assert [records[n]["status"] for n in (0, 1)] == ["failed", "failed"], cut.output[-3000:]
    seen = records[0]["unreachable"]
    # Both nodes name node 1, whose own link went down (which it saw itself), and the same
    # step: rank 0's steps when node 1 was last heard, a beat or two before the cut (or one
    # more, where the step under way finished with what was already sent).
    assert records[1]["unreachable"] == seen
    assert (seen["node"], seen["link_down"], seen["seen_by"]) == (1, True, [0, 1])
    assert cut_at - 4 <= seen["step"] <= cut_at + 1, (cut_at, seen)
    assert "no carrier" in seen["link"]
    # One account on both nodes: the node and step first, then each node's part: node 1's
    # (its own link is down) and node 0's (node 1 unreachable at that step).
    lead = f"node 1 unreachable at step {seen['step']}, its own link down ({seen['link']}); "
    for n in (0, 1):
        error = records[n]["error"]
        assert error.startswith(lead), error
        assert "node 1: this node's link is down (" in error
        assert f"node 0: node 1 unreachable at step {seen['step']}: not heard from" in error
        assert cut.of_run(n, 1, "run_end")[0]["record"] == records[n]  # as its events keep it


def test_a_cut_run_ends_within_the_stall_timeout(cut):
    cut_t = cut.fault("cut")["t"]
    for node in (0, 1):
        exits = cut.of_run(node, 1, "exit")
        # Every rank of the node's part was stopped by its launcher (the runner stopped the
        # run), within the stall timeout of the cut.
        assert exits and all(x["stopped"] for x in exits), exits
        late = max(x["t"] for x in exits) - cut_t
        assert late <= STALL_S + STOP_MARGIN_S, (node, late)
        # The run is recorded once the nodes have heard each other, which node 0 waits
        # FAILED_HEAR_S at most for.
        end = cut.of_run(node, 1, "run_end")[0]["t"] - cut_t
        assert end <= STALL_S + FAILED_HEAR_S + STOP_MARGIN_S, (node, end)


def test_nothing_of_a_cut_run_is_left(cut):
    # Nothing of run 1 was alive on either node when it recorded the run, and nothing of the
    # call, nor its namespaces, once it ended.
    assert cut.alive_at_run1_end == {0: [], 1: []}
    assert_nothing_left(cut)


def test_after_the_link_is_restored_the_nodes_meet_again_and_the_next_run_is_ok(cut):
    restored = cut.fault("restore")
    assert restored["node"] == 1
    for node in (0, 1):
        run2 = cut.runs(node)[1]
        assert run2["status"] == "ok" and run2["error"] is None, run2
        assert "unreachable" not in run2
        # Run 2 began after the link came back: the nodes met again on the same store.
        assert cut.of_run(node, 2, "run_start")[0]["t"] > restored["t"]
    assert cut.runs(0)[1]["samples_per_s"] > 0
    ports = [json.loads(next((cut.out / f"node-{n}").glob("runs/*_run2/cluster.json"))
                        .read_text())["ports"] for n in (0, 1)]
    assert ports[0] == ports[1]
    # A run failed: each node's command says so, and so does emulate's.
    assert cut.record["exit_codes"] == [1, 1] and cut.code == 1


# ------------------------------------------------------------------- a node that never joins

def waited(events: list[dict]) -> float:
    """Seconds from the runner's start (before the nodes first meet) to run 1's record."""
    start = next(e["t"] for e in events if e["event"] == "runner_start")
    return next(e["t"] for e in events if e["event"] == "run_end" and e["run"] == 1) - start


def test_a_node_that_never_joins_is_named_by_its_rank(tmp_path):
    """By hand (`emulate` gives each node its rank): node 1's cable is out from the start, so
    it never reaches node 0's store. Node 0 names rank 1; node 1 says its own link is down."""
    done = emulate(tmp_path, ["--cut-link", "1@0s"],
                   ["--runs", "2", "--iters", "6", "--rdzv-timeout", str(NEVER_JOINS_RDZV_S)])
    first = {n: done.runs(n)[0] for n in (0, 1)}
    assert first[0]["status"] == first[1]["status"] == "failed"
    assert first[0]["error"].startswith(
        f"node(s) [1] did not arrive for the first meeting within {NEVER_JOINS_RDZV_S} s "
        "(1 of 2 came;"), first[0]["error"]
    assert first[1]["error"].startswith("cannot reach node 0 at "), first[1]["error"]
    assert "this node's link is down (" in first[1]["error"]
    assert "no carrier" in first[1]["error"]
    for n in (0, 1):  # the plan's next run does not wait again
        assert done.runs(n)[1]["error"] == f"not run: {first[n]['error']}"
        assert waited(done.events[n]) <= NEVER_JOINS_RDZV_S + JOIN_MARGIN_S
    assert_nothing_left(done)


def test_a_node_that_never_joins_a_rendezvous_is_counted(tmp_path, emulated_nodes):
    """Through ``--rdzv``: node 0 alone at its own address; the rendezvous says 1 of 2 came."""
    nodes = emulated_nodes(2)
    out = tmp_path / "node-0"
    argv = [sys.executable, "-m", "trainperf.cli", *RUN, "--runs", "1", "--iters", "6",
            "--nnodes", "2", "--rdzv", f"{nodes.addr(0)}:29400", "--rdzv-timeout",
            str(NEVER_JOINS_RDZV_S), "--out", str(out)]
    proc = nodes.start(0, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    output = proc.communicate(timeout=LIMIT_S)[0]
    assert proc.returncode == 1, output[-2000:]
    (run,) = [r for c in json.loads((out / "results.json").read_text())["cases"]
              for r in c["runs"]]
    assert run["status"] == "failed"
    assert run["error"].startswith(
        f"the 2 nodes did not all arrive at the rendezvous {nodes.addr(0)}:29400 within "), run
    assert run["error"].endswith("(1 of 2 came)"), run["error"]
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x]
    assert waited(events) <= NEVER_JOINS_RDZV_S + JOIN_MARGIN_S
    assert nodes.pids() == [] and left_behind(tmp_path) == []


# ------------------------------------------------------------------------ a slowed link

def test_a_slowed_link_shows_in_the_steps_and_the_report_names_the_link(cut):
    slowed = cut
    run = slowed.runs(0)[1]
    assert run["status"] == "ok", slowed.output[-3000:]
    change = run["step_change"]
    # The fault counted node 0's steps over the plan; the run counts its own.
    slow_at = slowed.fault("slow")["node0_steps"] - len(slowed.of_run(0, 1, "step"))
    # The first slow step is the one under way when the link slowed, or the next.
    assert slow_at <= change["at_step"] <= slow_at + 2, (slow_at, change)
    assert change["ratio"] > 1 and change["verdict"] == "link" and change["nodes"] == [1]
    link = change["links"]["1"]
    assert min(link["probes"]) >= 1 and link["ratio"] > 1
    # The last probe is the closing one, taken once every step was over; while the steps ran,
    # the probes kept to their share of the link: at 1 Gbit/s one a second at most, and once
    # a probe had found the slow link (0.8 s a block), none until the steps were over.
    probes = run["link_probes"]["1"]
    steps = len(run["warmup_step_times_s"]) + len(run["step_times_s"])
    assert probes[-1][0] == steps and all(at < steps for at, _ in probes[:-1]), probes
    took = slowed.of_run(0, 2, "run_end")[0]["t"] - slowed.of_run(0, 2, "run_start")[0]["t"]
    assert len(probes) <= 2 + took / PROBE_S, (probes, took)
    # Counted from the first probe that found the slow link, not from the step the fault
    # fired at: a probe that set out at that step may have crossed the link before its rate
    # changed (it then took the fast link's milliseconds).
    first_slow = next(i for i, (_, secs) in enumerate(probes) if secs > 0.1)
    assert probes[first_slow][0] >= slow_at and first_slow >= len(probes) - 2, probes
    report = (slowed.out / "node-0" / "report.md").read_text()
    line = next(x for x in report.splitlines() if x.startswith("- 2n1g b8 run 2: steps "))
    assert f"slower from step {change['at_step']}" in line
    assert "node 1's link measured" in line and "**the link got slower**" in line
    assert "the model got slower" not in report
    assert slowed.runs(1)[1]["status"] == "ok" and "step_change" not in slowed.runs(1)[1]


# ------------------------------------------------------------- the verdict's rules, held

def test_a_lasting_change_is_found_and_a_few_slow_steps_are_not():
    flat = [0.2, 0.21, 0.19, 0.2, 0.22, 0.2, 0.19, 0.21, 0.2, 0.2]
    assert step_change(flat, 2) is None
    spikes = flat[:4] + [0.9] + flat[4:7] + [1.1] + flat[7:]
    assert step_change(spikes, 2) is None
    assert step_change([0.2] * (2 * CHANGE_MIN_STEPS - 1), 0) is None  # too few to say
    slower = flat[:6] + [0.8, 0.85, 0.9, 0.8, 0.82, 0.79]
    change = step_change(slower, 2)
    assert change["at_step"] == 8 and change["ratio"] == pytest.approx(0.82 / 0.2, rel=0.05)
    faster = step_change([x * 3 for x in flat[:5]] + flat, 0)
    assert faster["at_step"] == 5 and faster["ratio"] < 1


def test_the_verdict_tells_the_link_from_the_model():
    change = {"at_step": 12, "before_s": 0.2, "after_s": 0.8, "ratio": 4.0}
    fast, slow = 0.008, 0.9
    link = link_verdict(change, {"1": [[0, fast], [5, fast], [11, fast], [14, slow], [18, slow]]})
    assert (link["verdict"], link["nodes"]) == ("link", [1])
    same = link_verdict(change, {"1": [[0, fast], [6, fast * 1.1], [13, fast], [17, fast]]})
    assert (same["verdict"], same["nodes"]) == ("model", [])
    assert "**the model got slower**" in change_text(same)
    assert "not the link" in change_text(same) and "link got" not in change_text(same)
    # No probe after the change (a node that runs no probe service): no verdict either way.
    blind = link_verdict(change, {"1": [[0, fast], [5, fast]]})
    assert blind["verdict"] == "unclear" and "unknown" in change_text(blind)
    between = link_verdict(change, {"1": [[0, fast], [14, fast * 1.6]]})
    assert between["verdict"] == "unclear"
    # Probes that may not cross the collectives' network (NCCL): alike says nothing.
    other_path = link_verdict(change, {"1": [[0, fast], [13, fast]]}, probes_share_path=False)
    assert other_path["verdict"] == "unclear" and "may not" in change_text(other_path)


def test_the_nodes_agree_on_who_was_unreachable_from_either_side():
    """Node 1 saw its own link down (a step it last heard of, maybe late); node 0 saw node 1
    silent at its own count of rank 0's steps. Either node, having heard the other, says the
    same node and node 0's step; without node 1's word, node 0's view stands."""
    own = {"node": 1, "step": 7, "link_down": True, "link": "eth1: no carrier"}
    silent = {"node": 1, "step": 9, "link_down": False, "link": "eth0"}
    part0 = Outcome("timeout", "run went 5 s without a step", False, unreachable=silent)
    part1 = Outcome("failed", "this node's link is down", True, unreachable=own)
    told = {0: {"status": part0.status, "error": part0.error, "cause": False,
                "unreachable": silent},
            1: {"status": part1.status, "error": part1.error, "cause": True,
                "unreachable": own}}
    on0 = agree(0, part0, {1: told[1]}, 2, 10)
    on1 = agree(1, part1, {0: told[0]}, 2, 10)
    assert on0.unreachable == on1.unreachable == {
        "node": 1, "step": 9, "link_down": True, "link": "eth1: no carrier", "seen_by": [0, 1]}
    assert on0.error == on1.error and on0.status == "failed"
    assert on0.error.startswith("node 1 unreachable at step 9, its own link down (eth1")
    alone = agree(0, part0, {}, 2, 10)
    assert alone.unreachable["seen_by"] == [0] and not alone.unreachable["link_down"]
    assert "node(s) [1] told nothing" in alone.error
