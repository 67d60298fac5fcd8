"""``--mode best`` on several nodes: node 0's probe decides and every node's ranks run in its
choice. Each node is a runner of its own, as on a cluster (here two threads of this process
over loopback); the probe's rates are stood in so that node 0 chooses a mode other than the
default, while the timed run is real: a 2-node DDP job whose both processes must run the same
mode."""

from __future__ import annotations

import json
import threading

import pytest

from mode_runs import stand_in_events
from run_util import left_behind, reserved_ports
from trainperf import results
from trainperf.config import Measure, Topology, Tuning
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner

pytestmark = pytest.mark.slow

MEASURE = Measure(runs=1, iters=4, warmup=2, timeout_s=600)


def node_plan(tmp_path, node: int, port: int) -> Plan:
    topo = Topology(devices_per_node=1, nnodes=2, node_rank=node, master_addr="127.0.0.1",
                    master_port=port, device="cpu", rdzv_timeout_s=240)
    recipe = get_recipe("tiny-arcface")
    return Plan(recipe.name, recipe.workload.replace(num_classes=64), MEASURE, [Case(topo, 4)],
                tmp_path / f"n{node}", Tuning(mode="best"), framework="torch")


def stand_in_probe(runner: Runner, rates: dict[str, float] | None) -> None:
    """Probe rounds at known rates on node 0; on a follower, what it really sees of a round:
    a clean exit and no event (rank 0 writes them, on node 0)."""
    def probe_round(case, kind):
        if rates is None:
            return results.run_record(kind.run, [], "ok"), []
        events = stand_in_events(kind.probe_mode, rates[kind.probe_mode], 2, case.batch_size,
                                 kind.measure(runner.plan.measure))
        return results.run_record(kind.run, events, "ok"), events

    runner._probe_round = probe_round


def test_every_node_runs_node_zeros_choice(tmp_path):
    port = reserved_ports()[0]
    runners = [Runner(node_plan(tmp_path, n, port)) for n in (0, 1)]
    stand_in_probe(runners[0], {"eager": 100.0, "compile": 180.0})
    stand_in_probe(runners[1], None)
    docs: dict[int, dict] = {}
    failed: list[BaseException] = []

    def node(n: int) -> None:
        try:
            docs[n] = runners[n].run()
        except BaseException as exc:  # noqa: BLE001 - told to the test below
            failed.append(exc)

    threads = [threading.Thread(target=node, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not failed and len(docs) == 2, failed
    # The follower decided nothing alone: it took node 0's choice, figures and all.
    assert docs[0]["mode_probe"]["chosen"] == docs[1]["mode_probe"]["chosen"] == "compile"
    assert docs[1]["mode_probe"]["rates"] == docs[0]["mode_probe"]["rates"]
    assert docs[1].get("role") == "follower"
    for n in (0, 1):
        spec = json.loads((tmp_path / f"n{n}" / "runs" / "2n1g_b4_run1" / "spec.json")
                          .read_text())
        assert spec["tuning"]["mode"] == "compile", n
    run = docs[0]["cases"][0]["runs"][0]
    assert run["status"] == "ok" and run["mode"] == "compile", run["error"]
    follower = docs[1]["cases"][0]["runs"][0]
    assert follower["status"] == "ok" and follower["mode"] == "compile"
    assert left_behind(tmp_path) == []
