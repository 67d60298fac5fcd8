"""The JAX head and training step (``trainperf.backends.jax``) against the float64 oracle.

JAX runs in its own environment (``jax_python``), in one process that forces two CPU devices
(``--xla_force_host_platform_device_count=2``), so the sharded head and step run on a mesh of
two ranks exactly as two processes would run them (the same ``shard_map`` program, collectives
between the two devices). The script writes ``.npz`` files; the comparisons happen here, against
``tests/oracle.py`` in float64.

Checked: the dp head (ArcFace, CosFace and a combined margin, with targets in the clamped band
and past theta_max) and the mp head on two ranks with uneven (padded) shards: loss, logits,
embedding and class-matrix gradients by JAX's autodiff equal the oracle's analytic ones, i.e.
the full softmax of one device; Partial FC's sample equals ``oracle.pfc_sample`` given the same
scores; a pfc training step on two ranks updates the backbone as torch's SGD (momentum, weight
decay, global-norm clipping, a learning-rate change) on its summed gradients and touches only
the sampled class rows, each as torch's SGD with its own momentum row; unsupported settings are
refused, float64 among them where JAX's 64-bit mode is off, and a float64 program with a
narrower float in it is caught. (float64 itself runs end to end in ``test_jax_runs``' strict
alignment.)

Tolerances: as the MXNet head's (float32 arithmetic on float32 inputs that the oracle casts to
float64): loss 1e-5 relative, logits 1e-4 absolute, gradients 1e-5 of the largest entry.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import oracle
from framework_checks import check_head_equals, close_to_max, head_inputs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "combined": (1.2, 0.3, 0.1)}
SCALE = 64.0
GRAD_RTOL = 1e-5
# pfc step: lr 0.1 for step 0, 0.01 from step 1 (a rate change inside the run).
PFC = dict(backbone="micro", num_classes=40, batch_size=4, embedding_size=8,
           input_size=16, dropout=0.0, fc="pfc", sample_ratio=0.5, clip_grad_norm=0.05,
           lr_steps=[1], lr_scales=[0.1])
PFC_STEPS = 3

JAX_SIDE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
from trainperf.config import Workload
from trainperf.backends.jax import dist, heads
from trainperf.backends.jax.step import TrainStep, synthetic_batch, check_precision, _lr_at

folder = sys.argv[1]
assert jax.device_count() == 2, jax.devices()

# dp: one whole class matrix, autodiff gradients.
for name in json.load(open(f"{folder}/margins.json")):
    x = np.load(f"{folder}/{name}_in.npz")
    margins, scale = tuple(float(m) for m in x["margins"]), float(x["scale"])

    def f(e, w, labels):
        return heads.margin_softmax_loss(e, labels, w, margins=margins, scale=scale,
                                         return_logits=True)
    (loss, logits), (ge, gw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        x["emb"], x["weight"], jnp.asarray(x["labels"], jnp.int32))
    np.savez(f"{folder}/{name}_out.npz", loss=loss, logits=logits, grad_emb=ge, grad_weight=gw)

# mp on two ranks: uneven shards, so rank 1's block carries one padded row.
layout = dist.local_mesh(2)
x = np.load(f"{folder}/mp_in.npz")
c, d = x["weight"].shape
head = heads.MarginSoftmaxHead(c, d, tuple(float(m) for m in x["margins"]), float(x["scale"]),
                               world_size=2, mode="mp")
rows = x["emb"].shape[0] // 2
weight = head.weight_from_matrix(layout, x["weight"])
emb = layout.per_rank(lambda r: jnp.asarray(x["emb"][r * rows:(r + 1) * rows]))
labels = layout.per_rank(lambda r: jnp.asarray(x["labels"][r * rows:(r + 1) * rows], jnp.int32))

def body(e, l, w):
    sel = head.select(l)
    def f(e, w):
        g = jax.lax.all_gather(e, "r", tiled=True)
        return heads.margin_softmax_loss(g, sel.local_labels, w, margins=head.margins,
                                         scale=head.scale, axis="r", valid=sel.valid,
                                         return_logits=True)
    (loss, logits), (ge, gw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(e, w)
    return jax.lax.pcast(loss, "r", to="varying")[None], logits[None], ge, gw

out = jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=(P("r"),) * 3,
                            out_specs=(P("r"), P("r"), P("r"), P("r"))))(
    emb, labels, weight)
loss, logits, ge, gw = (np.asarray(o) for o in out)
np.savez(f"{folder}/mp_out.npz", loss=loss, logits=logits, grad_emb=ge, grad_weight=gw,
         block=head.block_rows)

# Partial FC's sample on random cases (one compiled function, scores given).
sample = jax.jit(heads.sample_classes, static_argnums=(3,))
cases = np.load(f"{folder}/pfc_cases.npz")
got = {}
for i in range(int(cases["count"])):
    index, remapped, valid = sample(jnp.asarray(cases[f"{i}/labels"], jnp.int32),
                                    int(cases[f"{i}/num_local"]), int(cases[f"{i}/num_sample"]),
                                    int(cases[f"{i}/num_sample"]), cases[f"{i}/uniform"])
    got[f"{i}/index"], got[f"{i}/remapped"], got[f"{i}/valid"] = index, remapped, valid
np.savez(f"{folder}/pfc_cases_out.npz", **got)

# A pfc training step on two ranks, its reduced gradients exposed. The step does not depend
# on the backbone, so a one-layer one (conv, BN, PReLU, FC, fixed-gamma BN) keeps the
# compilation short; the real backbones are test_jax_models' subject.
from flax import linen as nn
from trainperf.backends.jax import models

class Micro(nn.Module):
    embedding_size: int

    @nn.compact
    def __call__(self, x):
        x = models.PReLU(name="prelu")(models.BatchNorm(name="bn")(
            models.Conv(4, 3, 2, 1, name="conv")(x)))
        x = models.Dense(self.embedding_size, name="fc")(x.reshape(x.shape[0], -1))
        return models.BatchNorm(gamma="fixed", name="features")(x)

# "micro" is no catalogue backbone: the step finds it through the two functions it asks.
models.backbone_task = lambda name: "face"
models.build_backbone = lambda name, *, embedding_size, **_: Micro(embedding_size)
wl = Workload(**json.load(open(f"{folder}/pfc_workload.json")))
step = TrainStep(wl, layout, expose_grads=True)
images, labels = layout.per_rank(lambda r: synthetic_batch(wl, r))
out = {"labels": np.asarray(labels), "backbone_params": len(jax.tree.leaves(step.state["params"]))}
for i in range(int(sys.argv[2])):
    out[f"{i}/params"] = [np.asarray(v) for v in jax.tree.leaves(step.state["params"])]
    out[f"{i}/weight"] = np.asarray(step.state["head"]["weight"])
    out[f"{i}/momentum"] = np.asarray(step.state["head"]["momentum"])
    step(images, labels)
    g = step.last_grads
    out[f"{i}/grads"] = [np.asarray(v) for v in jax.tree.leaves(g["backbone"])]
    out[f"{i}/row_grads"] = np.asarray(g["rows"])
out["final/params"] = [np.asarray(v) for v in jax.tree.leaves(step.state["params"])]
out["final/weight"] = np.asarray(step.state["head"]["weight"])
out["final/momentum"] = np.asarray(step.state["head"]["momentum"])
flat = {}
for key, value in out.items():
    if isinstance(value, list):
        for j, v in enumerate(value):
            flat[f"{key}/{j}"] = v
    else:
        flat[key] = value
np.savez(f"{folder}/pfc_step.npz", **flat)

# fp16 loss scaling, decided on the device. Run A plants an overflow (an inf in the batch) at
# step 6; run B is the same without it. check_precision refuses fp16 on a CPU, where nothing
# would run it for real; XLA's CPU float16 kernels run this bookkeeping test.
from trainperf.backends.jax import step as step_module
step_module.check_precision = lambda precision, device_type: None
# Logit scale 1: the first steps still overflow at the initial loss scale (as torch's would),
# but few enough of them for the test to see clean steps before and after the planted one.
wl16 = wl.replace(fc="dp", sample_ratio=1.0, precision="fp16", clip_grad_norm=5.0, scale=1.0)
one = dist.local_mesh(1)
s16 = TrainStep(wl16, one)
images, labels = one.per_rank(lambda r: synthetic_batch(wl16, r))
bad = images.at[0, 0, 0, 0].set(jnp.inf)
start = jax.tree.map(jnp.copy, s16.state)
run_a = [s16(x, labels) for x in [images] * 6 + [bad, images]]
skipped_a, scale_a = s16.skipped_steps(), s16.loss_scale()
s16.state, s16.skipped = start, []
run_b = [s16(images, labels) for _ in range(7)]
fp16 = {"a": [float(np.asarray(l)[0]) for l in run_a],
        "b": [float(np.asarray(l)[0]) for l in run_b],
        "skipped_a": skipped_a, "scale_a": scale_a, "skipped_b": s16.skipped_steps(),
        "scale_b": s16.loss_scale()}

# The rate schedule on the device, and what is refused.
base = dict(backbone="iresnet_tiny", num_classes=10, batch_size=4, embedding_size=8,
            input_size=16)
sched = Workload(**base, lr_steps=(2, 5), lr_scales=(0.1, 0.01))
rates = [float(_lr_at(sched, jnp.int32(i))) for i in range(7)]
refused = []
for precision, device in (("fp16", "cpu"), ("fp16", "cuda")):
    try:
        check_precision(precision, device)
        refused.append("accepted")
    except ValueError as exc:
        refused.append(str(exc))
try:
    TrainStep(Workload(**{**base, "num_classes": 100}, fc="pfc", sample_ratio=0.1), layout)
    refused.append("accepted")
except ValueError as exc:
    refused.append(str(exc))
# float64 where JAX's 64-bit mode is off (as here) would silently be float32: refused.
try:
    TrainStep(Workload(**base), one, init={}, dtype="float64")
    refused.append("accepted")
except ValueError as exc:
    refused.append(str(exc))
# A float64 program with a narrower float anywhere in it is caught.
for text in ("%0 = stablehlo.convert %a : (tensor<8x64xf64>) -> tensor<8x64xf32>",
             "%1 = stablehlo.constant dense<2.0> : tensor<bf16>",
             "%2 = stablehlo.add %a, %b : tensor<8x64xf64>"):
    try:
        TrainStep.check_program(text)
        refused.append("accepted")
    except RuntimeError as exc:
        refused.append(str(exc))
# BatchNorm's moments: the CPU's mode by default, and a mode set on a step after construction
# (as jax_step_ablation.py sets it) reaches its trace. A fresh step each: jit keeps a trace.
programs, default_mode = {}, None
for mode in ("default", "two_pass", "shifted"):
    s32 = TrainStep(wl16.replace(precision="fp32"), one)
    if mode == "default":
        default_mode = s32.bn_moments
    else:
        s32.bn_moments = mode
    programs[mode] = s32._jitted.lower(s32.state, s32.frozen, images, labels).as_text()
bn = {"default_mode": default_mode, "default_is_two_pass": programs["default"] == programs["two_pass"],
      "shifted_differs": programs["shifted"] != programs["two_pass"]}
json.dump({"rates": rates, "refused": refused, "fp16": fp16, "bn": bn},
          open(f"{folder}/misc.json", "w"))
"""


def pfc_cases(seed: int) -> dict[str, np.ndarray]:
    """Sampling cases: labels outside the shard (-1), repeated positives, and samples that
    leave room for negatives (distinct scores, so the cut is unambiguous)."""
    rng = np.random.RandomState(seed)
    out = {}
    specs = [(20, 8, 6), (20, 10, 10), (31, 12, 16)]  # (num_local, num_sample, gathered N)
    for i, (num_local, num_sample, n) in enumerate(specs):
        labels = rng.randint(-1, num_local, size=n)
        labels[labels >= 0] = rng.choice(num_local, size=int((labels >= 0).sum()))
        labels[: max(1, n // 4)] = -1
        if num_sample < len(np.unique(labels[labels >= 0])):
            labels[num_sample:] = -1
        out[f"{i}/labels"] = labels
        out[f"{i}/num_local"] = np.int64(num_local)
        out[f"{i}/num_sample"] = np.int64(num_sample)
        out[f"{i}/uniform"] = rng.permutation(num_local).astype(np.float32) / num_local
    out["count"] = np.int64(len(specs))
    return out


@pytest.fixture(scope="module")
def jax_side(tmp_path_factory, jax_python):
    folder = tmp_path_factory.mktemp("jax_heads")
    for i, (name, margins) in enumerate(MARGINS.items()):
        np.savez(folder / f"{name}_in.npz", **head_inputs(i, 12, 8, 37), margins=margins,
                 scale=SCALE)
    (folder / "margins.json").write_text(json.dumps(list(MARGINS)))
    np.savez(folder / "mp_in.npz", **head_inputs(7, 12, 8, 37), margins=MARGINS["arcface"],
             scale=SCALE)
    np.savez(folder / "pfc_cases.npz", **pfc_cases(3))
    (folder / "pfc_workload.json").write_text(json.dumps(PFC))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2 "
                         "--xla_backend_optimization_level=0 "
                         "--xla_cpu_use_fusion_emitters=false")
    env.pop("TRAINPERF_FAULT", None)
    proc = subprocess.run([jax_python, "-c", JAX_SIDE, str(folder), str(PFC_STEPS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return folder


@pytest.mark.parametrize("loss", list(MARGINS))
def test_dp_head_equals_the_oracle(jax_side, loss):
    x = np.load(jax_side / f"{loss}_in.npz")
    got = np.load(jax_side / f"{loss}_out.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE,
                                       cos_eps=oracle.FP32_COS_EPS)
    check_head_equals(got, ref)


def test_mp_head_on_two_ranks_equals_the_full_softmax(jax_side):
    """37 classes over 2 ranks: 19 and 18 rows, the second block padded to 19; the padded
    column takes no part (its logit is -inf, its gradient zero)."""
    x = np.load(jax_side / "mp_in.npz")
    got = np.load(jax_side / "mp_out.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS["arcface"],
                                       SCALE, world_size=2, cos_eps=oracle.FP32_COS_EPS)
    block = int(got["block"])
    assert block == 19
    np.testing.assert_allclose(got["loss"], [ref["loss"]] * 2, rtol=1e-5)
    close_to_max(got["grad_emb"], ref["grad_emb"], what="grad_emb")
    for rank, shard in enumerate(ref["shards"]):
        count = shard["count"]
        logits = got["logits"][rank]
        np.testing.assert_allclose(logits[:, :count], shard["logits"], rtol=0, atol=1e-4)
        assert np.all(np.isneginf(logits[:, count:]))
        rows = got["grad_weight"][rank * block:(rank + 1) * block]
        close_to_max(rows[:count], shard["grad_weight"], what=f"grad_weight rank {rank}")
        assert np.all(rows[count:] == 0)


def test_pfc_sample_equals_the_oracle(jax_side):
    cases = np.load(jax_side / "pfc_cases.npz")
    got = np.load(jax_side / "pfc_cases_out.npz")
    for i in range(int(cases["count"])):
        index, remapped = oracle.pfc_sample(cases[f"{i}/labels"], int(cases[f"{i}/num_local"]),
                                            int(cases[f"{i}/num_sample"]),
                                            cases[f"{i}/uniform"])
        np.testing.assert_array_equal(got[f"{i}/index"], index, err_msg=f"case {i}")
        np.testing.assert_array_equal(got[f"{i}/remapped"], remapped, err_msg=f"case {i}")
        assert got[f"{i}/valid"].all()


def test_pfc_step_is_torch_sgd_on_summed_gradients_and_sampled_rows(jax_side):
    """Three steps of a sparse pfc step on two ranks (40 classes, 20 per shard, 10 sampled):
    the backbone update equals torch's SGD (oracle.sgd_momentum_step) on the reduced gradients
    after clip_grad_norm_'s scaling, with the rate changing after step 0; each rank changes
    exactly its 10 sampled rows, every positive class among them, each updated by the same
    rule with its own momentum row, while the other rows and their momentum stay as they
    were."""
    got = np.load(jax_side / "pfc_step.npz")
    count = int(got["backbone_params"])
    labels = got["labels"]
    rates = [0.1, 0.01, 0.01]
    bufs = [None] * count
    coefs = []
    for i, lr in enumerate(rates):
        before = [got[f"{i}/params/{j}"] for j in range(count)]
        after = [got[f"{i + 1}/params/{j}"] if i + 1 < PFC_STEPS else got[f"final/params/{j}"]
                 for j in range(count)]
        grads = [got[f"{i}/grads/{j}"].astype(np.float64) for j in range(count)]
        norm = np.sqrt(sum(float((g * g).sum()) for g in grads))
        coef = min(PFC["clip_grad_norm"] / (norm + 1e-6), 1.0)
        coefs.append(coef)
        for j in range(count):
            want, bufs[j] = oracle.sgd_momentum_step(before[j], grads[j] * coef, bufs[j], lr,
                                                     0.9, 5e-4)
            np.testing.assert_allclose(after[j], want, rtol=1e-5,
                                       atol=1e-6 * max(np.abs(want).max(), 1.0),
                                       err_msg=f"step {i} backbone array {j}")
    assert max(coefs) < 1.0  # clipping acted

    block, sample = 20, 10
    row_bufs: dict[int, np.ndarray] = {}
    for i, lr in enumerate(rates):
        w0 = got[f"{i}/weight"]
        m0 = got[f"{i}/momentum"]
        nxt = f"{i + 1}" if i + 1 < PFC_STEPS else "final"
        w1, m1 = got[f"{nxt}/weight"], got[f"{nxt}/momentum"]
        row_grads = got[f"{i}/row_grads"]
        for rank in range(2):
            sl = slice(rank * block, (rank + 1) * block)
            changed = np.flatnonzero(np.any(w1[sl] != w0[sl], axis=1))
            assert len(changed) == sample, f"step {i} rank {rank}: {changed}"
            positives = {int(c) - rank * block for c in labels
                         if rank * block <= c < (rank + 1) * block}
            assert positives <= set(changed.tolist())
            untouched = np.setdiff1d(np.arange(block), changed)
            assert np.array_equal(w1[sl][untouched], w0[sl][untouched])
            assert np.array_equal(m1[sl][untouched], m0[sl][untouched])
            grads = row_grads[rank * sample:(rank + 1) * sample]
            for k, row in enumerate(changed):
                key = rank * block + int(row)
                want, row_bufs[key] = oracle.sgd_momentum_step(w0[sl][row], grads[k],
                                                               row_bufs.get(key), lr, 0.9, 5e-4)
                np.testing.assert_allclose(w1[sl][row], want, rtol=1e-5, atol=1e-7)
                np.testing.assert_allclose(m1[sl][row], row_bufs[key], rtol=1e-5, atol=1e-7)


def test_rate_schedule_and_refusals(jax_side):
    from trainperf.config import Workload

    misc = json.loads((jax_side / "misc.json").read_text())
    sched = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=4,
                     lr_steps=(2, 5), lr_scales=(0.1, 0.01))
    np.testing.assert_allclose(misc["rates"], [sched.lr_at(i) for i in range(7)], rtol=1e-7)
    fp16_cpu, fp16_gpu, pfc_small, no_x64, to_f32, bf16, f64 = misc["refused"]
    assert fp16_cpu == "the jax backend runs --precision fp32, bf16 on a CPU; fp16 needs a GPU"
    assert fp16_gpu == "accepted"
    assert "samples a static 5 classes per shard, fewer than the 8 samples" in pfc_small
    assert "needs jax_enable_x64" in no_x64
    assert to_f32.startswith("a float64 step computes in f32: ")
    assert bf16.startswith("a float64 step computes in bf16: ")
    assert f64 == "accepted"


def test_the_devices_batchnorm_moments_reach_the_traced_step(jax_side):
    bn = json.loads((jax_side / "misc.json").read_text())["bn"]
    assert bn["default_mode"] == "two_pass"  # BN_MOMENTS_BY_DEVICE["cpu"]
    assert bn["default_is_two_pass"] and bn["shifted_differs"]


def test_fp16_loss_scaling_skips_on_the_device(jax_side):
    """torch's policy, decided on the device: from 2**16 the first steps overflow and are
    skipped (weights kept: the next loss repeats), the scale halving each time, until the
    updates run; the planted overflow is skipped and halves the scale once more, and the step
    after it starts from exactly the weights before it (its loss is run B's at that point)."""
    fp16 = json.loads((jax_side / "misc.json").read_text())["fp16"]
    a, b = fp16["a"], fp16["b"]
    first_clean = len(fp16["skipped_b"])
    assert fp16["skipped_b"] == list(range(first_clean)) and first_clean < 6
    assert fp16["scale_b"] == 2.0 ** (16 - first_clean)
    for i in range(first_clean):
        assert b[i + 1] == b[i]
    assert b[first_clean + 1] != b[first_clean] and all(math.isfinite(v) for v in b)
    assert fp16["skipped_a"] == [*range(first_clean), 6]
    assert fp16["scale_a"] == fp16["scale_b"] / 2
    assert a[:6] == b[:6] and not math.isfinite(a[6]) and a[7] == b[6]
