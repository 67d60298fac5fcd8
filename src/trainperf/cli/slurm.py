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

from ..config import parse_int_list
from ..scale import slurm
from .common import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUN_FAILED
from .run import add_run_command_arguments, run_plans_of

# dest -> why the user may not set it: the script derives it per task.
SET_BY_SCRIPT = {
    "nnodes": "the node count is the job's task count ($SLURM_NTASKS)",
    "node_rank": "node ranks are handed out at the rendezvous (with --resume, task i is "
                 "node i)",
    "master_addr": "the nodes meet at the allocation's first host",
    "master_port": "the rendezvous port is --rdzv-port (or the job id's default)",
    "rdzv": "the nodes meet at the allocation's first host (--rdzv-port picks the port)",
}
# Run options the command handles itself rather than passing on as given: --out and --resume
# name the job's folder, whose node folders the script hands out.
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
        help="write an sbatch script that runs a benchmark on several nodes (and submit it)",
        description="Write OUT/trainperf.sbatch: one `trainperf run` per node through srun, "
                    "meeting at the allocation's first host. With --submit, submit it, follow "
                    "the job to its end and write OUT/report.md as `run` does. OUT must be on "
                    "a filesystem every node sees. Every option of `run` is taken and passed "
                    "on to each node's run, except those that place a node, which the script "
                    "sets; --resume OUT finishes a job that stopped.")
    add_run_command_arguments(p)
    for dest in SET_BY_SCRIPT:
        p.add_argument(_flag(dest), action=_SetByScript)
    p.add_argument("--devices", help="processes per node, as for run (default: "
                   "--gpus-per-node, or 1 on CPU nodes)")
    p.add_argument("--out", help="output folder on a shared filesystem (default "
                   "results/slurm-<recipe>-<time>)")
    p.add_argument("--resume", metavar="OUT",
                   help="finish the job whose node folders are in OUT (stopped, failed or out "
                        "of time), given its recipe and options again: each node resumes one "
                        "folder as `run --resume` does, the one with the measurements as node "
                        "0, and the report covers all of OUT")
    p.add_argument("--data", metavar="PREFIX",
                   help="as for run: PREFIX.rec/.idx, on a filesystem every node sees (every "
                        "node's run reads it; it is checked here before submitting)")
    p.add_argument("--fabric", action="append", metavar="COMMBENCH",
                   help="--breakdown: as for run, on a filesystem every node sees; the report "
                        "at the top of OUT sets the exposed communication against it too")
    g = p.add_argument_group("Slurm")
    g.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    g.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs to allocate per node (default 0: CPU nodes)")
    g.add_argument("--partition")
    g.add_argument("--time", dest="time_limit", metavar="TIME",
                   help="the job's time limit, in sbatch's forms (e.g. 30, 2:00:00)")
    g.add_argument("--account")
    g.add_argument("--job-name", help="default trainperf-<recipe>")
    g.add_argument("--rdzv-port", type=int,
                   help=f"port the nodes meet at (default {slurm.RDZV_PORT_BASE} + job id mod "
                        f"{slurm.RDZV_PORT_SPAN}; ${slurm.PORT_ENV} at submission overrides)")
    g.add_argument("--tasks-per-node", type=int, default=1,
                   help="advanced: tasks per host that each act as one node, to try several "
                        "nodes' runs on one CPU host (default 1)")
    g.add_argument("--submit", action="store_true",
                   help="submit the script, follow the job to its end and write the report")
    p.set_defaults(handler=cmd_slurm)


def run_argv(args: argparse.Namespace) -> list[str]:
    """The `trainperf run` options that reproduce ``args``: --devices, then every option whose
    value differs from run's default."""
    argv = ["--devices", str(args.devices)]
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


def check_with_run(job: slurm.SlurmJob) -> list:
    """Parse the command every task will run with run's own parser and plan it, so a usage
    error shows here rather than on the cluster after the queue; resuming, check as well
    that the node folders hold runs of these plans. The plans, as node 0 makes them."""
    port = str(job.rdzv_port or slurm.RDZV_PORT_BASE)
    if job.resume_from is None:
        place = ["--rdzv", f"localhost:{port}",
                 "--out", str(job.out_dir / slurm.NODE_DIR.format(0))]
    else:
        place = ["--node-rank", "0", "--master-addr", "localhost", "--master-port", port,
                 "--resume", str(job.out_dir / slurm.NODE_DIR.format(job.resume_from))]
    args, unknown = run_parser().parse_known_args(
        [job.recipe, *job.run_argv, "--nnodes", str(job.ntasks), *place])
    assert not unknown, f"run does not take {unknown}"
    plans = run_plans_of(args)
    if job.resume_from is not None:
        check_same_plans(job, plans)
    return plans


def _comparable(settings: dict) -> dict:
    """A plan's settings as its plan.json holds them, less what this host may plan otherwise
    than the nodes: the layout --memory-format auto picks on --device auto follows whether
    the planning host has a GPU."""
    doc = json.loads(json.dumps(settings))
    if doc.get("device") == "auto" and doc.get("tuning", {}).get("memory_format") == "auto":
        doc.get("workload", {}).pop("channels_last", None)
    return doc


def check_same_plans(job: slurm.SlurmJob, plans: list) -> None:
    """ValueError, in one line, where a node folder of the job being resumed holds runs of
    another plan than ``plans`` (the check each node's run makes, made before the queue)."""
    home = job.out_dir / slurm.NODE_DIR.format(job.resume_from)
    wanted = {p.out_dir.relative_to(home): _comparable(p.settings()) for p in plans}
    hint = "give the recipe and options of the job that wrote it"
    for folder in slurm.node_dirs(job.out_dir):
        # A plan's folder is the node folder or one or two below it (per framework, per
        # sweep point, real data and its synthetic twin).
        for path in sorted(folder.glob("plan.json")) + sorted(folder.glob("*/plan.json")) \
                + sorted(folder.glob("*/*/plan.json")):
            where = path.parent.relative_to(folder)
            old = _comparable(json.loads(path.read_text(encoding="utf-8")))
            new = wanted.get(where)
            if new is None:
                raise ValueError(f"--resume: {path.parent} holds runs of a plan this job does "
                                 f"not make; {hint}")
            if old != new:
                changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
                raise ValueError(f"--resume: {path.parent} holds runs of another plan (differs "
                                 f"in {', '.join(changed)}); {hint}")


def job_from_args(args: argparse.Namespace) -> slurm.SlurmJob:
    from ..recipes import get_recipe
    from ..results import default_folder

    get_recipe(args.recipe)
    if args.devices is None:
        args.devices = str(args.gpus_per_node or 1)
    devices = parse_int_list(args.devices, "--devices")
    if args.gpus_per_node and max(devices) > args.gpus_per_node:
        raise ValueError(f"--devices {args.devices} asks for more processes per node than "
                         f"--gpus-per-node {args.gpus_per_node}")
    if args.resume and args.out and Path(args.out).absolute() != Path(args.resume).absolute():
        raise ValueError("--resume OUT names the job's folder: drop --out")
    out = Path(args.resume or args.out or default_folder(f"slurm-{args.recipe}"))
    job = slurm.SlurmJob(recipe=args.recipe, run_argv=tuple(run_argv(args)), out_dir=out,
                         nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         tasks_per_node=args.tasks_per_node, partition=args.partition,
                         time_limit=args.time_limit, account=args.account,
                         job_name=args.job_name, rdzv_port=args.rdzv_port,
                         fabric=tuple(str(Path(f).absolute()) for f in args.fabric or ()))
    if args.resume:
        job = replace(job, resume_from=slurm.resume_leader(job.out_dir, job.ntasks))
    elif slurm.node_dirs(job.out_dir):
        raise ValueError(f"{job.out_dir} already holds a job's node folders; choose another "
                         f"--out, or --resume it to finish that job")
    check_with_run(job)
    return job


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
        # As `run` writes it, from the node that kept the measurements.
        leader, report = slurm.collect(job.out_dir, job.fabric)
    except ValueError as exc:
        print(f"trainperf: {exc}", file=sys.stderr)
        return EXIT_RUN_FAILED
    print(report.read_text(encoding="utf-8"))
    print(f"results: {leader / 'results.json'}")
    print(f"report: {report}")
    ok = end.state == "COMPLETED" and slurm.all_runs_ok(leader)
    return EXIT_OK if ok else EXIT_RUN_FAILED
