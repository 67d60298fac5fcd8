"""`trainperf slurm`: the script (valid bash, the asked #SBATCH lines, run's options carried
over, what each task of each node count runs, a job that resumes an earlier one's node
folders), plans made for the nodes' devices, usage errors, following a job through a fake
Slurm, and a real Slurm of two nodes on this host running jobs of several plans, a node sweep
and a job resumed after one of its nodes was killed."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from run_util import reserved_ports
from slurm_host import slurm_cluster  # noqa: F401  (the fixture, imported to be found)
from trainperf import results
from trainperf.cli import build_parser, main
from trainperf.cli import slurm as slurm_cli
from trainperf.rendezvous import RendezvousError, rank_order
from trainperf.result_files import role_of
from trainperf.scale import commbench, node_sweep, slurm
from trainperf.scale.node_sweep import Step, steps_of

BASIC = ["tiny-arcface", "--nodes", "2"]


def make_script(tmp_path: Path, *argv: str) -> str:
    out = tmp_path / "job"
    assert main(["slurm", *argv, "--out", str(out)]) == 0
    return (out / slurm.SCRIPT_NAME).read_text()


def sbatch_lines(script: str) -> list[str]:
    return [ln.removeprefix("#SBATCH ") for ln in script.splitlines()
            if ln.startswith("#SBATCH ")]


@pytest.mark.parametrize("argv", [
    BASIC,
    ["r100-arcface-emore", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
     "--time", "1:00:00", "--account", "perf", "--precision", "fp16", "--fc", "pfc",
     "--batch-size", "64,96", "--rdzv-port", "31000"],
    ["tiny-arcface", "--nodes", "1", "--tasks-per-node", "2", "--device", "cpu",
     "--memory-format", "channels_last", "--job-name", "smoke"],
])
def test_script_is_valid_bash(tmp_path, argv, capsys):
    script = make_script(tmp_path, *argv)
    done = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert done.returncode == 0, done.stderr
    assert script.startswith("#!/bin/bash\n") and "set -euo pipefail" in script
    out = capsys.readouterr().out
    path = tmp_path / "job" / slurm.SCRIPT_NAME
    assert f"script: {path}" in out and f"sbatch {path}" in out
    assert os.stat(path).st_mode & stat.S_IXUSR


def test_sbatch_lines_follow_the_options(tmp_path):
    lines = sbatch_lines(make_script(
        tmp_path, "tiny-arcface", "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
        "--time", "1:00:00", "--account", "perf"))
    assert lines == ["--job-name=trainperf-tiny-arcface", "--nodes=4", "--ntasks-per-node=1",
                     "--gpus-per-node=8", "--exclusive", "--mem=0", "--partition=gpu",
                     "--time=1:00:00", "--account=perf",
                     f"--output={tmp_path / 'job'}/slurm-%j.out"]
    # Only what was asked: no GPUs, partition, time or account unless given.
    bare = sbatch_lines(make_script(tmp_path / "bare", *BASIC, "--tasks-per-node", "2"))
    assert "--ntasks-per-node=2" in bare
    assert not [ln for ln in bare if ln.split("=")[0] in
                ("--gpus-per-node", "--partition", "--time", "--account")]


def test_sbatch_directives_come_before_any_command(tmp_path):
    """sbatch stops reading #SBATCH lines at the first command."""
    script = make_script(tmp_path, *BASIC)
    last = max(i for i, ln in enumerate(script.splitlines()) if ln.startswith("#SBATCH"))
    assert all(ln.startswith("#") for ln in script.splitlines()[:last])


def slurm_namespace(*argv: str):
    return build_parser().parse_args(["slurm", *argv])


def test_plans_are_made_for_the_nodes_devices_not_this_hosts(tmp_path):
    """A login node has no GPU: a job asking for GPU nodes is planned for CUDA (bf16 for
    Paddle, CUDA graphs for torch, which a CPU does not run), one without for the CPU."""
    gpu = slurm_namespace("tiny-arcface", "--nodes", "2", "--gpus-per-node", "8",
                          "--framework", "torch,paddle,jax", "--precision", "bf16",
                          "--out", str(tmp_path / "a"))
    job = slurm_cli.job_from_args(gpu)
    assert "--device" in job.run_argv and job.run_argv[job.run_argv.index("--device") + 1] \
        == "cuda"
    assert job.steps == (Step(2, (8,)),)
    graphs = slurm_namespace("tiny-arcface", "--nodes", "2", "--gpus-per-node", "8", "--mode",
                             "compile-cudagraphs", "--out", str(tmp_path / "b"))
    slurm_cli.job_from_args(graphs)
    cpu = slurm_namespace(*BASIC, "--framework", "paddle", "--precision", "bf16",
                          "--out", str(tmp_path / "c"))
    with pytest.raises(ValueError, match="paddle"):
        slurm_cli.job_from_args(cpu)
    with pytest.raises(ValueError, match="--gpus-per-node"):
        slurm_cli.job_from_args(slurm_namespace(*BASIC, "--device", "cuda",
                                                "--out", str(tmp_path / "d")))


def test_run_options_round_trip():
    argv = ["--batch-size", "16,32", "--precision", "bf16",
            "--fc", "pfc", "--sample-ratio", "0.25", "--pfc-update", "dense",
            "--num-classes", "2000", "--runs", "3", "--iters", "40", "--warmup", "5",
            "--device", "cpu", "--timeout", "99.5", "--memory-limit", "4GiB",
            "--memory-format", "channels_last", "--mode", "eager", "--no-cudnn-benchmark",
            "--ddp-bucket-mb", "12.5",
            "--ddp-broadcast-buffers", "--no-ddp-static-graph", "--mxnet-kvstore", "device"]
    if "rdzv_timeout" in slurm_cli.run_option_defaults():
        argv += ["--rdzv-timeout", "77"]
    args = slurm_namespace(*BASIC, "--devices", "2", *argv)
    carried = slurm_cli.run_argv(args)
    back = build_parser().parse_args(["run", "tiny-arcface", *carried])
    for dest in slurm_cli.run_option_defaults():
        assert getattr(back, dest) == getattr(args, dest), dest
    # Every option above differs from run's default, so every one is carried, and no other
    # (the devices per node are each node count's own).
    flags = {w for w in argv if w.startswith("--")}
    assert {w for w in carried if w.startswith("--")} == flags
    assert "--framework" not in slurm_cli.run_argv(slurm_namespace(*BASIC, "--framework",
                                                                   "torch"))


def test_defaults_carry_only_the_nodes_device(tmp_path):
    assert slurm_cli.run_argv(slurm_namespace(*BASIC, "--devices", "1")) == []
    job = slurm_cli.job_from_args(slurm_namespace(*BASIC, "--out", str(tmp_path / "a")))
    assert job.run_argv == ("--device", "cpu") and job.steps == (Step(2, (1,)),)
    # One process per GPU unless told otherwise.
    args = slurm_namespace(*BASIC, "--gpus-per-node", "4", "--out", str(tmp_path / "b"))
    job = slurm_cli.job_from_args(args)
    assert job.run_argv == ("--device", "cuda") and job.steps == (Step(2, (4,)),)


@pytest.mark.parametrize("argv,steps", [
    (["--nodes", "1,2,4", "--devices", "1,8"],
     [Step(1, (1, 8)), Step(2, (1, 8)), Step(4, (1, 8))]),
    (["--nodes", "4,1"], [Step(1, (1,)), Step(4, (1,))]),
    (["--cases", "1n1g,1n8g,2n8g,4n8g"],  # DLPerf's rows 1n1g, 1n8g, 2n16g, 4n32g
     [Step(1, (1, 8)), Step(2, (8,)), Step(4, (8,))]),
    (["--nodes", "1,2", "--cases", "2n1g,1n1g,1n2g"], [Step(1, (1, 2)), Step(2, (1,))]),
])
def test_node_counts_and_cases_make_the_steps(argv, steps):
    nodes = argv[argv.index("--nodes") + 1] if "--nodes" in argv else ""
    devices = argv[argv.index("--devices") + 1] if "--devices" in argv else None
    cases = argv[argv.index("--cases") + 1] if "--cases" in argv else None
    assert steps_of(nodes, devices, cases) == steps


@pytest.mark.parametrize("argv,needle", [
    (["no-such-recipe", "--nodes", "2"], "unknown recipe"),
    ([*BASIC[:1], "--nodes", "0"], "--nodes"),
    ([*BASIC, "--tasks-per-node", "2", "--gpus-per-node", "1"], "--tasks-per-node"),
    ([*BASIC, "--gpus-per-node", "2", "--devices", "1,4"], "--gpus-per-node"),
    ([*BASIC, "--devices", "1,x"], "--devices"),
    ([*BASIC, "--iters", "10", "--warmup", "10"], "--iters"),
    ([*BASIC, "--fc", "mp", "--sample-ratio", "0.5"], "sample-ratio"),
    ([*BASIC, "--framework", "caffe"], "unknown framework"),
    ([*BASIC, "--partition", "a b"], "#SBATCH"),
    ([*BASIC, "--rdzv-port", "70000"], "--rdzv-port"),
    ([*BASIC, "--job-name", "it's"], "#SBATCH"),
    ([*BASIC[:1], "--nodes", "1,1"], "twice"),
    ([*BASIC[:1], "--nodes", "1", "--cases", "1n1g,2n1g"], "--nodes says 1"),
    ([*BASIC, "--cases", "2n1g,2n1g"], "twice"),
    ([*BASIC, "--cases", "2n1g", "--devices", "1"], "drop --devices"),
    ([*BASIC, "--cases", "two"], "NnGg"),
])
def test_usage_errors(tmp_path, argv, needle, capsys):
    assert main(["slurm", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.startswith("trainperf: error:") and "\n" not in err
    assert not (tmp_path / "o").exists()  # nothing written


@pytest.mark.parametrize("flag", ["--nnodes", "--node-rank", "--master-addr",
                                  "--master-port", "--rdzv"])
def test_placement_options_are_the_scripts(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["slurm", *BASIC, flag, "2"])
    assert exc.value.code == 2
    assert "set by the job script" in capsys.readouterr().err


def sample_words(action) -> list[str]:
    """A value of a run option other than its default, as a command line gives it."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [next(c for c in action.choices if c != action.default)]
    return ["3"]  # an int, a float or a string alike


def test_every_run_option_is_carried_or_refused(capsys):
    """An option of `trainperf run` that slurm neither passes on to the nodes nor refuses with
    its reason is one a cluster's runs silently lack: each one of run's is one or the other,
    or slurm's own (the job's folder, the processes per node)."""
    run = slurm_cli.run_parser()
    seen = set()
    for action in run._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag, dest = action.option_strings[-1], action.dest
        seen.add(dest)
        if dest in slurm_cli.SET_BY_SCRIPT:
            with pytest.raises(SystemExit):
                main(["slurm", *BASIC, flag, "2"])
            last = capsys.readouterr().err.strip().splitlines()[-1]
            assert last.endswith(f"{flag} is set by the job script: "
                                 f"{slurm_cli.SET_BY_SCRIPT[dest]}"), last
            continue
        if dest in slurm_cli.OWN_DESTS:
            continue  # the tests of --out, --devices (each step's) and --resume
        words = [flag, *sample_words(action)]
        carried = slurm_cli.run_argv(slurm_namespace(*BASIC, *words))
        assert flag in carried, flag
        wanted = getattr(run.parse_args(["tiny-arcface", *words]), dest)
        if dest in slurm_cli.PATH_DESTS:
            wanted = ([str(Path(w).absolute()) for w in wanted] if isinstance(wanted, list)
                      else str(Path(wanted).absolute()))
        assert getattr(run.parse_args(["tiny-arcface", *carried]), dest) == wanted, flag
    assert slurm_cli.OWN_DESTS <= seen and set(slurm_cli.SET_BY_SCRIPT) <= seen


def test_data_breakdown_and_trace_reach_every_node(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["data", "synth", "--identities", "2", "--images-per-identity", "2",
                 "--size", "16", "--val-pairs", "0", "--out", "faces"]) == 0
    Path("fabric.json").write_text(json.dumps({"schema": commbench.SCHEMA, "ops": []}))
    out = tmp_path / "out"
    # Relative paths, as typed: the script holds them absolute.
    args = slurm_namespace(*BASIC, "--data", "faces", "--loader-workers", "1",
                           "--no-synthetic-baseline", "--breakdown", "--breakdown-steps", "4",
                           "--trace", "--fabric", "fabric.json", "--out", str(out))
    job = replace(slurm_cli.job_from_args(args), python=str(tmp_path / "bin" / "python"))
    calls = run_script_with_fakes(tmp_path, job)
    for task, call in enumerate(calls[:2]):
        node = slurm_cli.run_parser().parse_args(call[3:])  # run's own parser takes it
        assert (node.data, node.loader_workers, node.no_synthetic_baseline) == \
            (str(tmp_path / "faces"), 1, True)
        assert (node.breakdown, node.breakdown_steps, node.trace) == (True, 4, True)
        assert node.fabric == [str(tmp_path / "fabric.json")]
        assert node.out == str(out / f"node-{task}") and node.resume is None
    # The report at the top of the job's folder sets the communication against it too.
    assert calls[2] == ["-m", "trainperf.scale.slurm", str(out),
                        "--fabric", str(tmp_path / "fabric.json")]


def test_a_bad_data_path_is_refused_before_submitting(tmp_path, capsys):
    assert main(["slurm", *BASIC, "--data", str(tmp_path / "none"),
                 "--out", str(tmp_path / "o"), "--submit"]) == 2
    err = capsys.readouterr().err.strip()
    assert "none.rec" in err and "\n" not in err
    assert not (tmp_path / "o").exists()


# -- resuming an earlier job's node folders ---------------------------------------------------

def earlier_job(out: Path, roles: list[str | None], plan: str = ".") -> None:
    """Node folders as a job leaves them: a plan's results.json by role (None: none, the job
    ended before that node recorded a run)."""
    for i, role in enumerate(roles):
        folder = out / f"node-{i}" / plan
        folder.mkdir(parents=True, exist_ok=True)
        if role is not None:
            doc = {"role": "follower"} if role == "follower" else {}
            (folder / "results.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("holds,first", [
    (["follower", "leader", "follower"], 1),
    ([None, None, None], 0),  # nothing recorded anywhere: the rendezvous's order stands
    (["follower", "follower", None], 2),  # node 0 ended before it recorded the run
    (["leader", "follower"], 0),
])
def test_the_node_with_the_measurements_becomes_node_0(holds, first):
    order = rank_order(holds)
    assert order[0] == first and sorted(order) == list(range(len(holds)))


def test_two_nodes_with_measurements_meet_no_further():
    with pytest.raises(RendezvousError, match="each hold measurements"):
        rank_order(["leader", "follower", "leader"])


def test_the_leader_is_found_per_plan(tmp_path):
    """Each plan's nodes meet on their own, so one plan's measurements may be on node 1 and
    another's on node 0: a job's documents are each joined from its own leader."""
    earlier_job(tmp_path, ["follower", "leader"], "torch")
    earlier_job(tmp_path, ["leader", "follower"], "jax")
    assert node_sweep.leader_of(tmp_path, "torch") == (tmp_path / "node-1", None)
    assert node_sweep.leader_of(tmp_path, "jax") == (tmp_path / "node-0", None)
    earlier_job(tmp_path, ["leader", "leader"], "paddle")
    leader, why = node_sweep.leader_of(tmp_path, "paddle")
    assert leader is None and "node-0, node-1 each hold measurements" in why
    leader, why = node_sweep.leader_of(tmp_path, "oneflow")
    assert leader is None and "no node folder" in why


def plan_folders(job: slurm.SlurmJob, step: Step) -> list:
    """The plans node 0 of ``step`` makes, as check_with_run plans them."""
    fresh = replace(job, resume=False)
    return slurm_cli.check_with_run(fresh)[list(job.steps).index(step)]


def test_a_resumed_job_resumes_each_node_folder(tmp_path):
    out = tmp_path / "out"
    earlier_job(out, ["follower", "leader"])
    job = slurm_cli.job_from_args(slurm_namespace(*BASIC, "--out", str(out / "x")))
    job = replace(job, out_dir=out)
    (plan,) = plan_folders(job, job.steps[0])
    for folder in node_sweep.node_dirs(out):
        (folder / "plan.json").write_text(json.dumps(plan.settings()))
    args = slurm_namespace(*BASIC, "--breakdown", "--resume", str(out))
    job = replace(slurm_cli.job_from_args(args), python=str(tmp_path / "bin" / "python"))
    assert job.resume
    calls = run_script_with_fakes(tmp_path, job)
    run = ["-m", "trainperf.cli", "run", "tiny-arcface", "--device", "cpu", "--breakdown",
           "--devices", "1", "--nnodes", "2", "--rdzv", "10.1.0.17:29634"]
    # Each task resumes its own folder; the rendezvous makes the one with the measurements
    # node 0 (rank_order).
    assert calls == [run + ["--resume", str(out / "node-0")],
                     run + ["--resume", str(out / "node-1")],
                     ["-m", "trainperf.scale.slurm", str(out)]]
    for call in calls[:2]:
        assert slurm_cli.run_parser().parse_args(call[3:]).resume
    assert "# This job finishes an earlier one" in (out / slurm.SCRIPT_NAME).read_text()


@pytest.mark.parametrize("setup,argv,needle", [
    (None, [], "no node folders"),
    (["leader", "follower", "follower"], [], "give the --nodes"),
    (["leader", "leader"], [], "each hold measurements"),
    (["follower", "follower"], [], "none the measurements"),
    (["leader", "follower"], ["--out", "elsewhere"], "drop --out"),
    (["leader", "follower"], ["--runs", "3"], "another plan (differs in measure)"),
    (["leader", "follower"], ["--framework", "torch,jax"], "a plan this job does not make"),
])
def test_a_resume_that_cannot_work_is_refused(tmp_path, setup, argv, needle, capsys):
    out = tmp_path / "out"
    if setup is not None:
        earlier_job(out, setup)
        job = slurm_cli.job_from_args(slurm_namespace(*BASIC, "--out", str(tmp_path / "x")))
        (plan,) = plan_folders(replace(job, out_dir=out), job.steps[0])
        (out / "node-0" / "plan.json").write_text(json.dumps(plan.settings()))
    assert main(["slurm", *BASIC, *argv, "--resume", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and err.startswith("trainperf: error:") and "\n" not in err
    assert not (out / slurm.SCRIPT_NAME).exists()  # nothing written


def test_a_percent_in_the_output_folder_is_refused(tmp_path, capsys):
    assert main(["slurm", *BASIC, "--out", str(tmp_path / "100%")]) == 2
    assert "pattern" in capsys.readouterr().err


def test_an_earlier_jobs_folder_is_refused(tmp_path, capsys):
    (tmp_path / "node-0").mkdir()
    assert main(["slurm", *BASIC, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "already holds" in err and "--resume" in err


def test_submit_without_sbatch_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["slurm", *BASIC, "--out", str(tmp_path / "o"), "--submit"]) == 2
    assert "needs sbatch" in capsys.readouterr().err


# -- the script's steps, run through bash with a fake srun ------------------------------------

FAKE_SRUN = """#!/bin/bash
# Records its own options, then runs the command once per task of the step as srun would,
# with the variables Slurm gives each task.
opts=()
ntasks=1
while [[ $1 == -* ]]; do
    opts+=("$1")
    [[ $1 == --ntasks=* ]] && ntasks=${1#--ntasks=}
    shift
done
printf '%s\\n' "${opts[*]}" >> "$RECORD/srun-options"
for ((i = 0; i < ntasks; i++)); do
    SLURM_PROCID=$i SLURM_NTASKS=$ntasks "$@"
done
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu-a17\\ngpu-a18\\ngpu-a19\\ngpu-a20\\n'
[[ "$1 $2" == "show node" ]] && echo "NodeName=$3 Arch=x86_64 CoresPerSocket=8"
[[ "$1 $2 $3" == "show node gpu-a17" ]] && echo "   NodeAddr=10.1.0.17 NodeHostName=gpu-a17"
exit 0
"""
FAKE_PYTHON = """#!{python}
import json, os, sys
with open(os.path.join(os.environ["RECORD"], "calls.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def run_script_with_fakes(tmp_path: Path, job: slurm.SlurmJob, **env: str) -> list[list[str]]:
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(parents=True)
    record.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("python", FAKE_PYTHON.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = slurm.write_script(job)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record),
           "SLURM_JOB_NODELIST": "gpu-a[17-20]", "SLURM_JOB_ID": "81234",
           "SLURM_CPUS_ON_NODE": "16", **env}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [json.loads(ln) for ln in (record / "calls.jsonl").read_text().splitlines()]


def test_each_task_runs_run_as_one_node(tmp_path):
    fake_python = str(tmp_path / "bin" / "python")
    job = slurm.SlurmJob("tiny-arcface", ("--runs", "3"), tmp_path / "out",
                         steps=(Step(2, (2,)),), python=fake_python)
    calls = run_script_with_fakes(tmp_path, job)
    # 29400 + 81234 % 1000; the address Slurm reaches the first host by
    run = ["-m", "trainperf.cli", "run", "tiny-arcface", "--runs", "3", "--devices", "2",
           "--nnodes", "2", "--rdzv", "10.1.0.17:29634"]
    assert calls == [run + ["--out", str(tmp_path / "out" / "node-0")],
                     run + ["--out", str(tmp_path / "out" / "node-1")],
                     ["-m", "trainperf.scale.slurm", str(tmp_path / "out")]]
    options = (tmp_path / "record" / "srun-options").read_text().split()
    assert "--ntasks-per-node=1" in options and '--cpus-per-task=16' in options
    assert "--nodes=2" in options and "--nodelist=gpu-a17,gpu-a18" in options


def test_a_node_sweep_runs_each_count_on_the_first_hosts(tmp_path):
    """One allocation of the largest count; each count a step on the allocation's first
    hosts, meeting on a port of its own, its node folders under nodes-N; under --mode best
    every count after the first takes the first one's choice."""
    out = tmp_path / "out"
    args = slurm_namespace("tiny-arcface", "--nodes", "1,2,4", "--devices", "1,2",
                           "--framework", "torch,jax", "--runs", "2", "--out", str(out))
    job = replace(slurm_cli.job_from_args(args), python=str(tmp_path / "bin" / "python"))
    assert job.mode_from_first  # several frameworks: --mode best
    assert sbatch_lines(slurm.render_script(job))[1] == "--nodes=4"
    calls = run_script_with_fakes(tmp_path, job)
    base = ["-m", "trainperf.cli", "run", "tiny-arcface", "--framework", "torch,jax",
            "--device", "cpu", "--runs", "2", "--devices", "1,2"]
    first = str(out / "nodes-1")
    assert calls[0] == base + ["--out", str(out / "nodes-1" / "node-0")]
    assert calls[1:3] == [base + ["--mode-from", first, "--nnodes", "2", "--rdzv",
                                  "10.1.0.17:29635", "--out", str(out / "nodes-2" / f"node-{i}")]
                          for i in range(2)]
    assert calls[3:7] == [base + ["--mode-from", first, "--nnodes", "4", "--rdzv",
                                  "10.1.0.17:29636", "--out", str(out / "nodes-4" / f"node-{i}")]
                          for i in range(4)]
    assert calls[7] == ["-m", "trainperf.scale.slurm", str(out)]
    steps = (tmp_path / "record" / "srun-options").read_text().splitlines()
    assert ["--nodes=1 --nodelist=gpu-a17", "--nodes=2 --nodelist=gpu-a17,gpu-a18",
            "--nodes=4 --nodelist=gpu-a17,gpu-a18,gpu-a19,gpu-a20"] == \
        [" ".join(line.split()[:2]) for line in steps]
    job_record = json.loads((out / "job.json").read_text())
    assert job_record["steps"] == [{"nodes": n, "devices_per_node": [1, 2]} for n in (1, 2, 4)]
    for call in calls[:7]:
        slurm_cli.run_parser().parse_args(call[3:])  # run's own parser takes each


def test_the_port_can_be_chosen(tmp_path):
    job = slurm.SlurmJob("tiny-arcface", (), tmp_path / "out", steps=(Step(1, (1,)),),
                         tasks_per_node=2, rdzv_port=31000, python=str(tmp_path / "bin/python"))
    calls = run_script_with_fakes(tmp_path, job)
    assert [c[c.index("--rdzv") + 1] for c in calls[:2]] == ["10.1.0.17:31000"] * 2
    options = (tmp_path / "record" / "srun-options").read_text().split()
    assert "--cpus-per-task=8" in options  # the host's CPUs shared by its two tasks
    calls = run_script_with_fakes(tmp_path / "again", job, TRAINPERF_RDZV_PORT="4242")
    assert calls[0][calls[0].index("--rdzv") + 1] == "10.1.0.17:4242"


# -- following a job, on a fake Slurm ---------------------------------------------------------

class FakeSlurm:
    """Answers squeue with the given states in turn, then with nothing (the job has left the
    queue); scontrol with how it ended."""

    def __init__(self, states: list[str], end: str = "COMPLETED", exit_code: str = "0:0"):
        self.states, self.end, self.exit_code = list(states), end, exit_code
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        out = ""
        if argv[0] == "squeue" and self.states:
            out = self.states.pop(0) + "\n"
        elif argv[0] == "scontrol":
            out = f"JobId=7 JobName=x JobState={self.end} Reason=None ExitCode={self.exit_code}"
        elif argv[0] == "sbatch":
            out = "7;cluster\n"
        return subprocess.CompletedProcess(argv, 0, out, "")


def test_follow_says_each_change_and_how_the_job_ended():
    fake = FakeSlurm(["PENDING|Resources", "PENDING|Resources", "RUNNING|None",
                      "RUNNING|None", "COMPLETING|None"])
    said = []
    end = slurm.follow("7", say=said.append, run=fake, sleep=lambda s: None)
    assert end == slurm.JobEnd("COMPLETED", "0:0")
    assert said == ["slurm job 7: PENDING (Resources)", "slurm job 7: RUNNING",
                    "slurm job 7: COMPLETING", "slurm job 7: COMPLETED (exit code 0:0)"]
    assert slurm.submit(Path("x.sbatch"), run=fake) == "7"


def test_follow_stops_at_an_end_state_squeue_still_shows():
    fake = FakeSlurm(["RUNNING|None", "TIMEOUT|TimeLimit"], end="TIMEOUT", exit_code="0:15")
    end = slurm.follow("7", say=lambda s: None, run=fake, sleep=lambda s: None)
    assert end.state == "TIMEOUT" and fake.states == []


def test_ctrl_c_cancels_the_job(tmp_path, monkeypatch, capsys):
    fake = FakeSlurm(["RUNNING|None"])
    monkeypatch.setattr(slurm, "run_command", fake)
    monkeypatch.setattr(slurm, "submit", lambda path: "7")

    def interrupted(job_id, say):
        raise KeyboardInterrupt

    monkeypatch.setattr(slurm, "follow", interrupted)
    monkeypatch.setattr(slurm, "cancel", lambda job_id: fake(["scancel", job_id]))
    assert main(["slurm", *BASIC, "--out", str(tmp_path), "--submit"]) == 130
    assert ["scancel", "7"] in fake.calls
    assert "cancelling slurm job 7" in capsys.readouterr().err


def test_cancel_waits_for_the_job_to_leave():
    fake = FakeSlurm(["RUNNING|None", "COMPLETING|None"])
    slurm.cancel("7", run=fake, sleep=lambda s: None)
    assert fake.calls[0] == ["scancel", "7"] and fake.states == []


# -- a real Slurm of two nodes ------------------------------------------------------------------

TINY = ["--runs", "1", "--iters", "5", "--warmup", "2", "--time", "5"]


def submit(slurm_cluster, out: Path, *argv: str) -> tuple[int, str]:
    rc = main(["slurm", "tiny-arcface", *argv, *TINY, "--rdzv-port",
               str(reserved_ports(3)[0]), "--out", str(out), "--submit"])
    return rc


def job_documents(out: Path) -> dict[str, dict]:
    """The job's documents by plan, as job.json lists them."""
    listed = json.loads((out / "job.json").read_text())["documents"]
    return {str(Path(rel).parent): results.load(out / rel) for rel in listed}


@pytest.mark.slow
def test_a_node_sweep_of_two_frameworks_completes_and_reports(slurm_cluster, tmp_path,
                                                             capsys):
    """torch and JAX (each in its default mode, as asked) at 1 node of 1 process and at 2
    nodes of 1: one document per framework with both cases, speedups against 1n1g on every
    row, report.md, exit 0."""
    out = tmp_path / "job"
    started = time.monotonic()
    rc = submit(slurm_cluster, out, "--framework", "torch,jax", "--mode", "default",
                "--cases", "1n1g,2n1g")
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "COMPLETED" in printed and (out / "report.md").exists()
    docs = job_documents(out)
    assert set(docs) == {"torch", "jax"}
    for doc in docs.values():
        assert [c["case"] for c in doc["cases"]] == ["1n1g", "2n1g"]
        assert all(c["speedup"] is not None and c["runs"][0]["status"] == "ok"
                   for c in doc["cases"])
        assert doc["cases"][0]["speedup"] == 1.0
        assert {c["measured_in"].split("/")[0] for c in doc["cases"]} == {"nodes-1", "nodes-2"}
    report = (out / "report.md").read_text()
    assert "## Comparison" in report
    assert slurm_cluster.job_ids() == []  # nothing left in the queue
    print(f"sweep submitted, run and reported in {time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_a_real_data_job_writes_its_report(slurm_cluster, tmp_path, capsys):
    prefix = tmp_path / "faces"
    assert main(["data", "synth", "--identities", "4", "--images-per-identity", "4",
                 "--size", "32", "--val-pairs", "0", "--out", str(prefix)]) == 0
    out = tmp_path / "job"
    rc = submit(slurm_cluster, out, "--nodes", "2", "--data", str(prefix),
                "--loader-workers", "1", "--no-synthetic-baseline")
    printed = capsys.readouterr().out
    assert rc == 0, printed
    docs = job_documents(out)  # the real-data plan writes a folder of its own, OUT/real
    assert set(docs) == {"real"}
    assert all(d["cases"][0]["case"] == "2n1g" for d in docs.values())
    assert "real-data" in (out / "report.md").read_text()


def kill_the_leader_after_its_first_run(out: Path, timeout_s: float = 180.0) -> Path:
    """Kill the node that keeps the measurements, runner and runs, once it has recorded its
    first run: a node lost in the middle of a job. Its folder."""
    deadline = time.monotonic() + timeout_s
    leader = None
    while leader is None:
        assert time.monotonic() < deadline, f"no node of {out} recorded a run"
        for node in node_sweep.node_dirs(out):
            try:
                doc = json.loads((node / "results.json").read_text())
            except (OSError, ValueError):
                continue
            if doc.get("role") != "follower" and doc["cases"] and doc["cases"][0]["runs"]:
                leader = node
        time.sleep(0.2)
    runners = [p for p in psutil.process_iter(["cmdline"])
               if str(leader) in (p.info["cmdline"] or [])]
    victims = [c for p in runners for c in p.children(recursive=True)] + runners
    for p in victims:
        try:
            p.kill()
        except psutil.Error:
            pass
    return leader


@pytest.mark.slow
def test_a_job_whose_node_was_killed_finishes_with_resume(slurm_cluster, tmp_path, capsys):
    out = tmp_path / "job"
    port = str(reserved_ports(3)[0])
    argv = ["slurm", "tiny-arcface", "--nodes", "2", "--runs", "2", "--iters", "5",
            "--warmup", "1", "--time", "5", "--rdzv-port", port, "--rdzv-timeout", "10"]
    killed: list[Path] = []
    killer = threading.Thread(
        target=lambda: killed.append(kill_the_leader_after_its_first_run(out)))
    killer.start()
    rc = main([*argv, "--out", str(out), "--submit"])
    killer.join()
    capsys.readouterr()
    assert rc == 1 and killed  # a node was lost: the job did not measure everything
    first = json.loads((killed[0] / "results.json").read_text())["cases"][0]["runs"]
    assert [r["run"] for r in first] == [1]
    rc = main([*argv, "--resume", str(out), "--submit"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    (doc,) = job_documents(out).values()
    (case,) = doc["cases"]
    assert [r["run"] for r in case["runs"]] == [1, 2]
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in case["runs"])
    # Run 1 is the one measured before the kill, in the folder that kept it; run 2 was
    # measured there too, whichever task the resumed job's rendezvous ranked first.
    assert case["runs"][0] == first[0]
    assert case["measured_in"] == killed[0].name
    roles = {node.name: role_of(node / "results.json") for node in node_sweep.node_dirs(out)}
    assert roles[killed[0].name] == "leader" and sorted(roles.values()) == ["follower",
                                                                            "leader"]
