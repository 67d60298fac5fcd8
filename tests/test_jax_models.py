"""JAX/flax backbones (trainperf.backends.jax.models) equal the torch ones.

Full-size networks, compared abstractly (flax through ``jax.eval_shape``, torch on the meta
device): every torch ``state_dict`` key has a flax variable of the matching shape (through the
one layout conversion, OIHW -> HWIO and [out, in] -> [in, out]) and the parameter counts are
equal. Tiny networks, with torch's weights loaded through ``load_torch_arrays``: the same
training-mode output and the same BatchNorm running statistics afterwards (torch's unbiased
running variance and momentum), in float32; and ``torch_arrays``, what an alignment run dumps,
gives back exactly torch's ``state_dict`` (names, layouts, values). The JAX side runs in the JAX
environment (no torch there) and writes its results to files that this process compares.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from framework_checks import randomise_norm_layers
from trainperf.backends.torch.backbones import build_backbone, get_spec

pytestmark = pytest.mark.slow
REPO_SRC = Path(__file__).resolve().parents[1] / "src"
FULL_SIZE = ["iresnet_tiny", "iresnet50", "iresnet100", "mobilefacenet_y1", "resnet50_v1b"]
# case -> (backbone, build kwargs, input side)
TINY = {
    "iresnet_tiny_E": ("iresnet_tiny", {"embedding_size": 16, "output_block": "E"}, 32),
    "mobilefacenet_tiny": ("mobilefacenet_tiny", {"embedding_size": 16}, 32),
    "resnet_v1b_tiny": ("resnet_v1b_tiny", {"num_classes": 10}, 32),
}
BATCH = 4
TOL = 1e-4
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
"""XLA flags that compile several times faster on a CPU (no LLVM optimisation, no fusion
emitters); the same arithmetic, rounded differently in places."""

JAX_SIDE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from trainperf.backends.jax import models

work = sys.argv[1]
spec = json.load(open(f"{work}/spec.json"))
report = {"full": {}, "tiny": {}}
for name in spec["full"]:
    model = models.build_backbone(name)
    side = 224 if models.backbone_task(name) == "classification" else 112
    abstract = models.abstract_variables(model, side)
    shapes = {}
    for torch_name, path in models.torch_names(abstract).items():
        leaf = abstract
        for key in path:
            leaf = leaf[key]
        shapes[torch_name] = list(models.torch_shape(leaf.shape))
    report["full"][name] = {"task": models.backbone_task(name), "shapes": shapes,
                            "count": models.param_count(abstract),
                            "frozen": sorted(n for n, p in models.torch_names(abstract).items()
                                             if p[0] == "frozen")}

for case, (name, kwargs, side) in spec["tiny"].items():
    data = np.load(f"{work}/{case}.torch.npz")
    model = models.build_backbone(name, **kwargs)
    variables = models.load_torch_arrays(models.abstract_variables(model, side), data)
    back = models.torch_arrays(variables)
    params = variables.pop("params")
    run = jax.jit(lambda p, v, x: model.apply({"params": p, **v}, x, mutable=["batch_stats"]))
    out, updates = run(params, variables, jnp.asarray(data["x"].transpose(0, 2, 3, 1)))
    after = {f"after/{n}": np.asarray(v) for n, v in
             ((n, models._get({"batch_stats": updates["batch_stats"]}, p))
              for n, p in models.torch_names(variables).items() if p[0] == "batch_stats")}
    np.savez(f"{work}/{case}.jax.npz", out=np.asarray(out), **after,
             **{f"back/{n[len('backbone/'):]}": v for n, v in back.items()})

# load_torch_arrays names every missing, unexpected and wrongly shaped array.
data = dict(np.load(f"{work}/iresnet_tiny_E.torch.npz"))
del data["backbone/fc.bias"]
data["backbone/extra.weight"] = np.zeros(3, np.float32)
data["backbone/conv1.weight"] = np.zeros((1, 2, 3, 3), np.float32)
data["backbone/features.weight"] = np.full(16, 2.0, np.float32)
model = models.build_backbone("iresnet_tiny", embedding_size=16)
try:
    models.load_torch_arrays(models.abstract_variables(model, 32), data)
    report["load_error"] = None
except ValueError as e:
    report["load_error"] = str(e)
try:
    models.build_backbone("no_such_net")
    report["unknown_error"] = None
except ValueError as e:
    report["unknown_error"] = str(e)

# BatchNorm's moments by every mode, on channels whose mean is far from zero against their
# spread, with a sane and a non-finite running mean; and the gradient of the variance.
bn = np.load(f"{work}/bn.npz")
x, sane = jnp.asarray(bn["x"]), jnp.asarray(bn["running"])
axes = (0, 1, 2)
moments = {}
for mode in models.BN_MOMENTS_CHOICES:
    with models.bn_moments(mode):
        for label, running in (("sane", sane), ("nan", jnp.full_like(sane, jnp.nan))):
            mean, var = jax.jit(lambda x, r: models.batch_moments(x, axes, r))(x, running)
            moments[f"{mode}/{label}/mean"] = np.asarray(mean)
            moments[f"{mode}/{label}/var"] = np.asarray(var)
        grad = jax.grad(lambda x: jnp.sum(models.batch_moments(x, axes, sane)[1]
                                          * jnp.arange(3.0)))
        moments[f"{mode}/grad"] = np.asarray(jax.jit(grad)(x))
try:
    with models.bn_moments("welford"):
        pass
except ValueError as e:
    moments["bad_mode"] = np.asarray(str(e))
np.savez(f"{work}/bn_moments.npz", **moments)
json.dump(report, open(f"{work}/report.json", "w"))
"""
BN_MODES = ("two_pass", "one_pass", "shifted", "running_shift")


def _torch_case(case: str, name: str, kwargs: dict, side: int, work: Path) -> dict:
    torch.manual_seed(sum(map(ord, case)))
    model = build_backbone(name, input_size=side, **kwargs)
    randomise_norm_layers(model)
    x = torch.randn(BATCH, 3, side, side)
    np.savez(work / f"{case}.torch.npz", x=x.numpy(),
             **{f"backbone/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()})
    model.train()
    with torch.no_grad():
        out = model(x)
    return {"out": out.numpy(),
            "after": {k: v.numpy() for k, v in model.state_dict().items() if "running" in k},
            "start": {k: v for k, v in np.load(work / f"{case}.torch.npz").items()
                      if k.startswith("backbone/") and not k.endswith("num_batches_tracked")}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, jax_python):
    work = tmp_path_factory.mktemp("jax_models")
    torch_side = {case: _torch_case(case, *args, work) for case, args in TINY.items()}
    (work / "spec.json").write_text(json.dumps({"full": FULL_SIZE, "tiny": TINY}))
    rng = np.random.default_rng(7)
    bn_x = (rng.standard_normal((8, 5, 5, 3)) * [1.0, 0.5, 2.0] + [3000.0, -500.0, 0.0])
    np.savez(work / "bn.npz", x=bn_x.astype(np.float32),
             running=np.array([2990.0, -480.0, 0.1], np.float32))
    env = dict(os.environ, PYTHONPATH=str(REPO_SRC), JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
    proc = subprocess.run([jax_python, "-c", JAX_SIDE, str(work)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((work / "report.json").read_text())
    jax_side = {case: dict(np.load(work / f"{case}.jax.npz")) for case in TINY}
    report["bn"] = {"x": np.load(work / "bn.npz")["x"], **np.load(work / "bn_moments.npz")}
    return torch_side, jax_side, report


@pytest.mark.parametrize("name", FULL_SIZE)
def test_names_shapes_and_parameter_counts_equal_torch(runs, name):
    _, _, report = runs
    with torch.device("meta"):
        model = build_backbone(name)
    got = report["full"][name]
    assert got["task"] == get_spec(name).task
    want = {k: list(v.shape) for k, v in model.state_dict().items()
            if not k.endswith("num_batches_tracked")}
    assert got["shapes"] == want
    assert got["count"] == sum(p.numel() for p in model.parameters())
    # Only torch's fixed parameters (IResNet's embedding-BN gamma) stay out of the optimizer.
    assert got["frozen"] == sorted(k for k, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("case", list(TINY))
def test_training_forward_and_running_statistics_equal_torch(runs, case):
    torch_side, jax_side, _ = runs
    t, j = torch_side[case], jax_side[case]
    scale = float(np.abs(t["out"]).max())
    np.testing.assert_allclose(j["out"], t["out"], rtol=TOL, atol=TOL * scale)
    for name, after in t["after"].items():
        np.testing.assert_allclose(j[f"after/{name}"], after, rtol=TOL, atol=TOL,
                                   err_msg=name)


@pytest.mark.parametrize("case", list(TINY))
def test_torch_arrays_give_back_the_loaded_state_dict(runs, case):
    """What an alignment run dumps: every array torch holds (the fixed BN gamma too), by its
    torch name, in torch's layout, bit for bit as loaded."""
    torch_side, jax_side, _ = runs
    want = torch_side[case]["start"]
    got = {k[len("back/"):]: v for k, v in jax_side[case].items() if k.startswith("back/")}
    assert sorted(got) == sorted(k[len("backbone/"):] for k in want)
    for name, value in got.items():
        assert value.dtype == np.float32, name
        np.testing.assert_array_equal(value, want[f"backbone/{name}"], err_msg=name)


def test_load_errors_and_unknown_name(runs):
    _, _, report = runs
    err = report["load_error"]
    assert "missing: fc.bias" in err
    assert "unexpected: extra.weight" in err
    assert "conv1.weight: shape (1, 2, 3, 3), expected (8, 3, 3, 3)" in err
    assert "features.weight: a fixed BatchNorm gamma must be all ones" in err
    assert "the jax backend has no backbone 'no_such_net'" in report["unknown_error"]


def test_batchnorm_moments_every_mode(runs):
    """Every mode gives the batch's mean and biased variance and the variance's true gradient
    (the shift is a constant for autodiff); the default ``shifted`` keeps the digits on
    channels whose mean is 3,000 times their spread, and its result does not depend on the
    running mean, so a non-finite one (left by a skipped fp16 step) changes nothing, where
    ``running_shift`` turns it into a non-finite variance."""
    _, _, report = runs
    bn = report["bn"]
    x = bn["x"].astype(np.float64)
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
    grad = 2.0 * (x - mean) / (x.size / 3) * np.arange(3.0)
    assert set(BN_MODES) == {k.split("/")[0] for k in bn if k not in ("x", "bad_mode")}
    assert "must be one of" in str(bn["bad_mode"])
    for mode in BN_MODES:
        np.testing.assert_allclose(bn[f"{mode}/sane/mean"], mean, rtol=1e-6,
                                   atol=1e-6 * np.abs(x).max(), err_msg=mode)
        np.testing.assert_allclose(bn[f"{mode}/grad"], grad, rtol=1e-3, atol=1e-4,
                                   err_msg=mode)
    for mode in ("two_pass", "shifted", "running_shift"):
        np.testing.assert_allclose(bn[f"{mode}/sane/var"], var, rtol=2e-3, err_msg=mode)
    for mode in ("two_pass", "one_pass", "shifted"):
        for part in ("mean", "var"):
            np.testing.assert_array_equal(bn[f"{mode}/nan/{part}"], bn[f"{mode}/sane/{part}"])
    assert not np.isfinite(bn["running_shift/nan/var"]).any()
