"""Benchmarks across a Slurm allocation: the sbatch script, and a submitted job followed to its
end.

The script starts one task per node with ``srun``; every task runs the same
``trainperf run ... --nnodes $SLURM_NTASKS --rdzv HEAD:PORT --out OUT/node-$SLURM_PROCID``.
HEAD is the allocation's first host, where the nodes meet (torch's c10d rendezvous) and get their
node ranks; the task that ends up node rank 0 keeps the measurements, the others mark their
folders ``"role": "follower"``. OUT must be on a filesystem every node sees. The script is meant
to be read and resubmitted by hand: it holds absolute paths only and explains every step.

A job that resumes an earlier one (``SlurmJob.resume_from``) runs ``trainperf run --resume`` on
the node folders already in OUT instead. The ranks are then fixed rather than met for: the
folder that kept the measurements must be node 0's again, or its runs would be taken back by a
follower and the new measurements land beside runs without figures.

``python -m trainperf.scale.slurm OUT [--fabric COMMBENCH]`` writes ``OUT/report.md`` from
whichever node folder holds the measurements; the script ends with it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import results

SCRIPT_NAME = "trainperf.sbatch"
RDZV_PORT_BASE = 29400
RDZV_PORT_SPAN = 1000
PORT_ENV = "TRAINPERF_RDZV_PORT"
NODE_DIR = "node-{}"
# Once the first task of the step ends, the others have this long before srun ends them: the
# nodes finish their last run together, and one that died early must not leave the rest
# waiting out the rendezvous timeout.
STRAGGLER_S = 180
POLL_S = 2.0
# States after which a job no longer runs (squeue's long names).
END_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                        "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED",
                        "SPECIAL_EXIT"})
TAIL_LINES = 30
LINE_WIDTH = 96


@dataclass(frozen=True)
class SlurmJob:
    """Everything the script says; checked on construction (ValueError)."""

    recipe: str
    run_argv: tuple[str, ...]
    """``trainperf run`` options every node gets (devices, measure, workload), without the
    node count, rendezvous and output folder, which the script sets from Slurm's variables."""
    out_dir: Path
    """Shared by every node; each writes under ``node-<task id>``. Made absolute."""
    nodes: int
    gpus_per_node: int = 0
    """GPUs asked of Slurm per node (``--gpus-per-node``); 0 for CPU nodes."""
    tasks_per_node: int = 1
    """Tasks that each act as one node; more than one only for CPU tests on one host."""
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    job_name: str | None = None
    rdzv_port: int | None = None
    """None: ``RDZV_PORT_BASE`` + job id mod ``RDZV_PORT_SPAN``, so jobs that share a first
    host rarely share a port."""
    resume_from: int | None = None
    """None: a new job, whose OUT holds no node folders yet. Otherwise the job finishes the
    node folders an earlier job left in OUT, and this is the one of them that kept the
    measurements (``resume_leader``): task 0, on the first host, resumes it as node 0."""
    fabric: tuple[str, ...] = ()
    """commbench results the report at the top of OUT sets the exposed communication
    against (run's ``--fabric``, which the tasks get in ``run_argv``)."""
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter every node runs: the one that wrote the script, so a virtual environment
    on the shared filesystem serves every node."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir).absolute())
        if self.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.tasks_per_node < 1:
            raise ValueError(f"--tasks-per-node must be >= 1, got {self.tasks_per_node}")
        if self.tasks_per_node > 1 and self.gpus_per_node > 0:
            raise ValueError("--tasks-per-node above 1 makes several nodes of one host's CPUs; "
                             "with GPUs every task would see the same devices")
        if self.rdzv_port is not None and not 0 < self.rdzv_port < 65536:
            raise ValueError(f"--rdzv-port must be 1..65535, got {self.rdzv_port}")
        sbatch_values = {"--out": str(self.out_dir), "--partition": self.partition,
                         "--time": self.time_limit, "--account": self.account,
                         "--job-name": self.job_name}
        for flag, value in sbatch_values.items():
            # sbatch reads #SBATCH lines with its own rules, not the shell's: keep to
            # values that need no quoting there.
            if value is not None and (not value or any(c.isspace() or c in "\"'\\"
                                                       for c in value)):
                raise ValueError(f"{flag} {value!r}: #SBATCH lines take no spaces, quotes or "
                                 f"backslashes")
        if "%" in str(self.out_dir):
            raise ValueError(f"--out {str(self.out_dir)!r}: sbatch reads % in --output as a "
                             f"pattern (%j: the job id); choose a path without")
        if not Path(self.python).is_absolute():
            raise ValueError(f"the interpreter must be an absolute path, got {self.python!r}")
        if self.resume_from is not None and not 0 <= self.resume_from < self.ntasks:
            raise ValueError(f"node folder {self.resume_from} is not one of the job's "
                             f"{self.ntasks}")

    @property
    def ntasks(self) -> int:
        """The nodes of the benchmark: one per task."""
        return self.nodes * self.tasks_per_node

    @property
    def script_path(self) -> Path:
        return self.out_dir / SCRIPT_NAME

    @property
    def name(self) -> str:
        return self.job_name or f"trainperf-{self.recipe}"

    def output_path(self, job_id: str) -> Path:
        """The job's own log (``--output``), where Slurm writes the script's and tasks' output."""
        return self.out_dir / f"slurm-{job_id}.out"


def sbatch_lines(job: SlurmJob) -> list[str]:
    lines = [f"--job-name={job.name}", f"--nodes={job.nodes}",
             f"--ntasks-per-node={job.tasks_per_node}"]
    if job.gpus_per_node:
        lines.append(f"--gpus-per-node={job.gpus_per_node}")
    lines += ["--exclusive", "--mem=0"]
    for flag, value in (("partition", job.partition), ("time", job.time_limit),
                        ("account", job.account)):
        if value is not None:
            lines.append(f"--{flag}={value}")
    lines.append(f"--output={job.out_dir}/slurm-%j.out")
    return [f"#SBATCH {line}" for line in lines]


def _wrap(words: list[str], indent: str = "    ") -> list[str]:
    """Shell words (already quoted) on continued lines, an option kept with its value."""
    groups: list[str] = []
    for w in words:
        if groups and not w.startswith("-") and groups[-1].startswith("--") \
                and " " not in groups[-1]:
            groups[-1] += " " + w
        else:
            groups.append(w)
    lines, cur = [], ""
    for g in groups:
        if cur and len(indent) + len(cur) + 1 + len(g) > LINE_WIDTH - 2:
            lines.append(cur)
            cur = g
        else:
            cur = f"{cur} {g}" if cur else g
    lines.append(cur)
    return [indent + ln for ln in lines]


# Runs in each task, so the variables are the task's own (SLURM_PROCID differs per task). exec:
# the task is trainperf itself, so Slurm's SIGTERM at the time limit reaches the runner, which
# stops its runs and keeps what they measured.
TASK_SNIPPET = ('exec "$@" --nnodes "$SLURM_NTASKS" --rdzv "$RDZV_HOST:$RDZV_PORT" '
                '--out "$OUT/node-$SLURM_PROCID"')
# Resuming: task 0 runs on the first host, so it can host the nodes' store there as node 0
# (run's --node-rank/--master-addr); the folders turn with it so that it gets the one that
# kept the measurements, and every other task a follower's.
RESUME_SNIPPET = ('exec "$@" --nnodes "$SLURM_NTASKS" --node-rank "$SLURM_PROCID" '
                  '--master-addr "$RDZV_HOST" --master-port "$RDZV_PORT" '
                  '--resume "$OUT/node-$(( (SLURM_PROCID + MEASURED) % SLURM_NTASKS ))"')


FRESH_HEAD = [
    "# Every task below runs one `trainperf run` acting as one node; the nodes meet through",
    "# torch's c10d rendezvous on the allocation's first host and get their node ranks there.",
    "# The node that becomes node rank 0 keeps the measurements (its results.json); the others",
    "# mark theirs as followers. Results: one folder per task under the output folder, which",
    "# every node must see (a shared filesystem).",
]


def render_script(job: SlurmJob, command_line: str | None = None) -> str:
    """The sbatch script for ``job``: valid bash, every value quoted for the shell."""
    q = shlex.quote
    port = (str(job.rdzv_port) if job.rdzv_port is not None
            else f"$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN} ))")
    total = job.ntasks
    resuming = job.resume_from is not None
    measured = NODE_DIR.format(job.resume_from) if resuming else None
    layout = (f"{job.nodes} node(s)" if job.tasks_per_node == 1 else
              f"{job.nodes} host(s) x {job.tasks_per_node} tasks, each task acting as a node")
    run_words = [q(w) for w in ("-m", "trainperf.cli", "run", job.recipe, *job.run_argv)]
    head = [
        "#!/bin/bash",
        f"# trainperf on Slurm: {job.recipe} on {layout}.",
        f"# Written by: {command_line}" if command_line else None,
        f"# Submit it (again) with: sbatch {q(str(job.script_path))}",
        "#",
        *(FRESH_HEAD if not resuming else [
            "# This job finishes an earlier one: every task below runs one `trainperf run",
            "# --resume` acting as one node, on a node folder that job left in the output folder,",
            "# and runs only what did not end there. Node 0 must resume the folder that kept the",
            f"# measurements, {measured}, so the node ranks are fixed rather than handed out:",
            "# task 0, on the allocation's first host, is node 0, resumes that folder and hosts",
            "# the nodes' meeting; the others resume the followers' folders. Every node must see",
            "# the output folder (a shared filesystem).",
        ]),
        "#",
        "# --exclusive and --mem=0: whole nodes with all their memory, so nothing else running on",
        "# them takes a share of what is measured.",
    ]
    body = [
        "",
        "set -euo pipefail",
        "",
        "# The interpreter that wrote this script; on a shared filesystem every node runs it.",
        f"PY={q(job.python)}",
        ("# Each task writes into OUT/node-<its task id>." if not resuming else
         "# The node folders the tasks resume."),
        f"OUT={q(str(job.out_dir))}",
        "",
        'if [ ! -x "$PY" ]; then',
        '    echo "trainperf: $PY is not on $(hostname): the nodes need it on a shared '
        'filesystem" >&2',
        "    exit 2",
        "fi",
        "",
        "# The nodes meet on the allocation's first host.",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'RDZV_HOST=${HOSTS[0]}',
        *(["# Set by the job id, so two jobs that share a first host rarely collide; submit",
           f"# with {PORT_ENV}=<port> in the environment to choose one."]
          if job.rdzv_port is None else
          ["# Chosen when the script was written (--rdzv-port); submit with",
           f"# {PORT_ENV}=<port> in the environment to choose another."]),
        f"RDZV_PORT=${{{PORT_ENV}:-{port}}}",
        "# Slurm gives each task one CPU unless told otherwise; share the node out instead.",
        f"CPUS_PER_TASK=$(( SLURM_CPUS_ON_NODE / {job.tasks_per_node} ))",
        "# srun hands the tasks this environment; unbuffered output reaches the job's log as it",
        "# happens rather than when a buffer fills.",
        "export OUT RDZV_HOST RDZV_PORT PYTHONUNBUFFERED=1",
        "",
        *(["# Task 0 resumes OUT/node-$MEASURED, the folder with the measurements; task i the",
           "# one i places after it.",
           f"MEASURED={job.resume_from}",
           "export MEASURED"] if resuming else []),
        f'echo "trainperf: {total} nodes meet at $RDZV_HOST:$RDZV_PORT; results under $OUT"',
        "",
        ("# One task per node." if job.tasks_per_node == 1 else
         f"# {job.tasks_per_node} tasks per host, each acting as a node."),
        "# --label prefixes each output line with the task's id. --wait: once one task has",
        f"# ended, the others get {STRAGGLER_S} s to end too, so a node that fails early does not",
        "# hold the rest until the rendezvous times out.",
        "status=0",
        f"srun --ntasks-per-node={job.tasks_per_node} --cpus-per-task=\"$CPUS_PER_TASK\" "
        f"--wait={STRAGGLER_S} --label \\",
        f"    bash -c {q(RESUME_SNIPPET if resuming else TASK_SNIPPET)} trainperf-node \\",
        *[ln + " \\" for ln in _wrap(['"$PY"', *run_words])],
        "    || status=$?",
        "",
        "# Whichever task became node rank 0 holds the measurements: put its report at the top",
        "# of the output folder (also after a failure, for the runs that did finish).",
        'if ! "$PY" -m trainperf.scale.slurm "$OUT"'
        + "".join(f" --fabric {q(path)}" for path in job.fabric)
        + ' && [ "$status" -eq 0 ]; then',
        "    status=1",
        "fi",
        'exit "$status"',
    ]
    return "\n".join([ln for ln in head if ln is not None] + sbatch_lines(job) + body) + "\n"


def write_script(job: SlurmJob, command_line: str | None = None) -> Path:
    path = job.script_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_script(job, command_line), encoding="utf-8")
    path.chmod(0o755)
    return path


# -- following a job --------------------------------------------------------------------------

Run = Callable[[Sequence[str]], subprocess.CompletedProcess]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60)


def submit(script: Path, run: Run = run_command) -> str:
    """The id of the job sbatch queued; ValueError with sbatch's words when it refuses."""
    try:
        done = run(["sbatch", "--parsable", str(script)])
    except FileNotFoundError:
        raise ValueError("--submit needs sbatch on this host; without --submit the script is "
                         "written for you to submit") from None
    if done.returncode != 0:
        raise ValueError(f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]  # "id" or, on a federation, "id;cluster"
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch answered {done.stdout.strip()!r}, not a job id")
    return job_id


def _fields(text: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (a value holds no spaces in the fields read here)."""
    out = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep:
            out.setdefault(key, value)
    return out


@dataclass
class JobEnd:
    state: str
    """Slurm's final state (COMPLETED, FAILED, CANCELLED, TIMEOUT...), or UNKNOWN when the
    controller forgot the job before it was seen ending."""
    exit_code: str = ""
    """Slurm's ``ExitCode``: the script's status and the signal that ended it, if any."""


def queue_state(job_id: str, run: Run = run_command) -> tuple[str, str] | None:
    """(state, reason) while squeue lists the job (pending, running, completing); None after."""
    done = run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"])
    line = done.stdout.strip()
    if done.returncode != 0 or not line:
        return None
    state, _, reason = line.splitlines()[0].partition("|")
    return state, reason


def final_state(job_id: str, run: Run = run_command) -> JobEnd:
    done = run(["scontrol", "show", "job", job_id, "-o"])
    f = _fields(done.stdout) if done.returncode == 0 else {}
    return JobEnd(f.get("JobState", "UNKNOWN"), f.get("ExitCode", ""))


def follow(job_id: str, say: Callable[[str], None] = print, run: Run = run_command,
           poll_s: float = POLL_S, sleep: Callable[[float], None] = time.sleep,
           max_misses: int = 30) -> JobEnd:
    """Poll the job until it has left the queue, saying each change of state. No accounting
    daemon needed (no sacct): squeue while it is listed, scontrol for how it ended."""
    last, misses = None, 0
    while True:
        try:
            now = queue_state(job_id, run)
            misses = 0
        except (OSError, subprocess.SubprocessError) as exc:
            # A controller that does not answer for a while is not yet a job that ended.
            misses += 1
            if misses > max_misses:
                say(f"slurm job {job_id}: the controller stopped answering ({exc})")
                return JobEnd("UNKNOWN")
            sleep(poll_s)
            continue
        if now is None or now[0] in END_STATES:
            end = final_state(job_id, run)
            say(f"slurm job {job_id}: {end.state}" +
                (f" (exit code {end.exit_code})" if end.exit_code else ""))
            return end
        if now != last:
            state, reason = now
            say(f"slurm job {job_id}: {state}" +
                (f" ({reason})" if reason and reason != "None" else ""))
            last = now
        sleep(poll_s)


def cancel(job_id: str, run: Run = run_command, wait_s: float = 30.0,
           sleep: Callable[[float], None] = time.sleep) -> None:
    """scancel, then wait (a while) for the job to leave the queue."""
    run(["scancel", job_id])
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        now = queue_state(job_id, run)
        if now is None or now[0] in END_STATES:
            return
        sleep(0.5)


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"({path} is not there)"
    return "\n".join(text.splitlines()[-lines:])


# -- results of a finished job ----------------------------------------------------------------

def node_dirs(out_dir: Path) -> list[Path]:
    return sorted(p for p in Path(out_dir).glob(NODE_DIR.format("*")) if p.is_dir())


def _role(folder: Path) -> str | None:
    """"leader" or "follower" as the folder's results.json says; None without one."""
    try:
        doc = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return "follower" if doc.get("role") == "follower" else "leader"


def resume_leader(out_dir: Path, ntasks: int) -> int:
    """The node folder that kept the measurements of the earlier job in ``out_dir``, for a job
    of ``ntasks`` tasks to resume; ValueError, in one line, where there is no such job to
    resume."""
    folders = node_dirs(out_dir)
    if not folders:
        raise ValueError(f"--resume {out_dir}: no node folders of an earlier job there; "
                         f"drop --resume to start one")
    names = sorted(p.name for p in folders)
    if names != sorted(NODE_DIR.format(i) for i in range(ntasks)):
        raise ValueError(f"--resume {out_dir}: the earlier job's node folders are "
                         f"{', '.join(names)}, this job's would be node-0..node-{ntasks - 1}: "
                         f"give the --nodes and --tasks-per-node it had")
    roles = [_role(out_dir / NODE_DIR.format(i)) for i in range(ntasks)]
    leaders = [i for i, role in enumerate(roles) if role == "leader"]
    unknown = [i for i, role in enumerate(roles) if role is None]
    if len(leaders) == 1:
        return leaders[0]
    if leaders:
        raise ValueError(f"--resume {out_dir}: node folders "
                         f"{', '.join(NODE_DIR.format(i) for i in leaders)} each hold "
                         f"measurements (one job's have exactly one)")
    if len(unknown) == ntasks:
        return 0  # no run ended anywhere: any folder can be node 0's
    if len(unknown) == 1:
        # Node 0 ended before it recorded a run its followers did: its folder is the one
        # without results.
        return unknown[0]
    rest = f"; {len(unknown)} have no results" if unknown else ""
    raise ValueError(f"--resume {out_dir}: no node folder holds the measurements (those with "
                     f"results are followers'{rest})")


def find_leader(out_dir: Path) -> Path:
    """The node folder with the measurements (its results.json has no follower role);
    ValueError when there is none or more than one."""
    roles = {folder: _role(folder) for folder in node_dirs(out_dir)}
    leaders = [folder for folder, role in roles.items() if role == "leader"]
    seen = sum(role is not None for role in roles.values())
    if len(leaders) != 1:
        what = "none" if not leaders else ", ".join(p.name for p in leaders)
        raise ValueError(f"{out_dir}: {seen} node folder(s) with results, and {what} holding "
                         f"the measurements (exactly one should)")
    return leaders[0]


def all_runs_ok(folder: Path) -> bool:
    doc = results.load(folder)
    runs = [r for c in doc["cases"] for r in c["runs"]]
    return bool(runs) and all(r["status"] == "ok" for r in runs)


def collect(out_dir: Path, fabric: Sequence[str] = ()) -> tuple[Path, Path]:
    """Write ``out_dir/report.md`` from the leader's folder: (leader folder, report path).
    ``fabric``: commbench results to set the exposed communication against, as run's."""
    from ..report.assemble import write_report
    from .bottleneck import analyser

    leader = find_leader(out_dir)
    return leader, write_report([str(leader)], Path(out_dir), False,
                                analyser(list(fabric) or None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainperf.scale.slurm",
                                     description="write a finished job's report")
    parser.add_argument("out", metavar="OUT", help="the job's output folder")
    parser.add_argument("--fabric", action="append", default=[], metavar="COMMBENCH",
                        help="as for run")
    args = parser.parse_args(argv)
    try:
        leader, path = collect(Path(args.out), args.fabric)
    except ValueError as exc:
        print(f"trainperf: error: {exc}", file=sys.stderr)
        return 1
    print(f"trainperf: measurements in {leader}; report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
