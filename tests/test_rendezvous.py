"""Several nodes meeting through ``--rdzv``: over loopback, across two network namespaces, a
node that never comes, and a node that dies mid-run. Each "node" is its own ``trainperf run``
process, as on a cluster."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from run_util import left_behind, reserved_ports
from trainperf.backends import get_backend
from trainperf.cli import main
from trainperf.config import Topology
from trainperf.rendezvous import parse_endpoint

pytestmark = pytest.mark.slow

NODE_ARGS = ["tiny-arcface", "--device", "cpu", "--devices", "1", "--nnodes", "2",
             "--warmup", "2"]
STEP_LINE = '"event": "step"'


def start_node(out: Path, endpoint: str, *extra: str, netns: str | None = None,
               timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.Popen:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    argv = [*prefix, sys.executable, "-m", "trainperf.cli", "run", *NODE_ARGS, "--rdzv",
            endpoint, "--rdzv-timeout", str(timeout_s), "--out", str(out), *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def finish(procs: list[subprocess.Popen], limit_s: float = 300) -> list[int]:
    # A generous limit that only stops a hung test; the outcome is decided by the results.
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=limit_s))
        except subprocess.TimeoutExpired:
            kill_process_tree(p.pid)
            codes.append(-9)
    return codes


def kill_process_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for q in tree:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=10)


def runs_of(folder: Path) -> tuple[dict, list[dict]]:
    doc = json.loads((folder / "results.json").read_text())
    return doc, [r for c in doc["cases"] for r in c["runs"]]


def check_pair(tmp_path: Path, codes: list[int]) -> None:
    """Both nodes ran the plan: one holds the measurement of a 2-node world, the other is a
    follower, and both were told the same cluster."""
    logs = {n: (tmp_path / f"n{n}.log").read_text(errors="replace")[-1500:] for n in (0, 1)}
    assert codes == [0, 0], logs
    docs = {n: runs_of(tmp_path / f"n{n}") for n in (0, 1)}
    leaders = [n for n, (doc, _) in docs.items() if doc.get("role") != "follower"]
    assert len(leaders) == 1, docs
    doc, runs = docs[leaders[0]]
    case = doc["cases"][0]
    assert (case["case"], case["world_size"], case["nodes"]) == ("2n1g", 2, 2)
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in runs)
    assert runs[0]["samples_per_step"] == 16  # both nodes' batches of 8
    follower_runs = docs[1 - leaders[0]][1]
    assert [r["status"] for r in follower_runs] == ["ok"] * len(runs)
    assert all(r["error"] is None for r in follower_runs)
    for run_dir in (tmp_path / "n0" / "runs").iterdir():
        clusters = [json.loads((tmp_path / f"n{n}" / "runs" / run_dir.name / "cluster.json")
                               .read_text()) for n in (0, 1)]
        assert sorted(c["node_rank"] for c in clusters) == [0, 1]
        assert clusters[0]["addrs"] == clusters[1]["addrs"]
        assert clusters[0]["ports"] == clusters[1]["ports"]
    assert left_behind(tmp_path) == []


def test_endpoint_and_layout_errors():
    assert parse_endpoint("node001:29400") == ("node001", 29400)
    assert parse_endpoint("[fe80::1]:29400") == ("fe80::1", 29400)
    for bad in ("node001", ":29400", "node001:http", "node001:70000"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_endpoint(bad)
    with pytest.raises(ValueError, match="--nnodes"):
        Topology(nnodes=1, rdzv="127.0.0.1:29400")
    with pytest.raises(ValueError, match="drop --node-rank"):
        Topology(nnodes=2, node_rank=1, rdzv="127.0.0.1:29400")
    with pytest.raises(ValueError, match="--rdzv-timeout"):
        Topology(nnodes=2, rdzv="127.0.0.1:29400", rdzv_timeout_s=0)
    # Every backend starts from a hand-given node rank and master address too: node 0 hosts
    # the store the nodes meet on.
    for name in ("torch", "paddle", "mxnet"):
        assert get_backend(name).capabilities.several_nodes


def test_cli_rejects_bad_rendezvous_options(tmp_path, capsys):
    base = ["run", *NODE_ARGS, "--out", str(tmp_path / "x")]
    assert main([*base, "--rdzv", "nohost"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert main(["run", "tiny-arcface", "--rdzv", "127.0.0.1:1234", "--out",
                 str(tmp_path / "y")]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_two_nodes_meet_over_loopback(tmp_path):
    endpoint = f"127.0.0.1:{reserved_ports()[0]}"
    procs = [start_node(tmp_path / f"n{n}", endpoint, "--runs", "2", "--iters", "6")
             for n in (0, 1)]
    check_pair(tmp_path, finish(procs))


def test_a_node_that_never_comes_is_a_recorded_failure(tmp_path):
    """Two nodes of a 3-node plan come; the third never does. Each records the failed first
    meeting, and the two folders say one leader (the node hosting the rendezvous, node 0 as
    far as anyone knows) and one follower: before, both wrote themselves as the leader."""
    endpoint = f"127.0.0.1:{reserved_ports()[0]}"
    procs = [start_node(tmp_path / f"n{n}", endpoint, "--nnodes", "3", "--runs", "2",
                        "--iters", "6", timeout_s=3) for n in (0, 1)]
    assert finish(procs) == [1, 1]
    roles, errors = [], []
    for n in (0, 1):
        doc, runs = runs_of(tmp_path / f"n{n}")
        roles.append(doc.get("role", "leader"))
        assert [r["status"] for r in runs] == ["failed", "failed"]
        assert "rendezvous" in runs[0]["error"]
        errors.append(runs[0]["error"])
        assert runs[1]["error"].startswith("not run:")  # no second wait of the same length
    # The first to give up says how many came; the other may find the rendezvous closed.
    assert any("did not all arrive" in e and "2 of 3 came" in e for e in errors), errors
    assert sorted(roles) == ["follower", "leader"]
    assert left_behind(tmp_path) == []


def test_a_node_killed_mid_run_is_a_recorded_failure_on_the_other(tmp_path):
    endpoint = f"127.0.0.1:{reserved_ports()[0]}"
    procs = [start_node(tmp_path / f"n{n}", endpoint, "--runs", "1", "--iters", "100000")
             for n in (0, 1)]
    leader = None
    for _ in range(3000):  # until rank 0 has measured a few steps (or a node gave up)
        for n in (0, 1):
            events = tmp_path / f"n{n}" / "events.jsonl"
            if events.exists() and events.read_text().count(STEP_LINE) >= 3:
                leader = n
        if leader is not None or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    assert leader is not None, [(tmp_path / f"n{n}.log").read_text()[-800:] for n in (0, 1)]
    kill_process_tree(procs[1 - leader].pid)  # the whole node goes, as a machine would
    assert finish([procs[leader]]) == [1]
    _, runs = runs_of(tmp_path / f"n{leader}")
    assert runs[0]["status"] == "failed"
    assert "peer node stopped" in runs[0]["error"]
    assert left_behind(tmp_path) == []


def test_a_rank_that_dies_after_the_last_step_fails_the_run_on_both_nodes(tmp_path):
    """Global rank 1 (node 1's only rank) aborts after the last step of every run, once rank 0
    on node 0 has written ``end``. Node 0 hears it from node 1 and records each run as failed
    with that cause instead of waiting on its dead peer (which would end in a timeout, not a
    failure), and both nodes go on to the next run."""
    endpoint = f"127.0.0.1:{reserved_ports()[0]}"
    fault = {"TRAINPERF_FAULT": "abort=munmap_chunk(): invalid pointer@6:2/1"}
    procs = [start_node(tmp_path / f"n{n}", endpoint, "--runs", "2", "--iters", "6",
                        "--timeout", "240", env=fault) for n in (0, 1)]
    codes = finish(procs)
    docs = {n: runs_of(tmp_path / f"n{n}") for n in (0, 1)}
    logs = {n: (tmp_path / f"n{n}.log").read_text(errors="replace")[-1500:] for n in (0, 1)}
    assert codes == [1, 1], logs
    for n, (_, runs) in docs.items():
        assert [r["status"] for r in runs] == ["failed", "failed"], (n, runs)
        for r in runs:
            assert "rank 1 died of SIGABRT (signal 6)" in r["error"], r["error"]
            assert "munmap_chunk(): invalid pointer" in r["error"]
    leader = next(n for n, (doc, _) in docs.items() if doc.get("role") != "follower")
    for r in docs[leader][1]:
        # Rank 0 measured the window before its peer died; the cause leads the error.
        assert r["window_s"] and r["samples_per_s"] is None
        assert r["error"].startswith("node 1: rank 1 died of SIGABRT (signal 6)"), r["error"]
    assert left_behind(tmp_path) == []


def make_namespaces(tag: str, subnet: str) -> list[str]:
    """Two network namespaces joined by a veth pair, ``subnet.1`` and ``subnet.2``."""
    names = [f"tp{tag}a", f"tp{tag}b"]
    commands = [["ip", "netns", "add", names[0]], ["ip", "netns", "add", names[1]],
                ["ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b"]]
    for i, name in enumerate(names):
        dev = f"v{tag}{'ab'[i]}"
        commands += [["ip", "link", "set", dev, "netns", name],
                     ["ip", "-n", name, "addr", "add", f"{subnet}.{i + 1}/24", "dev", dev],
                     ["ip", "-n", name, "link", "set", dev, "up"],
                     ["ip", "-n", name, "link", "set", "lo", "up"]]
    for cmd in commands:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            drop_namespaces(names)
            pytest.skip(f"cannot create network namespaces here ({' '.join(cmd)}: "
                        f"{done.stderr.strip()})")
    return names


def drop_namespaces(names: list[str]) -> None:
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2's `ip` is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_two_nodes_meet_across_network_namespaces(tmp_path):
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.{random.randrange(100, 250)}.{random.randrange(0, 250)}"
    names = make_namespaces(tag, subnet)
    procs = []
    try:
        # Each node sees only its own address; the hostname resolves to neither.
        endpoint = f"{subnet}.1:29400"
        procs = [start_node(tmp_path / f"n{n}", endpoint, "--runs", "1", "--iters", "6",
                            netns=names[n]) for n in (0, 1)]
        codes = finish(procs)
    finally:
        for p in procs:
            kill_process_tree(p.pid)
        drop_namespaces(names)
    check_pair(tmp_path, codes)
    addrs = json.loads(next(tmp_path.glob("n0/runs/*/cluster.json")).read_text())["addrs"]
    assert sorted(addrs) == [f"{subnet}.1", f"{subnet}.2"]
