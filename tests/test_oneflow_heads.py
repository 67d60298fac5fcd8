"""The OneFlow head and optimizer (``trainperf.backends.oneflow``) against the float64 oracle.

OneFlow runs in its own opt-in environment (``oneflow_python``, skipped where it is not built):
scripts run there and write ``.npz`` files, and the comparisons happen here against
``tests/oracle.py``. The sharded (mp) head runs on 2 ranks started by the backend's own launcher
(``trainperf.backends.spawn``), with a class count that does not divide evenly (37 over 2).

Tolerances: OneFlow computes in float32 from the float32 inputs the oracle casts to float64. The
loss agrees to a relative 1e-5, the logits (scaled by s = 64) to 1e-4 absolute, gradients to
1e-5 of the largest entry of the same gradient (measured: 3e-6 and below).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import oracle
from framework_checks import close_to_max, head_inputs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MARGINS = {"arcface": (1.0, 0.5, 0.0), "cosface": (1.0, 0.0, 0.4), "combined": (1.2, 0.3, 0.1)}
SCALE = 64.0
GRAD_RTOL = 1e-5


def of_env(python: str, *extra: Path) -> dict[str, str]:
    from trainperf.backends.oneflow.backend import library_path

    paths = [str(ROOT / "src"), str(ROOT / "tests"), *map(str, extra)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), OMP_NUM_THREADS="1",
               LD_LIBRARY_PATH=library_path(python), GLOG_minloglevel="2")
    env.pop("TRAINPERF_FAULT", None)
    return env


def run_of(argv: list[str], env: dict[str, str], timeout: float = 120) -> None:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"


# One process: the dp head for every margin, SGD against torch's rule (the rate changes at the
# third step), and the settings the backend refuses, each with its message.
ONE_PROCESS = r"""
import sys
import numpy as np
import oneflow as flow
from trainperf.config import Workload
from trainperf.backends.oneflow.dist import Dist
from trainperf.backends.oneflow.heads import MarginSoftmaxHead
from trainperf.backends.oneflow.step import check_workload

folder = sys.argv[1]
for name in sys.argv[2:]:
    x = np.load(f"{folder}/{name}_in.npz")
    c, d = x["weight"].shape
    head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), Dist())
    head.set_weight(x["weight"])
    emb = flow.tensor(x["emb"], requires_grad=True)
    loss = head(emb, flow.tensor(x["labels"]), keep_logits=True)
    loss.backward()
    np.savez(f"{folder}/{name}_out.npz", loss=loss.numpy(), grad_emb=emb.grad.numpy(),
             grad_weight=head.weight.grad.numpy(), logits=head.logits.numpy())

s = np.load(f"{folder}/sgd_in.npz")
w = flow.nn.Parameter(flow.tensor(s["weight"]))
opt = flow.optim.SGD([w], lr=0.1, momentum=0.9, weight_decay=5e-4)
after = []
for grad, lr in zip(s["grads"], s["lrs"]):
    opt.param_groups[0]["lr"] = float(lr)
    w.grad = flow.tensor(grad)
    opt.step()
    after.append(w.detach().numpy().copy())
np.save(f"{folder}/sgd_out.npy", np.stack(after))

base = Workload(backbone="iresnet_tiny", num_classes=10, batch_size=2)
refused = []
for change in ({"fc": "pfc"}, {"precision": "fp16"}, {"precision": "bf16"},
               {"backbone": "mobilefacenet_y1"},
               {"task": "classification", "backbone": "resnet50_v1b"},
               {"channels_last": True}):
    try:
        check_workload(base.replace(**change))
        refused.append("accepted")
    except ValueError as e:
        refused.append(str(e))
open(f"{folder}/refused.txt", "w").write("\n".join(refused))
"""


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, oneflow_python):
    folder = tmp_path_factory.mktemp("of_dp_head")
    for i, (name, margins) in enumerate(MARGINS.items()):
        np.savez(folder / f"{name}_in.npz", **head_inputs(i, 12, 8, 37), margins=margins,
                 scale=SCALE)
    rng = np.random.RandomState(5)
    np.savez(folder / "sgd_in.npz", weight=rng.randn(4, 3).astype(np.float32),
             grads=rng.randn(4, 4, 3).astype(np.float32), lrs=np.array([0.1, 0.1, 0.01, 0.01]))
    run_of([oneflow_python, "-c", ONE_PROCESS, str(folder), *MARGINS], of_env(oneflow_python))
    return folder


@pytest.mark.parametrize("loss", list(MARGINS))
def test_dp_head_equals_the_oracle(one_process, loss):
    x = np.load(one_process / f"{loss}_in.npz")
    got = np.load(one_process / f"{loss}_out.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS[loss], SCALE,
                                       cos_eps=oracle.FP32_COS_EPS)
    assert float(got["loss"]) == pytest.approx(ref["loss"], rel=1e-5)
    np.testing.assert_allclose(got["logits"], ref["logits"], rtol=0, atol=1e-4)
    close_to_max(got["grad_emb"], ref["grad_emb"])
    close_to_max(got["grad_weight"], ref["grad_weight"])


def test_sgd_is_torchs_update_through_a_rate_change(one_process):
    """OneFlow 0.9's momentum SGD keeps torch's buffer (its docstring still describes the
    older lr-scaled form, which would differ after the rate drops)."""
    s = np.load(one_process / "sgd_in.npz")
    got = np.load(one_process / "sgd_out.npy")
    weight, buf = s["weight"], None
    for i, (grad, lr) in enumerate(zip(s["grads"], s["lrs"])):
        weight, buf = oracle.sgd_momentum_step(weight, grad, buf, lr, 0.9, 5e-4)
        np.testing.assert_allclose(got[i], weight, rtol=1e-6, atol=1e-7)


def test_unsupported_settings_are_refused_with_a_reason(one_process):
    pfc, fp16, bf16, y1, rn50, nhwc = (one_process / "refused.txt").read_text().splitlines()
    assert pfc == "the oneflow backend runs --fc dp, mp; not pfc"
    assert fp16 == ("the oneflow backend runs --precision fp32 on a CPU (OneFlow 0.9's eager "
                    "mode has no dynamic loss scaler)")
    assert bf16 == "the oneflow backend runs --precision fp32 on a CPU"
    assert y1.startswith("the oneflow backend has no backbone 'mobilefacenet_y1'")
    assert rn50.startswith("the oneflow backend has no backbone 'resnet50_v1b'")
    assert nhwc == ("the oneflow backend runs its backbones channels-first only: drop "
                    "--channels-last")


# ------------------------------------------------------------------------ mp, on 2 ranks

# Each rank: the sharded head on its half of the oracle's batch, twice (the second call must
# repeat the first: nothing of a step may carry over into the next).
MP_RANK = r"""
import sys
from trainperf.backends.oneflow.rendezvous import wait_for_rank0
wait_for_rank0()
import numpy as np
import oneflow as flow
from trainperf.backends.oneflow.dist import dist_from_env
from trainperf.backends.oneflow.heads import MarginSoftmaxHead
from trainperf.backends.oneflow.step import TrainStep, synthetic_batch
from trainperf.config import Workload

folder = sys.argv[1]
dist = dist_from_env("cpu")
r = dist.rank
x = np.load(f"{folder}/head_in.npz")
c, d = x["weight"].shape
rows = x["emb"].shape[0] // dist.world_size
head = MarginSoftmaxHead(c, d, tuple(x["margins"]), float(x["scale"]), dist, mode="mp")
head.set_weight(x["weight"])
out = {"start": head.start, "count": head.count, "world": dist.world_size,
       "sbp": str(head.weight.sbp)}
for call in (1, 2):
    emb = flow.tensor(x["emb"][r * rows:(r + 1) * rows], requires_grad=True)
    head.weight.grad = None
    loss = head(emb, flow.tensor(x["labels"][r * rows:(r + 1) * rows]), keep_logits=True)
    loss.backward()
    out.update({f"loss{call}": loss.to_local().numpy(), f"grad_emb{call}": emb.grad.numpy(),
                f"grad_weight{call}": head.weight.grad.to_local().numpy(),
                f"logits{call}": head.logits.numpy()})
np.savez(f"{folder}/head_rank{r}.npz", **out)

# Whole steps without clipping (which would hide a wrong gradient scale): dp and mp from the
# same start on the same per-rank batches, gradients read after the reduction.
wl = Workload(backbone="iresnet_tiny", num_classes=c, batch_size=4, embedding_size=d,
              input_size=16, dropout=0.0, clip_grad_norm=None)
dp = TrainStep(wl.replace(fc="dp"), dist)
dp.head.set_weight(x["weight"])
init = {"backbone/" + k: v.numpy() for k, v in dp.backbone.state_dict().items()}
init["head/weight"] = x["weight"]
mp = TrainStep(wl.replace(fc="mp"), dist, init=init)
images, labels = synthetic_batch(wl, dist)
out = {}
for name, step in (("dp", dp), ("mp", mp)):
    loss = step.compute_gradients(images, labels)
    out[f"{name}/loss"] = (loss.to_local() if loss.is_global else loss).numpy()
    grad = step.head.weight.grad
    out[f"{name}/head"] = (grad.to_local() if grad.is_global else grad).numpy()
    for k, p in step.backbone.named_parameters():
        if p.requires_grad:
            out[f"{name}/grad/{k}"] = p.grad.numpy()
    step.apply()
np.savez(f"{folder}/step_rank{r}.npz", start=mp.head.start, **out)
dist.barrier()
"""


@pytest.fixture(scope="module")
def mp_two_ranks(tmp_path_factory, oneflow_python):
    folder = tmp_path_factory.mktemp("of_mp_head")
    np.savez(folder / "head_in.npz", **head_inputs(7, 12, 8, 37), margins=MARGINS["arcface"],
             scale=SCALE)
    (folder / "of_mp_rank.py").write_text(MP_RANK)
    run_of([oneflow_python, "-m", "trainperf.backends.spawn", "--backend", "oneflow",
            "--nproc", "2", "--module", "of_mp_rank", "--", str(folder)],
           of_env(oneflow_python, folder))
    return folder


def test_mp_head_on_two_ranks_equals_the_full_softmax(mp_two_ranks):
    x = np.load(mp_two_ranks / "head_in.npz")
    ref = oracle.head_forward_backward(x["emb"], x["weight"], x["labels"], MARGINS["arcface"],
                                       SCALE, world_size=2, cos_eps=oracle.FP32_COS_EPS)
    rows = x["emb"].shape[0] // 2
    for r in range(2):
        got = np.load(mp_two_ranks / f"head_rank{r}.npz")
        shard = ref["shards"][r]
        assert int(got["world"]) == 2 and "split(dim=0)" in str(got["sbp"])
        assert (int(got["start"]), int(got["count"])) == (shard["start"], shard["count"])
        for call in (1, 2):
            # Every rank holds the loss of the whole gathered batch.
            assert float(got[f"loss{call}"]) == pytest.approx(ref["loss"], rel=1e-5)
            np.testing.assert_allclose(got[f"logits{call}"], shard["logits"], rtol=0, atol=1e-4)
            close_to_max(got[f"grad_emb{call}"], ref["grad_emb"][r * rows:(r + 1) * rows])
            close_to_max(got[f"grad_weight{call}"], shard["grad_weight"])


def test_mp_step_sums_what_dp_averages(mp_two_ranks):
    """The same two per-rank batches through a dp and an mp step (clipping off): both give the
    gradient of the mean loss over the global batch, dp by averaging each rank's own gradient,
    mp by summing each rank's part of the global loss's. A backbone summed without the world
    size's factor, or averaged, would be half of dp's."""
    ranks = [np.load(mp_two_ranks / f"step_rank{r}.npz") for r in range(2)]
    names = [k for k in ranks[0].files if k.startswith("dp/grad/")]
    scale = max(np.abs(ranks[0][k]).max() for k in names)
    for got in ranks:
        for key in names:
            ref = ranks[0][key]  # every rank holds the same reduced gradient
            mp_key = "mp/" + key[len("dp/"):]
            np.testing.assert_allclose(got[key], ref, rtol=0, atol=1e-6 * scale, err_msg=key)
            np.testing.assert_allclose(got[mp_key], ref, rtol=0, atol=1e-5 * scale,
                                       err_msg=mp_key)
        start = int(got["start"])
        rows = got["mp/head"].shape[0]
        close_to_max(got["mp/head"], got["dp/head"][start:start + rows])
    # mp's loss is the global batch's: the mean of the ranks' own dp losses.
    dp_mean = np.mean([float(got["dp/loss"]) for got in ranks])
    for got in ranks:
        assert float(got["mp/loss"]) == pytest.approx(dp_mean, rel=1e-6)
    assert float(ranks[0]["dp/loss"]) != float(ranks[1]["dp/loss"])
