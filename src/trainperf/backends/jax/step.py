"""The training step that trainperf measures in JAX, equal to torch's ``TrainStep``.

One function, ``jax.jit(jax.shard_map(body))`` over the mesh axis of ranks (``dist.AXIS``),
compiled once before the measured loop: backbone forward (flax, training-mode BatchNorm on the
rank's own batch), head (``heads.py``), gradients by autodiff, the reduction over ranks,
clipping, and SGD. Everything the step needs from one call to the next is on the device in its
state (the step counter, so the learning rate, the dropout and Partial FC keys and the fp16
loss scale are computed inside), the state's buffers are donated to the next state, and nothing
is read back to the host: the step returns the loss of each rank as a device array.

Sharding of the state: backbone parameters, their momentum and the step counter are replicated
(``P()``); BatchNorm running statistics carry a leading rank axis (``P("r")``: each rank keeps
its own, as torch's DDP without SyncBN and without buffer broadcast); the class matrix and its
momentum are replicated for ``dp`` and split over ranks for ``mp`` / ``pfc``.

Gradients, as torch's DDP set-up: inside the body the replicated parameters are first cast to
per-rank values (``lax.pcast(..., to="varying")``), so autodiff gives each rank its own partial
gradient, reduced explicitly:

- ``dp`` and classification: every gradient (backbone and the whole class matrix) is the mean
  over ranks (``lax.pmean``), as DDP's average.
- ``mp`` / ``pfc``: the loss is the mean over the gathered global batch and the same on every
  rank, so each rank's backbone gradient is one partial of the true gradient: they are summed
  (``lax.psum``). The class-matrix shard's gradient stays local.
- Across processes on a CPU the reduction runs on one flat buffer per dtype (``_reduce_flat``:
  gloo runs XLA's tuple all-reduce one element at a time).

Clipping: the backbone's reduced gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``
with ``norm`` its global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` (not optax's
``clip_by_global_norm``, whose rule differs).

SGD: optax ``chain(add_decayed_weights(wd), trace(momentum))`` gives torch's ``buf = m * buf +
(g + wd * w)`` (zero initial trace: torch's first ``buf = d`` is the same number), and the step
applies ``w + (-lr) * buf`` as torch does; the rate comes from ``Workload.lr_at`` evaluated on
the device. A sparse Partial FC update runs the same transform on the sampled rows and their
momentum rows only, then scatters both back (rows not sampled keep weight and momentum).

Precision: ``bf16`` and ``fp16`` run convolutions, dense layers and the head's class-matrix
product in that dtype with fp32 master weights, BatchNorm statistics, margin and softmax in fp32
(as torch's autocast). ``fp16`` adds dynamic loss scaling with torch's policy (start 2**16,
halve on an overflow, double after 2000 clean steps); the overflow check covers every gradient
of every rank and is one decision for all of them, taken on the device (a skipped step keeps the
old parameters and momentum through ``jnp.where``), so even fp16 reads nothing back inside the
window; which steps were skipped is read after it. fp16 is refused on a CPU (``check_precision``).

A strict alignment run (``dtype="float64"``, with ``jax_enable_x64`` set before any array was
made) holds and computes everything in float64: the loaded weights, BatchNorm statistics and
class rows, the inputs, every activation, the head, the gradients, optax's momentum and the
rate. Building such a step checks that the state holds no narrower float, and
:meth:`TrainStep.check_program` that the lowered program computes none. ``record`` (an
alignment run with a dump) adds the step's rate and the backbone's gradient norm before
clipping to the step's outputs (computed even where the workload does not clip); a throughput
run's program has neither.
"""

from __future__ import annotations

import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from ...config import Workload
from ..base import require
from ..scaling import (BACKOFF as LOSS_SCALE_BACKOFF, GROWTH as LOSS_SCALE_GROWTH,
                       INIT as LOSS_SCALE_INIT, INTERVAL as LOSS_SCALE_INTERVAL)
from ..workerkit import start_batch
from . import models
from .backend import BACKEND
from .dist import AXIS, Layout
from .heads import MarginSoftmaxHead

COMPUTE_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}
RNG_IMPL = "rbg"
"""Random bits by XLA's RngBitGenerator (synthetic data, dropout masks, Partial FC scores):
it compiles in a fraction of the time of the default threefry, whose hash is unrolled into
every program that draws, and runs faster on GPUs."""
CLIP_EPS = 1e-6
"""torch's clip_grad_norm_ divides by norm + 1e-6."""
NARROW_FLOATS = re.compile(r"tensor<(?:[0-9?]+x)*(f16|bf16|f32)>")
"""A float narrower than float64 in a lowered program's text (StableHLO tensor types)."""


def check_precision(precision: str, device_type: str) -> None:
    """ValueError unless the backend's declaration runs ``precision`` on this device."""
    require(BACKEND.precision_refusal(precision, "cuda" if device_type in ("gpu", "cuda")
                                      else "cpu"))


def synthetic_batch(workload: Workload, rank: int) -> tuple[jax.Array, jax.Array]:
    """Rank ``rank``'s batch, made on the current default device: normal NHWC images and
    uniform labels, seeded by (seed, rank) so ranks see different samples."""
    key = jax.random.key(workload.seed * 1000 + rank + 1, impl=RNG_IMPL)
    k_img, k_lab = jax.random.split(key)
    side = workload.input_size
    images = jax.random.normal(k_img, (workload.batch_size, side, side, 3), jnp.float32)
    labels = jax.random.randint(k_lab, (workload.batch_size,), 0, workload.num_classes,
                                jnp.int32)
    return images, labels


def init_batch(workload: Workload, arrays: Any, rank: int, dtype: str = "float32"
               ) -> tuple[jax.Array, jax.Array]:
    """Rank ``rank``'s batch from an alignment file (NCHW there, NHWC here), images in
    ``dtype``."""
    images, labels = start_batch(workload, arrays, rank, dtype)
    return (jnp.asarray(images.transpose(0, 2, 3, 1), dtype), jnp.asarray(labels, jnp.int32))


def _lr_at(workload: Workload, step: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``Workload.lr_at`` on the device, in ``dtype`` (float32: the same rates torch's float32
    kernels use; float64 in an alignment run)."""
    rate = jnp.asarray(workload.lr, dtype)
    for boundary, factor in zip(workload.lr_steps, workload.lr_scales):
        rate = jnp.where(step >= boundary, jnp.asarray(workload.lr * factor, dtype), rate)
    return rate


def _global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)))


def _reduce_flat(tree: Any, reduce: Any) -> Any:
    """``reduce`` (``lax.psum`` or ``lax.pmean`` over the ranks) of every leaf of ``tree``,
    run on one flat buffer per dtype and split back. XLA already combines the gradients'
    reductions into one tuple all-reduce, but the cross-process CPU collectives (gloo) run a
    tuple one element after another, a round trip each: on 2 ranks of a 2-core machine (shared
    with other work), the tiny backbone's 57 gradients took 33 ms a call as a tuple, 3.9 ms as
    one buffer (``benchmarks/results/jax-ranks-2026-11-28``). The sums are the same numbers."""
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(jnp.dtype(leaf.dtype), []).append(i)
    out = list(leaves)
    for members in groups.values():
        flat = reduce(jnp.concatenate([leaves[i].ravel() for i in members]), AXIS)
        offset = 0
        for i in members:
            size = leaves[i].size
            out[i] = flat[offset:offset + size].reshape(leaves[i].shape)
            offset += size
    return jax.tree.unflatten(treedef, out)


def _all_finite(tree: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]))


def _sgd(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
         lr: jax.Array) -> tuple[Any, Any]:
    """torch's SGD step: the transform gives ``buf = m * buf + (g + wd * w)``, applied as
    ``w + (-lr) * buf``. Returns (new parameters, new transform state)."""
    bufs, opt_state = tx.update(grads, opt_state, params)
    return jax.tree.map(lambda w, b: w + (-lr) * b, params, bufs), opt_state


def _sgd_rows(tx: optax.GradientTransformation, empty: Any, head: dict, selection: Any,
              rows: jax.Array, grads: jax.Array, lr: jax.Array) -> dict:
    """The sparse Partial FC update: the same SGD on the sampled rows and their own momentum
    rows only, scattered back into the shard (surplus sample slots left as they were)."""
    index = selection.index
    mom_rows = head["momentum"][index]
    bufs, (_, trace) = tx.update(grads, (empty, optax.TraceState(trace=mom_rows)), rows)
    new_rows, new_mom = rows + (-lr) * bufs, trace.trace
    if selection.valid is not None:
        keep = selection.valid[:, None]
        new_rows = jnp.where(keep, new_rows, rows)
        new_mom = jnp.where(keep, new_mom, mom_rows)
    return {"weight": head["weight"].at[index].set(new_rows),
            "momentum": head["momentum"].at[index].set(new_mom)}


def _next_scaler(scaler: dict, finite: jax.Array) -> dict:
    """torch's GradScaler policy: halve on an overflow, double after 2000 clean steps."""
    clean = jnp.where(finite, scaler["clean"] + 1, 0)
    grow = clean == LOSS_SCALE_INTERVAL
    scale = jnp.where(finite,
                      jnp.where(grow, scaler["scale"] * LOSS_SCALE_GROWTH, scaler["scale"]),
                      scaler["scale"] * LOSS_SCALE_BACKOFF)
    return {"scale": scale, "clean": jnp.where(grow, 0, clean)}


def _float_dtype(name: str, workload: Workload, init: Any) -> Any:
    """The dtype a step holds its state in; float64 only where it can be honoured: from an
    alignment start, in fp32 precision, with JAX's 64-bit mode on (without it JAX would make
    every float64 array float32, silently)."""
    dtype = jnp.dtype(name)
    if dtype not in (jnp.float32, jnp.float64):
        raise ValueError(f"a jax step holds its state in float32 or float64, not {name}")
    if dtype == jnp.float64:
        if init is None:
            raise ValueError("a float64 step is an alignment run's: it needs a start file")
        if workload.precision != "fp32":
            raise ValueError(f"a float64 alignment run computes everything in float64; "
                             f"--precision {workload.precision} would narrow it")
        if not jax.config.jax_enable_x64:
            raise ValueError("a float64 step needs jax_enable_x64, set before any array is made")
    return dtype


def _under(path: tuple, name: str) -> bool:
    return any(getattr(k, "key", None) == name for k in path)


class TrainStep:
    """Builds the state and the compiled step of one workload on ``layout``.

    ``step(images, labels)`` (global arrays split over ranks: NHWC images in float32, or in
    ``dtype``, int32 labels) runs one step and returns the per-rank loss [world size] without
    waiting for it.
    ``init`` (an alignment ``.npz``) replaces the drawn weights with torch's. ``expose_grads``
    (tests): every call also keeps the reduced, unscaled, unclipped gradients in
    ``last_grads``.

    Alignment (see the module docstring): ``dtype`` is what everything is held and computed in
    (``float64`` needs an ``init``, fp32 precision and ``jax_enable_x64``); ``record`` keeps the
    last step's rate and gradient norm before clipping (``last_record``, on the device);
    ``straight_through`` breaks the margin's gradient on purpose (a negative control).
    """

    def __init__(self, workload: Workload, layout: Layout, init: Any = None,
                 expose_grads: bool = False, dtype: str = "float32", record: bool = False,
                 straight_through: bool = False) -> None:
        task = models.backbone_task(workload.backbone)
        if task != workload.task:
            raise ValueError(f"backbone {workload.backbone!r} is a {task} backbone, "
                             f"but the workload is {workload.task}")
        check_precision(workload.precision, layout.device_type)
        self.dtype = _float_dtype(dtype, workload, init)
        self.workload = workload
        self.layout = layout
        self.world = layout.world_size
        self.fp16 = workload.precision == "fp16"
        self.expose_grads = expose_grads
        self.record = record
        # float64 computes in float64 throughout; otherwise the precision's dtype.
        compute = self.dtype if self.dtype == jnp.float64 else COMPUTE_DTYPES[workload.precision]
        self.model = models.build_backbone(
            workload.backbone, embedding_size=workload.embedding_size,
            num_classes=workload.num_classes, output_block=workload.output_block,
            dropout=workload.dropout, dtype=compute)
        self.head: MarginSoftmaxHead | None = None
        if workload.task == "face":
            self.head = MarginSoftmaxHead(
                workload.num_classes, workload.embedding_size, workload.resolved_margins,
                workload.scale, self.world, workload.fc, workload.sample_ratio,
                workload.pfc_update, mm_dtype=compute, dtype=self.dtype,
                straight_through=straight_through)
            self.head.check_batch(workload.batch_size * self.world)
        self.sharded = self.head is not None and self.head.sharded
        self.flat_reduce = layout.distributed and layout.device_type == "cpu"
        """Whether the gradients are reduced as one flat buffer (``_reduce_flat``): across
        processes on a CPU. NCCL and the in-process CPU collectives take XLA's tuple at once."""
        self.bn_moments = models.BN_MOMENTS_BY_DEVICE.get(layout.device_type, "two_pass")
        """How the step's BatchNorms take their batch moments (``models.BN_MOMENTS_CHOICES``;
        float64 always takes two passes): read when the step is traced."""
        self.sparse = self.head is not None and self.head.update == "sparse"
        self.tx = optax.chain(optax.add_decayed_weights(workload.weight_decay),
                              optax.trace(decay=workload.momentum))

        if init is not None:
            abstract = models.abstract_variables(self.model, workload.input_size)
            variables = models.load_torch_arrays(abstract, init, dtype=self.dtype)
        else:
            variables = models.init_variables(self.model, workload.seed, workload.input_size)
        self.param_count = models.param_count(variables)
        self.state, self.frozen = self._build_state(variables, init)
        self._check_state_dtype()
        self.state_specs = self._specs(self.state)
        self.skipped: list[jax.Array] = []
        self.last_grads: Any = None
        self.last_record: dict[str, jax.Array] | None = None
        """``record``: the last step's ``lr`` and ``grad_norm`` (before clipping), replicated
        device scalars."""
        self._jitted = jax.jit(self._shard_mapped(), donate_argnums=(0,))
        self._compiled = None
        self._last_loss: jax.Array | None = None
        self.compiles = 0
        """Executables ``compile`` built. Once there is one, every call runs it: a ``Compiled``
        object never traces again (a call whose arguments do not fit its shapes, dtypes,
        pytree or shardings raises), so nothing compiles behind this count. (A step called
        without ``compile``, as some tests do, goes through ``jax.jit`` uncounted.)"""
        self.compile_s = 0.0
        """Seconds ``compile`` spent lowering and compiling, summed over its calls."""

    # ------------------------------------------------------------------------- state

    def _build_state(self, variables: dict, init: Any) -> tuple[dict, dict]:
        layout, head = self.layout, self.head
        state: dict = {"step": layout.replicated(jnp.int32(0)),
                       "params": {"backbone": layout.replicated(variables["params"])}}
        if head is not None:
            if init is not None:
                weight = head.weight_from_matrix(layout, init["head/weight"])
            else:
                weight = head.init_weight(layout, self.workload.seed)
            if self.sparse:
                momentum = layout.zeros(weight.shape, weight.dtype, weight.sharding.spec)
                state["head"] = {"weight": weight, "momentum": momentum}
            else:
                state["params"]["head"] = weight
        # optax's state mirrors the parameters (zero momentum), laid out as they are.
        shapes = jax.eval_shape(self.tx.init, state["params"])
        specs = self._specs({"opt": shapes})["opt"]
        state["opt"] = jax.tree.map(lambda a, spec: layout.zeros(a.shape, a.dtype, spec),
                                    shapes, specs)
        stats = variables.get("batch_stats", {})
        state["batch_stats"] = layout.per_rank(
            lambda r: jax.tree.map(lambda x: np.asarray(x)[None], stats))
        if self.fp16:
            state["scaler"] = layout.replicated({"scale": jnp.float32(LOSS_SCALE_INIT),
                                                 "clean": jnp.int32(0)})
        frozen = layout.replicated(variables.get("frozen", {}))
        return state, frozen

    def _check_state_dtype(self) -> None:
        """A float64 run's state (weights, statistics, momentum, fixed gamma) must hold no
        narrower float: one would silently round every update it takes part in."""
        if self.dtype != jnp.float64:
            return
        leaves = jax.tree_util.tree_leaves_with_path({"state": self.state,
                                                      "frozen": self.frozen})
        narrow = [jax.tree_util.keystr(path) for path, leaf in leaves
                  if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != jnp.float64]
        if narrow:
            raise RuntimeError(f"a float64 step holds narrower floats: {', '.join(narrow[:4])}")

    def _specs(self, state: dict) -> dict:
        """The PartitionSpec of every state leaf (see the module docstring)."""
        def spec(path, _):
            if _under(path, "batch_stats"):
                return P(AXIS)
            if _under(path, "head") and self.sharded:
                return P(AXIS)
            return P()
        return jax.tree_util.tree_map_with_path(spec, state)

    # -------------------------------------------------------------------------- body

    def _shard_mapped(self):
        wl, head, model = self.workload, self.head, self.model
        sharded, sparse, fp16 = self.sharded, self.sparse, self.fp16
        tx, expose, record, dtype = self.tx, self.expose_grads, self.record, self.dtype
        base_key = jax.random.key(wl.seed, impl=RNG_IMPL)

        def body(state: dict, frozen: dict, images: jax.Array, labels: jax.Array):
            step = state["step"]
            rank = jax.lax.axis_index(AXIS)
            key = jax.random.fold_in(jax.random.fold_in(base_key, step), rank)
            dropout_key, sample_key = jax.random.split(key)
            stats = jax.tree.map(lambda x: x[0], state["batch_stats"])
            scale = state["scaler"]["scale"] if fp16 else None

            selection = head.select(labels, sample_key) if head is not None else None
            params = state["params"]
            # Per-rank copies: autodiff then gives each rank its own partial gradient, and the
            # reduction below is the explicit one torch's DDP does.
            trainable = {"backbone": jax.lax.pcast(params["backbone"], AXIS, to="varying")}
            if "head" in params:
                trainable["head"] = (params["head"] if sharded else
                                     jax.lax.pcast(params["head"], AXIS, to="varying"))
            if sparse:
                rows = state["head"]["weight"][selection.index]
                trainable["rows"] = rows

            def loss_fn(tr: dict):
                # Read when traced, so that a mode set after construction still applies.
                with models.bn_moments(self.bn_moments):
                    out, updates = model.apply(
                        {"params": tr["backbone"], "frozen": frozen, "batch_stats": stats},
                        images, rngs={"dropout": dropout_key}, mutable=["batch_stats"])
                if head is None:
                    logits = models.at_least_fp32(out)
                    picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
                    loss = jnp.mean(jax.nn.logsumexp(logits, axis=1) - picked)
                else:
                    if sparse:
                        class_rows = tr["rows"]
                    elif selection.index is not None:     # pfc, dense update
                        class_rows = tr["head"][selection.index]
                    else:
                        class_rows = tr["head"]
                    loss = head.loss(out, selection, class_rows)
                objective = loss * scale if fp16 else loss
                return objective, (loss, updates["batch_stats"])

            (_, (loss, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)

            # mp / pfc: every rank holds a partial of the one global loss (summed); dp: means.
            reduce_backbone = jax.lax.psum if sharded else jax.lax.pmean
            grads = dict(grads)
            # dp's class matrix is averaged as the backbone is: one reduction for both.
            reduced = {k: grads[k] for k in ("backbone", "head")
                       if k == "backbone" or (k in grads and not sharded)}
            if self.flat_reduce:
                grads.update(_reduce_flat(reduced, reduce_backbone))
            else:
                grads.update(reduce_backbone(reduced, AXIS))

            finite = None
            if fp16:
                local_bad = 1.0 - _all_finite(grads).astype(jnp.float32)
                finite = jax.lax.psum(local_bad, AXIS) == 0.0
                grads = jax.tree.map(lambda g: g * (1.0 / scale), grads)
            exposed = dict(grads) if expose else None

            norm = None
            if wl.clip_grad_norm is not None or record:
                norm = _global_norm(grads["backbone"])
            if wl.clip_grad_norm is not None:
                coef = jnp.minimum(wl.clip_grad_norm / (norm + CLIP_EPS), 1.0)
                grads["backbone"] = jax.tree.map(lambda g: g * coef, grads["backbone"])

            lr = _lr_at(wl, step, dtype)
            dense_grads = {k: v for k, v in grads.items() if k != "rows"}
            new_params, opt = _sgd(tx, dense_grads, state["opt"], params, lr)
            new_state = dict(state)
            new_state["step"] = step + 1
            new_state["batch_stats"] = jax.tree.map(lambda x: x[None], new_stats)
            if sparse:
                new_state["head"] = _sgd_rows(tx, state["opt"][0], state["head"], selection,
                                              rows, grads["rows"], lr)
            if fp16:
                # A skipped step keeps every weight and momentum; BatchNorm's running
                # statistics still move, as torch's forward moved them.
                def keep_old(new, old):
                    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
                new_params = keep_old(new_params, params)
                opt = keep_old(opt, state["opt"])
                if sparse:
                    new_state["head"] = keep_old(new_state["head"], state["head"])
                new_state["scaler"] = _next_scaler(state["scaler"], finite)
            new_state["params"] = new_params
            new_state["opt"] = opt
            skipped = jnp.logical_not(finite) if fp16 else jnp.bool_(False)
            loss_out = jax.lax.pcast(loss, AXIS, to="varying") if sharded else loss
            recorded = {"lr": lr, "grad_norm": norm} if record else None
            return new_state, loss_out[None], skipped, exposed, recorded

        specs = self.state_specs
        grad_specs = None
        if expose:
            grad_specs = {"backbone": P()}
            if self.head is not None and not sparse:
                grad_specs["head"] = P(AXIS) if sharded else P()
            if sparse:
                grad_specs["rows"] = P(AXIS)
        record_specs = {"lr": P(), "grad_norm": P()} if record else None
        return jax.shard_map(body, mesh=self.layout.mesh,
                             in_specs=(specs, P(), P(AXIS), P(AXIS)),
                             out_specs=(specs, P(AXIS), P(), grad_specs, record_specs))

    # ---------------------------------------------------------------------- running

    @property
    def grad_reduce(self) -> str:
        """How the gradients are reduced over ranks, for the start event's settings."""
        if self.world == 1:
            return "none (one rank)"
        if self.flat_reduce:
            return "one flat buffer per dtype (cross-process CPU collectives)"
        return "XLA's combined all-reduce of the gradient tuple"

    @property
    def pfc_update(self) -> str | None:
        return None if self.head is None else self.head.update

    def compile(self, images: jax.Array, labels: jax.Array,
                options: dict[str, Any] | None = None) -> None:
        """Lower and compile the step for these batch shapes (ahead of the first call), with
        XLA's compile ``options`` (``tuning.compiler_options``); a float64 step's program is
        checked first (:meth:`check_program`). Adds the seconds of
        the lowering (tracing to a jaxpr, then to StableHLO) and of XLA's compile to
        ``compile_s``, and one to ``compiles``."""
        began = time.perf_counter()
        lowered = self._jitted.lower(self.state, self.frozen, images, labels)
        lowered_s = time.perf_counter() - began
        if self.dtype == jnp.float64:
            self.check_program(lowered.as_text())
        began = time.perf_counter()
        self._compiled = lowered.compile(compiler_options=options)
        self.compile_s += lowered_s + time.perf_counter() - began
        self.compiles += 1

    @staticmethod
    def check_program(text: str) -> None:
        """A float64 step's lowered program must compute no narrower float anywhere (a cast
        to float32 in a layer, a float32 constant that demotes, a kernel that only takes
        float32): RuntimeError naming what it found."""
        found = sorted(set(NARROW_FLOATS.findall(text)))
        if found:
            lines = [line.strip() for line in text.splitlines() if NARROW_FLOATS.search(line)]
            raise RuntimeError(f"a float64 step computes in {', '.join(found)}: "
                               + " | ".join(lines[:3])[:600])

    def cost_flops(self) -> float | None:
        """XLA's own count of the compiled step's floating-point operations per device, when
        the backend reports one."""
        if self._compiled is None:
            return None
        try:
            cost = self._compiled.cost_analysis()
        except Exception:  # noqa: BLE001 - optional on some backends
            return None
        if isinstance(cost, (list, tuple)):
            cost = cost[0] if cost else None
        flops = (cost or {}).get("flops")
        return float(flops) if flops and flops > 0 else None

    def __call__(self, images: jax.Array, labels: jax.Array) -> jax.Array:
        fn = self._compiled if self._compiled is not None else self._jitted
        self.state, loss, skipped, grads, recorded = fn(self.state, self.frozen, images, labels)
        if self.fp16:
            self.skipped.append(skipped)
        if self.expose_grads:
            self.last_grads = grads
        if self.record:
            self.last_record = recorded
        self._last_loss = loss
        return loss

    @property
    def markers(self) -> list[jax.Array]:
        """The last step's loss: an output of the same executable as the updated state, so it
        is ready when the update has run (PjRt marks an execution's outputs ready together).
        Not the state itself: its buffers are donated to the next step as soon as it is
        dispatched."""
        return [self._last_loss]

    def skipped_steps(self) -> list[int]:
        """0-based indices of the steps fp16 loss scaling skipped (reads the device: call
        after the measured window)."""
        return [i for i, flag in enumerate(self.skipped) if bool(np.asarray(
            flag.addressable_shards[0].data))]

    def loss_scale(self) -> float | None:
        """The current fp16 loss scale (a read-back: after the window)."""
        if not self.fp16:
            return None
        return float(np.asarray(self.state["scaler"]["scale"].addressable_shards[0].data))
