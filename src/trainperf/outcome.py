"""How a run ended, in words: its status, and an error that names the cause first.

A run's processes tell the runner what happened in two ways: a worker that fails in Python writes
an ``error`` event, and the launcher writes an ``exit`` event for every process it started (its
exit status, whether the launcher stopped it, and its own output file). A process that died of a
signal, or left with a code and no ``error``, died of something native (memory corruption, an
abort, the kernel's out-of-memory killer): that is the cause, and it is named first, with where
the run was and the last lines of that process's own output that say why (framework banners and
log noise left out). A surviving rank's broken connection comes after, as its consequence.

Standard library only; the runner imports it and it imports no framework.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from .protocol import End, Error, Event, Exit, Step

LOST_PEER_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused",
                   "timed out", "timeout")

NOISE = [re.compile(p) for p in (
    # absl / glog INFO and WARNING lines (TensorFlow, Paddle, JAX's XLA), and absl's banner.
    r"^[IW]\d{4} \d\d:\d\d:\d\d",
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called",
    r"^To enable the following instructions: .* rebuild TensorFlow",
    # torch's C++ warnings ("[W1125 13:22:01.12 ...] Warning: ...").
    r"^\[[IW]\d{4} \d\d:\d\d:\d\d",
    # Python warnings: "file.py:12: UserWarning: ..." and the source line shown under it.
    r"^\S+:\d+: \w*Warning: ",
    r"^\s+warnings\.warn\(",
    # Paddle's banner of changed flags, and the summary its own signal handler prints (the
    # signal itself is said from the exit status).
    r"^(-{5,}|={5,})", r"^FLAGS\(name=", r"^C\+\+ Traceback \(most recent call last\):$",
    r"^No stack trace in paddle", r"^Error Message Summary:$",
    r"^FatalError: `.*` is detected by the operating system\.$",
    r"^\s*\[(TimeInfo|SignalInfo): \*\*\*",
    r"^WARNING: OMP_NUM_THREADS set to \d+, not 1", r"^PLEASE USE OMP_NUM_THREADS WISELY",
)]
FAULT_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")
OWN_CODE = re.compile(r"/trainperf/(backends/|scale/|[a-z_]+\.py$)")
FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def is_lost_peer(text: str | None) -> bool:
    """An error that a rank gets when another process of the run went away."""
    low = (text or "").lower()
    return any(w in low for w in LOST_PEER_WORDS)


def how_it_ended(returncode: int) -> str:
    """``died of SIGSEGV (signal 11)``, ``exited with code 134 (SIGABRT)``, ``exited with code
    1``. A shell or a launcher that wraps a process reports a death by signal N as 128 + N."""
    if returncode < 0:
        name = _signal_name(-returncode)
        return (f"died of {name} (signal {-returncode})" if name
                else f"died of signal {-returncode}")
    name = _signal_name(returncode - 128) if returncode > 128 else None
    return f"exited with code {returncode}" + (f" ({name})" if name else "")


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def last_words(log: str | Path | None, count: int = 3) -> list[str]:
    """The last ``count`` lines of a process's output that say something: framework banners,
    INFO/WARNING log lines and Python warnings left out, and a fault handler's dump of every
    thread's stack cut to one line: the innermost Python frame of the thread that crashed, or,
    where that thread runs no Python (a framework's own thread), of the main thread, which the
    dump lists last."""
    if not log:
        return []
    try:
        lines = Path(log).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    kept: list[str] = []
    dump: list[tuple[bool, list[re.Match]]] = []  # (current thread, its frames) per thread

    def close_dump() -> None:
        frames = next((f for current, f in dump if current and f), None)
        if frames is None and dump:
            frames = dump[-1][1]
        if frames:
            text = _frame_text(frames[0])
            # Where trainperf's own code called into the framework, when it is further out.
            ours = next((f for f in frames if OWN_CODE.search(f["path"])), None)
            if ours is not None and ours is not frames[0]:
                text += f", called from {_frame_text(ours)[3:]}"
            kept.append(text)
        dump.clear()

    for line in lines:
        text = line.rstrip()
        if not text.strip() or any(p.search(text) for p in NOISE):
            continue
        header = FAULT_HEADER.match(text)
        if header:
            dump.append((header.group(1) == "Current thread", []))
            continue
        if dump:
            frame = FRAME.match(text)
            if frame:
                dump[-1][1].append(frame)
                continue
            if text.strip() == "<no Python frame>" or text.startswith("Extension modules:"):
                continue
            close_dump()
        kept.append(text.strip())
    close_dump()
    return kept[-count:]


def _frame_text(frame: re.Match) -> str:
    return f"in {frame['func']} ({Path(frame['path']).name}:{frame['line']})"


def progress_at(t: float, events: list[Event], has_rank0: bool = True) -> str:
    """Where rank 0 was at time ``t``: ``before the first step``, ``at step N`` (N steps done),
    ``after the last step``; empty on a node without rank 0 (a follower), which sees no steps."""
    if not has_rank0:
        return ""
    end = next((e for e in events if isinstance(e, End)), None)
    if end is not None and end.t <= t:
        return "after the last step"
    done = sum(1 for e in events if isinstance(e, Step) and e.t <= t)
    return f"at step {done}" if done else "before the first step"


def deaths(events: list[Event]) -> list[Exit]:
    """Processes that died of themselves: a signal the launcher did not send, or a non-zero
    code without an ``error`` event of their own to explain it. Earliest first."""
    explained = {(e.rank, e.exit_code) for e in events if isinstance(e, Error)}
    out = [x for x in events if isinstance(x, Exit) and x.returncode != 0 and not x.stopped
           and not (x.rank >= 0 and (x.rank, x.returncode) in explained)]
    return sorted(out, key=lambda x: x.t)


def death_text(x: Exit, events: list[Event], has_rank0: bool = True) -> str:
    where = progress_at(x.t, events, has_rank0)
    words = last_words(x.log)
    text = " ".join(filter(None, (x.name, how_it_ended(x.returncode), where)))
    return f"{text}: {' | '.join(words)}" if words else text


@dataclass(frozen=True)
class Outcome:
    status: str
    """``ok``, ``oom``, ``timeout`` or ``failed`` (``results.RUN_STATUSES``)."""
    error: str | None
    cause: bool = False
    """The error names a cause (a death, an exception of its own), not only a lost peer."""


CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)
"""How native code dies when an allocation it did not check fails."""


def _crashed(x: Exit) -> bool:
    code = -x.returncode if x.returncode < 0 else x.returncode - 128
    return code in CRASH_SIGNALS


def decide(events: list[Event], timed_out: bool, has_rank0: bool = True,
           memory_capped: bool = False) -> Outcome:
    """The run's status and error text, from what its processes wrote and how they ended
    (``has_rank0``: this node runs rank 0, whose steps say where a death happened;
    ``memory_capped``: the processes ran under ``--memory-limit``)."""
    errors = [e for e in events if isinstance(e, Error)]
    dead = deaths(events)
    died = "; ".join(death_text(x, events, has_rank0) for x in dead)
    if timed_out:
        text = "run exceeded its timeout and was killed"
        return Outcome("timeout", f"{died}; then the {text}" if died else text, bool(died))
    oom = next((e for e in errors if e.kind == "oom"), None)
    if oom is not None:
        return Outcome("oom", oom.message, True)
    # Causes first: a rank's own exception before a peer's broken connection.
    errors.sort(key=lambda e: (is_lost_peer(e.message), e.rank))
    if dead:
        after = "; ".join(f"then rank {e.rank}: {e.message}" for e in errors)
        text = "; ".join(filter(None, (died, after)))
        if memory_capped and all(_crashed(x) for x in dead):
            # Under the cap, malloc returns NULL where the machine would have had memory, and
            # native code that does not check it crashes: that probe did not fit.
            return Outcome("oom", f"{text} (taken as out of memory: a crash under "
                                  f"--memory-limit)", True)
        return Outcome("failed", text, True)
    if any(isinstance(e, End) for e in events):
        # The window was measured and reported; an exception while shutting down does not
        # undo that. The runner records the exit beside the figure.
        return Outcome("ok", None)
    if errors:
        return Outcome("failed", errors[0].message, not is_lost_peer(errors[0].message))
    return Outcome("failed", None)


def agree(node_rank: int, here: Outcome, heard: dict[int, dict], nnodes: int,
          waited_s: float) -> Outcome:
    """One outcome for a run on several nodes, from this node's and what the others told
    (``{node: {"status", "error", "cause"}}``): it failed on every node if it failed on any,
    and the error names each failed node's part, causes first."""
    parts = {node_rank: {"status": here.status, "error": here.error, "cause": here.cause},
             **heard}
    missing = [n for n in range(nnodes) if n not in parts]
    bad = {n: p for n, p in parts.items() if p.get("status") != "ok"}
    if not bad and not missing:
        return here
    statuses = {p.get("status") for p in bad.values()}
    status = next((s for s in ("oom", "failed", "timeout") if s in statuses), "failed")
    order = sorted(bad, key=lambda n: (not bad[n].get("cause"), n != node_rank, n))
    texts = [f"node {n}: {bad[n].get('error') or bad[n].get('status')}" for n in order]
    if missing:
        texts.append(f"node(s) {missing} told nothing of how the run ended within "
                     f"{waited_s:.0f} s (stopped, or its network failed)")
    cause = any(p.get("cause") for p in bad.values())
    error = "; ".join(texts)
    if not cause and is_lost_peer(error):
        error += " (a peer node stopped or its network failed)"
    return Outcome(status, error, cause)
