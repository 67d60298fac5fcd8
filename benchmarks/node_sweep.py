"""DLPerf's table from one command on emulated nodes: torch and JAX at 1n1g and 1n2g (one node,
one and two ranks) and 2n1g (two nodes of one rank), one document per framework with every
row's speedup against its 1n1g, each framework in the one mode its first case's probe chose.

    sudo python benchmarks/node_sweep.py [--out benchmarks/results/node_sweep-emulated-cpu]

Needs root (emulated nodes are network namespaces). It runs

    trainperf emulate --cases 1n1g,1n2g,2n1g --rate 1gbit -- run tiny-arcface
        --framework torch,jax --runs 3 --iters 30 --warmup 10 --out OUT

and keeps what the runs wrote, less the runs' link to the source tree and each run's own
copy of its events (the folders' streams hold them: ``compact_records.py``). On a 2-core
machine each emulated node has one core: 1n2g puts two ranks on node 0's one core, so its
speedup says what a second rank on a full node costs, not what a second device gives.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMAND = ["emulate", "--cases", "1n1g,1n2g,2n1g", "--rate", "1gbit", "--", "run",
           "tiny-arcface", "--framework", "torch,jax", "--runs", "3", "--iters", "30",
           "--warmup", "10"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "node_sweep-emulated-cpu")
    args = p.parse_args(argv)
    if args.out.exists():
        sys.exit(f"{args.out} exists; move it away first")
    done = subprocess.run([sys.executable, "-m", "trainperf.cli", *COMMAND,
                           "--out", str(args.out)])
    if done.returncode not in (0, 1):
        return done.returncode
    # A framework's runs see trainperf through a link to the source tree: not a result.
    for link_dir in args.out.rglob(".pythonpath"):
        shutil.rmtree(link_dir)
    subprocess.run([sys.executable, str(HERE / "compact_records.py"), str(args.out)],
                   check=True)
    print(f"trainperf {' '.join(COMMAND)} --out {args.out}: exit {done.returncode}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
