"""The JAX backend's speed settings (``backends/jax/tuning.py``): which it declares, the values
its switches take, and what a run records, on a CPU, where no TF32 and no cuDNN exist.

The GPU branch is checked here without a GPU where JAX lets it be: the precision the worker sets
reaches every dot and convolution of the traced step (forward and backward), which is what
XLA's GPU backend reads to choose TF32 or full fp32 (``tuning.py`` cites where); XLA accepts the
compile option that turns its autotuning off; and the record reads both back. What XLA's GPU
backend then runs has never been measured here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from trainperf.config import TUNING_SETTINGS, Tuning
from trainperf.backends.jax import tuning
from trainperf.backends.jax.backend import BACKEND

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_it_declares_the_two_settings_its_switches_honour():
    assert set(BACKEND.capabilities.tuning) == {"cudnn_benchmark", "tf32"}
    assert set(BACKEND.capabilities.tuning) <= set(TUNING_SETTINGS)
    assert "jax_default_matmul_precision" in BACKEND.capabilities.tuning["tf32"]
    assert "xla_gpu_autotune_level" in BACKEND.capabilities.tuning["cudnn_benchmark"]


def test_settings_it_has_no_switch_for_are_refused_in_one_line():
    for change in ({"ddp_bucket_mb": 16.0}, {"ddp_static_graph": False},
                   {"ddp_broadcast_buffers": True}):
        why = BACKEND.tuning_refusal(Tuning(**change), "cuda")
        assert why and "\n" not in why and "the jax backend has no switch" in why, change
    for honoured in ({"tf32": "off"}, {"cudnn_benchmark": False}):
        assert BACKEND.tuning_refusal(Tuning(**honoured), "cuda") is None
    # Another framework's setting is not JAX's to refuse.
    assert BACKEND.tuning_refusal(Tuning(mxnet_kvstore="device"), "cpu") is None


def test_switch_values_follow_the_one_rule():
    """On a GPU: TF32 on is ``tensorfloat32`` (HIGH), off is ``float32`` (HIGHEST); cuDNN's
    timing off compiles with XLA's autotuning at level 0, on leaves XLA's default. On a CPU
    nothing is set."""
    assert tuning.matmul_precision(Tuning(), True) == "tensorfloat32"
    assert tuning.matmul_precision(Tuning(tf32="off"), True) == "float32"
    assert tuning.matmul_precision(Tuning(tf32="off"), False) is None
    assert tuning.compiler_options(Tuning(), True) is None
    assert tuning.compiler_options(Tuning(cudnn_benchmark=False), True) == {
        "xla_gpu_autotune_level": 0}
    assert tuning.compiler_options(Tuning(cudnn_benchmark=False), False) is None
    assert tuning.IN_TF32["tensorfloat32"] and not tuning.IN_TF32["float32"]


JAX_SIDE = r"""
import json, re
import jax
from trainperf.config import Tuning, Workload
from trainperf.backends.jax import dist, tuning
from trainperf.backends.jax.step import TrainStep, synthetic_batch

out = {"cpu_fields": tuning.tf32_fields(False), "cpu_applied": tuning.applied(False, None)}
layout = dist.local_mesh(1)
wl = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=2)
images, labels = layout.per_rank(lambda r: synthetic_batch(wl, r))
for tf32 in ("on", "off"):
    asked = Tuning(tf32=tf32, cudnn_benchmark=tf32 == "on")
    tuning.configure(asked, True)        # the GPU branch, on this CPU
    step = TrainStep(wl, layout)
    lowered = step._jitted.lower(step.state, step.frozen, images, labels)
    ops = [line for line in lowered.as_text().splitlines()
           if "stablehlo.dot_general" in line or "stablehlo.convolution" in line]
    options = tuning.compiler_options(asked, True)
    lowered.compile(compiler_options=options)   # XLA takes the option
    out[tf32] = {"ops": len(ops),
                 "convolutions": sum("stablehlo.convolution" in line for line in ops),
                 "precisions": sorted({p for line in ops
                                       for p in re.findall(r"\b(HIGHEST|HIGH|DEFAULT)\b", line)}),
                 "fields": tuning.tf32_fields(True), "applied": tuning.applied(True, options)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def jax_side(jax_python) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
    proc = subprocess.run([jax_python, "-c", JAX_SIDE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cpu_run_records_no_tf32_and_applies_no_gpu_setting(jax_side):
    assert jax_side["cpu_fields"] == {"tf32_cudnn": None, "tf32_matmul": None,
                                      "tf32_switch": None}
    assert jax_side["cpu_applied"] == {}


@pytest.mark.parametrize("tf32, precision", [("on", "HIGH"), ("off", "HIGHEST")])
def test_the_precision_reaches_every_dot_and_convolution_of_the_step(jax_side, tf32,
                                                                     precision):
    """Every dot and convolution of the lowered step (the forward's and autodiff's) carries
    the precision the switch set, and nothing else."""
    got = jax_side[tf32]
    assert got["ops"] > 10 and got["convolutions"] > 0
    assert got["precisions"] == [precision]


def test_the_gpu_record_reads_the_switches_back(jax_side):
    on, off = jax_side["on"], jax_side["off"]
    assert on["fields"]["tf32_cudnn"] is on["fields"]["tf32_matmul"] is True
    assert off["fields"]["tf32_cudnn"] is off["fields"]["tf32_matmul"] is False
    assert "'float32'" in off["fields"]["tf32_switch"]
    assert on["applied"] == {"tf32": "on", "cudnn_benchmark": True}
    assert off["applied"] == {"tf32": "off", "cudnn_benchmark": False}
    for got in (on, off):
        assert set(got["applied"]) <= set(BACKEND.capabilities.tuning)
    assert re.search(r"jax_default_matmul_precision", on["fields"]["tf32_switch"])
