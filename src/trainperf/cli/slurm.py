"""`trainperf slurm`: write an sbatch script that runs a benchmark on several nodes, and with
``--submit`` follow the job to its end. The script and the job's handling are in
``trainperf.scale.slurm``; this module turns a command line into them.

The run options are `trainperf run`'s own, all of them, read back into an argv for the script;
the ones that place a node (node count, rank, addresses, rendezvous) are the script's to set,
from Slurm's variables, and the output folder and ``--resume`` name the whole job's folder.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from ..config import MODE_BEST
from ..result_files import JOB, RESULTS, role_of
from ..scale import slurm
from ..scale.node_sweep import NODE_DIR, Step, all_runs_ok, collect, node_dirs, steps_of
from .common import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED
from .run import add_run_command_arguments, run_plans_of

# dest -> why the user may not set it: the script derives it per task.
SET_BY_SCRIPT = {
    "nnodes": "the node count is the job's task count ($SLURM_NTASKS)",
    "node_rank": "node ranks are handed out at the rendezvous (resuming, each plan's node "
                 "with the measurements becomes node 0)",
    "master_addr": "the nodes meet at the allocation's first host",
    "master_port": "the rendezvous port is --rdzv-port (or the job id's default)",
    "rdzv": "the nodes meet at the allocation's first host (--rdzv-port picks the port)",
    "mode_from": "under --mode best each node count after the first takes the first one's "
                 "choice",
}
# Run options the command handles itself rather than passing on as given: --out and --resume
# name the job's folder, whose node folders the script hands out; --devices is each step's;
# --mode-from is the script's to give each step after the first.
OWN_DESTS = {"out", "devices", "resume"}
# Run options that name files: made absolute, as the script may be submitted from anywhere.
PATH_DESTS = {"data", "fabric"}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class _SetByScript(argparse.Action):
    """A run option the script sets: giving it is a usage error that says why."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is set by the job script: {SET_BY_SCRIPT[self.dest]}")


def run_parser() -> argparse.ArgumentParser:
    """`trainperf run`'s own parser, which every task's command goes through."""
    run = argparse.ArgumentParser(prog="trainperf run")
    add_run_command_arguments(run)
    return run


def run_option_defaults() -> dict[str, object]:
    """Every option of `trainperf run` the script passes on, with run's default."""
    return {dest: value for dest, value in vars(run_parser().parse_args(["recipe"])).items()
            if dest != "recipe" and dest not in SET_BY_SCRIPT and dest not in OWN_DESTS}


def register(sub) -> None:
    p = sub.add_parser(
        "slurm", conflict_handler="resolve",  # to take over run's --out, --devices and more
        help="write an sbatch script that runs a benchmark on several nodes, or on several "
             "node counts in one job (and submit it)",
        description="Write OUT/trainperf.sbatch: for each node count of --nodes (1,2,4: one "
                    "allocation of the largest, each count a step inside it), one `trainperf "
                    "run` per node through srun, meeting at the allocation's first host. At "
                    "its end OUT holds one results document per plan with every node count's "
                    "cases, each with its speedup against the 1-device case, and OUT/report.md. "
                    "With --submit, submit it and follow the job to its end. OUT must be on a "
                    "filesystem every node sees. Every option of `run` is taken and passed on "
                    "to each node's run, except those that place a node, which the script sets; "
                    "the plans are made and checked for the nodes' devices (CUDA with "
                    "--gpus-per-node, else the CPU), not this host's. --resume OUT finishes a "
                    "job that stopped.")
    add_run_command_arguments(p)
    for dest in SET_BY_SCRIPT:
        p.add_argument(_flag(dest), action=_SetByScript)
    p.add_argument("--devices", help="processes per node, as for run; a list runs each at "
                   "every node count (default: --gpus-per-node, or 1 on CPU nodes)")
    p.add_argument("--out", help="output folder on a shared filesystem (default "
                   "results/slurm-<recipe>-<time>)")
    p.add_argument("--resume", metavar="OUT",
                   help="finish the job whose folder is OUT (stopped, failed or out of time), "
                        "given its recipe and options again: each node resumes its own folder "
                        "as `run --resume` does (for each plan the node with the measurements "
                        "becomes node 0), and the report covers all of OUT")
    p.add_argument("--data", metavar="PREFIX",
                   help="as for run: PREFIX.rec/.idx, on a filesystem every node sees (every "
                        "node's run reads it; it is checked here before submitting)")
    p.add_argument("--fabric", action="append", metavar="COMMBENCH",
                   help="--breakdown: as for run, on a filesystem every node sees; the report "
                        "at the top of OUT sets the exposed communication against it too")
    g = p.add_argument_group("Slurm")
    g.add_argument("--nodes", metavar="N[,N...]",
                   help="nodes to allocate; a list (1,2,4) runs each count as a step of one "
                        "job, smallest first, and joins them into one document per plan")
    g.add_argument("--cases", metavar="NnGg[,...]",
                   help="instead of every --devices at every node count, exactly these cases, "
                        "named as DLPerf and the results name them (1n1g,1n8g,2n8g: nodes, "
                        "devices per node)")
    g.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs to allocate per node (default 0: CPU nodes); the plans are made "
                        "for CUDA with it, for the CPU without")
    g.add_argument("--partition")
    g.add_argument("--time", dest="time_limit", metavar="TIME",
                   help="the job's time limit, in sbatch's forms (e.g. 30, 2:00:00)")
    g.add_argument("--account")
    g.add_argument("--job-name", help="default trainperf-<recipe>")
    g.add_argument("--rdzv-port", type=int,
                   help=f"port the nodes meet at (default {slurm.RDZV_PORT_BASE} + job id mod "
                        f"{slurm.RDZV_PORT_SPAN}; ${slurm.PORT_ENV} at submission overrides); "
                        "each later node count meets at the next port")
    g.add_argument("--tasks-per-node", type=int, default=1,
                   help="advanced: tasks per host that each act as one node, to try several "
                        "nodes' runs on one CPU host (default 1)")
    g.add_argument("--submit", action="store_true",
                   help="submit the script, follow the job to its end and write the report")
    p.set_defaults(handler=cmd_slurm)


def run_argv(args: argparse.Namespace) -> list[str]:
    """The `trainperf run` options that reproduce ``args``, less the devices per node (each
    step's own): every option whose value differs from run's default."""
    argv = []
    for dest, default in run_option_defaults().items():
        value = getattr(args, dest)
        if value == default:
            continue
        if isinstance(value, bool):
            # run's switches are all store_true: a value that differs from its default is
            # the switch given.
            assert value is True, dest
            argv.append(_flag(dest))
            continue
        for item in value if isinstance(value, list) else [value]:  # append: once each
            text = str(Path(item).absolute()) if dest in PATH_DESTS else str(item)
            argv += [_flag(dest), text]
    return argv


def step_argv(job: slurm.SlurmJob, step: Step, place: str) -> list[str]:
    """The command a task of ``step`` runs, as this host checks it: its run options, its
    devices and node count, node 0's folder (``place``: ``--out`` or ``--resume``) and a
    rendezvous standing in for the allocation's first host."""
    port = str(job.rdzv_port or slurm.RDZV_PORT_BASE)
    meet = ["--nnodes", str(step.nodes * job.tasks_per_node), "--rdzv", f"localhost:{port}"] \
        if step.nodes * job.tasks_per_node > 1 else []
    return [job.recipe, *job.run_argv, "--devices", ",".join(map(str, step.devices)), *meet,
            place, str(job.step_dir(step) / NODE_DIR.format(0))]


def check_with_run(job: slurm.SlurmJob) -> list[list]:
    """Parse the command every task of every step will run with run's own parser and plan it,
    for the nodes' devices, so a usage error shows here rather than on the cluster after the
    queue; resuming, check as well that each step's node folders hold runs of these plans.
    Each step's plans, as node 0 makes them."""
    out = []
    for step in job.steps:
        args, unknown = run_parser().parse_known_args(
            step_argv(job, step, "--resume" if job.resume else "--out"))
        assert not unknown, f"run does not take {unknown}"
        plans = run_plans_of(args)
        if job.resume:
            check_same_plans(job, step, plans)
            check_measurements(job, step, plans)
        out.append(plans)
    return out


def check_measurements(job: slurm.SlurmJob, step: Step, plans: list) -> None:
    """ValueError, in one line, where a plan of the job being resumed cannot say which node
    folder holds its measurements: two do, or every one with records is a follower's and more
    than one holds none (the node that becomes node 0 at the rendezvous must be the one)."""
    home = job.step_dir(step) / NODE_DIR.format(0)
    nodes = node_dirs(job.step_dir(step))
    for plan in plans:
        rel = plan.out_dir.relative_to(home)
        holds = [role_of(node / rel / RESULTS) for node in nodes]
        leaders = [node.name for node, h in zip(nodes, holds) if h == "leader"]
        where = f"{job.step_dir(step)}'s node folders"
        what = f"of {rel.as_posix()}" if rel != Path() else ""
        if len(leaders) > 1:
            raise ValueError(f"--resume: {', '.join(leaders)} each hold measurements {what} "
                             f"(one job's have exactly one): {where} are not one job's")
        if not leaders and "follower" in holds and holds.count(None) != 1:
            raise ValueError(f"--resume: {holds.count('follower')} of {where} hold records "
                             f"{what}, none the measurements: resume the folder of the job "
                             "that has them")


def check_same_plans(job: slurm.SlurmJob, step: Step, plans: list) -> None:
    """ValueError, in one line, where a node folder of the job being resumed holds runs of
    another plan than ``plans`` (the check each node's run makes, made before the queue)."""
    home = job.step_dir(step) / NODE_DIR.format(0)
    wanted = {p.out_dir.relative_to(home): json.loads(json.dumps(p.settings())) for p in plans}
    hint = "give the recipe and options of the job that wrote it"
    for folder in node_dirs(job.step_dir(step)):
        # A plan's folder is the node folder or one or two below it (per framework, per
        # sweep point, real data and its synthetic twin).
        for path in sorted(folder.glob("plan.json")) + sorted(folder.glob("*/plan.json")) \
                + sorted(folder.glob("*/*/plan.json")):
            where = path.parent.relative_to(folder)
            old = json.loads(path.read_text(encoding="utf-8"))
            new = wanted.get(where)
            if new is None:
                raise ValueError(f"--resume: {path.parent} holds runs of a plan this job does "
                                 f"not make; {hint}")
            if old != new:
                changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
                raise ValueError(f"--resume: {path.parent} holds runs of another plan (differs "
                                 f"in {', '.join(changed)}); {hint}")


def nodes_device(args: argparse.Namespace) -> str:
    """The device the nodes' runs go to, decided by what the job asks of Slurm rather than by
    the host that writes the script (a login node has no GPU; a GPU node's runs need CUDA)."""
    if args.device == "auto":
        return "cuda" if args.gpus_per_node else "cpu"
    if args.device == "cuda" and not args.gpus_per_node:
        raise ValueError("--device cuda on nodes without GPUs: give --gpus-per-node")
    return args.device


def job_from_args(args: argparse.Namespace) -> slurm.SlurmJob:
    from ..recipes import get_recipe
    from ..results import default_folder

    get_recipe(args.recipe)
    if not args.nodes and not args.cases:
        raise ValueError("give --nodes (a count, or a list of counts) or --cases")
    args.device = nodes_device(args)
    if args.devices is None and not args.cases:
        args.devices = str(args.gpus_per_node or 1)
    steps = steps_of(args.nodes or "", args.devices, args.cases)
    most = max(d for s in steps for d in s.devices)
    if args.gpus_per_node and most > args.gpus_per_node:
        raise ValueError(f"{most} processes per node is more than --gpus-per-node "
                         f"{args.gpus_per_node}")
    if args.resume and args.out and Path(args.out).absolute() != Path(args.resume).absolute():
        raise ValueError("--resume OUT names the job's folder: drop --out")
    out = Path(args.resume or args.out or default_folder(f"slurm-{args.recipe}"))
    job = slurm.SlurmJob(recipe=args.recipe, run_argv=tuple(run_argv(args)), out_dir=out,
                         steps=tuple(steps), gpus_per_node=args.gpus_per_node,
                         tasks_per_node=args.tasks_per_node, partition=args.partition,
                         time_limit=args.time_limit, account=args.account,
                         job_name=args.job_name, rdzv_port=args.rdzv_port,
                         resume=bool(args.resume),
                         fabric=tuple(str(Path(f).absolute()) for f in args.fabric or ()))
    if args.resume:
        check_resumable(job)
    elif slurm.job_folders(job.out_dir) or (job.out_dir / JOB).exists():
        raise ValueError(f"{job.out_dir} already holds a job's node folders; choose another "
                         f"--out, or --resume it to finish that job")
    plans = check_with_run(job)
    best = any(p.tuning.mode == MODE_BEST for step in plans for p in step)
    return replace(job, mode_from_first=best and len(job.steps) > 1)


def check_resumable(job: slurm.SlurmJob) -> None:
    """ValueError, in one line, where ``job``'s folder holds no job to resume, or one of other
    node counts."""
    if not slurm.job_folders(job.out_dir):
        raise ValueError(f"--resume {job.out_dir}: no node folders of an earlier job there; "
                         f"drop --resume to start one")
    if (job.out_dir / JOB).exists():
        earlier = slurm.steps_of_job(job.out_dir)
        if earlier != list(job.steps):
            def words(steps):
                return "; ".join(f"{s.nodes} node(s) x {','.join(map(str, s.devices))}"
                                 for s in steps)
            raise ValueError(f"--resume {job.out_dir}: the earlier job ran {words(earlier)}, "
                             f"this one would run {words(job.steps)}: give the --nodes, "
                             "--devices or --cases it had")
    for step in job.steps:
        names = [p.name for p in node_dirs(job.step_dir(step))]
        extra = [n for n in names if int(n.split("-")[1]) >= step.nodes * job.tasks_per_node]
        if extra:
            raise ValueError(f"--resume {job.out_dir}: {job.step_dir(step)} holds "
                             f"{', '.join(extra)}, beyond this job's "
                             f"{step.nodes * job.tasks_per_node} node(s) at that count: give "
                             "the --nodes and --tasks-per-node it had")


def cmd_slurm(args: argparse.Namespace) -> int:
    job = job_from_args(args)
    command_line = shlex.join(["trainperf", *sys.argv[1:]]) if sys.argv[1:2] == ["slurm"] \
        else None
    path = slurm.write_script(job, command_line)
    if not args.submit:
        print(f"script: {path}")
        print(f"submit it with: sbatch {shlex.quote(str(path))}")
        return EXIT_OK
    return submit_and_follow(job, path)


def submit_and_follow(job: slurm.SlurmJob, path: Path) -> int:
    from ..procs import interrupt_on_sigterm

    job_id = slurm.submit(path)
    print(f"slurm job {job_id}: submitted ({path}); its log: {job.output_path(job_id)}",
          flush=True)
    interrupt_on_sigterm()
    try:
        end = slurm.follow(job_id, say=lambda text: print(text, flush=True))
    except KeyboardInterrupt:
        print(f"trainperf: interrupted; cancelling slurm job {job_id}", file=sys.stderr)
        slurm.cancel(job_id)
        return EXIT_INTERRUPTED
    print(f"--- last lines of {job.output_path(job_id)} ---")
    print(slurm.tail(job.output_path(job_id)))
    print("---")
    try:
        # The job's documents and report, as its script's last step writes them (again here:
        # a job cancelled or out of time never reached that step).
        docs, report, missing = collect(job.out_dir, list(job.steps), "slurm", job.fabric)
    except ValueError as exc:
        print(f"trainperf: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    print(report.read_text(encoding="utf-8"))
    for line in missing:
        print(f"trainperf: not measured: {line}", file=sys.stderr)
    for doc in docs:
        print(f"results: {doc}")
    print(f"report: {report}")
    ok = end.state == "COMPLETED" and all_runs_ok(docs, missing)
    return EXIT_OK if ok else EXIT_RUN_FAILED
