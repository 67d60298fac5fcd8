"""The OneFlow backend's speed settings and memory figures (``backends/oneflow/tuning.py``), and
the fused momentum update GPU runs use, checked on a CPU.

- Declared: cuDNN's search (read by ``nn.Graph`` only), DDP's buffer broadcast (eager, several
  ranks; refused for ``--mode graph`` there) and TF32, each with its own switch.
- TF32: the variables a run starts with, and the record read back from the process's C
  environment as OneFlow 0.9 parses it.
- cuDNN's search: the session switch the worker sets, read back before and after the session
  starts (a graph compiled on the CPU in between).
- Memory on a GPU: the device's used memory (``workerkit.device_used_bytes``, stood in for), no
  PID matching; on a CPU, the resident set.
- The fused update: ``oneflow.optim.SGD(fused=True)`` as ``step.py`` builds it, run on a CPU
  with its CUDA-only ``multi_tensor_momentum_update`` stood in for by that kernel's rule as
  OneFlow 0.9.0's source writes it (``MultiTensorMomentumUpdateGpu``): the arguments SGD passes
  make it the CPU ``momentum_update`` kernel's update, through a change of the rate. The CUDA
  kernel itself has never run here (``test_oneflow_heads``' bridge runs it where OneFlow sees a
  GPU).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from trainperf.config import TUNING_SETTINGS, Topology, Tuning, Workload
from trainperf.backends.oneflow.backend import (BACKEND, GRAPH_BUFFERS, launch_env,
                                                mode_rules)
from test_oneflow_heads import of_env

pytestmark = pytest.mark.slow
FUSED_BOUND = 4 * 2.0 ** -24
"""Four units of float32 rounding: the stand-in and the CPU kernel compute the same float32
operations in the same order; a compiler's fused multiply-add may round one of them once."""


def test_it_declares_the_settings_it_honours():
    tuning = BACKEND.capabilities.tuning
    assert set(tuning) == {"cudnn_benchmark", "ddp_broadcast_buffers", "tf32"}
    assert set(tuning) <= set(TUNING_SETTINGS)
    assert "enable_conv_heuristic_search_algo" in tuning["cudnn_benchmark"]
    assert "ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION" in tuning["tf32"]


def test_settings_it_has_no_switch_for_are_refused_in_one_line():
    for change in ({"ddp_bucket_mb": 16.0}, {"ddp_static_graph": False}):
        why = BACKEND.tuning_refusal(Tuning(**change), "cuda")
        assert why and "\n" not in why and "the oneflow backend has no switch" in why, change


def test_graph_mode_refuses_the_buffer_broadcast_on_several_ranks():
    wl = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=2)
    graph = Tuning(mode="graph", ddp_broadcast_buffers=True)
    assert mode_rules(wl, Topology(devices_per_node=2), graph) == GRAPH_BUFFERS
    assert mode_rules(wl, Topology(devices_per_node=1), graph) is None
    assert mode_rules(wl, Topology(devices_per_node=2), Tuning(mode="eager",
                                                               ddp_broadcast_buffers=True)) is None


def test_a_run_starts_with_the_tf32_variables_asked():
    assert launch_env(Tuning()) == {"ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION": "1"}
    assert launch_env(Tuning(tf32="off")) == {"ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION": "0",
                                              "NVIDIA_TF32_OVERRIDE": "0"}


ONEFLOW_SIDE = r"""
import json, os, types, warnings
import numpy as np
import oneflow as flow
from trainperf.config import Tuning, Workload
from trainperf.backends.oneflow import tuning, worker
from trainperf.backends.oneflow.backend import launch_env
from trainperf.backends.oneflow.dist import Dist
from trainperf.backends.oneflow.step import TrainStep

out = {}
f32 = np.float32

# -- the fused update: OneFlow 0.9.0's MultiTensorMomentumUpdateGpu, element by element in
# float32, with no rate tensor, no scale tensor, no skip and l1 = l2 = 0 (its defaults).
calls = []
def momentum_kernel(model, model_diff, momentum_buf, scale, weight_decay, learning_rate_val,
                    momentum, dampening, nesterov, maximize):
    calls.append({"n": len(model), "scale": scale, "weight_decay": weight_decay,
                  "lr": learning_rate_val, "momentum": momentum, "dampening": dampening,
                  "nesterov": nesterov, "maximize": maximize})
    for w, g, b in zip(model, model_diff, momentum_buf):
        wv, gv, bv = w.numpy().copy(), g.numpy(), b.numpy().copy()
        d = gv * f32(scale) + f32(0.0) * ((wv >= 0).astype(f32) - (wv <= 0)) + f32(0.0) * wv
        if weight_decay != 0:
            d = d + f32(weight_decay) * wv
        bv = f32(momentum) * bv + (f32(1.0) - f32(dampening)) * d
        d = d + f32(momentum) * bv if nesterov else bv
        alpha = f32(learning_rate_val) if maximize else -f32(learning_rate_val)
        w.copy_(flow.tensor(wv + alpha * d))
        b.copy_(flow.tensor(bv))

wl = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=2, lr=0.1, momentum=0.9,
              weight_decay=5e-4)
builder = types.SimpleNamespace(workload=wl)
rng = np.random.RandomState(3)
start = [rng.randn(4, 3).astype(f32), rng.randn(7).astype(f32)]
grads = [[rng.randn(*w.shape).astype(f32) for w in start] for _ in range(4)]
rates = [0.1, 0.1, 0.01, 0.01]
after = {}
for fused in (True, False):
    params = [flow.nn.Parameter(flow.tensor(w)) for w in start]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Fused SGD only support cuda parameters."
        opt = TrainStep._sgd(builder, params, fused=fused, exact_float64=False)
    # As on a GPU: OneFlow turned the fused path off for these CPU arrays.
    opt.param_groups[0]["fused"] = fused
    flow._C.multi_tensor_momentum_update = momentum_kernel
    steps = []
    for lr, gs in zip(rates, grads):
        opt.param_groups[0]["lr"] = lr
        for p, g in zip(params, gs):
            p.grad = flow.tensor(g)
        opt.step()
        steps.append([p.detach().numpy().copy() for p in params]
                     + [opt._state[p]["momentum_buf"].numpy().copy() for p in params])
    after[fused] = steps
error = max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
            for s_f, s_c in zip(after[True], after[False]) for a, b in zip(s_f, s_c))
moved = max(float(np.max(np.abs(a - b))) for a, b in zip(after[False][-1][:2], start))
out["fused"] = {"calls": calls, "error": error, "moved": moved}

# -- TF32 as the variables say (no GPU: the GPU branch's reading).
out["cpu_fields"] = tuning.tf32_fields(False)
for name in ("ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION", "NVIDIA_TF32_OVERRIDE"):
    os.environ.pop(name, None)
out["unset"] = tuning.tf32_fields(True)
os.environ.update(launch_env(Tuning(tf32="off")))
out["off"] = tuning.tf32_fields(True)
out["off_applied"] = tuning.applied(Tuning(tf32="off"), True, False, False)
os.environ.pop("NVIDIA_TF32_OVERRIDE")
os.environ["ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION"] = "False"
out["mixed_applied"] = tuning.applied(Tuning(), True, False, False)
os.environ["ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION"] = "YES"
out["on"] = tuning.tf32_fields(True)

# -- cuDNN's search, before and after the session starts.
out["search_default"] = tuning.heuristic_search()
tuning.configure(Tuning(cudnn_benchmark=False), False)      # a CPU run sets nothing
out["search_cpu"] = tuning.heuristic_search()
tuning.configure(Tuning(), True)
out["search_asked"] = tuning.heuristic_search()

class Tiny(flow.nn.Graph):
    def __init__(self):
        super().__init__()
        self.m = flow.nn.Linear(3, 2)
    def build(self, x):
        return self.m(x)

Tiny()(flow.ones(2, 3)).numpy()
out["search_started"] = tuning.heuristic_search()
out["graph_applied"] = tuning.applied(Tuning(), True, True, False)["cudnn_benchmark"]
out["eager_applied"] = tuning.applied(Tuning(), True, False, True)
tuning.configure(Tuning(cudnn_benchmark=False), True)
out["search_off"] = tuning.heuristic_search()
out["cpu_applied"] = tuning.applied(Tuning(ddp_broadcast_buffers=True), False, False, True)

# -- memory: the device's used memory on a GPU (stood in for), the resident set on a CPU.
class GpuDist:
    device_type, gpu_index = "cuda", 1
    def gather_host(self, values):
        return np.array([values, values])
worker.device_used_bytes = lambda ordinal: (5 << 20) + ordinal
out["gpu_memory"] = worker.memory_over_ranks(GpuDist())
worker.device_used_bytes = lambda ordinal: None
out["no_driver"] = worker.memory_over_ranks(GpuDist())
out["cpu_memory"] = worker.memory_over_ranks(Dist())
out["cpu_env"] = {k: worker.framework_env(Dist(), 1)[k]
                  for k in ("memory_kind", "tf32_cudnn", "tf32_matmul", "tf32_switch")}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def oneflow_side(oneflow_python) -> dict:
    proc = subprocess.run([oneflow_python, "-c", ONEFLOW_SIDE], env=of_env(oneflow_python),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_fused_update_is_the_cpu_kernels_through_a_rate_change(oneflow_side):
    got = oneflow_side["fused"]
    # One call a step, with the group's rate, momentum and weight decay, and no other term.
    assert [c["lr"] for c in got["calls"]] == pytest.approx([0.1, 0.1, 0.01, 0.01])
    for call in got["calls"]:
        assert call["n"] == 2 and call["scale"] == 1.0
        assert call["momentum"] == pytest.approx(0.9)
        assert call["weight_decay"] == pytest.approx(5e-4)
        assert call["dampening"] == 0.0 and not call["nesterov"] and not call["maximize"]
    assert got["error"] <= FUSED_BOUND
    assert got["moved"] > 0.1


def test_tf32_is_read_as_oneflow_reads_its_variables(oneflow_side):
    assert oneflow_side["cpu_fields"] == {"tf32_cudnn": None, "tf32_matmul": None,
                                          "tf32_switch": None}
    unset = oneflow_side["unset"]
    assert unset["tf32_matmul"] is True and unset["tf32_cudnn"] is True
    assert "ONEFLOW_EP_CUDA_ENABLE_TF32_EXECUTION=unset" in unset["tf32_switch"]
    off = oneflow_side["off"]
    assert off["tf32_matmul"] is False and off["tf32_cudnn"] is False
    assert oneflow_side["off_applied"] == {"tf32": "off", "cudnn_benchmark": False}
    assert oneflow_side["mixed_applied"]["tf32"] == "mixed"
    assert oneflow_side["on"]["tf32_matmul"] is True and oneflow_side["on"]["tf32_cudnn"]


def test_the_graph_search_is_set_on_a_gpu_and_read_back(oneflow_side):
    """OneFlow's default is the heuristic; cuDNN's timing on turns it off for graphs (before
    and after the session starts), eager convolutions record it as never timed."""
    assert oneflow_side["search_default"] is True
    assert oneflow_side["search_cpu"] is True
    assert oneflow_side["search_asked"] is False
    assert oneflow_side["search_started"] is False
    assert oneflow_side["graph_applied"] is True
    eager = oneflow_side["eager_applied"]
    assert eager["cudnn_benchmark"] is False and eager["ddp_broadcast_buffers"] is False
    assert oneflow_side["search_off"] is True
    assert oneflow_side["cpu_applied"] == {"ddp_broadcast_buffers": True}
    assert set(eager) <= set(BACKEND.capabilities.tuning)


def test_memory_is_the_devices_used_memory_on_a_gpu_and_the_resident_set_on_a_cpu(
        oneflow_side):
    used = (5 << 20) + 1
    assert oneflow_side["gpu_memory"] == {"peak_memory_bytes": used,
                                          "peak_memory_bytes_per_rank": [used, used],
                                          "device_used_bytes": used}
    assert oneflow_side["no_driver"]["device_used_bytes"] is None
    assert oneflow_side["cpu_memory"]["peak_memory_bytes"] > 0
    assert "device_used_bytes" not in oneflow_side["cpu_memory"]
    assert oneflow_side["cpu_env"] == {"memory_kind": "resident_set_peak", "tf32_cudnn": None,
                                       "tf32_matmul": None, "tf32_switch": None}
