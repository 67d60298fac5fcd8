"""The device is decided once, by the runner: a CUDA plan's workers are told ``cuda`` and fail
in one line where their framework sees no GPU, rather than running the CUDA plan on the CPU.

A GPU machine whose framework sees none is made here as it happens to users: ``nvidia-smi``
lists a GPU (a stand-in script on the PATH, the one thing this machine lacks), and the
framework is the CPU build this machine has, given to the runner as a user gives their own
interpreter (``TRAINPERF_<FW>_PYTHON``). Before, the runner planned for the GPU and the worker,
deciding ``auto`` again, ran on the CPU: torch's run then crashed in the CPU's channels-last
convolution that its GPU plan had chosen."""

from __future__ import annotations

import importlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

LISTING = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)"
SEES_NONE = {"torch": "torch sees no GPU", "jax": "JAX sees no GPU",
             "tf": "TensorFlow sees no GPU", "paddle": "Paddle sees no GPU",
             "mxnet": "MXNet sees no GPU", "oneflow": "OneFlow sees no GPU"}


def gpu_listed_path(folder: Path) -> str:
    """A PATH on which ``nvidia-smi -L`` lists one GPU (and every query finds none)."""
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "-L" ]; then echo "{LISTING}"; exit 0; fi\n'
                      'echo "No devices were found"; exit 6\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize("framework", list(SEES_NONE))
def test_a_worker_whose_framework_sees_no_gpu_fails_in_one_line(framework, request, tmp_path):
    env = dict(os.environ, PATH=gpu_listed_path(tmp_path / "bin"), OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if framework != "torch":
        env[f"TRAINPERF_{framework.upper()}_PYTHON"] = request.getfixturevalue(
            f"{framework}_python")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "trainperf.cli", "run", "tiny-arcface",
                           "--framework", framework, "--runs", "1", "--iters", "3",
                           "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    spec = json.loads(next((out / "runs").glob("*/spec.json")).read_text())
    assert spec["device"] == "cuda"  # decided by the runner, never "auto"
    (case,) = json.loads((out / "results.json").read_text())["cases"]
    (run,) = case["runs"]
    assert run["status"] == "failed" and run["samples_per_s"] is None
    assert "\n" not in run["error"] and SEES_NONE[framework] in run["error"], run["error"]


def rank_gpus(framework: str, visible: str) -> list[str]:
    """The physical GPU each of a node's two ranks drives, from what the framework's own
    launcher gives each rank (its environment) and the device the framework's worker opens in
    that environment: the rank's ``CUDA_VISIBLE_DEVICES`` entry at the worker's ordinal (torch,
    Paddle and OneFlow open the local rank's ordinal of the inherited list; JAX, TensorFlow and
    MXNet are given one GPU and open ordinal 0)."""
    from trainperf.backends.base import Cluster

    cluster = Cluster(0, 2, ("127.0.0.1",), ((20000, 20001, 20002, 20003, 20004),))
    out = []
    for local in range(2):
        if framework == "mxnet":
            from trainperf.backends.mxnet import launch as mx

            (proc,) = [p for p in mx.plan(2, "horovod", [], cluster, visible=visible)
                       if p.rank == local and not p.helper]
            env = {"CUDA_VISIBLE_DEVICES": visible, **proc.env}
            ordinal = 0
        else:
            backend = importlib.import_module(f"trainperf.backends.{framework}.backend")
            env = {"CUDA_VISIBLE_DEVICES": visible, **backend.rank_env(local, cluster)}
            ordinal = {"torch": int(env.get("LOCAL_RANK", -1)),
                       "oneflow": int(env.get("LOCAL_RANK", -1)),
                       "paddle": int(env.get("FLAGS_selected_gpus", -1))}.get(framework, 0)
        listed = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d]
        out.append(listed[ordinal] if 0 <= ordinal < len(listed) else None)
    return out


@pytest.mark.parametrize("framework", list(SEES_NONE))
def test_an_inherited_gpu_list_is_honoured_by_every_launcher(framework, monkeypatch):
    """A scheduler gave this job GPUs 4 and 5: rank 0 drives GPU 4 and rank 1 GPU 5, in every
    framework (JAX and TensorFlow took GPUs 0 and 1 before issue 61; MXNet and the others
    already took 4 and 5)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert rank_gpus(framework, "4,5") == ["4", "5"]
