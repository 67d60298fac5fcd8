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

import dataclasses
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .protocol import End, Error, Event, Exit, Step

LOST_PEER_WORDS = ("connection closed", "connection reset", "broken pipe", "connection refused",
                   "timed out", "timeout")
BIND_FAILURE_WORDS = ("address already in use", "eaddrinuse", "bind failed", "errno 98",
                      "failed to bind", "could not bind", "cannot bind", "unable to bind",
                      "failed to add port", "could not start grpc server",
                      "failed to start rpc server")
"""How the frameworks say that a listening socket could not have its port: torch's and Paddle's
stores, MXNet's ps-lite scheduler (``bind failed``), gRPC under JAX, TensorFlow and OneFlow."""

NOISE = [re.compile(p) for p in (
    # absl / glog INFO and WARNING lines (TensorFlow, Paddle, JAX's XLA; OneFlow's glog puts
    # the year in: W20261128), and absl's banner.
    r"^[IW](\d{4})?\d{4} \d\d:\d\d:\d\d",
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
    # OneFlow's start-up on a machine without InfiniBand.
    r"^libibverbs not available, ibv_fork_init skipped",
)]
FAULT_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ .*\(most recent call first\):$")
OWN_CODE = re.compile(r"/trainperf/(backends/|scale/|[a-z_]+\.py$)")
FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def is_lost_peer(text: str | None) -> bool:
    """An error that a rank gets when another process of the run went away."""
    low = (text or "").lower()
    return any(w in low for w in LOST_PEER_WORDS)


def names_bind_failure(text: str | None) -> bool:
    low = (text or "").lower()
    return any(w in low for w in BIND_FAILURE_WORDS)


TRACE_LINE = re.compile(r'^(File "|Detected at node |Traceback \(most recent call last\))')


def one_line(text: str | None) -> str | None:
    """An error on one line: its first line, and where that only announces what follows
    (TensorFlow's "Graph execution error:" before the trace of where the op was defined), the
    first lines after the trace that say what went wrong."""
    if text is None:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return text.strip()
    said = [lines[0]]
    rest = [ln for ln in lines[1:] if not TRACE_LINE.match(ln)]
    while said[-1].endswith(":") and rest and len(said) < 4:
        said.append(rest.pop(0))
    return " ".join(said)


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
    return _said(_lines(log), count)


def _lines(log: str | Path | None) -> list[str]:
    if not log:
        return []
    try:
        return Path(log).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


def _in_dump(text: str) -> bool:
    stripped = text.strip()
    return (not stripped or bool(FAULT_HEADER.match(stripped)) or bool(FRAME.match(text))
            or stripped == "<no Python frame>")


def dumped_stack(log: str | Path | None) -> str | None:
    """Where the process's last dump of its threads' stacks (a hung run's, ``spawn.
    look_before_stopping``) found it, in ``last_words``'s form; None without a dump."""
    lines = _lines(log)
    headers = [i for i, ln in enumerate(lines) if FAULT_HEADER.match(ln.strip())]
    if not headers:
        return None
    start = headers[-1]
    while start > 0 and _in_dump(lines[start - 1]):
        start -= 1
    end = headers[-1]
    while end < len(lines) and _in_dump(lines[end]):
        end += 1
    said = _said(lines[start:end], 1)
    return said[0] if said else None


def _said(lines: list[str], count: int) -> list[str]:
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
    retry: str | None = None
    """Why the run should start again on fresh ports (``with_port_retry``); None: it should
    not."""
    unreachable: dict | None = None
    """Several nodes: the node that became unreachable during the run and the step of rank 0
    it went at, as the nodes saw it (``node_agreement.RunWatch.finding``; agreed by
    ``agree``); None where no node did."""


CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)
"""How native code dies when an allocation it did not check fails."""


def _crashed(x: Exit) -> bool:
    code = -x.returncode if x.returncode < 0 else x.returncode - 128
    return code in CRASH_SIGNALS


def suspended(events: list[Event], has_rank0: bool = True) -> str | None:
    """The processes found suspended (SIGSTOP, a debugger) when the run was stopped, and since
    when the run made no progress; None where none was."""
    stuck = sorted((x for x in events if isinstance(x, Exit) and x.suspended),
                   key=lambda x: (x.rank < 0, x.rank))
    if not stuck:
        return None
    names = ", ".join(x.name for x in stuck)
    where = progress_at(float("inf"), events, has_rank0)
    return " ".join(filter(None, (names, "was" if len(stuck) == 1 else "were",
                                  "found suspended (stopped by SIGSTOP or a debugger)", where,
                                  "and never resumed")))


def stacks_at_stop(events: list[Event]) -> str | None:
    """Where each rank was when a hung run was stopped, from the stacks the ranks still able to
    answer wrote (``Exit.stack_dumped``)."""
    wheres = [f"rank {x.rank} {frame}" for x in sorted(
        (x for x in events if isinstance(x, Exit) and x.stack_dumped), key=lambda x: x.rank)
        if (frame := dumped_stack(x.log))]
    return "; ".join(wheres) or None


def decide(events: list[Event], timed_out: bool, has_rank0: bool = True,
           memory_capped: bool = False, stalled_s: float | None = None,
           rank0_steps: int | None = None) -> Outcome:
    """The run's status and error text, from what its processes wrote and how they ended
    (``has_rank0``: this node runs rank 0, whose steps say where a death happened;
    ``memory_capped``: the processes ran under ``--memory-limit``; ``stalled_s``: the run was
    stopped for going that long without a step, ``timed_out`` is then set too; ``rank0_steps``:
    on a node without rank 0, its steps as node 0 told them, which say where a stopped run
    was). A run with a suspended process hung, whichever timeout ended it: the runner's, or a
    framework's collective that gave up on the suspended peer."""
    errors = [e for e in events if isinstance(e, Error)]
    dead = deaths(events)
    died = "; ".join(death_text(x, events, has_rank0) for x in dead)
    stuck = suspended(events, has_rank0)
    stopped = (f"run went {stalled_s:g} s without a step and was stopped as hung"
               if stalled_s is not None else "run exceeded its timeout and was killed")
    stacks = stacks_at_stop(events)
    where_ranks = f"; where each rank was: {stacks}" if stacks else ""
    if stuck and not dead:
        errors.sort(key=lambda e: e.rank)
        then = (f"the {stopped}" if timed_out or not errors
                else f"rank {errors[0].rank}: {one_line(errors[0].message)}")
        return Outcome("timeout", f"{stuck}; then {then}{where_ranks}", True)
    if timed_out:
        text = stopped
        where = progress_at(float("inf"), events, has_rank0)
        if not has_rank0 and rank0_steps is not None:
            where = f"{step_words(rank0_steps)} (rank 0's steps, as node 0 told them)"
        if not died and where:
            text += f" {where}"
        text += where_ranks
        return Outcome("timeout", f"{died}; then the {text}" if died else text, bool(died))
    oom = next((e for e in errors if e.kind == "oom"), None)
    if oom is not None:
        return Outcome("oom", one_line(oom.message), True)
    # Causes first: a rank's own exception before a peer's broken connection.
    errors.sort(key=lambda e: (is_lost_peer(e.message), e.rank))
    if dead:
        after = "; ".join(f"then rank {e.rank}: {one_line(e.message)}" for e in errors)
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
        return Outcome("failed", one_line(errors[0].message), not is_lost_peer(errors[0].message))
    return Outcome("failed", None)


def with_port_retry(here: Outcome, events: list[Event], taken: Callable[[], list[int]]
                    ) -> Outcome:
    """``here`` with ``retry`` set where the run failed for want of a port: it failed before
    its first step, and ``taken()`` (asked only then, once the run's processes have ended)
    finds one of its ports held by a process outside the run, or a process of the run said that
    its bind failed."""
    if here.status != "failed" or any(isinstance(e, Step) for e in events):
        return here
    held = taken()
    if held:
        names = ", ".join(str(p) for p in held)
        why = (f"port{'s' if len(held) > 1 else ''} {names} taken by another process before "
               "the run's own could bind")
    else:
        texts = [here.error] + [f"{e.message} {' '.join(e.traceback)}" for e in events
                                if isinstance(e, Error)]
        if not any(names_bind_failure(t) for t in texts):
            return here
        why = "a process of the run could not bind its port"
    return dataclasses.replace(here, retry=why)


def unreachable_node(parts: dict[int, dict]) -> dict | None:
    """The node that became unreachable, from what each node saw (``parts[n]["unreachable"]``),
    alike on every node that heard the same parts: the node whose own link went down says so
    itself; else node 0's view, which hears every node. The step is node 0's where it named the
    same node (rank 0's steps are node 0's to count); ``seen_by`` lists the nodes that named
    it."""
    found = {n: p["unreachable"] for n, p in sorted(parts.items()) if p.get("unreachable")}
    if not found:
        return None
    own = [f for f in found.values() if f.get("link_down")]
    lead = own[0] if own else found[min(found)]
    node = lead["node"]
    step = lead.get("step")
    if 0 in found and found[0]["node"] == node and found[0].get("step") is not None:
        step = found[0]["step"]
    return {"node": node, "step": step, "link_down": bool(lead.get("link_down")),
            "link": lead.get("link") if lead.get("link_down") else None,
            "seen_by": sorted(n for n, f in found.items() if f["node"] == node)}


def step_words(step: int | None) -> str:
    """Where rank 0 was, from the steps it had done: ``at step 5``, ``before the first step``."""
    if step is None:
        return "at an unknown step"
    return f"at step {step}" if step else "before the first step"


def unreachable_text(found: dict) -> str:
    """``node 1 unreachable at step 5, its own link down (eth0: no carrier, ...)``."""
    text = f"node {found['node']} unreachable {step_words(found.get('step'))}"
    if found.get("link_down"):
        text += f", its own link down ({found['link']})"
    return text


def agree(node_rank: int, here: Outcome, heard: dict[int, dict], nnodes: int,
          waited_s: float) -> Outcome:
    """One outcome for a run on several nodes, from this node's and what the others told
    (``{node: {"status", "error", "cause", "retry", "unreachable"}}``): it failed on every node
    if it failed on any, and the error names each failed node's part, causes first, after the
    node that became unreachable where one did (``unreachable_node``)."""
    parts = {node_rank: {"status": here.status, "error": here.error, "cause": here.cause,
                         "retry": here.retry, "unreachable": here.unreachable}, **heard}
    missing = [n for n in range(nnodes) if n not in parts]
    bad = {n: p for n, p in parts.items() if p.get("status") != "ok"}
    if not bad and not missing:
        return here
    lost = unreachable_node(parts)
    statuses = {p.get("status") for p in bad.values()}
    status = next((s for s in ("oom", "failed", "timeout") if s in statuses), "failed")
    order = sorted(bad, key=lambda n: (not bad[n].get("cause"), n != node_rank, n))
    texts = [f"node {n}: {bad[n].get('error') or bad[n].get('status')}" for n in order]
    if missing:
        texts.append(f"node(s) {missing} told nothing of how the run ended within "
                     f"{waited_s:.0f} s (stopped, or its network failed)")
    cause = any(p.get("cause") for p in bad.values())
    error = "; ".join(([unreachable_text(lost)] if lost else []) + texts)
    if not cause and is_lost_peer(error):
        error += " (a peer node stopped or its network failed)"
    # Every node starts the run again when a node lost a port and nothing else went wrong
    # anywhere: the others' failures are then only their lost peer.
    retry = next((bad[n].get("retry") for n in sorted(bad) if bad[n].get("retry")), None)
    if missing or lost or any(p.get("cause") and not p.get("retry") for p in bad.values()):
        retry = None
    return Outcome(status, error, cause, retry, lost)
