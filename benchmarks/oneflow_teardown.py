"""How often OneFlow aborts a rank at the end of a 2-rank run, with and without trainperf's
departure handshake (``trainperf.backends.oneflow.rendezvous``).

Each round starts two ranks of a bare program: join the group (OneFlow's import), one eager
operation, ``flow.comm.barrier()``, then leave with ``os._exit`` as trainperf's worker does.
``bare`` leaves straight after the barrier; ``departure`` first has rank 0 wait until the other
rank says it is past the barrier. A round fails where a rank exits non-zero; the record keeps
each failure's first OneFlow check line.

    python benchmarks/oneflow_teardown.py --rounds 20 --out benchmarks/results/oneflow-teardown

Uses trainperf's OneFlow environment (made by ``trainperf env create oneflow``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))

from trainperf.backends import ports  # noqa: E402
from trainperf.backends.oneflow.backend import PORT_VARIABLE, library_path  # noqa: E402
from trainperf.envs import interpreter  # noqa: E402

RANK_PROGRAM = """
import os, sys
sys.path.insert(0, {src!r})
from trainperf.backends.oneflow.rendezvous import Departure, wait_for_rank0
wait_for_rank0()
import oneflow as flow
departure = Departure.from_env()
flow.ones(4).sum().numpy()
flow.comm.barrier()
if {handshake!r}:
    departure.leave_after_peers()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""
VARIANTS = ("bare", "departure")
ROUND_TIMEOUT_S = 120


def one_round(python: str, handshake: bool, scratch: Path) -> dict:
    held = ports.reserve(2)
    program = RANK_PROGRAM.format(src=str(SRC), handshake=handshake)
    env_common = {**os.environ, "MASTER_ADDR": ports.LOOPBACK, "MASTER_PORT": str(held.ports[0]),
                  PORT_VARIABLE: str(held.ports[1]), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
                  "LD_LIBRARY_PATH": library_path(python)}
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(2):
        log = scratch / f"rank{rank}.log"
        logs.append(log)
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [python, "-c", program], stdout=out, stderr=subprocess.STDOUT,
                env={**env_common, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    codes = []
    with held:
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=ROUND_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
    # glog's prefix (time, thread) dropped, so that equal checks read as one.
    checks = [line.split("] ", 1)[-1].strip() for log in logs
              for line in log.read_text(errors="replace").splitlines() if "Check failed" in line]
    return {"codes": codes, "seconds": round(time.monotonic() - start, 2),
            "check": checks[0][:200] if checks else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds per variant")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    python = interpreter("oneflow")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.out / "scratch"
    scratch.mkdir(exist_ok=True)
    rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(args.rounds):
        for variant in (VARIANTS if i % 2 == 0 else VARIANTS[::-1]):  # alternate the order
            result = one_round(python, variant == "departure", scratch)
            rounds[variant].append(result)
            print(f"round {i} {variant}: exit codes {result['codes']}", flush=True)
    for log in scratch.iterdir():
        log.unlink()
    scratch.rmdir()
    summary = {v: {"rounds": len(rs), "failed": sum(any(r["codes"]) for r in rs)}
               for v, rs in rounds.items()}
    record = {"what": "2-rank OneFlow teardown after flow.comm.barrier() and os._exit",
              "command": " ".join(["python", "benchmarks/oneflow_teardown.py", *sys.argv[1:]]),
              "machine": {"cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count()},
              "summary": summary, "rounds": rounds}
    (args.out / "teardown.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# OneFlow's teardown on 2 CPU ranks", "", f"`{record['command']}`", "",
             "| variant | rounds | a rank aborted |", "|---|---|---|"]
    lines += [f"| {v} | {s['rounds']} | {s['failed']} |" for v, s in summary.items()]
    checks = sorted({r["check"] for rs in rounds.values() for r in rs if r["check"]})
    if checks:
        lines += ["", "What OneFlow said:", ""] + [f"- `{c}`" for c in checks]
    (args.out / "teardown.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
