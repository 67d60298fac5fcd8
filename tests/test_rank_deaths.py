"""A rank that dies says how: the run's error names the rank, its signal or exit code and where
rank 0 was, then the last lines of that rank's own output (banners and log noise left out), and
only then a surviving rank's broken connection. For torch and for Paddle (both started by
``trainperf.backends.spawn``), on 1 and 2 ranks, a rank killing itself with SIGSEGV and one
aborting after a framework's banner and glibc's complaint (``TRAINPERF_FAULT``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from run_util import assert_a_suspended_rank_is_named, left_behind
from trainperf import results
from trainperf.backends import spawn
from trainperf.backends.loop import MAX_STEPS_IN_FLIGHT
from trainperf.cli import main
from trainperf.outcome import Outcome, agree, decide, how_it_ended, last_words, one_line
from trainperf.protocol import Error, Exit, Step, decode

BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
GLIBC = "munmap_chunk(): invalid pointer"
ABORT = f"abort={BANNER}|{GLIBC}"
# Rank 0 alone dies at step 2 in the 1-rank case, rank 1 of 2 at step 3 in the other.
SEGV_FIRST = f"segv@2:1,{ABORT}@3:2/1"
ABORT_FIRST = f"{ABORT}@2:1,segv@3:2/1"
LATE = {"torch": 0, "paddle": MAX_STEPS_IN_FLIGHT}


def deaths_of(framework: str, fault: str, out: Path, monkeypatch, *extra: str) -> list[dict]:
    monkeypatch.setenv("TRAINPERF_FAULT", fault)
    code = main(["run", "tiny-arcface", "--framework", framework, "--devices", "1,2",
                 "--runs", "1", "--iters", "6", "--warmup", "1", "--device", "cpu", *extra,
                 "--out", str(out)])
    assert code == 1
    runs = [c["runs"][0] for c in results.load(out)["cases"]]
    assert [r["status"] for r in runs] == ["failed", "failed"]
    assert left_behind(out) == []
    return runs


def death(error: str, rank: int, signal: str, step: int, late: int) -> str:
    """What the error says after naming the death: rank 0's step is the first it had not
    reported, which for a backend that keeps steps in flight may lag the step that died by
    ``late``."""
    for s in range(step - late, step + 1):
        head = f"rank {rank} died of {signal} at step {s}"
        if error.startswith(head):
            return error[len(head):]
    raise AssertionError(error)


def check_segv(error: str, rank: int, step: int, framework: str) -> None:
    rest = death(error, rank, "SIGSEGV (signal 11)", step, LATE[framework])
    if framework == "torch":
        # Python's fault handler: its line and where Python was. (Paddle installs a handler
        # of its own in its place, which prints only the signal.)
        assert rest.startswith(": Fatal Python error: Segmentation fault | in inject (faults.py:")
    assert "FatalError" not in rest and "OMP_NUM_THREADS" not in rest, rest


def check_abort(error: str, rank: int, step: int, framework: str) -> None:
    rest = death(error, rank, "SIGABRT (signal 6)", step, LATE[framework])
    assert rest.startswith(f": {GLIBC}"), rest
    assert "absl" not in rest and "FatalError" not in rest, rest


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_a_rank_that_dies_is_named_with_its_signal_and_its_last_words(
        framework, tmp_path, monkeypatch, request):
    if framework == "paddle":
        request.getfixturevalue("paddle_python")
    extra = ["--fc", "mp"] if framework == "paddle" else []
    one, two = deaths_of(framework, SEGV_FIRST, tmp_path / "segv", monkeypatch, *extra)
    check_segv(one["error"], 0, 2, framework)
    check_abort(two["error"], 1, 3, framework)
    one, two = deaths_of(framework, ABORT_FIRST, tmp_path / "abort", monkeypatch, *extra)
    check_abort(one["error"], 0, 2, framework)
    check_segv(two["error"], 1, 3, framework)


@pytest.mark.slow
def test_a_suspended_torch_rank_is_named_with_where_the_run_stalled(tmp_path):
    """Rank 1 stopped with SIGSTOP while rank 0 waits on it in DDP's all-reduce (every other
    backend's file has the same test)."""
    error = assert_a_suspended_rank_is_named("torch", tmp_path / "r")
    assert error.startswith("rank 1 was found suspended (stopped by SIGSTOP or a debugger) at "
                            "step 1 and never resumed")


def test_a_launcher_tells_a_suspended_rank_and_asks_the_others_where_they_are(tmp_path):
    """What the launcher does when it stops a hung run, on plain processes: the one stopped by
    SIGSTOP is noted suspended and killed at once (SIGTERM would stay pending); the one still
    running writes its stack, which says where it was."""
    sleeper = ("import faulthandler, signal, time; faulthandler.register(signal.SIGUSR1, "
               "all_threads=True); print('ready', flush=True)\ndef wait_here():\n    "
               "time.sleep(600)\nwait_here()")
    members = spawn.Members(str(tmp_path), str(tmp_path / "events.jsonl"))
    stopped = members.start([sys.executable, "-c", "import os, signal; "
                             "os.kill(os.getpid(), signal.SIGSTOP)"], dict(os.environ), 1)
    waiting = members.start([sys.executable, "-c", sleeper], dict(os.environ), 0)
    for _ in range(300):
        if (spawn.process_state(stopped.proc.pid) == "T"
                and "ready" in Path(waiting.log).read_text()):
            break
        time.sleep(0.05)
    spawn.look_before_stopping(members.workers, dump_stacks=True)
    assert (stopped.suspended, stopped.stack_dumped) == (True, False)
    assert (waiting.suspended, waiting.stack_dumped) == (False, True)
    spawn.stop(members.workers, grace_s=5)
    members.report_ended()
    events = [decode(json.loads(line))
              for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    got = decide(events, timed_out=True)
    assert got.status == "timeout"
    assert got.error == ("rank 1 was found suspended (stopped by SIGSTOP or a debugger) before "
                         "the first step and never resumed; then the run exceeded its timeout "
                         "and was killed; where each rank was: rank 0 in wait_here "
                         "(<string>:3)"), got.error


def test_a_collective_that_gave_up_on_a_suspended_rank_is_a_hang():
    """Paddle's gloo and TensorFlow's collectives give up on a suspended peer by themselves
    (after about a minute): the run is a ``timeout`` naming the suspended rank first, then the
    collective's own one line."""
    tf = ("UnavailableError: Graph execution error:\n\nDetected at node CollectiveReduceV2 "
          "defined at (most recent call last):\n  File \"<frozen runpy>\", line 198, in "
          "_run_module_as_main\n\nCollective ops is aborted by: Error reported from "
          "/job:worker/task:1: The following tasks are unhealthy (stopped sending "
          "heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed.")
    events = [Step(index=i, seconds=0.1, samples=16, warmup=False, t=i) for i in range(3)]
    events += [Error(kind="exception", message=tf, rank=0, t=60.0),
               Exit(returncode=1, rank=0, t=61.0),
               Exit(returncode=-9, stopped=True, suspended=True, rank=1, t=62.0)]
    got = decide(events, timed_out=False)
    assert (got.status, got.cause) == ("timeout", True)
    assert got.error == (
        "rank 1 was found suspended (stopped by SIGSTOP or a debugger) at step 3 and never "
        "resumed; then rank 0: UnavailableError: Graph execution error: Collective ops is "
        "aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy "
        "(stopped sending heartbeats): /job:worker/replica:0/task:1")
    assert one_line("RuntimeError: plain") == "RuntimeError: plain"


def test_exit_statuses_in_words():
    assert how_it_ended(-11) == "died of SIGSEGV (signal 11)"
    assert how_it_ended(-9) == "died of SIGKILL (signal 9)"
    assert how_it_ended(134) == "exited with code 134 (SIGABRT)"
    assert how_it_ended(1) == "exited with code 1"
    assert how_it_ended(255) == "exited with code 255"
    assert how_it_ended(-99) == "died of signal 99"


def test_last_words_leave_out_banners_and_cut_a_fault_dump(tmp_path):
    log = tmp_path / "rank-1.log"
    log.write_text("\n".join([
        BANNER,
        "I0000 00:00:1795613150.242507    3263 port.cc:153] oneDNN custom operations are on.",
        "To enable the following instructions: AVX2 AVX512F FMA, in other operations, "
        "rebuild TensorFlow with the appropriate compiler flags.",
        "/x/site-packages/paddle/fluid/a.py:12: UserWarning: something deprecated",
        "  warnings.warn(",
        "[W1125 13:22:01.123456 99 ProcessGroupGloo.cpp:42] Warning: a torch warning",
        "",
        "corrupted size vs. prev_size",
        "Fatal Python error: Aborted",
        "",
        "Thread 0x00007f79effff6c0 (most recent call first):",
        '  File "/usr/lib/python3.11/threading.py", line 327 in wait',
        "",
        "Thread 0x00007f7a36e76b80 (most recent call first):",
        '  File "/env/site-packages/tensorflow/python/eager/execute.py", line 53 in '
        "quick_execute",
        '  File "/home/u/.cache/trainperf/envs/tf/lib/site.py", line 9 in helper',
        '  File "/src/trainperf/backends/tf/step.py", line 219 in __call__',
        '  File "/src/trainperf/backends/tf/worker.py", line 159 in one_step',
        "",
        "Extension modules: numpy._core._multiarray_umath, h5py._errors (total: 2)",
    ]) + "\n")
    # No thread was current (the crash came from a framework thread): the main thread, listed
    # last, says where Python was, and where trainperf's own code called the framework.
    assert last_words(log) == [
        "corrupted size vs. prev_size", "Fatal Python error: Aborted",
        "in quick_execute (execute.py:53), called from __call__ (step.py:219)"]
    assert last_words(log, 1) == last_words(log)[-1:]
    assert last_words(tmp_path / "missing.log") == [] and last_words(None) == []


def test_nodes_agree_on_one_outcome():
    """Node 0 measured the window (ok) while a rank of node 1 died: the run failed on both,
    the cause first wherever it happened, then what it did to the others."""
    ok = Outcome("ok", None)
    died = {"status": "failed", "cause": True,
            "error": "rank 1 died of SIGABRT (signal 6): munmap_chunk(): invalid pointer"}
    reset = Outcome("failed", "RuntimeError: Connection reset by peer", False)
    assert agree(0, ok, {1: {"status": "ok", "error": None, "cause": False}}, 2, 60) == ok
    got = agree(0, ok, {1: died}, 2, 60)
    assert (got.status, got.error) == ("failed", f"node 1: {died['error']}")
    got = agree(0, reset, {1: died}, 2, 60)
    assert got.error == (f"node 1: {died['error']}; node 0: RuntimeError: Connection reset by "
                         "peer")
    # An out-of-memory anywhere makes the run an out-of-memory (capacity searches read it).
    oom = {"status": "oom", "error": "CUDA out of memory", "cause": True}
    assert agree(1, reset, {0: oom}, 2, 60).status == "oom"
    # A node that never told: the run failed, and the error says who and how long it waited.
    got = agree(0, ok, {}, 3, 300)
    assert got.status == "failed" and got.error == (
        "node(s) [1, 2] told nothing of how the run ended within 300 s (stopped, or its "
        "network failed)")
    # Only broken connections everywhere: a lost peer, said so.
    got = agree(1, reset, {0: {"status": "failed", "error": "Connection closed",
                               "cause": False}}, 2, 60)
    assert got.error.endswith("(a peer node stopped or its network failed)")
