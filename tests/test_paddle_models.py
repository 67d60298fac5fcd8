"""The Paddle backbones (``trainperf.backends.paddle.models``) equal the torch ones.

Same state_dict names, order and shapes (Linear weights transposed on load), same parameter
counts for the recipes' backbones, and, with torch's weights loaded, the same training-mode
output, input gradient, parameter gradients and BN running statistics (Paddle, like MXNet,
updates the running variance with the biased batch variance). The torch side runs here; the
Paddle side runs in the Paddle environment on an .npz of torch's weights and inputs. Both sides
compute in float64, where the two frameworks agree to rounding (~1e-13), so any mapping or
semantic slip shows. The same networks as a float64 alignment run sets them up
(``backends.paddle.alignment``: Paddle's BatchNorm and global pool with their constants held
exactly) agree with torch to rounding everywhere but the running variance, which keeps Paddle's
rule (the biased batch variance), also to rounding.
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
from trainperf.backends.torch.backbones import build_backbone, get_spec

REPO_SRC = Path(__file__).resolve().parents[1] / "src"

# case id -> (backbone, build kwargs, input side, batch)
CASES = {
    "iresnet_tiny_E": ("iresnet_tiny", {"embedding_size": 16, "output_block": "E"}, 32, 4),
    "iresnet_tiny_FC": ("iresnet_tiny", {"embedding_size": 16, "output_block": "FC"}, 32, 4),
    "mobilefacenet_tiny": ("mobilefacenet_tiny", {"embedding_size": 16}, 32, 4),
    "resnet_v1b_tiny": ("resnet_v1b_tiny", {"num_classes": 10}, 32, 4),
}
# Default builds whose names, shapes and counts must equal torch's: the recipes' backbones,
# IResNet-100 aside (the same code as IResNet-50 with more units; checked by hand, equal).
COUNTED = ("iresnet_tiny", "iresnet50", "mobilefacenet_y1", "resnet50_v1b")
TOL = 1e-8
ALIGNED_TOL = 1e-11
"""An alignment run's layers: float64 rounding only."""
RUNNING_TOL = 1e-6
"""Paddle holds BatchNorm's momentum as a C float (0.9f = 0.89999998), so float64 running
statistics agree to ~1e-8 relative, not to rounding."""

PADDLE_SIDE = r"""
import json, sys
import numpy as np
import paddle
from trainperf.backends.paddle import alignment, models

work = sys.argv[1]
spec = json.load(open(f"{work}/spec.json"))
report = {"cases": {}, "counted": {}}
for name in spec["counted"]:
    net = models.build_backbone(name)
    report["counted"][name] = {
        "task": models.backbone_task(name), "count": models.param_count(net),
        "shapes": {n: list(models.torch_shape(p, t))
                   for n, (p, t) in models.torch_names(net).items()}}

def forward_backward(c, data, aligned):
    # One training-mode forward and backward from torch's weights: Paddle's own layers, or
    # (aligned) as a float64 alignment run sets them up.
    net = models.build_backbone(c["name"], input_size=c["side"], **c["kwargs"])
    models.load_torch_arrays(net, data)
    if aligned:
        alignment.use_exact_kernels(net)
    net.train()
    x = paddle.to_tensor(data["x"], stop_gradient=False)
    out = net(x)
    (out * paddle.to_tensor(data["r"])).sum().backward()
    names = models.torch_names(net)
    trainable = {id(p) for p in models.trainable_parameters(net)}
    res = {"out": out.numpy(), "x_grad": x.grad.numpy()}
    for name, (p, transposed) in names.items():
        if id(p) in trainable:
            g = p.grad.numpy()
            res["grad/" + name] = g.T if transposed else g
        if name.endswith(("running_mean", "running_var")):
            res["after/" + name] = p.numpy()
    return net, names, trainable, res


paddle.set_default_dtype("float64")
for case, c in spec["cases"].items():
    data = np.load(f"{work}/{case}.torch.npz")
    net, names, trainable, res = forward_backward(c, data, aligned=False)
    np.savez(f"{work}/{case}.paddle.npz", **res)
    np.savez(f"{work}/{case}.aligned.npz", **forward_backward(c, data, aligned=True)[3])
    report["cases"][case] = {"names": list(names), "count": models.param_count(net),
                             "fixed": [n for n, (p, _) in names.items()
                                       if id(p) not in trainable and "running" not in n]}

# load_torch_arrays names every missing, unexpected and wrongly shaped array.
data = dict(np.load(f"{work}/iresnet_tiny_E.torch.npz"))
del data["backbone/fc.bias"]
data["backbone/extra.weight"] = np.zeros(3)
data["backbone/conv1.weight"] = np.zeros((1, 2, 3, 3))
data["backbone/fc.weight"] = data["backbone/fc.weight"].T
try:
    models.load_torch_arrays(models.build_backbone("iresnet_tiny", embedding_size=16,
                                                   input_size=32), data)
    report["load_error"] = None
except ValueError as e:
    report["load_error"] = str(e)
try:
    models.build_backbone("no_such_net")
    report["unknown_error"] = None
except ValueError as e:
    report["unknown_error"] = str(e)
json.dump(report, open(f"{work}/report.json", "w"))
"""


def _torch_case(case: str, name: str, kwargs: dict, side: int, batch: int, work: Path) -> dict:
    torch.manual_seed(sum(map(ord, case)))
    model = build_backbone(name, input_size=side, **kwargs)
    randomise_norm_layers(model)
    model = model.double().train()
    arrays = {f"backbone/{k}": v.detach().clone().numpy() for k, v in model.state_dict().items()}
    x = torch.randn(batch, 3, side, side, dtype=torch.float64)
    with torch.no_grad():
        width = copy.deepcopy(model)(x[:2]).shape[1]
    r = torch.randn(batch, width, dtype=torch.float64)
    np.savez(work / f"{case}.torch.npz", x=x.numpy(), r=r.numpy(), **arrays)
    before = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()
              if "running" in k}
    counts = {}  # values each BN normalises over per channel (for the running-variance check)
    hooks = [m.register_forward_hook(
        lambda mod, inp, out, key=n: counts.__setitem__(key, inp[0].numel() // mod.num_features))
        for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    xg = x.clone().requires_grad_(True)
    out = model(xg)
    (out * r).sum().backward()
    for h in hooks:
        h.remove()
    return {
        "out": out.detach().numpy(), "x_grad": xg.grad.numpy(), "before": before,
        "counts": counts,
        "grads": {k: p.grad.numpy() for k, p in model.named_parameters() if p.requires_grad},
        "after": {k: v.numpy() for k, v in model.state_dict().items() if "running" in k},
        "keys": [k for k in model.state_dict() if not k.endswith("num_batches_tracked")],
        "fixed": [k for k, p in model.named_parameters() if not p.requires_grad],
        "count": sum(p.numel() for p in model.parameters()),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, paddle_python):
    work = tmp_path_factory.mktemp("paddle_models")
    torch_side = {case: _torch_case(case, *args, work) for case, args in CASES.items()}
    spec = {"counted": list(COUNTED),
            "cases": {case: {"name": n, "kwargs": kw, "side": side}
                      for case, (n, kw, side, _) in CASES.items()}}
    (work / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO_SRC), OMP_NUM_THREADS="1")
    proc = subprocess.run([paddle_python, "-c", PADDLE_SIDE, str(work)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((work / "report.json").read_text())
    paddle_side = {case: {kind: dict(np.load(work / f"{case}.{kind}.npz"))
                          for kind in ("paddle", "aligned")} for case in CASES}
    return torch_side, paddle_side, report


def _close(actual: np.ndarray, expected: np.ndarray, what: str, scale: float = 0.0,
           tol: float = TOL) -> None:
    """Relative ``tol``, absolute ``tol`` times the larger of the array's magnitude and
    ``scale`` (a gradient that is zero in exact arithmetic, e.g. the bias of a BN followed by a
    training-mode BN, is rounding noise in both frameworks)."""
    assert actual.shape == expected.shape, what
    atol = tol * max(float(np.abs(expected).max()), scale, 1e-30)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=atol, err_msg=what)


@pytest.mark.parametrize("name", COUNTED)
def test_recipe_backbones_have_torch_names_shapes_and_counts(runs, name):
    """Default (full-size) builds: torch's state_dict keys in torch's order, its shapes in its
    layouts, and its parameter count; torch builds on the meta device."""
    _, _, report = runs
    with torch.device("meta"):
        model = build_backbone(name)
    got = report["counted"][name]
    assert got["task"] == get_spec(name).task
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()
              if not k.endswith("num_batches_tracked")}
    assert list(got["shapes"]) == list(shapes)
    assert got["shapes"] == shapes
    assert got["count"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_forward_gradients_and_running_statistics_match_torch(runs, case):
    t_all, p_all, report = runs
    t, p, rep = t_all[case], p_all[case]["paddle"], report["cases"][case]
    assert rep["names"] == t["keys"] and rep["count"] == t["count"]
    # Only torch's fixed gamma (and BN running statistics) take no update in Paddle.
    assert sorted(rep["fixed"]) == sorted(t["fixed"])
    _close(p["out"], t["out"], "output")
    _close(p["x_grad"], t["x_grad"], "input gradient")
    assert {k[len("grad/"):] for k in p if k.startswith("grad/")} == set(t["grads"])
    scale = 1e-3 * max(float(np.abs(g).max()) for g in t["grads"].values())
    for name, grad in t["grads"].items():
        _close(p["grad/" + name], grad, f"gradient of {name}", scale)
    for name, after in t["after"].items():
        got = p["after/" + name]
        if name.endswith("running_mean"):
            _close(got, after, name, tol=RUNNING_TOL)
        else:  # Paddle's biased batch variance: torch's update term times (n - 1) / n
            n = t["counts"][name.rsplit(".", 1)[0]]
            kept = 0.9 * t["before"][name]
            _close(got, kept + (after - kept) * (n - 1) / n, name, tol=RUNNING_TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_alignment_layers_follow_paddles_rule_to_rounding(runs, case):
    """As a float64 alignment run sets the network up (Paddle's BatchNorm with its epsilon and
    momentum held exactly, the global pool as a mean): torch's output, gradients and running
    mean to rounding, and the running variance Paddle's rule (the biased batch variance, which
    the backend declares) to rounding, with torch's 0.9 kept exactly."""
    t_all, p_all, _ = runs
    t, p = t_all[case], p_all[case]["aligned"]
    _close(p["out"], t["out"], "output", tol=ALIGNED_TOL)
    _close(p["x_grad"], t["x_grad"], "input gradient", tol=ALIGNED_TOL)
    scale = 1e-3 * max(float(np.abs(g).max()) for g in t["grads"].values())
    for name, grad in t["grads"].items():
        _close(p["grad/" + name], grad, f"gradient of {name}", scale, tol=ALIGNED_TOL)
    for name, after in t["after"].items():
        got = p["after/" + name]
        if name.endswith("running_mean"):
            _close(got, after, name, tol=ALIGNED_TOL)
        else:
            n = t["counts"][name.rsplit(".", 1)[0]]
            kept = 0.9 * t["before"][name]
            _close(got, kept + (after - kept) * (n - 1) / n, name, tol=ALIGNED_TOL)


def test_load_errors_and_unknown_name(runs):
    _, _, report = runs
    err = report["load_error"]
    assert err is not None
    assert "missing: fc.bias" in err
    assert "unexpected: extra.weight" in err
    assert "conv1.weight: shape (1, 2, 3, 3), expected (8, 3, 3, 3)" in err
    assert "fc.weight: shape (256, 16), expected (16, 256)" in err  # torch's layout is asked
    assert "the paddle backend has no backbone 'no_such_net'" in (report["unknown_error"] or "")
