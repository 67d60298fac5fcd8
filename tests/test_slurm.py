"""`trainperf slurm`: the script (valid bash, the asked #SBATCH lines, run's options carried
over, what each task runs, a job that resumes an earlier one's node folders), usage errors,
following a job through a fake Slurm, and a real single-host Slurm running a job of two tasks
acting as two nodes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from run_util import reserved_ports
from slurm_host import slurm_cluster  # noqa: F401  (the fixture, imported to be found)
from trainperf import results
from trainperf.cli import build_parser, main
from trainperf.cli import slurm as slurm_cli
from trainperf.scale import commbench, slurm

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
    for dest in [*slurm_cli.run_option_defaults(), "devices"]:
        assert getattr(back, dest) == getattr(args, dest), dest
    # Every option above differs from run's default, so every one is carried, and no other.
    flags = {w for w in argv if w.startswith("--")}
    assert {w for w in carried if w.startswith("--")} == flags | {"--devices"}
    assert "--framework" not in slurm_cli.run_argv(slurm_namespace(*BASIC, "--framework",
                                                                   "torch"))


def test_defaults_carry_only_the_devices():
    assert slurm_cli.run_argv(slurm_namespace(*BASIC, "--devices", "1")) == ["--devices", "1"]
    # One process per GPU unless told otherwise.
    args = slurm_namespace(*BASIC, "--gpus-per-node", "4")
    job = slurm_cli.job_from_args(args)
    assert job.run_argv == ("--devices", "4")


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
            continue  # the tests of --out, --devices and --resume below
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

def earlier_job(out: Path, roles: list[str | None]) -> None:
    """Node folders as a job leaves them: a results.json by role (None: none, the job ended
    before that node recorded a run)."""
    for i, role in enumerate(roles):
        folder = out / f"node-{i}"
        folder.mkdir(parents=True)
        if role is not None:
            doc = {"role": "follower"} if role == "follower" else {}
            (folder / "results.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("roles,leader", [
    (["follower", "leader", "follower"], 1),
    ([None, None, None], 0),  # nothing recorded anywhere: any folder will do
    (["follower", "follower", None], 2),  # node 0 ended before it recorded the run
])
def test_the_folder_with_the_measurements_is_resumed_as_node_0(tmp_path, roles, leader):
    earlier_job(tmp_path, roles)
    assert slurm.resume_leader(tmp_path, 3) == leader


def test_a_resumed_job_resumes_each_node_folder(tmp_path):
    out = tmp_path / "out"
    earlier_job(out, ["follower", "leader"])
    plans = slurm_cli.check_with_run(slurm.SlurmJob("tiny-arcface", ("--devices", "1"), out,
                                                    nodes=2))
    settings = plans[0].settings()
    # The layout --memory-format auto picks follows the host's GPUs, which a login node
    # may lack: a node folder planned on a GPU node is still this plan's.
    settings["workload"]["channels_last"] = True
    for folder in slurm.node_dirs(out):
        (folder / "plan.json").write_text(json.dumps(settings))
    args = slurm_namespace(*BASIC, "--breakdown", "--resume", str(out))
    job = replace(slurm_cli.job_from_args(args), python=str(tmp_path / "bin" / "python"))
    assert job.resume_from == 1
    calls = run_script_with_fakes(tmp_path, job)
    run = ["-m", "trainperf.cli", "run", "tiny-arcface", "--devices", "1", "--breakdown",
           "--nnodes", "2"]
    # Task 0 runs on the first host: node 0, hosting the meeting, in the measurements' folder.
    meet = ["--master-addr", "gpu-a17", "--master-port", "29634"]
    assert calls == [run + ["--node-rank", "0", *meet, "--resume", str(out / "node-1")],
                     run + ["--node-rank", "1", *meet, "--resume", str(out / "node-0")],
                     ["-m", "trainperf.scale.slurm", str(out)]]
    for call in calls[:2]:
        assert slurm_cli.run_parser().parse_args(call[3:]).resume
    assert "# This job finishes an earlier one" in (out / slurm.SCRIPT_NAME).read_text()


@pytest.mark.parametrize("setup,argv,needle", [
    (None, [], "no node folders"),
    (["leader", "follower", "follower"], [], "give the --nodes"),
    (["leader", "leader"], [], "each hold measurements"),
    (["follower", "follower"], [], "no node folder holds the measurements"),
    (["leader", "follower"], ["--out", "elsewhere"], "drop --out"),
    (["leader", "follower"], ["--runs", "3"], "another plan (differs in measure)"),
    (["leader", "follower"], ["--framework", "torch,jax"], "a plan this job does not make"),
])
def test_a_resume_that_cannot_work_is_refused(tmp_path, setup, argv, needle, capsys):
    out = tmp_path / "out"
    if setup is not None:
        earlier_job(out, setup)
        plans = slurm_cli.check_with_run(slurm.SlurmJob("tiny-arcface", ("--devices", "1"),
                                                        out, nodes=2))
        (out / "node-0" / "plan.json").write_text(json.dumps(plans[0].settings()))
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
# Records its own options, then runs the command once per task as srun would, with the
# variables Slurm gives each task.
opts=()
while [[ $1 == -* ]]; do opts+=("$1"); shift; done
printf '%s\\n' "${opts[@]}" > "$RECORD/srun-options"
for ((i = 0; i < FAKE_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_NTASKS=$FAKE_NTASKS "$@"
done
"""
FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu-a17\\ngpu-a18\\n'
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
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_JOB_ID": "81234",
           "SLURM_CPUS_ON_NODE": "16", "FAKE_NTASKS": str(job.nodes * job.tasks_per_node),
           **env}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [json.loads(ln) for ln in (record / "calls.jsonl").read_text().splitlines()]


def test_each_task_runs_run_as_one_node(tmp_path):
    fake_python = str(tmp_path / "bin" / "python")
    job = slurm.SlurmJob("tiny-arcface", ("--devices", "2", "--runs", "3"), tmp_path / "out",
                         nodes=2, python=fake_python)
    calls = run_script_with_fakes(tmp_path, job)
    run = ["-m", "trainperf.cli", "run", "tiny-arcface", "--devices", "2", "--runs", "3",
           "--nnodes", "2", "--rdzv", "gpu-a17:29634"]  # 29400 + 81234 % 1000
    assert calls == [run + ["--out", str(tmp_path / "out" / "node-0")],
                     run + ["--out", str(tmp_path / "out" / "node-1")],
                     ["-m", "trainperf.scale.slurm", str(tmp_path / "out")]]
    options = (tmp_path / "record" / "srun-options").read_text().split()
    assert "--ntasks-per-node=1" in options and '--cpus-per-task=16' in options


def test_the_port_can_be_chosen(tmp_path):
    job = slurm.SlurmJob("tiny-arcface", ("--devices", "1"), tmp_path / "out", nodes=1,
                         tasks_per_node=2, rdzv_port=31000, python=str(tmp_path / "bin/python"))
    calls = run_script_with_fakes(tmp_path, job)
    assert [c[c.index("--rdzv") + 1] for c in calls[:2]] == ["gpu-a17:31000"] * 2
    options = (tmp_path / "record" / "srun-options").read_text().split()
    assert "--cpus-per-task=8" in options  # the host's CPUs shared by its two tasks
    calls = run_script_with_fakes(tmp_path / "again", job, TRAINPERF_RDZV_PORT="4242")
    assert calls[0][calls[0].index("--rdzv") + 1] == "gpu-a17:4242"


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


def test_the_leader_is_the_folder_that_is_no_follower(tmp_path):
    for name, doc in (("node-0", {"role": "follower"}), ("node-1", {}),
                      ("node-2", {"role": "follower"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(doc))
    assert slurm.find_leader(tmp_path) == tmp_path / "node-1"
    (tmp_path / "node-2" / "results.json").write_text("{}")
    with pytest.raises(ValueError, match="node-1, node-2"):
        slurm.find_leader(tmp_path)
    with pytest.raises(ValueError, match="none"):
        slurm.find_leader(tmp_path / "node-0")


# -- a real Slurm -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_submitted_two_node_job_completes_and_reports(slurm_cluster, tmp_path, capsys):
    out = tmp_path / "job"
    started = time.monotonic()
    rc = main(["slurm", "tiny-arcface", "--nodes", "1", "--tasks-per-node", "2",
               "--devices", "1", "--runs", "1", "--iters", "6", "--warmup", "2",
               "--device", "cpu", "--time", "3", "--rdzv-port", str(reserved_ports()[0]),
               "--out", str(out), "--submit"])
    printed = capsys.readouterr().out
    took = time.monotonic() - started
    assert rc == 0, printed
    assert "COMPLETED" in printed and (out / "report.md").exists()
    leader = slurm.find_leader(out)
    doc = results.load(leader)
    (case,) = doc["cases"]
    assert case["world_size"] == 2 and case["nodes"] == 2
    (run,) = case["runs"]
    assert run["status"] == "ok" and run["samples_per_s"] > 0
    (follower,) = [p for p in slurm.node_dirs(out) if p != leader]
    assert json.loads((follower / "results.json").read_text())["role"] == "follower"
    assert slurm_cluster.job_ids() == []  # nothing left in the queue
    print(f"job submitted, run and reported in {took:.1f} s")
