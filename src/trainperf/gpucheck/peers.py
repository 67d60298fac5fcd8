"""Peers (part 4), in the same check, where they are installed.

- timm's ResNet50 (a ResNet-B, the v1b layout: stride on the 3x3), one training step timed as
  trainperf times its own: the same batch, precision, memory format, SGD settings and window
  rule (warm-up outside, the device synchronised only at the window's edges). Not timm's
  benchmark script: the ratio is then between the two models' steps and nothing else.
- trainperf's JAX worker on the same device for R100 ``mp`` and ResNet50, in the Python that
  runs this check when it holds JAX (``TRAINPERF_JAX_PYTHON``), else in trainperf's own JAX
  environment when one was built.

The trainperf figures the ratios divide by come from the case stages (4 and 5) of this check,
or of earlier parts on the same machine.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from .. import envs
from ..config import Measure
from ..recipes import get_recipe
from . import cases
from .record import StageLog
from .runs import plan_for, run_plan, summarise

TIMM_CASES = {"gpu": [("RN50 v1b fp32", "fp32", False, 128, 224),
                      ("RN50 v1b bf16", "bf16", False, 128, 224)],
              "cpu": [("RN50 v1b fp32", "fp32", False, 2, 32),
                      ("RN50 v1b bf16", "bf16", False, 2, 32)]}
TIMM_STEPS = {"gpu": (40, 10), "cpu": (4, 1)}
JAX_CASES = [cases.Case("R100 emore mp fp32", "r100-arcface-emore", {"fc": "mp"}),
             cases.Case("RN50 v1b fp32", "rn50-v1b-imagenet", {"precision": "fp32"})]
JAX_MEASURE = {"gpu": Measure(runs=1, iters=40, warmup=10, timeout_s=150),
               "cpu": cases.CPU_MEASURE}
"""One run each: JAX compiles its step before the loop, which a borrowed machine pays once."""


def missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def timm_step_rate(mode: str, precision: str, channels_last: bool, batch: int, side: int
                   ) -> dict:
    """Samples/s of timm's resnet50 training step under trainperf's window rule."""
    import timm
    import torch
    import torch.nn.functional as F

    from ..backends.torch.timing import make_timer, timed_loop

    device = torch.device(cases.device(mode))
    torch.backends.cudnn.benchmark = True  # trainperf's default on a GPU
    torch.manual_seed(0)
    recipe = get_recipe("rn50-v1b-imagenet").workload
    model = timm.create_model("resnet50", num_classes=recipe.num_classes).to(device)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt).train()
    opt = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=recipe.momentum,
                          weight_decay=recipe.weight_decay)
    gen = torch.Generator(device=device).manual_seed(1)
    images = torch.randn(batch, 3, side, side, device=device, generator=gen).contiguous(
        memory_format=fmt)
    labels = torch.randint(0, recipe.num_classes, (batch,), device=device, generator=gen)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(images).float(), labels)
        loss.backward()
        opt.step()
        return loss.detach()

    iters, warmup = TIMM_STEPS[mode]
    # trainperf's own measured loop: warm-up outside the window, the device synchronised at
    # its edges only.
    seconds, _ = timed_loop(step, iters, warmup, make_timer(device))
    return {"samples_per_s": batch * (iters - warmup) / seconds, "window_s": seconds,
            "timm_version": timm.__version__}


def run_timm(log: StageLog, mode: str) -> None:
    gone = missing("timm")
    if gone:
        log.not_run("timm ResNet50 step", "timm is not installed in this Python")
        return
    for label, precision, channels_last, batch, side in TIMM_CASES[mode]:
        got = timm_step_rate(mode, precision, channels_last, batch, side)
        if mode == "gpu":
            import torch

            torch.cuda.empty_cache()  # the JAX worker that follows takes most of the device
        log.add("peer", peer="timm", label=label, batch_size=batch, input_size=side,
                precision=precision, channels_last=channels_last, **got)
        print(f"timm {label}: {got['samples_per_s']:.1f} samples/s", flush=True)


def jax_interpreter(mode: str) -> tuple[str | None, str]:
    """The Python that runs the JAX worker in the check's ``mode`` (a CUDA build for the GPU
    mode), and where it came from."""
    if not missing("jax", "flax", "optax"):
        os.environ[envs.python_override_var("jax")] = sys.executable
        return sys.executable, "this Python"
    try:
        return envs.interpreter("jax", cases.device(mode)), "trainperf's JAX environment"
    except ValueError as exc:
        return None, str(exc)


def run_jax(log: StageLog, mode: str, work: Path) -> None:
    python, where = jax_interpreter(mode)
    if python is None:
        for case in JAX_CASES:
            log.not_run(f"JAX worker: {case.label}", f"no JAX here ({where})")
        return
    for case in JAX_CASES if mode == "gpu" else [cases.tiny(c) for c in JAX_CASES]:
        plan = plan_for(case, work, JAX_MEASURE[mode], cases.device(mode), framework="jax",
                        folder=f"jax-{case.name}")
        got = summarise(run_plan(plan), plan.out_dir)
        log.add("peer", peer="jax", label=case.label, interpreter=where, **got)
        rate = got.get("median_samples_per_s")
        print(f"jax {case.label}: {f'{rate:.1f} samples/s' if rate else got['status']}",
              flush=True)


def run(log: StageLog, mode: str, work: Path) -> None:
    run_timm(log, mode)
    run_jax(log, mode, work)

