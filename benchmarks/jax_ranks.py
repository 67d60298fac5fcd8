"""JAX on 1 and 2 CPU ranks of one machine (issue 43: 2 ranks ran at a fraction of 1 rank's
samples/s, while torch's 2 ranks ran faster than its 1).

Three parts, each interleaved over ``--rounds`` (every round runs every variant once, in turn):

- ``reduce``: the tiny-arcface backbone's gradient shapes summed across two processes over
  gloo (JAX's CPU collectives), as XLA's combined tuple all-reduce (one collective, which gloo
  runs one element after another) and as one flat buffer (what trainperf's step does now);
  milliseconds and CPU milliseconds per call, voluntary context switches per call.
- ``step``: the tiny-arcface ``pfc`` step (trainperf's own ``TrainStep``), timed in processes
  of its own, one step at a time: 1 rank on all the cores; 2 ranks as before the fix (the tuple
  reduction, XLA's pools over all the cores in each rank, gloo's socket buffers as its first
  small reduce-scatter leaves them); 2 ranks as trainperf runs them now (one flat buffer, pools
  of the rank's share, gloo's buffers sized first: ``dist.widen_gloo_send_buffers``); the fix
  with each of its three parts taken back in turn; and the fix with each rank pinned to its own
  cores (``os.sched_setaffinity``). Samples/s summed over ranks, CPU milliseconds per sample,
  cores kept busy, context switches per step, and XLA's pool threads counted in each rank.
- ``cli``: ``trainperf run tiny-arcface --framework jax --fc pfc --devices 1,2 --runs 1
  --iters 20 --warmup 5 --device cpu``, the shipped worker, once per round.

    python benchmarks/jax_ranks.py --rounds 2 --out benchmarks/results/jax-ranks-2026-11-28

Writes ``jax_ranks.json`` (every round's figures) and ``jax_ranks.md`` (medians, the ratio of
2 ranks to 1) to ``--out``. Uses trainperf's JAX environment; a few minutes on a quiet 2-core
machine. Timings taken while other work shares the cores compare only within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from trainperf.backends import ports  # noqa: E402
from trainperf.envs import interpreter  # noqa: E402

SINGLE_THREAD_FLAG = "--xla_cpu_multi_thread_eigen=false"
PROGRAM_TIMEOUT_S = 600

RANK_PROGRAM = r"""
import json, os, resource, sys, time
cfg = json.loads(sys.argv[1])
if cfg["cores"]:
    os.sched_setaffinity(0, cfg["cores"])
import jax, jax.numpy as jnp, numpy as np
if cfg["nproc"] > 1:
    jax.distributed.initialize(f"127.0.0.1:{cfg['port']}", cfg["nproc"], cfg["rank"])
from trainperf.recipes import get_recipe
from trainperf.backends.jax import dist
from trainperf.backends.jax.step import TrainStep, _reduce_flat, synthetic_batch
from trainperf.backends.jax.worker import pool_threads

workload = get_recipe("tiny-arcface").workload.replace(fc="pfc", sample_ratio=0.1,
                                                       pfc_update="sparse")
if not cfg["widen"]:
    dist.widen_gloo_send_buffers = lambda layout, nbytes=0: None   # as before the fix
layout = dist.layout_from_env(cfg["nproc"] > 1)
step = TrainStep(workload, layout)

def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_nvcsw

if cfg["part"] == "step":
    step.flat_reduce = cfg["flat"]           # read when the step is traced
    images, labels = layout.per_rank(lambda r: synthetic_batch(workload, r))
    step.compile(images, labels)
    run = lambda: step(images, labels)
else:
    # The backbone's gradients: its parameters' shapes, one block per rank.
    from jax.sharding import PartitionSpec as P
    leaves = jax.tree.leaves(step.state["params"]["backbone"])
    grads = layout.per_rank(lambda r: [jnp.ones((1, *x.shape), x.dtype) for x in leaves])
    def body(xs):
        xs = [x[0] for x in xs]
        out = (_reduce_flat(xs, jax.lax.psum) if cfg["flat"] else
               jax.lax.psum(xs, dist.AXIS))
        return [x[None] for x in out]
    summed = jax.jit(jax.shard_map(body, mesh=layout.mesh, in_specs=P(dist.AXIS),
                                   out_specs=P(dist.AXIS)))
    run = lambda: summed(grads)

for _ in range(cfg["warmup"]):
    jax.block_until_ready(run())
layout.barrier("start")
cpu0, switches0 = usage()
start = time.perf_counter()
for _ in range(cfg["steps"]):
    jax.block_until_ready(run())
wall = time.perf_counter() - start
cpu1, switches1 = usage()
layout.barrier("end")
print(json.dumps({"rank": cfg["rank"], "wall_s": wall, "cpu_s": cpu1 - cpu0,
                  "switches": switches1 - switches0, "pool_threads": pool_threads(),
                  "arrays": len(jax.tree.leaves(step.state["params"]["backbone"]))}))
sys.stdout.flush()
if cfg["nproc"] > 1:
    jax.distributed.shutdown()
os._exit(0)
"""


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def step_variants() -> dict[str, dict]:
    """Name -> (ranks, flat reduction, XLA pool size or None for XLA's default, gloo's send
    buffers sized first, pinned to the rank's own cores)."""
    n = len(cores())
    share = max(1, n // 2)
    now = dict(nproc=2, flat=True, pool=share, widen=True, pin=False)
    return {
        "1 rank": dict(nproc=1, flat=False, pool=n, widen=False, pin=False),
        "2 ranks, before (tuple reduction, default pools, gloo's buffers as they come)":
            dict(nproc=2, flat=False, pool=None, widen=False, pin=False),
        "2 ranks, now (flat reduction, pools of the share, gloo's buffers sized first)": now,
        "2 ranks, now but gloo's buffers as they come": {**now, "widen": False},
        "2 ranks, now but the tuple reduction": {**now, "flat": False},
        "2 ranks, now but XLA's default pools": {**now, "pool": None},
        "2 ranks, now, pinned to its cores": {**now, "pin": True},
    }


def launch(python: str, part: str, variant: dict, steps: int, warmup: int) -> dict:
    """One variant's processes; their figures summed (samples/s) or averaged over ranks."""
    nproc = variant["nproc"]
    all_cores = cores()
    share = max(1, len(all_cores) // nproc)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}
    for name in ("PJRT_NPROC", "NPROC", "XLA_FLAGS"):
        env.pop(name, None)
    if variant["pool"]:
        env["PJRT_NPROC"] = str(variant["pool"])
    # As the worker did before and does now: one thread per rank keeps Eigen on the caller.
    if share == 1:
        env["XLA_FLAGS"] = SINGLE_THREAD_FLAG
    held = ports.reserve(1)
    procs = []
    with held:
        for rank in range(nproc):
            pinned = all_cores[rank * share:(rank + 1) * share] if variant["pin"] else None
            cfg = {"part": part, "nproc": nproc, "rank": rank, "port": held.ports[0],
                   "flat": variant["flat"], "widen": variant["widen"], "cores": pinned,
                   "steps": steps, "warmup": warmup}
            procs.append(subprocess.Popen([python, "-c", RANK_PROGRAM, json.dumps(cfg)],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=PROGRAM_TIMEOUT_S) for p in procs]
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"a rank exited {p.returncode}: {err[-2000:]}")
    ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    per_call = steps * nproc
    result = {"ranks": nproc, "wall_s": max(r["wall_s"] for r in ranks),
              "cpu_ms_per_call": 1000 * sum(r["cpu_s"] for r in ranks) / per_call,
              "switches_per_call": sum(r["switches"] for r in ranks) / per_call,
              "pool_threads": [r["pool_threads"] for r in ranks], "arrays": ranks[0]["arrays"],
              "ms_per_call": 1000 * max(r["wall_s"] for r in ranks) / steps}
    result["cores_busy"] = sum(r["cpu_s"] for r in ranks) / result["wall_s"]
    if part == "step":
        batch = 8
        result["samples_per_s"] = batch * nproc * steps / result["wall_s"]
        result["cpu_ms_per_sample"] = result["cpu_ms_per_call"] / batch
    return result


def cli_round(scratch: Path) -> dict:
    out = scratch / f"cli-{time.time_ns()}"
    cmd = [sys.executable, "-m", "trainperf.cli", "run", "tiny-arcface", "--framework", "jax",
           "--fc", "pfc", "--devices", "1,2", "--runs", "1", "--iters", "20", "--warmup", "5",
           "--device", "cpu", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "XLA_FLAGS")}
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True,
                   timeout=PROGRAM_TIMEOUT_S)
    doc = json.loads((out / "results.json").read_text())
    figures = {str(c["world_size"]): c["runs"][0]["samples_per_s"] for c in doc["cases"]}
    starts = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    envs = {str(e["world_size"]): e["env"] for e in starts if e.get("event") == "start"}
    return {"samples_per_s": figures,
            "threads": {w: {k: e.get(k) for k in ("threads", "pjrt_nproc", "eigen_kernels",
                                                  "threads_per_rank", "cpu_collectives")}
                        for w, e in envs.items()}}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


CAUSES = """\
What the parts show (issue 43):

- gloo runs XLA's combined all-reduce of the gradient tuple one element after another, a round
  trip each; one flat buffer is one collective (`step._reduce_flat`).
- gloo sizes a socket's send buffer to the first message its reduce-scatter sends, and the
  kernel then stops sizing it: pfc's and mp's first reduce-scatter is 2 KB, the buffer stays at
  4.6 KB, and every large send afterwards waits for the peer's delayed acknowledgement (about
  40 ms each time the buffer fills). The worker sizes the buffers first with one 1 MB
  reduce-scatter (`dist.widen_gloo_send_buffers`).
- Threads: each rank's XLA pools take its share of the cores (`PJRT_NPROC`, and with one thread
  Eigen's kernels on the calling thread), recorded per rank in the start event's env.
"""


def summary(record: dict) -> str:
    lines = [f"# JAX on 1 and 2 CPU ranks ({record['date']})", "",
             f"{record['machine']}, {record['cores']} cores; jax {record['jax']}; "
             f"{record['rounds']} interleaved rounds; load average at the start "
             f"{record['load_start']:.2f}, at the end {record['load_end']:.2f} (above 0 means "
             f"other work shared the cores: compare within a round).", "", CAUSES,
             "## The gradient reduction across two processes (gloo)", "",
             "| reduction | arrays | ms per call | CPU ms per call (both ranks) "
             "| context switches per call |", "|---|---|---|---|---|"]
    for name, rows in record["reduce"].items():
        lines.append(f"| {name} | {rows[0]['arrays']} | "
                     f"{median([r['ms_per_call'] for r in rows]):.2f} | "
                     f"{median([r['cpu_ms_per_call'] for r in rows]):.2f} | "
                     f"{median([r['switches_per_call'] for r in rows]):.0f} |")
    one = median([r["samples_per_s"] for r in record["step"]["1 rank"]])
    lines += ["", "## The tiny-arcface pfc step (trainperf's TrainStep, one step at a time)", "",
              "| variant | samples/s (median) | x 1 rank | CPU ms per sample "
              "| cores busy (CPU s / wall s) | context switches per step "
              "| XLA pool threads per rank |", "|---|---|---|---|---|---|---|"]
    for name, rows in record["step"].items():
        sps = median([r["samples_per_s"] for r in rows])
        lines.append(f"| {name} | {sps:.1f} | {sps / one:.2f} | "
                     f"{median([r['cpu_ms_per_sample'] for r in rows]):.2f} | "
                     f"{median([r['cores_busy'] for r in rows]):.2f} | "
                     f"{median([r['switches_per_call'] for r in rows]):.0f} | "
                     f"{rows[0]['pool_threads']} |")
    cli = record["cli"]
    if cli:
        ones = [r["samples_per_s"]["1"] for r in cli]
        twos = [r["samples_per_s"]["2"] for r in cli]
        lines += ["", "## The shipped worker: `trainperf run tiny-arcface --framework jax --fc pfc "
                  "--devices 1,2 --runs 1 --iters 20 --warmup 5 --device cpu`", "",
                  "| round | 1 rank samples/s | 2 ranks samples/s | 2 / 1 |", "|---|---|---|---|"]
        for i, (a, b) in enumerate(zip(ones, twos), 1):
            lines.append(f"| {i} | {a:.1f} | {b:.1f} | {b / a:.2f} |")
        lines += ["", f"2 ranks' threads as recorded: `{json.dumps(cli[-1]['threads']['2'])}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="timed steps per step variant")
    p.add_argument("--calls", type=int, default=30, help="timed calls per reduction variant")
    p.add_argument("--no-cli", action="store_true", help="skip the trainperf run part")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    python = os.environ.get("TRAINPERF_JAX_PYTHON") or interpreter("jax")
    a.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="jax_ranks_"))
    version = subprocess.run([python, "-c", "import jax; print(jax.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor()
              or platform.machine(), "cores": len(cores()), "jax": version,
              "rounds": a.rounds, "load_start": os.getloadavg()[0],
              "reduce": {}, "step": {}, "cli": []}
    reductions = {"tuple (XLA's combined all-reduce)": dict(nproc=2, flat=False, pool=None,
                                                            widen=False, pin=False),
                  "one flat buffer": dict(nproc=2, flat=True, pool=None, widen=False,
                                          pin=False)}
    for i in range(a.rounds):
        for name, variant in reductions.items():
            row = launch(python, "reduce", variant, a.calls, 5)
            record["reduce"].setdefault(name, []).append(row)
            print(f"round {i + 1} reduce {name}: {row['ms_per_call']:.2f} ms", flush=True)
        for name, variant in step_variants().items():
            row = launch(python, "step", variant, a.steps, 5)
            record["step"].setdefault(name, []).append(row)
            print(f"round {i + 1} step {name}: {row['samples_per_s']:.1f} samples/s", flush=True)
        if not a.no_cli:
            row = cli_round(scratch)
            record["cli"].append(row)
            print(f"round {i + 1} cli: {row['samples_per_s']}", flush=True)
    record["load_end"] = os.getloadavg()[0]
    shutil.rmtree(scratch, ignore_errors=True)
    (a.out / "jax_ranks.json").write_text(json.dumps(record, indent=1) + "\n")
    (a.out / "jax_ranks.md").write_text(summary(record))
    print(summary(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
