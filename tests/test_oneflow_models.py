"""OneFlow backbones (``trainperf.backends.oneflow.models``) equal the torch ones.

The same state_dict names and shapes and the same parameter counts for the tiny, the R50 (PLSC's
ResNet50 layout, E block) and the R100 IResNets, MobileFaceNet Y1 and ResNet50 v1b; and, with
torch's weights loaded, the same training-mode output, input gradient and parameter gradients in
float64, for both IResNet output blocks (E and FC), the tiny MobileFaceNet (PReLU, depthwise
convolutions, GDC) and the tiny ResNet v1b (max pool, average pool, logits). The torch side runs
here; the OneFlow side in its own environment, on an ``.npz`` of torch's weights and inputs.

float64 is the proof of equality (agreement to ~1e-12). In float32 the frameworks round
differently and an activation within rounding of a PReLU kink can take the other branch, so
float32 is not compared here. These use OneFlow's own BatchNorm kernel; the float64 alignment
tests (``test_oneflow_align.py``) compare whole training steps with ``exact.py``'s BatchNorm.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from trainperf.backends.torch.backbones import build_backbone

from test_oneflow_heads import of_env

pytestmark = pytest.mark.slow

# case -> (backbone, build kwargs, batch, input side, the parameters torch holds fixed)
CASES = {
    "tiny_E": ("iresnet_tiny", {"embedding_size": 16, "output_block": "E"}, 4, 112,
               ["features.weight"]),
    "tiny_FC": ("iresnet_tiny", {"embedding_size": 16, "output_block": "FC"}, 4, 112,
                ["features.weight"]),
    "mobilefacenet_tiny": ("mobilefacenet_tiny", {"embedding_size": 16, "input_size": 32}, 4,
                           32, []),
    "resnet_v1b_tiny": ("resnet_v1b_tiny", {"num_classes": 10}, 4, 32, []),
}
# Default builds (the catalogue's embedding or classes) and the output block IResNet takes:
# key -> (backbone, output block).
FULL_SIZE = {"iresnet_tiny_E": ("iresnet_tiny", "E"), "iresnet_tiny_FC": ("iresnet_tiny", "FC"),
             "iresnet50_E": ("iresnet50", "E"), "iresnet100_E": ("iresnet100", "E"),
             "mobilefacenet_y1": ("mobilefacenet_y1", "E"),
             "resnet50_v1b": ("resnet50_v1b", "E")}
TOL = 1e-8

ONEFLOW_SIDE = r"""
import json, sys
import numpy as np
import oneflow as flow
from trainperf.backends.oneflow.models import build_backbone, load_torch_arrays, param_count

work = sys.argv[1]
spec = json.load(open(f"{work}/spec.json"))
report = {"cases": {}, "full": {}}
for case, c in spec["cases"].items():
    data = np.load(f"{work}/{case}.torch.npz")
    net = build_backbone(c["name"], **c["kwargs"])
    load_torch_arrays(net, data)
    net = net.double()
    net.train()
    x = flow.tensor(data["x"], requires_grad=True)
    out = net(x)
    (out * flow.tensor(data["r"])).sum().backward()
    res = {"out": out.detach().numpy(), "x_grad": x.grad.numpy()}
    for name, p in net.named_parameters():
        if p.grad is not None:
            res["grad/" + name] = p.grad.numpy()
    np.savez(f"{work}/{case}.oneflow.npz", **res)
    report["cases"][case] = {"no_grad": [n for n, p in net.named_parameters()
                                         if not p.requires_grad]}
for key, (name, block) in spec["full"].items():
    net = build_backbone(name, output_block=block)
    report["full"][key] = {"count": param_count(net),
                           "shapes": {k: list(v.shape) for k, v in net.state_dict().items()}}

data = dict(np.load(f"{work}/tiny_E.torch.npz"))
del data["backbone/fc.bias"]
data["backbone/extra.weight"] = np.zeros(3, np.float32)
data["backbone/conv1.weight"] = np.zeros((1, 2, 3, 3), np.float32)
try:
    load_torch_arrays(build_backbone("iresnet_tiny", embedding_size=16), data)
    report["load_error"] = None
except ValueError as e:
    report["load_error"] = str(e)
json.dump(report, open(f"{work}/report.json", "w"))
"""


def _torch_case(case: str, name: str, kwargs: dict, batch: int, side: int, work: Path) -> dict:
    torch.manual_seed(sum(map(ord, case)))
    model = build_backbone(name, **kwargs)
    with torch.no_grad():  # non-trivial BN and PReLU values, so a mix-up cannot hide
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                if m.weight.requires_grad:
                    m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
            elif isinstance(m, torch.nn.PReLU):
                m.weight.uniform_(0.1, 0.4)
    arrays = {f"backbone/{k}": v.detach().clone().numpy() for k, v in model.state_dict().items()}
    x = torch.randn(batch, 3, side, side, dtype=torch.float64)
    width = kwargs.get("embedding_size") or kwargs["num_classes"]
    r = torch.randn(batch, width, dtype=torch.float64)
    np.savez(work / f"{case}.torch.npz", x=x.numpy(), r=r.numpy(), **arrays)
    model = model.double().train()
    x.requires_grad_(True)
    out = model(x)
    (out * r).sum().backward()
    return {"out": out.detach().numpy(), "x_grad": x.grad.numpy(),
            "grads": {k: p.grad.numpy() for k, p in model.named_parameters()
                      if p.requires_grad},
            "fixed": [k for k, p in model.named_parameters() if not p.requires_grad]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, oneflow_python):
    work = tmp_path_factory.mktemp("oneflow_models")
    torch_side = {case: _torch_case(case, *args[:4], work) for case, args in CASES.items()}
    spec = {"cases": {case: {"name": n, "kwargs": kw} for case, (n, kw, *_) in CASES.items()},
            "full": FULL_SIZE}
    (work / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([oneflow_python, "-c", ONEFLOW_SIDE, str(work)],
                          env=of_env(oneflow_python), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((work / "report.json").read_text())
    of_side = {case: dict(np.load(work / f"{case}.oneflow.npz")) for case in CASES}
    return torch_side, of_side, report


@pytest.mark.parametrize("key", list(FULL_SIZE))
def test_names_shapes_and_parameter_count_equal_torchs(runs, key):
    """Default builds as the recipes use them; torch builds on the meta device."""
    _, _, report = runs
    name, block = FULL_SIZE[key]
    with torch.device("meta"):
        model = build_backbone(name, output_block=block)
    got = report["full"][key]
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert list(got["shapes"]) == list(shapes)  # every key, in torch's order
    assert got["shapes"] == shapes
    assert got["count"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_float64_forward_and_gradients_equal_torchs(runs, case):
    t_all, o_all, report = runs
    t, o = t_all[case], o_all[case]
    np.testing.assert_allclose(o["out"], t["out"], rtol=TOL, atol=TOL * np.abs(t["out"]).max())
    np.testing.assert_allclose(o["x_grad"], t["x_grad"], rtol=TOL,
                               atol=TOL * np.abs(t["x_grad"]).max())
    # A BN bias feeding another training-mode BN has an exactly-zero gradient: rounding noise
    # on both sides, compared against the largest gradient of the network.
    scale = max(float(np.abs(g).max()) for g in t["grads"].values())
    assert {k[len("grad/"):] for k in o if k.startswith("grad/")} == set(t["grads"])
    for name, grad in t["grads"].items():
        np.testing.assert_allclose(o["grad/" + name], grad, rtol=TOL,
                                   atol=TOL * max(float(np.abs(grad).max()), 1e-3 * scale),
                                   err_msg=name)
    assert report["cases"][case]["no_grad"] == t["fixed"] == CASES[case][4]


def test_load_names_every_problem(runs):
    _, _, report = runs
    err = report["load_error"]
    assert err is not None
    assert "missing: fc.bias" in err
    assert "unexpected: extra.weight" in err
    assert "conv1.weight: shape (1, 2, 3, 3), expected (8, 3, 3, 3)" in err
