"""The Paddle backend's speed settings (``backends/paddle/tuning.py``): which it declares, the
variables a run starts with, and what the worker sets and records, on a CPU.

Paddle's CPU wheel has the same TF32 switches as its GPU wheel (``core.set_cublas_switch`` and
``set_cudnn_switch``), so the GPU branch is run here for real: the switches are set as the rule
asks and read back, and ``NVIDIA_TF32_OVERRIDE``, read from the process's C environment, can
veto them. The flags ``FLAGS_cublas_allow_tf32``/``FLAGS_cudnn_allow_tf32`` and
``FLAGS_cudnn_exhaustive_search`` exist in GPU builds only: here their absence is what is
checked. What cuBLAS and cuDNN then run has never been measured here.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from trainperf.config import TUNING_SETTINGS, Tuning
from trainperf.backends.paddle.backend import BACKEND, launch_env
from test_paddle_heads import pd_env

pytestmark = pytest.mark.slow


def test_it_declares_the_settings_it_honours():
    assert set(BACKEND.capabilities.tuning) == {"cudnn_benchmark", "ddp_bucket_mb", "tf32"}
    assert set(BACKEND.capabilities.tuning) <= set(TUNING_SETTINGS)
    assert BACKEND.capabilities.tuning["cudnn_benchmark"] == "FLAGS_cudnn_exhaustive_search"


def test_settings_it_has_no_switch_for_are_refused_in_one_line():
    for change in ({"ddp_static_graph": False}, {"ddp_broadcast_buffers": True}):
        why = BACKEND.tuning_refusal(Tuning(**change), "cuda")
        assert why and "\n" not in why and "the paddle backend has no switch" in why, change
    for honoured in ({"tf32": "off"}, {"cudnn_benchmark": False}, {"ddp_bucket_mb": 8.0}):
        assert BACKEND.tuning_refusal(Tuning(**honoured), "cuda") is None


def test_a_run_starts_with_the_search_and_the_override_asked():
    assert launch_env(Tuning()) == {"FLAGS_cudnn_exhaustive_search": "1",
                                    "NVIDIA_TF32_OVERRIDE": "1"}
    assert launch_env(Tuning(tf32="off", cudnn_benchmark=False)) == {
        "FLAGS_cudnn_exhaustive_search": "0", "NVIDIA_TF32_OVERRIDE": "0"}


PADDLE_SIDE = r"""
import json, os
import paddle
from trainperf.config import Tuning
from trainperf.backends.paddle import tuning

core = paddle.base.core
out = {"cpu_fields": tuning.tf32_fields(False),
       "cpu_one": tuning.applied(Tuning(), False, False),
       "cpu_two": tuning.applied(Tuning(ddp_bucket_mb=8.0), False, True),
       "gpu_flags": tuning.defined_flags(list(tuning.TF32_FLAGS.values())
                                         + ["FLAGS_cudnn_exhaustive_search"])}
os.environ.pop("NVIDIA_TF32_OVERRIDE", None)
for tf32 in ("off", "on", "off"):           # each from the other's state
    tuning.configure(Tuning(tf32=tf32), True)
    out[tf32] = {"switches": [core.get_cublas_switch(), core.get_cudnn_switch()],
                 "fields": tuning.tf32_fields(True),
                 "applied": tuning.applied(Tuning(tf32=tf32), True, False)}
# The switches on, the libraries' own variable off: nothing runs in TF32.
os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
out["vetoed"] = tuning.tf32_fields(True)
os.environ["FLAGS_cudnn_exhaustive_search"] = "1"
out["search"] = tuning.applied(Tuning(), True, True)
# A CPU run leaves the switches as they were.
core.set_cublas_switch(False)
tuning.configure(Tuning(tf32="on"), False)
out["cpu_left"] = core.get_cublas_switch()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def paddle_side(paddle_python) -> dict:
    proc = subprocess.run([paddle_python, "-c", PADDLE_SIDE], env=pd_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cpu_run_records_what_applies_on_a_cpu(paddle_side):
    assert paddle_side["cpu_fields"] == {"tf32_cudnn": None, "tf32_matmul": None,
                                         "tf32_switch": None}
    assert paddle_side["cpu_one"] == {}
    assert paddle_side["cpu_two"] == {"ddp_bucket_mb": 8.0}
    assert paddle_side["cpu_left"] is False


def test_the_cpu_build_lacks_the_gpu_flags(paddle_side):
    """Where the flags are missing the worker sets and reads the switches alone (the flags are
    set too where a GPU build defines them)."""
    assert paddle_side["gpu_flags"] == {}


@pytest.mark.parametrize("tf32", ["on", "off"])
def test_the_gpu_branch_sets_both_switches_and_reads_them_back(paddle_side, tf32):
    got, on = paddle_side[tf32], tf32 == "on"
    assert got["switches"] == [on, on]
    assert got["fields"]["tf32_matmul"] is on and got["fields"]["tf32_cudnn"] is on
    assert "set_cublas_switch" in got["fields"]["tf32_switch"]
    assert "NVIDIA_TF32_OVERRIDE=unset" in got["fields"]["tf32_switch"]
    assert got["applied"] == {"tf32": tf32, "cudnn_benchmark": False}
    assert set(got["applied"]) <= set(BACKEND.capabilities.tuning)


def test_the_override_vetoes_the_switches_and_the_search_is_read_back(paddle_side):
    assert paddle_side["vetoed"]["tf32_matmul"] is False
    assert paddle_side["vetoed"]["tf32_cudnn"] is False
    assert paddle_side["vetoed"]["tf32_switch"].endswith("NVIDIA_TF32_OVERRIDE=0")
    assert paddle_side["search"] == {"ddp_bucket_mb": 25.0, "tf32": "off",
                                     "cudnn_benchmark": True}
