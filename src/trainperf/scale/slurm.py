"""Benchmarks across a Slurm allocation: the sbatch script, and a submitted job followed to its
end.

The script runs one step per node count of the job (``--nodes 1,2,4``: an allocation of the
largest, each count a step inside it, on the allocation's first hosts), and each step starts
one task per node with ``srun``; every task runs the same
``trainperf run ... --nnodes N --rdzv HEAD:PORT --out STEP/node-$SLURM_PROCID``. HEAD is the
allocation's first host, where the nodes meet (torch's c10d rendezvous) and get their node ranks;
for each plan, the task that ends up node rank 0 keeps its measurements, the others mark their
folders ``"role": "follower"``. Under ``--mode best`` the first step's probe decides, and every
later step takes its choice (``run --mode-from``). OUT must be on a filesystem every node sees.
The script is meant to be read and resubmitted by hand: it holds absolute paths only and
explains every step.

At its end the job's documents, one per plan joined across its steps, ``job.json`` and
``report.md`` are written at the top of OUT (``node_sweep.collect``).

A job that resumes an earlier one (``SlurmJob.resume``) runs ``trainperf run --resume`` on each
task's node folder instead; the nodes meet as before, and for each plan the node whose folder
holds its measurements becomes node 0 (``rendezvous.rank_order``), so a job stopped anywhere
finishes with its figures where they are.

``python -m trainperf.scale.slurm OUT [--fabric COMMBENCH]`` writes the job's documents and
report from its node folders; the script ends with it.
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

from ..result_files import JOB
from ..results import write_json_atomic
from .node_sweep import JOB_SCHEMA, Step, all_runs_ok, collect, is_sweep, node_dirs


SCRIPT_NAME = "trainperf.sbatch"
RDZV_PORT_BASE = 29400
RDZV_PORT_SPAN = 1000
PORT_ENV = "TRAINPERF_RDZV_PORT"
STEP_PORTS = 1
"""Each step meets on a port of its own (the job's port plus the step's index): a step's
rendezvous never finds what an earlier step's store left."""
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
    """``trainperf run`` options every node gets (measure, workload, tuning), without the
    devices per node (each step's own), the node count, rendezvous and output folder, which
    the script sets from Slurm's variables."""
    out_dir: Path
    """Shared by every node; each writes under its step's ``node-<task id>``. Made absolute."""
    steps: tuple[Step, ...]
    """The node counts the job runs, smallest first, each with its processes per node."""
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
    resume: bool = False
    """Finish the node folders an earlier job of the same steps left in OUT (every task runs
    ``run --resume`` on its own)."""
    mode_from_first: bool = False
    """``--mode best``: every step after the first takes the mode the first step's probe
    chose (``run --mode-from``)."""
    fabric: tuple[str, ...] = ()
    """commbench results the report at the top of OUT sets the exposed communication
    against (run's ``--fabric``, which the tasks get in ``run_argv``)."""
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter every node runs: the one that wrote the script, so a virtual environment
    on the shared filesystem serves every node."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir).absolute())
        object.__setattr__(self, "steps", tuple(self.steps))
        if not self.steps or any(s.nodes < 1 for s in self.steps):
            raise ValueError("--nodes must name counts of 1 or more")
        if [s.nodes for s in self.steps] != sorted({s.nodes for s in self.steps}):
            raise ValueError("a job's node counts go smallest first, each once")
        if self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node must be >= 0, got {self.gpus_per_node}")
        if self.tasks_per_node < 1:
            raise ValueError(f"--tasks-per-node must be >= 1, got {self.tasks_per_node}")
        if self.tasks_per_node > 1 and self.gpus_per_node > 0:
            raise ValueError("--tasks-per-node above 1 makes several nodes of one host's CPUs; "
                             "with GPUs every task would see the same devices")
        if self.rdzv_port is not None and not 0 < self.rdzv_port < 65536 - len(self.steps):
            raise ValueError(f"--rdzv-port must be 1..{65535 - len(self.steps)}, got "
                             f"{self.rdzv_port}")
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

    @property
    def nodes(self) -> int:
        """The hosts to allocate: the largest step's."""
        return self.steps[-1].nodes

    @property
    def ntasks(self) -> int:
        """The nodes of the benchmark's largest step: one per task."""
        return self.nodes * self.tasks_per_node

    @property
    def script_path(self) -> Path:
        return self.out_dir / SCRIPT_NAME

    @property
    def name(self) -> str:
        return self.job_name or f"trainperf-{self.recipe}"

    def step_dir(self, step: Step) -> Path:
        """Where a step's node folders go: OUT itself for a job of one node count, else
        ``OUT/nodes-N``."""
        return self.out_dir / step.folder(is_sweep(list(self.steps)))

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
# stops its runs and keeps what they measured. A step of several tasks meets at the rendezvous;
# a step of one task is one node and meets nobody.
TASK_SNIPPET = ('exec "$@" --nnodes "$SLURM_NTASKS" --rdzv "$RDZV_HOST:$STEP_PORT" '
                '--{folder} "$STEP_DIR/node-$SLURM_PROCID"')
ONE_TASK_SNIPPET = 'exec "$@" --{folder} "$STEP_DIR/node-$SLURM_PROCID"'


def task_snippet(tasks: int, resume: bool) -> str:
    return (TASK_SNIPPET if tasks > 1 else ONE_TASK_SNIPPET).format(
        folder="resume" if resume else "out")


FRESH_HEAD = [
    "# Every task of a step runs one `trainperf run` acting as one node; the nodes meet through",
    "# torch's c10d rendezvous on the allocation's first host and get their node ranks there.",
    "# For each plan, the node that becomes node rank 0 keeps the measurements (its",
    "# results.json); the others mark theirs as followers. Each step's results: one folder per",
    "# task, under the output folder, which every node must see (a shared filesystem).",
]
RESUME_HEAD = [
    "# This job finishes an earlier one: every task below runs one `trainperf run --resume`",
    "# acting as one node, on the node folder its task of that job left in the output folder,",
    "# and runs only what did not end there. The nodes meet as before; for each plan the node",
    "# whose folder holds the measurements becomes node 0, so the figures go on where they",
    "# are. Every node must see the output folder (a shared filesystem).",
]


def _step_lines(job: SlurmJob, index: int, step: Step, run_words: list[str]) -> list[str]:
    q = shlex.quote
    tasks = step.nodes * job.tasks_per_node
    first = job.step_dir(job.steps[0])
    words = [*run_words, "--devices", ",".join(str(d) for d in step.devices)]
    mode_from = job.mode_from_first and index > 0
    if mode_from:
        words += ["--mode-from", q(str(first))]
    hosts = "${HOSTS[*]:0:%d}" % step.nodes
    return [
        "",
        f"# Step {index + 1} of {len(job.steps)}: {step.nodes} node(s), "
        f"{','.join(str(d) for d in step.devices)} process(es) per node"
        + (", on the allocation's first host" if step.nodes == 1 else
           f", on the allocation's first {step.nodes} hosts") + ".",
        *(["# --mode best: this step runs each plan in the mode the first step's probe chose."]
          if mode_from else []),
        f"STEP_DIR={q(str(job.step_dir(step)))}",
        f"STEP_PORT=$(( RDZV_PORT + {index * STEP_PORTS} ))",
        "export STEP_DIR STEP_PORT",
        f'STEP_HOSTS=$(IFS=,; echo "{hosts}")',
        f"srun --nodes={step.nodes} --nodelist=\"$STEP_HOSTS\" --ntasks={tasks} "
        f"--ntasks-per-node={job.tasks_per_node} --cpus-per-task=\"$CPUS_PER_TASK\" "
        f"--wait={STRAGGLER_S} --label \\",
        f"    bash -c {q(task_snippet(tasks, job.resume))} trainperf-node \\",
        *[ln + " \\" for ln in _wrap(['"$PY"', *words])],
        "    || status=$?",
    ]


def render_script(job: SlurmJob, command_line: str | None = None) -> str:
    """The sbatch script for ``job``: valid bash, every value quoted for the shell."""
    q = shlex.quote
    port = (str(job.rdzv_port) if job.rdzv_port is not None
            else f"$(( {RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN} ))")
    counts = ",".join(str(s.nodes) for s in job.steps)
    layout = (f"{counts} node(s)" if job.tasks_per_node == 1 else
              f"{counts} host(s) x {job.tasks_per_node} tasks, each task acting as a node")
    run_words = [q(w) for w in ("-m", "trainperf.cli", "run", job.recipe, *job.run_argv)]
    head = [
        "#!/bin/bash",
        f"# trainperf on Slurm: {job.recipe} on {layout}.",
        f"# Written by: {command_line}" if command_line else None,
        f"# Submit it (again) with: sbatch {q(str(job.script_path))}",
        "#",
        *(RESUME_HEAD if job.resume else FRESH_HEAD),
        *(["#",
           "# One step per node count, smallest first, in one allocation of the largest; at",
           "# the end one document per plan holds every count's cases, each with its speedup",
           "# against the 1-device case."] if is_sweep(list(job.steps)) else []),
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
        "# The job's folder: its node folders, then its documents and report.",
        f"OUT={q(str(job.out_dir))}",
        "",
        'if [ ! -x "$PY" ]; then',
        '    echo "trainperf: $PY is not on $(hostname): the nodes need it on a shared '
        'filesystem" >&2',
        "    exit 2",
        "fi",
        "",
        "# The nodes meet on the allocation's first host, at the address Slurm reaches it by.",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'RDZV_HOST=$(scontrol show node "${HOSTS[0]}" 2>/dev/null '
        '| sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' || true)',
        'RDZV_HOST=${RDZV_HOST:-${HOSTS[0]}}',
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
        f'echo "trainperf: {counts} node(s) meet at $RDZV_HOST:$RDZV_PORT; results under $OUT"',
        "",
        ("# One task per node." if job.tasks_per_node == 1 else
         f"# {job.tasks_per_node} tasks per host, each acting as a node."),
        "# --label prefixes each output line with the task's id. --wait: once one task has",
        f"# ended, the others get {STRAGGLER_S} s to end too, so a node that fails early does not",
        "# hold the rest until the rendezvous times out. A step that fails does not stop the",
        "# next: each node count's figures stand on their own.",
        "status=0",
    ]
    for index, step in enumerate(job.steps):
        body += _step_lines(job, index, step, run_words)
    body += [
        "",
        "# The job's documents (one per plan, every node count's cases in it) and its report at",
        "# the top of the output folder, also after a failure, for the runs that did finish.",
        'if ! "$PY" -m trainperf.scale.slurm "$OUT"'
        + "".join(f" --fabric {q(path)}" for path in job.fabric)
        + ' && [ "$status" -eq 0 ]; then',
        "    status=1",
        "fi",
        'exit "$status"',
    ]
    return "\n".join([ln for ln in head if ln is not None] + sbatch_lines(job) + body) + "\n"


def job_record(job: SlurmJob) -> dict:
    """``job.json`` as the script is written: the steps, and no documents yet (the job's end
    lists them)."""
    return {"schema": JOB_SCHEMA, "kind": "slurm", "steps": [s.to_dict() for s in job.steps],
            "documents": [], "plans": []}


def write_script(job: SlurmJob, command_line: str | None = None) -> Path:
    path = job.script_path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_script(job, command_line), encoding="utf-8")
    path.chmod(0o755)
    if not job.resume:
        write_json_atomic(job.out_dir / JOB, job_record(job))
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

def steps_of_job(out_dir: Path) -> list[Step]:
    """The steps ``job.json`` in ``out_dir`` names; ValueError where it is not a job's folder."""
    try:
        job = json.loads((Path(out_dir) / JOB).read_text(encoding="utf-8"))
        return [Step(s["nodes"], tuple(s["devices_per_node"])) for s in job["steps"]]
    except FileNotFoundError:
        raise ValueError(f"{out_dir}: no {JOB}, so no trainperf job's folder") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{Path(out_dir) / JOB} does not read ({exc})") from None


def job_folders(out_dir: Path) -> list[Path]:
    """Every node folder of the job in ``out_dir``, of every step."""
    out_dir = Path(out_dir)
    found = node_dirs(out_dir)
    for step in sorted(out_dir.glob("nodes-*")):
        found += node_dirs(step)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainperf.scale.slurm",
                                     description="write a finished job's documents and report")
    parser.add_argument("out", metavar="OUT", help="the job's output folder")
    parser.add_argument("--fabric", action="append", default=[], metavar="COMMBENCH",
                        help="as for run")
    args = parser.parse_args(argv)
    try:
        docs, path, missing = collect(Path(args.out), steps_of_job(Path(args.out)), "slurm",
                                      args.fabric)
    except ValueError as exc:
        print(f"trainperf: error: {exc}", file=sys.stderr)
        return 1
    for line in missing:
        print(f"trainperf: not measured: {line}", file=sys.stderr)
    print(f"trainperf: {len(docs)} document(s); report: {path}")
    return 0 if all_runs_ok(docs, missing) else 1


if __name__ == "__main__":
    sys.exit(main())
