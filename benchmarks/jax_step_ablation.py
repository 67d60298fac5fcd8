"""Where trainperf's JAX step loses time against flax's own step (issue 26): variants of
trainperf's ``TrainStep`` and the flax reference (``benchmarks/native/jax_native.py``), each
compiled once in one process and then timed in rounds, the order of the variants rotating from
round to round, so that every variant sees the same device, clocks and allocator.

A variant changes one module constant of trainperf's JAX backend before its step is traced:

- ``two_pass`` / ``one_pass`` / ``shifted`` / ``running_shift``: BatchNorm's batch moments
  (``trainperf.backends.jax.models.BN_MOMENTS_CHOICES`` says what each computes; trainperf
  runs ``BN_MOMENTS_BY_DEVICE``'s for the device);
- ``threefry``: JAX's default generator instead of ``rbg`` (``step.RNG_IMPL``), with the
  device's BatchNorm moments;
- ``native``: the flax reference itself.

Run it with JAX's Python (``$TRAINPERF_JAX_PYTHON`` or trainperf's JAX environment):

    python benchmarks/jax_step_ablation.py --case rn50 --batch 128 --device cuda \\
        --precision fp32 --variants native,two_pass,shifted --rounds 5 --iters 30 --out DIR

Writes ``ablation-<case>-<precision>.json`` and ``.md`` to ``--out``: every round's samples/s,
the median and spread of each variant, and its ratio to ``native`` where that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE / "native"), str(HERE.parent / "src")]

import jax_native  # noqa: E402  (benchmarks/native: stdlib until build() imports JAX)
import native_cli  # noqa: E402

BN_VARIANTS = ("two_pass", "one_pass", "shifted", "running_shift")
VARIANTS = ("native", *BN_VARIANTS, "threefry")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = native_cli.parser("jax_step_ablation", __doc__)
    p.add_argument("--variants", default="native,two_pass,shifted",
                   help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=5, help="timed windows per variant")
    p.add_argument("--out", type=Path, help="folder for the JSON and markdown record")
    a = native_cli.parse(p, argv)
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(a.variants) - set(VARIANTS))
    if unknown or not a.variants:
        p.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(VARIANTS)}")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    if a.precision == "fp16":
        p.error("--precision fp16: the flax reference trains in bf16 or fp32 only")
    return a


def trainperf_runner(a: argparse.Namespace, variant: str):
    """A compiled trainperf step with the variant's constants: (run(n) -> last loss,
    compile seconds)."""
    import jax

    from trainperf.backends.jax import step
    from trainperf.backends.jax.dist import local_mesh
    from trainperf.parity import row_workload

    workload = row_workload(a.case, a.batch, a.precision, input_size=a.input_size,
                            classes=a.classes)
    saved = step.RNG_IMPL
    try:
        if variant == "threefry":
            step.RNG_IMPL = "threefry2x32"
        layout = local_mesh(1)
        train_step = step.TrainStep(workload, layout)
        if variant in BN_VARIANTS:
            train_step.bn_moments = variant
        images, labels = layout.per_rank(lambda r: step.synthetic_batch(workload, r))
        t0 = time.perf_counter()
        train_step.compile(images, labels)
        compile_s = time.perf_counter() - t0
    finally:
        step.RNG_IMPL = saved

    def run(n: int):
        loss = None
        for _ in range(n):
            loss = train_step(images, labels)
        return jax.block_until_ready(loss)
    return run, compile_s


def native_runner(a: argparse.Namespace):
    import jax

    ref = jax_native.build(a)
    t0 = time.perf_counter()
    ref.step = ref.step.lower(ref.state, ref.images, ref.labels, ref.keys[0]).compile()
    compile_s = time.perf_counter() - t0
    count = [0]

    def run(n: int):
        loss = None
        for _ in range(n):
            key = ref.keys[count[0] % len(ref.keys)]
            ref.state, loss = ref.step(ref.state, ref.images, ref.labels, key)
            count[0] += 1
        return jax.block_until_ready(loss)
    return run, compile_s


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    jax_native.configure(a)
    import jax

    runners, compile_s = {}, {}
    for variant in a.variants:
        try:
            runners[variant], compile_s[variant] = (
                native_runner(a) if variant == "native" else trainperf_runner(a, variant))
            runners[variant](max(a.warmup, 1))
        except Exception as err:  # noqa: BLE001 - one variant's failure leaves the others
            print(f"jax_step_ablation: {variant}: {' '.join(str(err).split())[:300]}",
                  file=sys.stderr)
    if not runners:
        return 1
    rates: dict[str, list[float]] = {v: [] for v in runners}
    order = list(runners)
    for r in range(a.rounds):
        for variant in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            loss = runners[variant](a.iters)
            window = time.perf_counter() - t0
            if not bool(jax.numpy.isfinite(loss).all()):
                print(f"jax_step_ablation: {variant}: the loss is not finite", file=sys.stderr)
            rates[variant].append(a.batch * a.iters / window)
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(
            f"{v} {rates[v][-1]:.4g}" for v in order), flush=True)

    native = statistics.median(rates["native"]) if "native" in rates else None
    rows = []
    for variant in order:
        med = statistics.median(rates[variant])
        rows.append({"variant": variant, "median_samples_per_s": med,
                     "min": min(rates[variant]), "max": max(rates[variant]),
                     "rounds": rates[variant], "compile_s": compile_s[variant],
                     "vs_native": med / native if native else None})
    doc = {"case": a.case, "batch": a.batch, "precision": a.precision, "device": a.device,
           "device_kind": jax.devices()[0].device_kind, "input_size": native_cli.shape(a)[0],
           "iters": a.iters, "warmup": a.warmup, "rounds": a.rounds,
           "versions": {"jax": jax.__version__, "python": platform.python_version()},
           "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}
    lines = [f"# trainperf's JAX step against flax's: {a.case}, batch {a.batch}, {a.precision}, "
             f"{doc['device_kind']}", "",
             f"{a.rounds} rounds of {a.iters} steps per variant, rotating order; JAX "
             f"{jax.__version__}.", "",
             "| variant | median samples/s | min-max | vs native | compile s |",
             "|---|---|---|---|---|"]
    for row in rows:
        ratio = f"{row['vs_native']:.3f}" if row["vs_native"] else "-"
        lines.append(f"| {row['variant']} | {row['median_samples_per_s']:.5g} | "
                     f"{row['min']:.5g}-{row['max']:.5g} | {ratio} | {row['compile_s']:.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = a.out / f"ablation-{a.case}-{a.precision}"
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        stem.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
