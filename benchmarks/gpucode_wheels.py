"""Every framework's CUDA build read from its own wheels: what each library's fatbins hold, how
long each wheel takes to download and to read, and which builds have code for a GPU of
compute capability 8.0, 9.0, 10.0 and 12.0. The suite reads the MXNet and JAX builds' wheels
(``tests/test_gpucode.py``); this reads all of them, 3.3 GB, which is too much for it.

    python benchmarks/gpucode_wheels.py --out benchmarks/results/gpucode_wheels.json

Downloads into a fresh temporary folder unless ``--wheel-dir`` names one (then a wheel
already there is not downloaded again, and a summary already beside it is not read again:
the times recorded are then those of that folder's state). A wheel that cannot be had (Paddle's
CUDA wheel lives on Paddle's own index) is recorded with pip's reason; nothing is made up
for it. The record feeds the install page's table (``python -m trainperf.cli.pages``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from trainperf import envs, gpucode, gpufit  # noqa: E402
from trainperf.backends import BACKENDS  # noqa: E402
from trainperf.cli import main as cli  # noqa: E402
from trainperf.env import cpu_model  # noqa: E402

CAPABILITIES = ((8, 0), (9, 0), (10, 0), (12, 0))
STANDIN = "9.0,550.54.15"
"""The GPU ``trainperf env list`` is shown on in the record: an H100's compute capability
and the driver of CUDA 12.4 Update 1."""


def read_build(name: str, log) -> dict:
    backend = BACKENDS[name]
    spec = backend.env
    python = envs.wheel_python(backend)
    options = [p for p in spec.cuda_packages if p.startswith("--")]
    wheels = []
    for requirement in spec.gpu_wheels:
        started = time.monotonic()
        try:
            path = envs.fetch_wheel(requirement, python, options, log)
        except ValueError as exc:
            wheels.append({"requirement": requirement, "error": str(exc)})
            continue
        fetched = time.monotonic() - started
        started = time.monotonic()
        doc = gpucode.read_wheel(path)
        wheels.append({"requirement": requirement, "wheel": path.name, "bytes": doc["bytes"],
                       "download_s": round(fetched, 2),
                       "read_s": round(time.monotonic() - started, 2),
                       "libraries": doc["libraries"]})
    out = {"framework": name, "cuda": spec.cuda, "python": python,
           "main_library": spec.gpu_library, "wheels": wheels}
    if all("error" not in w for w in wheels):
        code = envs.gpu_code(name)
        out["main"] = code.main
        out["fits"] = {f"{a}.{b}": gpufit.code_fit(code.libraries[code.main], (a, b)).text(
            code.libraries[code.main]) for a, b in CAPABILITIES}
    return out


def env_list_on_standin() -> str:
    """`trainperf env list` on the stand-in GPU, no environment built (a fresh folder), the
    GPU lines only."""
    saved = {k: os.environ.get(k) for k in (gpufit.STANDIN_VAR, "TRAINPERF_ENV_DIR")}
    with tempfile.TemporaryDirectory() as empty:
        os.environ.update({gpufit.STANDIN_VAR: STANDIN, "TRAINPERF_ENV_DIR": empty})
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cli(["env", "list"])
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    lines = buf.getvalue().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("GPUs: "))
    return "\n".join(lines[first:]).replace(str(envs.wheel_root()), "WHEEL_DIR")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--wheel-dir", type=Path,
                   help="where the wheels go (default: a fresh temporary folder, removed after)")
    p.add_argument("--frameworks", default=",".join(
        n for n, b in BACKENDS.items() if b.env and b.env.gpu_wheels))
    args = p.parse_args()
    with contextlib.ExitStack() as stack:
        folder = args.wheel_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="gpucode-wheels-")))
        os.environ[envs.WHEEL_DIR_VAR] = str(folder)
        builds = [read_build(n.strip(), sys.stderr) for n in args.frameworks.split(",")]
        shown = env_list_on_standin()
    record = {"command": " ".join(["python", "benchmarks/gpucode_wheels.py", *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"),
              "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "wheel_dir": "a fresh temporary folder" if args.wheel_dir is None else "given",
              "standin": STANDIN, "builds": builds, "env_list_on_standin": shown}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    for b in builds:
        for w in b["wheels"]:
            print(f"{b['framework']}: {w['requirement']}: " + (
                w["error"] if "error" in w else
                f"{w['bytes'] / 1e6:.0f} MB, download {w['download_s']} s, read {w['read_s']} s"))
    print(shown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
