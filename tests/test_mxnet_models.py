"""MXNet Gluon backbones (trainperf.backends.mxnet.models) equal the torch ones.

Same state_dict names and shapes, same parameter counts, and, with torch's weights loaded, the
same training-mode forward, input gradient, parameter gradients and BN running statistics (up
to MXNet's biased running variance). The torch side runs here; the MXNet side runs in the MXNet
environment (no torch there) on an .npz of torch's weights and inputs, and writes its results to
another .npz.

Every case runs in float64 and float32. float64 is the proof of equality (agreement to ~1e-13,
and MXNet float64 runs its native kernels, the ones a GPU uses, not oneDNN's). In float32 the
frameworks round differently, and an activation that lies within rounding of a PReLU / ReLU /
max-pool kink takes the other branch in one of them, which changes the gradient locally; float32
gradients are therefore compared by relative L2 error, outputs element by element.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from framework_checks import randomise_norm_layers
from trainperf.backends.torch.backbones import backbone_names, build_backbone, get_spec

REPO_SRC = Path(__file__).resolve().parents[1] / "src"



# case id -> (backbone, torch build kwargs, input side, batch, MXNet-only build kwargs)
CASES = {
    "iresnet_tiny_E": ("iresnet_tiny", {"embedding_size": 16, "output_block": "E"}, 112, 4, {}),
    "iresnet_tiny_FC": ("iresnet_tiny", {"embedding_size": 16, "output_block": "FC"}, 112, 4, {}),
    "mobilefacenet_tiny": ("mobilefacenet_tiny", {"embedding_size": 16}, 112, 4, {}),
    "resnet_v1b_tiny": ("resnet_v1b_tiny", {"num_classes": 10}, 32, 4, {}),
    # MXNet's fused PReLU op: its slope gradients are wrong in graph mode (see models.PReLU),
    # everything else must still match.
    "iresnet_tiny_E_fused": ("iresnet_tiny", {"embedding_size": 16, "output_block": "E"}, 112, 4,
                             {"prelu": "fused"}),
}
DTYPES = ("float64", "float32")
TOL = {"float64": 1e-8, "float32": 1e-4}
# MXNet keeps BatchNorm's momentum as a C float (0.9f = 0.89999998), so float64 running
# statistics agree to ~1e-8 relative, not 1e-13; its fused PReLU op rounds like float32.
RUNNING_TOL_F64 = 1e-6
FUSED_TOL_F64 = 1e-5
L2_TOL_F32 = 5e-3  # relative L2 error of float32 gradients (kink flips: seen up to 7e-4)

MXNET_SIDE = r"""
import json, sys
import numpy as np
import mxnet as mx
from mxnet import autograd
from trainperf.backends.mxnet.models import (backbone_names, backbone_task, build_backbone,
                                             load_torch_arrays, param_count, torch_names)

work = sys.argv[1]
spec = json.load(open(f"{work}/spec.json"))
report = {"cases": {}, "all": {}}
for case, c in spec["cases"].items():
    data = np.load(f"{work}/{case}.torch.npz")
    for dtype in spec["dtypes"]:
        net = build_backbone(c["name"], input_size=c["side"], **c["kwargs"], **c["mx_kwargs"])
        net.hybridize()
        load_torch_arrays(net, data, ctx=mx.cpu())
        net.cast(dtype)
        names = torch_names(net)
        x = mx.nd.array(data["x"], dtype=dtype)
        x.attach_grad()
        r = mx.nd.array(data["r"], dtype=dtype)
        with autograd.record(train_mode=True):
            out = net(x)
            objective = (out * r).sum()
        objective.backward()
        mx.nd.waitall()
        res = {"out": out.asnumpy(), "x_grad": x.grad.asnumpy()}
        for name, p in names.items():
            if p.grad_req != "null":
                res["grad/" + name] = p.grad().asnumpy()
            if name.endswith(("running_mean", "running_var")):
                res["after/" + name] = p.data().asnumpy()
        np.savez(f"{work}/{case}.{dtype}.mxnet.npz", **res)
    report["cases"][case] = {"names": list(names), "count": param_count(net),
                             "no_grad": [n for n, p in names.items() if p.grad_req == "null"]}
for name in backbone_names():
    net = build_backbone(name)
    report["all"][name] = {"task": backbone_task(name), "count": param_count(net),
                           "shapes": {n: list(p.shape) for n, p in torch_names(net).items()}}

# load_torch_arrays names every missing, unexpected and wrongly shaped array.
data = dict(np.load(f"{work}/iresnet_tiny_E.torch.npz"))
del data["backbone/fc.bias"]
data["backbone/extra.weight"] = np.zeros(3, np.float32)
data["backbone/conv1.weight"] = np.zeros((1, 2, 3, 3), np.float32)
data["backbone/features.weight"] = np.full(16, 2.0, np.float32)  # fixed gamma must stay 1
try:
    load_torch_arrays(build_backbone("iresnet_tiny", embedding_size=16), data)
    report["load_error"] = None
except ValueError as e:
    report["load_error"] = str(e)
try:
    build_backbone("no_such_net")
    report["unknown_error"] = None
except ValueError as e:
    report["unknown_error"] = str(e)
json.dump(report, open(f"{work}/report.json", "w"))
"""


def _run_torch(model: nn.Module, x: torch.Tensor, r: torch.Tensor) -> dict:
    model.train()
    before = {k: v.detach().clone().double().numpy() for k, v in model.state_dict().items()
              if "running" in k}
    counts = {}  # values each BN normalises over per channel (for the running-variance check)
    hooks = [m.register_forward_hook(
        lambda mod, inp, out, key=name: counts.__setitem__(key, inp[0].numel() // mod.num_features))
        for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out * r).sum().backward()
    for h in hooks:
        h.remove()
    return {
        "before": before, "counts": counts, "out": out.detach().numpy(), "x_grad": x.grad.numpy(),
        "grads": {k: p.grad.numpy() for k, p in model.named_parameters() if p.requires_grad},
        "after": {k: v.numpy() for k, v in model.state_dict().items() if "running" in k},
    }


def _torch_case(case: str, name: str, kwargs: dict, side: int, batch: int, work: Path) -> dict:
    torch.manual_seed(sum(map(ord, case)))
    model = build_backbone(name, input_size=side, **kwargs)
    randomise_norm_layers(model)
    arrays = {f"backbone/{k}": v.detach().clone().numpy() for k, v in model.state_dict().items()}
    x = torch.randn(batch, 3, side, side, dtype=torch.float64)
    r = torch.randn(batch, model(x.float()[:2]).shape[1], dtype=torch.float64)
    model.load_state_dict({k[len("backbone/"):]: torch.from_numpy(v) for k, v in arrays.items()})
    np.savez(work / f"{case}.torch.npz", x=x.numpy(), r=r.numpy(), **arrays)
    runs = {"float64": _run_torch(copy.deepcopy(model).double(), x, r),
            "float32": _run_torch(model, x.float(), r.float())}
    return {
        **runs,
        "keys": [k for k in model.state_dict() if not k.endswith("num_batches_tracked")],
        "fixed": [k for k, p in model.named_parameters() if not p.requires_grad],
        "count": sum(p.numel() for p in model.parameters()),
        "prelu": [k for k, m in model.named_modules() if isinstance(m, nn.PReLU)],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mxnet_python):
    work = tmp_path_factory.mktemp("mxnet_models")
    torch_side = {case: _torch_case(case, *args[:4], work) for case, args in CASES.items()}
    spec = {"dtypes": list(DTYPES),
            "cases": {case: {"name": n, "kwargs": kw, "side": side, "mx_kwargs": mx_kw}
                      for case, (n, kw, side, _, mx_kw) in CASES.items()}}
    (work / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO_SRC), OMP_NUM_THREADS="1")
    proc = subprocess.run([mxnet_python, "-c", MXNET_SIDE, str(work)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((work / "report.json").read_text())
    mx_side = {(case, dt): dict(np.load(work / f"{case}.{dt}.mxnet.npz"))
               for case in CASES for dt in DTYPES}
    return torch_side, mx_side, report


def _close(actual: np.ndarray, expected: np.ndarray, what: str, tol: float,
           scale: float = 0.0) -> None:
    """Element by element: relative ``tol``, absolute ``tol`` times the larger of the array's
    own magnitude and ``scale`` (a gradient that is zero in exact arithmetic, e.g. the bias of
    a BN followed by another training-mode BN, is pure rounding noise in both frameworks)."""
    assert actual.shape == expected.shape, what
    atol = tol * max(float(np.abs(expected).max()), scale, 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=atol, err_msg=what)


def _l2_close(actual: np.ndarray, expected: np.ndarray, what: str, scale: float) -> None:
    assert actual.shape == expected.shape, what
    err = float(np.linalg.norm(actual - expected))
    ref = max(float(np.linalg.norm(expected)), scale)
    assert err <= L2_TOL_F32 * ref, f"{what}: relative L2 error {err / ref:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_names_and_counts_match_torch(runs, case):
    t, _, report = runs
    t, m = t[case], report["cases"][case]
    assert m["names"] == t["keys"]  # every state_dict key, in torch's order
    assert m["count"] == t["count"]
    # Only BN running statistics and torch's fixed gamma take no gradient in MXNet.
    assert sorted(n for n in m["no_grad"] if "running" not in n) == sorted(t["fixed"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_torch(runs, case, dtype):
    t_all, m_all, _ = runs
    t, m = t_all[case][dtype], m_all[case, dtype]
    fused = CASES[case][4].get("prelu") == "fused"
    tol = FUSED_TOL_F64 if fused and dtype == "float64" else TOL[dtype]
    _close(m["out"], t["out"], "output", tol)
    grads = dict(t["grads"])
    if fused:
        for prelu in t_all[case]["prelu"]:
            del grads[f"{prelu}.weight"]
    assert {k[len("grad/"):] for k in m if k.startswith("grad/")} >= set(grads)
    scale = 1e-3 * max(float(np.abs(g).max()) for g in grads.values())
    if dtype == "float64":
        _close(m["x_grad"], t["x_grad"], "input gradient", tol)
        for name, grad in grads.items():
            _close(m["grad/" + name], grad, f"gradient of {name}", tol, scale)
    else:
        _l2_close(m["x_grad"], t["x_grad"], "input gradient", 0.0)
        for name, grad in grads.items():
            _l2_close(m["grad/" + name], grad, f"gradient of {name}", scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_running_statistics_match_torch(runs, case, dtype):
    """Running means are torch's; MXNet updates running variances with the biased batch
    variance (torch: unbiased), so the update term is torch's times (n - 1) / n."""
    t_all, m_all, _ = runs
    t, m = t_all[case][dtype], m_all[case, dtype]
    tol = RUNNING_TOL_F64 if dtype == "float64" else TOL[dtype]
    for name, after in t["after"].items():
        got = m["after/" + name]
        if name.endswith("running_mean"):
            _close(got, after, name, tol)
        else:
            n = t["counts"][name.rsplit(".", 1)[0]]
            kept = 0.9 * t["before"][name]
            _close(got, kept + (after - kept) * (n - 1) / n, name, tol)


@pytest.mark.parametrize("name", backbone_names())
def test_every_backbone_has_torch_names_shapes_and_count(runs, name):
    """Default builds, full-size ones included (iresnet100 "E", mobilefacenet_y1, resnet50_v1b
    ...): state_dict names and shapes and parameter counts; torch builds on the meta device."""
    _, _, report = runs
    with torch.device("meta"):
        model = build_backbone(name)
    m = report["all"][name]
    assert m["task"] == get_spec(name).task
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()
              if not k.endswith("num_batches_tracked")}
    assert list(m["shapes"]) == list(shapes)
    assert m["shapes"] == shapes
    assert m["count"] == sum(p.numel() for p in model.parameters())


def test_load_errors_and_unknown_name(runs):
    _, _, report = runs
    err = report["load_error"]
    assert err is not None
    assert "missing: fc.bias" in err
    assert "unexpected: extra.weight" in err
    assert "conv1.weight: shape (1, 2, 3, 3), expected (8, 3, 3, 3)" in err
    assert "features.weight: a fixed BatchNorm gamma must be all ones" in err
    assert report["unknown_error"] is not None
    assert "the mxnet backend has no backbone 'no_such_net'" in report["unknown_error"]
