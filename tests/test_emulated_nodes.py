"""Emulated nodes (``trainperf emulate``, ``trainperf.emulated_nodes``): each node its own
namespace, address, link and cores; a 2-node run through the command; nothing left behind,
whether the command ends, is interrupted, fails, or is killed with -9; and a link slowed under
load that still carries its traffic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainperf import emulated_nodes as emu
from trainperf.cli import emulate as cli_emulate
from trainperf.cli import main

RUN = ["run", "tiny-arcface", "--fc", "dp", "--warmup", "1"]


def emulate(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainperf.cli", "emulate", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), **popen)


def left_of(tag: str) -> dict:
    """What of set ``tag`` still exists: namespaces, links, state file, processes."""
    prefix = f"{emu.PREFIX}{tag}"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    procs = [p.pid for p in psutil.process_iter(["cmdline"])
             if any(prefix in a for a in p.info["cmdline"] or [])]
    return {"namespaces": [w for w in netns.split() if w.startswith(prefix)]
            + [p.name for p in emu.NETNS_ETC.glob(f"{prefix}*")],
            "links": [w for w in links.split() if w.startswith(prefix)],
            "state": (emu.STATE_DIR / f"{prefix}.json").exists(), "processes": procs}


NOTHING = {"namespaces": [], "links": [], "state": False, "processes": []}


def tag_of(out: Path) -> str:
    """The tag of the set a call made, from its namespaces' names in its record."""
    return json.loads((out / "emulation.json").read_text())["tag"]


# ------------------------------------------------------------------------------- unit tests

def test_rates_read_as_bits_per_second():
    assert emu.parse_rate("100mbit") == 10**8 and emu.parse_rate("5Gbit") == 5 * 10**9
    assert emu.parse_rate("2.5gbit") == 25 * 10**8 and emu.parse_rate("250000") == 250000
    assert emu.rate_text(10**9) == "1gbit" and emu.rate_text(None) == "unlimited"
    for bad in ("fast", "1tbit", "10kbit"):
        with pytest.raises(ValueError):
            emu.parse_rate(bad)


def test_each_node_gets_its_share_of_cores_and_gpus_and_is_another_host_to_nccl():
    nodes = emu.EmulatedNodes(2, gpus=(0, 1, 2, 3), cores=(0, 1, 2, 3, 4), tag="000001")
    nodes.subnet = "10.99.1"
    assert [nodes.node_cores(n) for n in (0, 1)] == [[0, 1], [2, 3]]
    assert [nodes.addr(n) for n in (0, 1)] == ["10.99.1.1", "10.99.1.2"]
    assert all(len(n) <= 15 for n in (nodes.bridge, nodes.host_link(1), nodes.namespace(1)))
    env = nodes.node_env(1, {})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["NCCL_SOCKET_IFNAME"] == nodes.node_link(1)
    assert env["NCCL_HOSTID"] != nodes.node_env(0, {})["NCCL_HOSTID"]
    assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == "1"
    cpu = emu.EmulatedNodes(3, cores=(0, 1), tag="000002")
    assert cpu.node_env(0, {"CUDA_VISIBLE_DEVICES": "0"})["CUDA_VISIBLE_DEVICES"] == ""
    assert cpu.node_cores(2) == [0, 1]  # fewer cores than nodes: every node shares them
    with pytest.raises(ValueError, match="its own"):
        emu.EmulatedNodes(2, gpus=(0,))


def test_each_node_is_told_how_to_meet_and_where_to_write(tmp_path):
    nodes = emu.EmulatedNodes(2, tag="000003")
    nodes.subnet = "10.99.2"
    command, rest, out = cli_emulate.split_command(["--", *RUN, "--out", str(tmp_path)])
    assert (command, out) == ("run", tmp_path) and "--out" not in rest
    argv = cli_emulate.node_argv(command, rest, nodes, 1, out)
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--master-addr") + 1] == "10.99.2.1"
    assert argv[argv.index("--out") + 1] == str(tmp_path / "node-1")
    bench = cli_emulate.node_argv("commbench", [], nodes, 0, out)
    assert bench[bench.index("--rdzv") + 1] == f"10.99.2.1:{cli_emulate.MASTER_PORT}"
    with pytest.raises(ValueError, match="--node-rank"):
        cli_emulate.split_command(["run", "tiny-arcface", "--node-rank", "1"])
    with pytest.raises(ValueError, match="one of run, commbench"):
        cli_emulate.split_command(["align", "tiny-arcface"])


def test_faults_are_read_as_node_and_step_or_seconds():
    cut = cli_emulate.Fault.parse("cut", "1@30", 2)
    assert (cut.node, cut.at_step, cut.at_s) == (1, 30, None)
    assert cut.due(0.0, 30) and not cut.due(99.0, 29)
    slow = cli_emulate.Fault.parse("slow", "0@2.5s:100mbit", 2)
    assert (slow.at_s, slow.rate_bps) == (2.5, 10**8) and slow.due(2.5, 0)
    for action, bad in (("cut", "2@5"), ("cut", "1"), ("slow", "1@5"), ("cut", "1@soon")):
        with pytest.raises(ValueError, match=f"--{action}-link"):
            cli_emulate.Fault.parse(action, bad, 2)


def test_without_root_it_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["emulate", "--", *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "need root" in err


# ------------------------------------------------------------------------ real namespaces

needs_root = pytest.mark.skipif(emu.missing_privilege() is not None,
                                reason=str(emu.missing_privilege()))


@needs_root
def test_nodes_have_their_own_address_link_rate_and_cores(emulated_nodes):
    nodes = emulated_nodes(2, rate_bps=10**8)
    for n in (0, 1):
        shown = subprocess.run(["ip", "-n", nodes.namespace(n), "-o", "-4", "addr"],
                               capture_output=True, text=True).stdout
        assert f"{nodes.addr(n)}/24" in shown and nodes.node_link(n) in shown
        qdisc = subprocess.run(["ip", "netns", "exec", nodes.namespace(n), "tc", "qdisc",
                                "show", "dev", nodes.node_link(n)],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
    probe = nodes.start(1, [sys.executable, "-c", "import os, socket; name = "
                            "socket.gethostname(); print(sorted(os.sched_getaffinity(0)), "
                            "os.environ['TRAINPERF_EMULATED_NODE'], name, "
                            "socket.gethostbyname(name), socket.gethostbyname("
                            f"{nodes.namespace(0)!r}))"], stdout=subprocess.PIPE, text=True)
    # Its own cores, and a host name of its own that every node resolves to its address.
    assert probe.communicate(timeout=60)[0].split() == [
        *str(nodes.node_cores(1)).split(), "1", nodes.namespace(1), nodes.addr(1), nodes.addr(0)]
    nodes.cut(1)
    carrier = Path(f"/sys/class/net/{nodes.node_link(1)}/carrier")
    seen = subprocess.run(["ip", "netns", "exec", nodes.namespace(1), "cat", str(carrier)],
                          capture_output=True, text=True)
    assert seen.stdout.strip() == "0" or "Invalid argument" in seen.stderr  # no carrier


@needs_root
def test_one_command_runs_two_nodes_and_leaves_nothing(tmp_path):
    proc = emulate("--nodes", "2", "--rate", "1gbit", "--", *RUN, "--runs", "1", "--iters", "3",
                   "--out", str(tmp_path))
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output
    record = json.loads((tmp_path / "emulation.json").read_text())
    assert record["exit_codes"] == [0, 0] and record["rate"] == "1gbit"
    results = json.loads((tmp_path / "node-0" / "results.json").read_text())
    (case,) = results["cases"]
    assert case["nodes"] == 2 and case["runs"][0]["status"] == "ok"
    cluster = json.loads(next((tmp_path / "node-0").glob("runs/*/cluster.json")).read_text())
    assert sorted(cluster["addrs"]) == sorted(record["addrs"])
    assert left_of(record["tag"]) == NOTHING


def start_long_run(tmp_path: Path) -> subprocess.Popen:
    """A run long enough to be stopped in the middle, once node 0 has taken steps."""
    proc = emulate("--nodes", "2", "--", *RUN, "--runs", "3", "--iters", "400",
                   "--out", str(tmp_path), start_new_session=True,
                   # a Ctrl-C reaches it as a terminal's would: a child inherits an ignored
                   # SIGINT (pytest-xdist's workers', a shell's background job's)
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    events = tmp_path / "node-0" / "events.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if events.exists() and cli_emulate.STEP_MARK in events.read_text(errors="replace"):
            return proc
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no step within 240 s: {proc.communicate()[0][-2000:]}")


def tag_from_state(owner: int) -> str:
    for path in emu.STATE_DIR.glob(f"{emu.PREFIX}*.json"):
        state = json.loads(path.read_text())
        if state["owner"] == owner:
            return state["tag"]
    raise AssertionError(f"no state file of process {owner}")


@needs_root
def test_ctrl_c_stops_the_nodes_and_removes_everything(tmp_path):
    proc = start_long_run(tmp_path)
    tag = tag_from_state(proc.pid)
    os.kill(proc.pid, signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    assert left_of(tag) == NOTHING


@needs_root
def test_after_kill_9_the_next_start_removes_what_was_left(tmp_path, emulated_nodes):
    proc = start_long_run(tmp_path)
    tag = tag_from_state(proc.pid)
    proc.kill()
    proc.wait(timeout=30)
    # The nodes' processes go with their parent; the namespaces and links stay until the
    # next start finds their owner gone.
    deadline = time.monotonic() + 60
    while left_of(tag)["processes"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_of(tag)["processes"] == []
    emulated_nodes(2)
    assert left_of(tag) == NOTHING


@needs_root
def test_a_command_that_cannot_run_is_refused_before_any_node_is_made(tmp_path):
    proc = emulate("--nodes", "2", "--", "run", "no-such-recipe", "--out", str(tmp_path))
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "no-such-recipe" in output
    assert not (tmp_path / "emulation.json").exists()  # planned here, before the nodes


def test_a_failing_node_command_fails_the_call_and_leaves_nothing(tmp_path):
    # Planned fine, fails on the nodes: no run can load its framework under 64 MiB.
    proc = emulate("--nodes", "2", "--", "run", "tiny-arcface", "--device", "cpu", "--runs",
                   "1", "--iters", "3", "--warmup", "1", "--memory-limit", "64MiB",
                   "--out", str(tmp_path))
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, output
    assert json.loads((tmp_path / "emulation.json").read_text())["exit_codes"][0] != 0
    assert left_of(tag_of(tmp_path)) == NOTHING


SENDER = """
import socket, sys, time
block = bytes(1 << 20)
with socket.create_connection((sys.argv[1], 29500), timeout=60) as s:
    while True:
        s.sendall(block)
        s.recv(1)
        print(time.time(), flush=True)
"""
SINK = """
import socket, sys
with socket.create_server((sys.argv[1], 29500)) as ls:
    print("listening", flush=True)
    s, _ = ls.accept()
    while True:
        got = 0
        while got < 1 << 20:
            chunk = s.recv(1 << 20)
            if not chunk:
                sys.exit(0)
            got += len(chunk)
        s.sendall(b"k")
"""
SLOWED_RATE = 10**7
LOADED_S = 0.5
"""How long the stream runs at 1 Gbit/s, once its first block has crossed, before the slowing."""
SENDS_AFTER_S = 6.0
"""How long the sender goes on after each slowing: a 1 MiB block crosses 10 Mbit/s in 0.84 s."""


def test_a_link_slowed_under_load_keeps_moving(emulated_nodes):
    """A link slowed while its queue holds the kernel's large (GSO) packets: every packet
    leaves. tbf cuts a packet larger than its bucket at the door only, so a bucket shrunk under
    packets already queued held them, and the link, for good; each slowing takes a fresh
    queue. Three slowings, each under a stream of 1 MiB blocks at 1 Gbit/s."""
    nodes = emulated_nodes(2, rate_bps=10**9)
    for attempt in range(3):
        nodes.set_rate(1, 10**9)
        sink = nodes.start(0, [sys.executable, "-c", SINK, nodes.addr(0)],
                           stdout=subprocess.PIPE, text=True)
        assert sink.stdout.readline() == "listening\n"
        sender = nodes.start(1, [sys.executable, "-c", SENDER, nodes.addr(0)],
                             stdout=subprocess.PIPE, text=True)
        # The stream is under way (a block crossed) on however busy a machine, then slowed.
        assert sender.stdout.readline(), attempt
        time.sleep(LOADED_S)
        slowed_at = time.time()
        nodes.set_rate(1, SLOWED_RATE)
        time.sleep(SENDS_AFTER_S)
        sender.kill()
        acks = [float(t) for t in sender.communicate()[0].split()]
        sink.kill()
        sink.communicate()
        # Blocks crossed after the slowing (a stuck link carries none).
        after = [t for t in acks if t > slowed_at]
        assert len(after) >= 2, (attempt, len(acks), after)
