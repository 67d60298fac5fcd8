"""What every native reference shares: the command line that benchmarks/native_parity.py drives,
its one-line errors, the two cases' shapes and the result line it reads back.

Standard library only: each reference imports it beside its own framework, in that framework's
environment (run as a script, a reference has this folder first on its import path).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import NoReturn

FACE_CLASSES = 85742
CASES = {"rn50": (224, 1000), "face": (112, FACE_CLASSES)}
"""Input side and default classes: ResNet50 v1b on ImageNet, IResNet-50 ArcFace on face_emore."""


def fail(name: str, message: str) -> NoReturn:
    """A bad input: one line on stderr, exit code 2."""
    print(f"{name}: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The options every reference takes; a reference adds its own before ``parse``."""
    p = _Parser(prog=name, description=(doc or "").split("\n\n")[0])
    p.add_argument("--case", choices=tuple(CASES), required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--threads", type=int, default=0,
                   help="intra-op threads on CPU (0: the framework's default)")
    p.add_argument("--iters", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="steps before the window")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--mode", default="",
                   help="the framework's execution mode, in trainperf's names for it "
                        "(torch: eager, compile; oneflow: eager, graph; paddle: dygraph, "
                        "static; mxnet: imperative, hybrid; tf: function, xla; jax: jit); "
                        "empty: the reference's usual one")
    p.add_argument("--classes", type=int, help="classes (default: the case's)")
    p.add_argument("--input-size", type=int,
                   help="input side, rn50 only (default 224; face is 112, its output block's)")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    a = p.parse_args(argv)
    if a.batch < 1 or a.iters < 1 or a.warmup < 0 or a.threads < 0:
        p.error("--batch and --iters must be >= 1, --warmup and --threads >= 0")
    if a.classes is not None and a.classes < 2:
        p.error("--classes must be >= 2")
    if a.input_size is not None and (a.input_size < 32 if a.case == "rn50"
                                     else a.input_size != CASES[a.case][0]):
        p.error(f"--input-size {a.input_size}: rn50 takes 32 or more, face only 112")
    return a


def shape(a: argparse.Namespace) -> tuple[int, int]:
    """The case's input side and number of classes."""
    side, classes = CASES[a.case]
    return a.input_size or side, a.classes or classes


def report(framework: str, a: argparse.Namespace, window_s: float, **fields) -> None:
    """The result line, last on stdout: the window's rate, the run's shape and ``fields``
    (threads, settings, versions, params, loss_first, loss_last). A loss that is not finite
    gives no figure: one line on stderr and exit code 1."""
    last = fields.get("loss_last")
    if last is not None and not math.isfinite(last):
        print(f"native {framework}: the loss is {last}", file=sys.stderr)
        raise SystemExit(1)
    doc = {"framework": framework, "case": a.case,
           "samples_per_s": a.batch * a.iters / window_s, "window_s": window_s,
           "iters": a.iters, "warmup": a.warmup, "batch": a.batch, "threads": a.threads,
           "input_size": shape(a)[0], "device": a.device, "precision": a.precision, **fields}
    sys.stdout.flush()
    print(json.dumps(doc), flush=True)
