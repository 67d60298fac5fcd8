"""``--mode best`` on several nodes: node 0's probe decides and every node's ranks run in its
choice. Each node is a runner of its own, as on a cluster (here two threads of this process
over loopback); the probe's rounds are real 2-node runs of every mode torch declares here, and
so is the timed run: a 2-node DDP job whose both processes must run the mode node 0 chose."""

from __future__ import annotations

import json
import threading

import pytest

from run_util import left_behind, reserved_ports
from trainperf.backends import get_backend
from trainperf.config import Measure, Topology, Tuning
from trainperf.recipes import get_recipe
from trainperf.runner import Case, Plan, Runner

pytestmark = pytest.mark.slow

MEASURE = Measure(runs=2, iters=4, warmup=2, timeout_s=600)


def node_plan(tmp_path, node: int, port: int) -> Plan:
    topo = Topology(devices_per_node=1, nnodes=2, node_rank=node, master_addr="127.0.0.1",
                    master_port=port, device="cpu", rdzv_timeout_s=240)
    recipe = get_recipe("tiny-arcface")
    return Plan(recipe.name, recipe.workload.replace(num_classes=64), MEASURE, [Case(topo, 4)],
                tmp_path / f"n{node}", Tuning(mode="best"), framework="torch")


def run_nodes(tmp_path, resume: bool = False) -> dict[int, dict]:
    """Both nodes' runners, each in a thread as on its own machine; their documents."""
    port = reserved_ports()[0]
    runners = [Runner(node_plan(tmp_path, n, port)) for n in (0, 1)]
    docs: dict[int, dict] = {}
    failed: list[BaseException] = []

    def node(n: int) -> None:
        try:
            docs[n] = runners[n].run(resume=resume)
        except BaseException as exc:  # noqa: BLE001 - told to the test below
            failed.append(exc)

    threads = [threading.Thread(target=node, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not failed and len(docs) == 2, failed
    return docs


def events_of(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


def test_every_node_runs_node_zeros_choice(tmp_path):
    docs = run_nodes(tmp_path)
    probe = docs[0]["mode_probe"]
    modes = list(get_backend("torch").modes_on("cpu"))
    assert {r["mode"] for r in probe["rounds"]} == set(modes) and len(modes) > 1
    # Every round a real 2-node run that node 0 timed.
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in probe["rounds"]), \
        probe["rounds"]
    chosen = probe["chosen"]
    assert chosen in modes
    # The follower decided nothing alone: it took node 0's choice, figures and all.
    assert docs[1]["mode_probe"]["chosen"] == chosen
    assert docs[1]["mode_probe"]["rates"] == probe["rates"]
    assert docs[1].get("role") == "follower"
    for n in (0, 1):
        spec = json.loads((tmp_path / f"n{n}" / "runs" / "2n1g_b4_run1" / "spec.json")
                          .read_text())
        assert spec["tuning"]["mode"] == chosen, n
        for mode in modes:  # both nodes ran both rounds of every mode
            for r in (1, 2):
                assert (tmp_path / f"n{n}" / "runs" / f"2n1g_b4_probe-{mode}-{r}").is_dir()
    run = docs[0]["cases"][0]["runs"][0]
    assert run["status"] == "ok" and run["mode"] == chosen, run["error"]
    follower = docs[1]["cases"][0]["runs"][0]
    assert follower["status"] == "ok" and follower["mode"] == chosen

    # Cut both folders as at run 2's start, node 1's record of the choice turned to the
    # other mode (a folder that disagrees), and resume both: the nodes agree again on node 0's
    # choice, and run 2 goes in it on both. Before, node 1 took its own record.
    other = next(m for m in modes if m != chosen)
    for n in (0, 1):
        folder = tmp_path / f"n{n}"
        events = events_of(folder)
        cut = next(i for i, e in enumerate(events)
                   if e["event"] == "run_start" and e.get("run") == 2 and "probe" not in e)
        kept = events[:cut]
        if n == 1:
            for e in kept:
                if e["event"] == "mode_probe":
                    e["probe"]["chosen"] = other
        (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    again = run_nodes(tmp_path, resume=True)
    assert again[0]["mode_probe"]["chosen"] == again[1]["mode_probe"]["chosen"] == chosen
    assert any(e.get("agreed_on_resume") for e in events_of(tmp_path / "n1"))
    for n in (0, 1):
        spec = json.loads((tmp_path / f"n{n}" / "runs" / "2n1g_b4_run2" / "spec.json")
                          .read_text())
        assert spec["tuning"]["mode"] == chosen, n
    assert [r["status"] for r in again[0]["cases"][0]["runs"]] == ["ok", "ok"]
    assert again[0]["cases"][0]["runs"][1]["mode"] == chosen
    assert left_behind(tmp_path) == []
