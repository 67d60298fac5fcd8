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


def test_commbench_takes_faults_in_seconds_only(capsys):
    """commbench has no steps for a fault to count: one given at a step is refused in one line
    before any node is made, never left to not fire."""
    assert main(["emulate", "--nodes", "2", "--cut-link", "1@8", "--", "commbench"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "give a fault's WHEN in seconds" in err


def test_without_root_it_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["emulate", "--", *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "need root" in err


def test_gpus_are_the_inherited_ones_and_too_few_are_refused(monkeypatch, capsys):
    """A scheduler's CUDA_VISIBLE_DEVICES=4,5: node 0 gets GPU 4 and node 1 GPU 5, by those
    names (before, nodes were given 0 and 1, GPUs outside the list). Too few GPUs for every
    node's share is refused in one line, never a node left on the CPU without a word."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    gpus = cli_emulate.node_gpus(2, None)
    assert gpus == ("4", "5") and cli_emulate.node_gpus(2, 1) == ("4", "5")
    nodes = emu.EmulatedNodes(2, gpus=gpus, tag="000004")
    assert [nodes.node_env(n, {})["CUDA_VISIBLE_DEVICES"] for n in (0, 1)] == ["4", "5"]
    assert cli_emulate.node_gpus(2, 0) == ()
    with pytest.raises(ValueError, match="2 visible GPU.s. cannot give each of 3 nodes one"):
        cli_emulate.node_gpus(3, None)
    with pytest.raises(ValueError, match="needs 4 GPUs; CUDA_VISIBLE_DEVICES=4,5 has 2"):
        cli_emulate.node_gpus(2, 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    if cli_emulate.gpu_count() == 0:  # this machine's own count, as nvidia-smi gives it
        assert main(["emulate", "--nodes", "2", "--gpus-per-node", "1", "--", *RUN,
                     "--device", "cpu", "--out", "/nonexistent/never-written"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "needs 2 GPUs; this machine has 0" in err


def test_a_state_file_is_trusted_only_for_the_names_of_its_own_set(tmp_path):
    good = emu.set_names("k3x9q0", 2)
    path = tmp_path / "tpek3x9q0.json"
    state = {"owner": 1, "owner_started": 0.0, "tag": "k3x9q0", **good, "subnet": "10.1.2"}
    assert emu.state_problem(path, state) is None
    for change, said in (({"namespaces": ["tpek3x9q0n0", "../../tmp/x"]}, "namespaces"),
                         ({"links": ["eth0", "tpek3x9q0h1"]}, "links"),
                         ({"bridge": "docker0"}, "bridge"),
                         ({"tag": "../x"}, "tag"), ({"owner": "1"}, "owner")):
        assert said in emu.state_problem(path, {**state, **change})
    assert "name" in emu.state_problem(tmp_path / "tpe000000.json", state)
    assert len({emu.new_tag() for _ in range(50)}) == 50


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


FOREIGN_NS, FOREIGN_LINK = "tpforeign62", "tpdummy62"


@needs_root
def test_clean_refuses_a_state_file_naming_what_emulate_never_made(tmp_path):
    """A stale state file (its owner gone) that names a namespace, a link and a path emulate
    never made: `emulate --clean` refuses it in one line and touches none of them. Before, it
    deleted the namespace, the link and the folder under /tmp, as root."""
    state_dir, victim = tmp_path / "state", tmp_path / "victim"
    state_dir.mkdir()
    victim.mkdir()
    (victim / "kept").write_text("x")
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        subprocess.run(["ip", "netns", "add", FOREIGN_NS], check=True)
        subprocess.run(["ip", "link", "add", FOREIGN_LINK, "type", "bridge"], check=True)
        forged = {"owner": gone.pid, "owner_started": 0.0, "tag": "00000a",
                  "bridge": FOREIGN_LINK, "links": [FOREIGN_LINK],
                  "namespaces": [FOREIGN_NS, f"../../{victim.relative_to('/')}"]}
        (state_dir / "tpe00000a.json").write_text(json.dumps(forged))
        done = subprocess.run([sys.executable, "-m", "trainperf.cli", "emulate", "--clean"],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, TRAINPERF_EMULATED_STATE=str(state_dir)))
        assert done.returncode == 2, done.stdout + done.stderr
        err = done.stderr.strip()
        assert len(err.splitlines()) == 1 and err.startswith("trainperf: error: refused ")
        assert "tpe00000a.json" in err and "nothing it names was touched" in err
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert FOREIGN_NS in netns.split()
        assert subprocess.run(["ip", "link", "show", FOREIGN_LINK],
                              capture_output=True).returncode == 0
        assert (victim / "kept").exists() and (state_dir / "tpe00000a.json").exists()
    finally:
        subprocess.run(["ip", "netns", "del", FOREIGN_NS], capture_output=True)
        subprocess.run(["ip", "link", "del", FOREIGN_LINK], capture_output=True)


SECOND_SET = """
import sys
from trainperf import emulated_nodes as emu
second = emu.EmulatedNodes(2, tag=sys.argv[1])
second.make()
print(second.tag, flush=True)
second.remove()
"""


@needs_root
def test_a_second_set_beside_a_live_one_leaves_it_alone(emulated_nodes):
    """Set A lives, a process running in its node 0. A second set made in another process,
    asking for A's very tag (two emulates that drew the same one), then `emulate --clean`:
    the second takes a fresh tag, and A's namespaces, links, state file and process are as
    they were. Before, the second overwrote A's state file, failed on A's bridge and, taking
    itself down by that file, took A down with it."""
    first = emulated_nodes(2)
    before = left_of(first.tag)
    state = first.state_file.read_text()
    sleeper = first.start(0, ["sleep", "120"])
    try:
        done = subprocess.run([sys.executable, "-c", SECOND_SET, first.tag],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        second_tag = done.stdout.split()[-1]
        assert second_tag != first.tag and left_of(second_tag) == NOTHING
        cleaned = subprocess.run([sys.executable, "-m", "trainperf.cli", "emulate", "--clean"],
                                 capture_output=True, text=True, timeout=120)
        assert first.tag not in cleaned.stdout
        assert sleeper.poll() is None  # still running in A's node 0
        after = left_of(first.tag)
        assert (after["namespaces"], after["links"], after["state"]) == \
            (before["namespaces"], before["links"], True)
        assert first.state_file.read_text() == state
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)


@needs_root
@pytest.mark.slow
def test_a_cut_link_fires_in_a_run_of_two_frameworks_and_one_that_never_came_is_said(
        tmp_path):
    """Two frameworks: node 0 writes node-0/torch and node-0/jax, no node-0/events.jsonl.
    The cut at node 0's step 8 (torch's 6 steps, then JAX's second) fires in JAX's run and is
    put back a second later; a slowing at a step the run never reaches is recorded as not
    fired, said in one line, and fails the call. Before, no step-triggered fault fired with
    several plans, and emulation.json said nothing of it."""
    proc = emulate("--nodes", "2", "--cut-link", "1@8", "--restore-after", "1",
                   "--slow-link", "1@100000:100mbit", "--", "run", "tiny-arcface",
                   "--framework", "torch,jax", "--mode", "default", "--device", "cpu",
                   "--runs", "1", "--iters", "6",
                   "--warmup", "2", "--out", str(tmp_path))
    output = proc.communicate(timeout=600)[0]
    record = json.loads((tmp_path / "emulation.json").read_text())
    cut = [f for f in record["faults"] if f["action"] == "cut"]
    assert len(cut) == 1 and cut[0]["node0_steps"] >= 8, (record["faults"], output[-3000:])
    # torch's run had ended by then: its 6 steps are all in its folder.
    torch_steps = (tmp_path / "node-0" / "torch" / "events.jsonl").read_text().count(
        cli_emulate.STEP_MARK)
    jax_started = min(json.loads(line)["t"] for line in
                      (tmp_path / "node-0" / "jax" / "events.jsonl").read_text().splitlines())
    assert torch_steps == 6 and cut[0]["t"] > jax_started
    assert [f["action"] for f in record["faults"]] == ["cut", "restore"]
    (never,) = record["faults_not_fired"]
    assert never["action"] == "slow" and never["at_step"] == 100000
    assert "node 0 made" in never["why"]
    assert proc.returncode == 1
    assert "--slow-link 1@100000 never fired (node 0 made " in output
    assert left_of(record["tag"]) == NOTHING
