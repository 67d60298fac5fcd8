"""The MXNet head and training step (``trainperf.backends.mxnet``) against the float64 oracle.

MXNet runs in its own environment (``mxnet_python``): each test runs a script there that writes
``.npz`` files, and the comparisons happen here, against ``tests/oracle.py`` in float64.

Tolerances: MXNet computes in float32 from the same float32 inputs the oracle casts to float64.
The loss agrees to a relative 1e-5; the logits (scaled by s = 64) to 1e-4 absolute; gradients
to 1e-5 of the largest entry of the same gradient (measured: 1e-6 and below). The clamp of the
margin is compared with ``oracle.FP32_COS_EPS``, the bound a float32 backend really applies.
The head in float64 (an alignment run's) is the oracle's arithmetic to rounding: 1e-12.

Partial FC (``pfc``) is checked as the oracle's head restricted to the classes sampled, the
sample the oracle's rule (``oracle.pfc_sample``) with the negatives ranked by scores the test
gives in place of the head's uniform draw.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import oracle
from framework_checks import (check_recorded_sgd_steps, check_sampling_rule, close_to_max,
                              head_inputs, sample_cases, sampled_ids_on_two_ranks, sampled_oracle,
                              shard_scores)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "combined": (1.2, 0.3, 0.1)}
SCALE = 64.0
GRAD_RTOL = 1e-5


def mx_env(*extra: Path) -> dict[str, str]:
    paths = [str(ROOT / "src"), str(ROOT / "tests"), *map(str, extra)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1")
    env.pop("TRAINPERF_FAULT", None)
    return env




def run_mx(mxnet_python: str, argv: list[str], env: dict[str, str], timeout: float = 120
           ) -> None:
    proc = subprocess.run([mxnet_python, *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


# ------------------------------------------------------------------------- dp, one process

DP_SIDE = r"""
import sys
import mxnet as mx
import numpy as np
from trainperf.backends.mxnet.comm import Comm
from trainperf.backends.mxnet.heads import MarginSoftmaxHead

folder = sys.argv[1]
ARCFACE = (1.0, 0.5, 0.0)
for name in sys.argv[2:]:
    x = np.load(f"{folder}/{name}_in.npz")
    c, d = x["weight"].shape
    for dtype in ("float32", "float64"):
        head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), Comm(),
                                 mx.cpu(), dtype=dtype)
        head.set_weight(x["weight"])
        loss, grad = head.forward_backward(mx.nd.array(x["emb"], dtype=dtype),
                                           mx.nd.array(x["labels"], dtype="float64"),
                                           keep_logits=True)
        np.savez(f"{folder}/{name}_{dtype}_out.npz", loss=loss.asnumpy(),
                 grad_emb=grad.asnumpy(), grad_weight=head.grad.asnumpy(),
                 logits=head.logits.asnumpy(), dtypes=[np.dtype(a.dtype).name for a in
                                                       (loss, grad, head.grad, head.logits)])
    # The GPU's float32 products (linalg.gemm2, for TF32), run here on the CPU's BLAS.
    head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), Comm(), mx.cpu())
    head.linalg_products = True
    head.set_weight(x["weight"])
    loss, grad = head.forward_backward(mx.nd.array(x["emb"]),
                                       mx.nd.array(x["labels"], dtype="float64"),
                                       keep_logits=True)
    np.savez(f"{folder}/{name}_gemm2_out.npz", loss=loss.asnumpy(), grad_emb=grad.asnumpy(),
             grad_weight=head.grad.asnumpy(), logits=head.logits.asnumpy())

# pfc: the sampling rule on its own, then one-rank pfc heads on 20 classes with given negative
# scores: ratio 1.0 (no sampling), 0.4 with either update, 0.2 (more positives than the sample).
from trainperf.backends.mxnet.heads import sample_classes
s = np.load(f"{folder}/sample_in.npz")
out = {}
for i in range(int(s["cases"])):
    local = s[f"{i}/labels"]
    index, cols = sample_classes(mx.nd.array(np.maximum(local, 0)),
                                 mx.nd.array(local >= 0, dtype="float64"),
                                 int(s[f"{i}/num_local"]), int(s[f"{i}/num_sample"]),
                                 mx.nd.array(s[f"{i}/uniform"]))
    out[f"{i}/index"], out[f"{i}/cols"] = index.asnumpy(), cols.asnumpy()
np.savez(f"{folder}/sample_out.npz", **out)
x = np.load(f"{folder}/pfc_in.npz")
c, d = x["weight"].shape
for tag, ratio, update in (("r1", 1.0, "sparse"), ("sparse", 0.4, "sparse"),
                           ("dense", 0.4, "dense"), ("crowded", 0.2, "sparse")):
    head = MarginSoftmaxHead(c, d, ARCFACE, 64.0, Comm(), mx.cpu(), mode="pfc",
                             sample_ratio=ratio, update=update)
    head.set_weight(x["weight"])
    loss, grad = head.forward_backward(mx.nd.array(x["emb"]),
                                       mx.nd.array(x["labels"], dtype="float64"),
                                       keep_logits=True, scores=mx.nd.array(x["scores"]))
    np.savez(f"{folder}/pfc_{tag}_out.npz", loss=loss.asnumpy(), grad_emb=grad.asnumpy(),
             grad_weight=head.grad.asnumpy(), logits=head.logits.asnumpy(),
             index=np.arange(c) if head.index is None else head.index.asnumpy(),
             num_sample=head.num_sample, update=head.update)
"""


@pytest.fixture(scope="module")
def dp_heads(tmp_path_factory, mxnet_python):
    folder = tmp_path_factory.mktemp("mx_dp_head")
    for i, (name, margins) in enumerate(MARGINS.items()):
        np.savez(folder / f"{name}_in.npz", **head_inputs(i, 12, 8, 37), margins=margins,
                 scale=SCALE)
    np.savez(folder / "sample_in.npz", **sample_cases())
    rng = np.random.RandomState(5)
    np.savez(folder / "pfc_in.npz", **head_inputs(11, 6, 8, 20),
             scores=(rng.permutation(20) / 20).astype(np.float32))
    run_mx(mxnet_python, ["-c", DP_SIDE, str(folder), *MARGINS], mx_env())
    return folder




@pytest.mark.parametrize("loss", list(MARGINS))
def test_dp_head_equals_the_oracle(dp_heads, loss):
    x = np.load(dp_heads / f"{loss}_in.npz")
    got = np.load(dp_heads / f"{loss}_float32_out.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE,
                                       cos_eps=oracle.FP32_COS_EPS)
    assert float(got["loss"][0]) == pytest.approx(ref["loss"], rel=1e-5)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-4)
    close_to_max(got["grad_emb"], ref["grad_emb"])
    close_to_max(got["grad_weight"], ref["grad_weight"])


@pytest.mark.parametrize("loss", list(MARGINS))
def test_the_gpus_linalg_products_are_the_same_products(dp_heads, loss):
    """On a GPU the head's float32 products go through ``linalg.gemm2`` (TF32 as ``Dense``):
    the same call forms (transposes included) give what ``dot`` gives, on the CPU's BLAS."""
    dot = np.load(dp_heads / f"{loss}_float32_out.npz")
    gemm = np.load(dp_heads / f"{loss}_gemm2_out.npz")
    for key in ("loss", "grad_emb", "grad_weight", "logits"):
        np.testing.assert_allclose(gemm[key], dot[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("loss", list(MARGINS))
def test_dp_head_in_float64_is_the_oracles_arithmetic(dp_heads, loss):
    """Every part of the head computes in float64 when asked (no float32 step in between):
    the oracle's numbers to rounding, with its exact clamp of the cosine."""
    x = np.load(dp_heads / f"{loss}_in.npz")
    got = np.load(dp_heads / f"{loss}_float64_out.npz")
    assert list(got["dtypes"]) == ["float64"] * 4
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE)
    assert float(got["loss"][0]) == pytest.approx(ref["loss"], rel=1e-12)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-12)
    close_to_max(got["grad_emb"], ref["grad_emb"], rtol=1e-12)
    close_to_max(got["grad_weight"], ref["grad_weight"], rtol=1e-12)


def test_sampling_follows_the_oracles_rule(dp_heads):
    """Every positive kept, negatives by score, sorted; each label's column in the sample
    (samples of other shards point at column 0, masked by the head)."""
    x = np.load(dp_heads / "sample_in.npz")
    got = dict(np.load(dp_heads / "sample_out.npz"))
    for i in range(int(x["cases"])):
        # The head's columns are the oracle's remapped labels with -1 sent to column 0.
        got[f"{i}/remapped"] = np.where(x[f"{i}/labels"] >= 0, got[f"{i}/cols"], -1)
    check_sampling_rule(x, got)


@pytest.mark.parametrize("tag,ratio,count,update", [
    ("r1", 1.0, 20, "full"), ("sparse", 0.4, 8, "sparse"), ("dense", 0.4, 8, "dense"),
    ("crowded", 0.2, 5, "sparse"),
])
def test_pfc_head_is_the_softmax_over_its_sample(dp_heads, tag, ratio, count, update):
    """One rank, 20 classes. At ratio 1.0 nothing is sampled: the oracle's full softmax. Below
    it, the oracle's sample (5 positives outnumber ratio 0.2's 4 columns: all 5 kept) and the
    oracle's head over the sampled classes; the sparse gradient is the sampled rows', the dense
    one the whole matrix's, zero off the sample."""
    x = np.load(dp_heads / "pfc_in.npz")
    got = np.load(dp_heads / f"pfc_{tag}_out.npz")
    assert str(got["update"]) == update
    if ratio == 1.0:
        index = np.arange(20)
    else:
        index, _ = oracle.pfc_sample(x["labels"], 20, int(got["num_sample"]), x["scores"])
    assert len(index) == count
    np.testing.assert_array_equal(got["index"], index)
    ref = sampled_oracle(x["emb"], x["weight"], x["labels"], index)
    assert float(got["loss"][0]) == pytest.approx(ref["loss"], rel=1e-5)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-4)
    close_to_max(got["grad_emb"], ref["grad_emb"])
    if tag == "dense":
        full = np.zeros((20, 8))
        full[index] = ref["grad_weight"]
        close_to_max(got["grad_weight"], full)
        assert not np.delete(got["grad_weight"], index, axis=0).any()
    else:
        close_to_max(got["grad_weight"], ref["grad_weight"])


# ---------------------------------------------------------------- mp, 2 ranks in dist_sync

# Each rank of a dist_sync launch: (1) the sharded head on the oracle's inputs, twice (the
# second call must repeat the first: buffers of the collectives must not carry over), then
# pfc heads on them, at ratio 1.0 and at 0.5 with given negative scores; (2) a TrainStep with fc
# mp on a BN backbone, its reduced gradients before the update and its weights after it;
# (3) a sparse pfc TrainStep whose shards sample fewer columns than the gathered batch has
# samples (each rank counts its positives), three steps back to back.
MP_RANK = r"""
import sys
import mxnet as mx
import numpy as np
from trainperf.config import Workload
from trainperf.backends.mxnet import models
from trainperf.backends.mxnet.comm import comm_from_env
from trainperf.backends.mxnet.heads import MarginSoftmaxHead
from trainperf.backends.mxnet.step import TrainStep, synthetic_batch

folder = sys.argv[1]
comm = comm_from_env("cpu")
r, ctx = comm.rank, comm.contexts[0]
x = np.load(f"{folder}/head_in.npz")
c, d = x["weight"].shape
rows = x["emb"].shape[0] // comm.world_size
head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), comm, ctx, mode="mp")
head.set_weight(x["weight"])
out = {"start": head.start, "count": head.count}
for call in (1, 2):
    loss, grad = head.forward_backward(
        mx.nd.array(x["emb"][r * rows:(r + 1) * rows], ctx=ctx),
        mx.nd.array(x["labels"][r * rows:(r + 1) * rows], ctx=ctx, dtype="float64"),
        keep_logits=True)
    out.update({f"loss{call}": loss.asnumpy(), f"grad_emb{call}": grad.asnumpy(),
                f"grad_weight{call}": head.grad.asnumpy(), f"logits{call}": head.logits.asnumpy()})
for tag, ratio in (("pfc1", 1.0), ("pfc", 0.5)):
    head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), comm, ctx,
                             mode="pfc", sample_ratio=ratio)
    head.set_weight(x["weight"])
    loss, grad = head.forward_backward(
        mx.nd.array(x["emb"][r * rows:(r + 1) * rows], ctx=ctx),
        mx.nd.array(x["labels"][r * rows:(r + 1) * rows], ctx=ctx, dtype="float64"),
        keep_logits=True, scores=mx.nd.array(x[f"scores{r}"][:head.count], ctx=ctx))
    out.update({f"{tag}/loss": loss.asnumpy(), f"{tag}/grad_emb": grad.asnumpy(),
                f"{tag}/grad_weight": head.grad.asnumpy(), f"{tag}/logits": head.logits.asnumpy(),
                f"{tag}/num_sample": head.num_sample})
    if head.index is not None:
        out[f"{tag}/index"] = head.index.asnumpy()
np.savez(f"{folder}/head_rank{r}.npz", **out)

wl = Workload(**eval(open(f"{folder}/workload.txt").read()))
step = TrainStep(wl, comm)
step.heads[0].set_weight(np.load(f"{folder}/step_in.npz")["head"])
names = models.torch_names(step.net)
if r == 0:
    np.savez(f"{folder}/init.npz",
             **{"backbone/" + k: p.data().asnumpy() for k, p in names.items()})
losses = step.compute_gradients([synthetic_batch(wl, r, ctx)])
grads = {"grad/" + k: p.grad().asnumpy() for k, p in names.items() if p.grad_req != "null"}
head_grad = step.heads[0].grad.asnumpy()
step.apply(losses)
after = {"after/" + k: p.data().asnumpy() for k, p in names.items()}
# Three more steps issued back to back, nothing read in between (as the worker runs them):
# every rank's collectives must still meet in the right rounds.
batch = [synthetic_batch(wl, r, ctx)]
later = [step(batch) for _ in range(3)]
np.savez(f"{folder}/step_rank{r}.npz", loss=losses[0].asnumpy(), head_grad=head_grad,
         start=step.heads[0].start, later=np.concatenate([l.asnumpy() for l in later]),
         **grads, **after)

pfc = TrainStep(wl.replace(fc="pfc", sample_ratio=0.2), comm)
pfc_losses = [pfc(batch) for _ in range(3)]
np.savez(f"{folder}/pfc_step_rank{r}.npz", update=pfc.pfc_update,
         num_sample=pfc.heads[0].num_sample, sampled=len(pfc.heads[0].index),
         labels=batch[0][1].asnumpy(),
         losses=np.concatenate([l.asnumpy() for l in pfc_losses]))
mx.nd.waitall()
comm.barrier()
"""

# One process, the same step by hand: each rank's half of the batch through the backbone on
# its own (so BatchNorm sees the same per-rank batch statistics as the two ranks do), the
# whole softmax head on the concatenated embeddings, one backward through both halves.
MP_REFERENCE = r"""
import sys
import mxnet as mx
import numpy as np
from mxnet import autograd
from trainperf.config import Workload
from trainperf.backends.mxnet import models
from trainperf.backends.mxnet.comm import Comm
from trainperf.backends.mxnet.step import TrainStep, synthetic_batch

folder = sys.argv[1]
wl = Workload(**eval(open(f"{folder}/workload.txt").read())).replace(fc="dp")
init = dict(np.load(f"{folder}/init.npz"))
init["head/weight"] = np.load(f"{folder}/step_in.npz")["head"]
step = TrainStep(wl, Comm(), init=init)
head = step.heads[0]
net = step.net
net.hybridize(active=False)  # two calls in one recording: plain imperative graphs
batches = [synthetic_batch(wl, r, mx.cpu()) for r in range(2)]
with autograd.record():
    halves = [net(images) for images, _ in batches]
emb = mx.nd.concat(*halves, dim=0)
labels = mx.nd.concat(*[labels for _, labels in batches], dim=0)
loss, grad = head.forward_backward(emb, labels)
b = wl.batch_size
autograd.backward(halves, head_grads=[grad[:b], grad[b:]])
names = models.torch_names(net)
grads = {"grad/" + k: p.grad().asnumpy() for k, p in names.items() if p.grad_req != "null"}
first, head_grad = loss.asnumpy(), head.grad.asnumpy()
later = []
for _ in range(3):
    step.apply([loss])
    with autograd.record():
        halves = [net(images) for images, _ in batches]
    loss, grad = head.forward_backward(mx.nd.concat(*halves, dim=0), labels)
    autograd.backward(halves, head_grads=[grad[:b], grad[b:]])
    later.append(float(loss.asscalar()))
np.savez(f"{folder}/reference.npz", loss=first, head_grad=head_grad, later=np.array(later),
         **grads)
"""


@pytest.fixture(scope="module")
def mp_two_ranks(tmp_path_factory, mxnet_python):
    folder = tmp_path_factory.mktemp("mx_mp")
    rng = np.random.RandomState(9)
    np.savez(folder / "head_in.npz", **head_inputs(7, 12, 8, 37), margins=MARGINS["arcface"],
             scale=SCALE, **shard_scores(rng))
    workload = dict(backbone="iresnet_tiny", num_classes=37, batch_size=4, embedding_size=8,
                    input_size=16, dropout=0.0, fc="mp", clip_grad_norm=None,
                    lr_steps=(1,), lr_scales=(0.01,))
    # No clipping here: a clipped update is the same whatever the gradient's scale, so it
    # would hide a mean taken where a sum belongs (the update test covers clipping). The rate
    # drops after the first step so that the later steps compared stay well conditioned.
    (folder / "workload.txt").write_text(repr(workload))
    rng = np.random.RandomState(3)
    np.savez(folder / "step_in.npz", head=(rng.randn(37, 8) * 0.05).astype(np.float32))
    (folder / "mp_rank.py").write_text(MP_RANK)
    run_mx(mxnet_python, ["-m", "trainperf.backends.mxnet.launch", "--nproc", "2", "--kvstore",
                          "dist_sync", "--module", "mp_rank", "--", str(folder)],
           mx_env(folder), timeout=240)
    run_mx(mxnet_python, ["-c", MP_REFERENCE, str(folder)], mx_env())
    return folder


def test_mp_head_shards_equal_the_oracle(mp_two_ranks):
    x = np.load(mp_two_ranks / "head_in.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS["arcface"],
                                       SCALE, world_size=2, cos_eps=oracle.FP32_COS_EPS)
    rows = x["emb"].shape[0] // 2
    for rank, shard in enumerate(ref["shards"]):
        got = np.load(mp_two_ranks / f"head_rank{rank}.npz")
        assert (int(got["start"]), int(got["count"])) == (shard["start"], shard["count"])
        for call in (1, 2):
            assert float(got[f"loss{call}"][0]) == pytest.approx(ref["loss"], rel=1e-5)
            np.testing.assert_allclose(got[f"logits{call}"], shard["logits"], rtol=0, atol=1e-4)
            close_to_max(got[f"grad_weight{call}"], shard["grad_weight"])
            # This rank's rows of the embedding gradient, summed over both ranks' partials.
            close_to_max(got[f"grad_emb{call}"], ref["grad_emb"][rank * rows:(rank + 1) * rows])
    shards = [np.load(mp_two_ranks / f"head_rank{r}.npz") for r in range(2)]
    assert (shards[0]["count"], shards[1]["count"]) == (19, 18)  # 37 classes: uneven shards
    for got in shards:  # pfc at ratio 1.0 samples nothing: mp, bit for bit
        for key in ("loss", "grad_emb", "grad_weight", "logits"):
            np.testing.assert_array_equal(got[f"pfc1/{key}"], got[f"{key}1"], err_msg=key)


def test_pfc_on_two_ranks_is_the_softmax_over_the_sampled_classes(mp_two_ranks):
    """Each rank samples its shard by the oracle's rule; the loss (the same on both ranks) and
    the gradients are the oracle's over the union of both ranks' samples."""
    x = np.load(mp_two_ranks / "head_in.npz")
    ranks = [np.load(mp_two_ranks / f"head_rank{r}.npz") for r in range(2)]
    ids = sampled_ids_on_two_ranks(x, ranks)
    assert [len(i) for i in ids] == [9, 9]
    ref = sampled_oracle(x["emb"], x["weight"], x["labels"], np.concatenate(ids))
    rows, offset = x["emb"].shape[0] // 2, 0
    for r, got in enumerate(ranks):
        assert float(got["pfc/loss"][0]) == pytest.approx(ref["loss"], rel=1e-5)
        np.testing.assert_allclose(got["pfc/logits"], ref["logits"][:, offset:offset + 9],
                                   rtol=0, atol=1e-4)
        close_to_max(got["pfc/grad_emb"], ref["grad_emb"][r * rows:(r + 1) * rows])
        close_to_max(got["pfc/grad_weight"], ref["grad_weight"][offset:offset + 9])
        offset += 9


def test_pfc_step_on_two_ranks_counts_positives_past_the_sample(mp_two_ranks):
    """Ratio 0.2 of shards of 19 and 18 keeps 3 columns, fewer than the 8 gathered samples:
    each rank counts its positives (a read-back of its own) and keeps them all where they are
    more; three sparse steps issued back to back give both ranks the one global loss each
    step."""
    ranks = [np.load(mp_two_ranks / f"pfc_step_rank{r}.npz") for r in range(2)]
    labels = np.concatenate([got["labels"] for got in ranks]).astype(np.int64)
    for r, got in enumerate(ranks):
        assert str(got["update"]) == "sparse" and int(got["num_sample"]) == 3
        assert np.isfinite(got["losses"]).all() and len(got["losses"]) == 3
        start, count = oracle.shard_of(37, r, 2)
        positives = len(np.unique(labels[(labels >= start) & (labels < start + count)]))
        assert int(got["sampled"]) == max(3, positives)
    assert max(int(got["sampled"]) for got in ranks) > 3  # the count was needed
    np.testing.assert_array_equal(ranks[0]["losses"], ranks[1]["losses"])


def test_mp_step_sums_backbone_gradients_over_ranks(mp_two_ranks):
    """The 2-rank mp step has the loss and the backbone gradient of one process running the
    full softmax on the concatenated batch (the sum, not the mean, of the ranks' partials)."""
    ref = np.load(mp_two_ranks / "reference.npz")
    ranks = [np.load(mp_two_ranks / f"step_rank{r}.npz") for r in range(2)]
    grad_names = [k for k in ref.files if k.startswith("grad/")]
    assert len(grad_names) > 10
    for got in ranks:
        assert float(got["loss"][0]) == pytest.approx(float(ref["loss"][0]), rel=1e-5)
        largest = max(np.abs(ref[k]).max() for k in grad_names)
        for k in grad_names:
            err = np.abs(got[k].astype(np.float64) - ref[k]).max() / largest
            assert err <= 1e-4, f"{k}: {err:.3g} of the largest backbone gradient"
        # The shard's class-matrix gradient is its rows of the full one, not reduced.
        start = int(got["start"])
        close_to_max(got["head_grad"], ref["head_grad"][start:start + got["head_grad"].shape[0]],
                     rtol=1e-4)
    # Later steps, issued without a sync in between, keep training as the reference does. The
    # unclipped first step leaves a badly conditioned net in which the rounding difference of a
    # two-rank sum grows about tenfold a step (2e-6, 3e-5, 2e-4 here): a collective that met
    # the wrong round would be off by tens of percent.
    for got in ranks:
        np.testing.assert_allclose(got["later"], ref["later"], rtol=2e-3)
    # The update applies that sum, not a mean over ranks.
    init = np.load(mp_two_ranks / "init.npz")
    moves = {}
    for k in grad_names:
        name = k[len("grad/"):]
        w0 = init["backbone/" + name].astype(np.float64)
        moves[name] = (ranks[0]["after/" + name] - w0, -0.1 * (ref[k] + 5e-4 * w0))
    largest = max(np.abs(want).max() for _, want in moves.values())
    for name, (got, want) in moves.items():
        err = np.abs(got - want).max() / largest
        assert err <= 1e-4, f"{name}: update off by {err:.3g} of the largest update"
    # Both ranks pulled the same sum and applied the same update: identical trained weights
    # (BatchNorm running statistics stay per rank, as in torch without SyncBN).
    for k in grad_names:
        after = "after/" + k[len("grad/"):]
        np.testing.assert_array_equal(ranks[0][after], ranks[1][after], err_msg=after)


# --------------------------------------------------------------- the update, one process

STEP_SIDE = r"""
import sys
import mxnet as mx
import numpy as np
from trainperf.config import Workload
from trainperf.backends.mxnet.comm import Comm
from trainperf.backends.mxnet.step import TrainStep, synthetic_batch

folder = sys.argv[1]
cases = {
    # A tiny clip norm so clipping acts on every step; the rate drops after step 1.
    "face": Workload(backbone="iresnet_tiny", num_classes=10, batch_size=4, embedding_size=8,
                     input_size=16, dropout=0.0, clip_grad_norm=0.05, lr_steps=(1,),
                     lr_scales=(0.1,)),
    "classification": Workload(backbone="resnet_v1b_tiny", task="classification",
                               num_classes=10, batch_size=4, input_size=16, lr=0.05,
                               clip_grad_norm=None, lr_steps=(2,), lr_scales=(0.2,)),
    # arcface_torch's dense update of a sampled head: the whole matrix, a gradient zero off it.
    "pfc_dense": Workload(backbone="iresnet_tiny", num_classes=20, batch_size=4,
                          embedding_size=8, input_size=16, dropout=0.0, fc="pfc",
                          sample_ratio=0.4, pfc_update="dense", clip_grad_norm=0.05,
                          lr_steps=(1,), lr_scales=(0.1,)),
}
for name, wl in cases.items():
    step = TrainStep(wl, Comm())
    batch = [synthetic_batch(wl, 0, mx.cpu())]
    def values(kind):
        if kind == "data":
            return ([p.data().asnumpy() for p in step.params]
                    + [h.weight.asnumpy() for h in step.heads])
        return [p.grad().asnumpy() for p in step.params] + [h.grad.asnumpy() for h in step.heads]
    out = {"backbone_count": len(step.params)}
    for i in range(3):
        before = values("data")
        losses = step.compute_gradients(batch)
        grads = values("grad")
        step.apply(losses)
        after = values("data")
        for j, (b, g, a) in enumerate(zip(before, grads, after)):
            out[f"{i}/{j}/before"], out[f"{i}/{j}/grad"], out[f"{i}/{j}/after"] = b, g, a
    out["arrays"] = len(before)
    np.savez(f"{folder}/{name}.npz", **out)

# A sparse pfc step: the shard's weight before and after each of three steps (the rate drops
# after the first), the sampled rows' gradient and their index.
wl = cases["pfc_dense"].replace(pfc_update="sparse", clip_grad_norm=None)
step = TrainStep(wl, Comm())
head = step.heads[0]
batch = [synthetic_batch(wl, 0, mx.cpu())]
out = {"update": step.pfc_update}
for i in range(3):
    out[f"{i}/before"] = head.weight.asnumpy()
    losses = step.compute_gradients(batch)
    out[f"{i}/grad"], out[f"{i}/index"] = head.grad.asnumpy(), head.index.asnumpy()
    step.apply(losses)
    out[f"{i}/after"] = head.weight.asnumpy()
np.savez(f"{folder}/pfc_sparse.npz", **out)

refused = []
base = dict(backbone="iresnet_tiny", num_classes=10, batch_size=4, embedding_size=8, input_size=16)
two_contexts = Comm("device", 0, 2, 0, "cpu", [mx.cpu(0), mx.cpu(1)])
for change, comm in (({"fc": "pfc"}, two_contexts), ({"precision": "fp16"}, Comm()),
                     ({"precision": "bf16"}, Comm())):
    try:
        TrainStep(Workload(**base, **change), comm)
        refused.append("accepted")
    except ValueError as exc:
        refused.append(str(exc))
with open(f"{folder}/refused.txt", "w") as f:
    f.write("\n".join(refused))

# fp16's loss-scaling bookkeeping on CPU, where half-precision kernels do not exist: AMP off and
# the head's products in fp32, so only the scaling, the overflow check and the skip remain.
from trainperf.backends.mxnet import step as step_module
step_module.check_precision = lambda precision, device_type: None
step_module.enable_amp = lambda: None
scaled = {}
for precision in ("fp32", "fp16"):
    wl = Workload(**base, precision=precision, dropout=0.0)
    step = TrainStep(wl, Comm())
    step.heads[0].mm_dtype = "float32"
    batch = [synthetic_batch(wl, 0, mx.cpu())]
    losses = []
    for i in range(5):
        got = step.compute_gradients(batch)
        if precision == "fp16" and i == 2:
            step.params[3].grad()[:] = float("inf")  # an overflow in one gradient
        step.apply(got)
        losses.append(float(got[0].asscalar()))
    scaled[precision] = losses
    scaled[precision + "_scale"] = -1.0 if step.loss_scale is None else step.loss_scale
    scaled[precision + "_skipped"] = step.skipped_steps
np.savez(f"{folder}/loss_scaling.npz", **scaled)
"""


@pytest.fixture(scope="module")
def updates(tmp_path_factory, mxnet_python):
    folder = tmp_path_factory.mktemp("mx_step")
    run_mx(mxnet_python, ["-c", STEP_SIDE, str(folder)], mx_env())
    return folder


@pytest.mark.parametrize("case,clip,rates", [
    ("face", 0.05, (0.1, 0.01, 0.01)),
    ("classification", None, (0.05, 0.05, 0.01)),
    ("pfc_dense", 0.05, (0.1, 0.01, 0.01)),
])
def test_update_is_torch_sgd_with_clipping_and_rate_changes(updates, case, clip, rates):
    """Three steps of the fused MXNet update equal torch's SGD (oracle.sgd_momentum_step) on
    the step's own gradients, with the backbone's global-norm clipping and a change of rate
    (which MXNet's momentum form needs rescaled to stay equal). A dense pfc head's gradient is
    the whole matrix's, zero off the 8 sampled rows."""
    got = np.load(updates / f"{case}.npz")
    count = int(got["arrays"])
    check_recorded_sgd_steps(got, count, int(got["backbone_count"]), rates, clip)
    if case == "pfc_dense":
        for i in range(3):
            head_grad = got[f"{i}/{count - 1}/grad"]
            assert head_grad.shape == (20, 8)
            assert np.count_nonzero(np.abs(head_grad).sum(axis=1)) == 8


def test_sparse_pfc_update_moves_only_sampled_rows_with_momentum_per_row(updates):
    """Three sparse steps (ratio 0.4 of 20 classes, the rate 0.1 then 0.01): the sampled rows
    take torch's SGD step on their gradient with momentum kept per row (a row's buffer starts
    at its first sample and waits, untouched, while it is not sampled), weight decay on them
    only; every other row stays bit for bit as it was."""
    got = np.load(updates / "pfc_sparse.npz")
    assert str(got["update"]) == "sparse"
    buf = np.zeros((20, 8))
    sampled = np.zeros(20, bool)
    for i, lr in enumerate((0.1, 0.01, 0.01)):
        before, index = got[f"{i}/before"], got[f"{i}/index"].astype(np.int64)
        assert len(index) == 8 and np.all(np.diff(index) > 0)
        want = before.astype(np.float64)
        want[index], buf[index] = oracle.sgd_momentum_step(before[index], got[f"{i}/grad"],
                                                           buf[index], lr, 0.9, 5e-4)
        np.testing.assert_allclose(got[f"{i}/after"], want, rtol=1e-5, atol=1e-7,
                                   err_msg=f"step {i}")
        others = np.setdiff1d(np.arange(20), index)
        np.testing.assert_array_equal(got[f"{i}/after"][others], before[others])
        sampled[index] = True
    # Rows sampled at the first step, left out at the second (where the rate changed) and
    # sampled again at the third carry their first step's momentum over the gap; rows never
    # sampled never moved.
    first, second, third = (set(got[f"{i}/index"].astype(int)) for i in range(3))
    assert (first - second) & third
    assert not sampled.all()
    np.testing.assert_array_equal(got["2/after"][~sampled], got["0/before"][~sampled])


def test_unsupported_settings_are_refused_up_front(updates):
    pfc, fp16, bf16 = (updates / "refused.txt").read_text().splitlines()
    assert pfc == ("kvstore device runs data parallel only (--fc dp); use horovod (the "
                   "default) for --fc pfc")
    assert fp16 == "the mxnet backend runs --precision fp32 on a CPU; fp16 needs a GPU"
    assert bf16.startswith("the mxnet backend runs --precision fp32 on a CPU (MXNet 1.9's")


def test_fp16_loss_scaling_scales_checks_and_skips(updates):
    """Without an overflow the scaled step trains exactly as fp32 (the scale is a power of
    two); an overflow skips that step's update (the next loss repeats it) and halves the
    scale from 2**16."""
    got = np.load(updates / "loss_scaling.npz")
    fp32, fp16 = list(got["fp32"]), list(got["fp16"])
    np.testing.assert_allclose(fp16[:3], fp32[:3], rtol=1e-6)
    assert fp16[3] == fp16[2]
    np.testing.assert_allclose(fp16[4], fp32[3], rtol=1e-5)
    assert float(got["fp16_scale"]) == 2.0 ** 15
    assert list(got["fp16_skipped"]) == [2]
