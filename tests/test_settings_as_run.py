"""Settings recorded as they ran: TF32 and XLA's autotuning, asked for one way and turned the
other by a variable a GPU user's shell carries (``NVIDIA_TF32_OVERRIDE=0``, an ``XLA_FLAGS``
autotune level), are recorded as the variable made them. Each framework's own reading of its
switches runs here in its own environment, on the CPU, with the variables set as a GPU run
would see them and the fields read as on a GPU (``gpu=True``): what the record would say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Each framework's switch turned on, as --tf32 on turns it, then its TF32 fields as the worker
# records them: {"tf32_cudnn", "tf32_matmul", "tf32_switch"}.
READ_TF32 = {
    "torch": """
import torch
from trainperf.backends.torch.env import tf32_fields
torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
out = tf32_fields()
""",
    "jax": """
import jax
from trainperf.backends.jax import tuning
jax.config.update(tuning.PRECISION_OPTION, "tensorfloat32")
out = tuning.tf32_fields(True)
out["cudnn_benchmark"] = tuning.applied(True, None)["cudnn_benchmark"]
""",
    "tf": """
import tensorflow as tf
from trainperf.backends.tf import worker
tf.config.experimental.enable_tensor_float_32_execution(True)
out = worker.tf32_fields(True)
""",
    "paddle": """
from trainperf.backends.paddle import tuning
from trainperf.config import Tuning
tuning.configure(Tuning(tf32="on"), True)
out = tuning.tf32_fields(True)
""",
    "oneflow": """
from trainperf.backends.oneflow import tuning
out = tuning.tf32_fields(True)
""",
    "mxnet": """
from types import SimpleNamespace
from trainperf.backends.mxnet import worker
ran = worker.tf32_ran(SimpleNamespace(device_type="gpu", contexts=[]))
out = {"tf32_cudnn": ran, "tf32_matmul": ran,
       "tf32_switch": worker.TF32_SWITCH[ran is not False]}
""",
}


def read(framework: str, python: str, **variables: str) -> dict:
    code = READ_TF32[framework] + "\nimport json; print(json.dumps(out))\n"
    env = {k: v for k, v in os.environ.items()
           if k not in ("NVIDIA_TF32_OVERRIDE", "XLA_FLAGS")}
    env.update(PYTHONPATH=SRC, JAX_PLATFORMS="cpu", **variables)
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("framework", list(READ_TF32))
def test_tf32_is_recorded_as_the_override_leaves_it(framework, request):
    """--tf32 on, and NVIDIA_TF32_OVERRIDE=0 in the shell: every framework records TF32 off,
    naming the variable, so that MFU divides by the fp32 peak. Before, torch, JAX and
    TensorFlow recorded their own switch (on)."""
    python = sys.executable if framework == "torch" else request.getfixturevalue(
        f"{framework}_python")
    if framework != "mxnet":  # MXNet has no switch of its own: TF32 is on unless overridden
        asked = read(framework, python)
        assert asked["tf32_cudnn"] is True and asked["tf32_matmul"] is True, asked
    overridden = read(framework, python, NVIDIA_TF32_OVERRIDE="0")
    assert overridden["tf32_cudnn"] is False and overridden["tf32_matmul"] is False, overridden
    assert "NVIDIA_TF32_OVERRIDE=0" in overridden["tf32_switch"], overridden
    if framework == "jax":
        # The caller's XLA_FLAGS turn XLA's autotuning off: recorded so, not as JAX's default.
        assert overridden["cudnn_benchmark"] is True
        off = read("jax", python, XLA_FLAGS="--xla_gpu_autotune_level=0")
        assert off["cudnn_benchmark"] is False


@pytest.mark.parametrize("ran,said", [
    ({"cudnn_benchmark": False, "tf32": "on"},
     ["**not applied:** cuDNN autotuning asked on, ran off"]),
    ({"cudnn_benchmark": True, "tf32": "off"},
     ["**not applied:** TF32 asked on, ran off (NVIDIA_TF32_OVERRIDE=0 in the run's "
      "environment)"]),
    ({"cudnn_benchmark": True, "tf32": "on"}, []),
    ({"cudnn_benchmark": None, "tf32": None}, []),  # a CPU run: neither applies
])
def test_the_settings_line_names_what_was_asked_and_did_not_run(ran, said):
    """A GPU document whose plan asked for the defaults (autotuning on, TF32 on) and whose
    runs recorded otherwise (OneFlow's eager mode, which never autotunes; an inherited
    NVIDIA_TF32_OVERRIDE=0): the report's settings line says so, so that a comparison of six
    frameworks shows which ran without what."""
    import numpy as np

    import synthetic_results as sr
    from trainperf.report.markdown import not_applied, settings_text

    doc = sr.doc_of([sr.case_of(sr.runs_of(100, 3, np.random.default_rng(0)))])
    doc["tuning"] = {"cudnn_benchmark": True, "tf32": "on", "mode": "eager"}
    doc["env"]["tf32_switch"] = "flow; NVIDIA_TF32_OVERRIDE=0"
    doc["cases"][0]["settings"] = {"tuning": ran}
    assert not_applied(doc) == said
    for line in said:
        assert line in settings_text(doc)
