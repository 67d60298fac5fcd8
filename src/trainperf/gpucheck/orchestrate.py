"""Runs the chosen stages one after another, each in its own process under its cap, then writes
the part's folder: ``summary.md``, ``summary.json``, one ``.tar.gz`` and the plots.

The raw material (every stage's record, results folders, logs) lives in a work folder outside
the output folder, which holds only what a borrowed machine can bring back (at most 8 files,
no sub-folders). Later parts of the same check on the same machine find the earlier parts'
records there (the ceiling for MFU, the case stages' figures for the peers' ratios).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

from ..env import cpu_model, host_env, nvidia_driver
from ..procs import POLL_S, kill_tree, log_tail
from . import summary
from .plan import Stage, select
from .record import read_stage, stage_path
from ..results import write_json_atomic

OPTIONAL = (
    ("matplotlib", "the plots"),
    ("timm", "the peers' timm ResNet50 step"),
    ("jax", "JAX's native parity and the peers' JAX worker (unless trainperf's JAX "
            "environment exists)"),
    ("pynvml", "NVML power readings (nvidia-smi's are used instead where it exists)"),
    ("simplejpeg", "the fastest JPEG decoder (OpenCV or Pillow decode instead)"),
    ("nvidia.dali", "the real-data stage's DALI mixed decoder"),
    ("PIL", "the real-data stage's data synth"),
)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


def optional_notes() -> list[str]:
    return [f"{module} is not installed: {what} skipped" for module, what in OPTIONAL
            if not installed(module)]


def detect_mode(asked: str) -> tuple[str, str | None]:
    """(``gpu`` or ``cpu``, a note when a GPU is present that torch cannot use)."""
    if asked != "auto":
        return asked, None
    probe = subprocess.run([sys.executable, "-c",
                            "import torch; print(torch.cuda.is_available(), torch.__version__)"],
                           capture_output=True, text=True)
    words = probe.stdout.split()
    if probe.returncode == 0 and words[:1] == ["True"]:
        return "gpu", None
    gpus = nvidia_driver()["gpus"]
    if gpus:
        version = words[1] if len(words) > 1 else "?"
        return "cpu", (f"nvidia-smi lists {len(gpus)} GPU(s) but this Python's torch "
                       f"({version}) cannot use CUDA: the CPU mode ran instead")
    return "cpu", None


def device_label(mode: str) -> str:
    if mode == "gpu":
        gpus = nvidia_driver()["gpus"]
        if gpus:
            return gpus[0]["name"]
    return cpu_model()


def run_stage(stage: Stage, mode: str, work: Path, cap_s: float, device: str) -> dict:
    """Run one stage to its end, its cap or Ctrl-C; its record with the outcome added."""
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"stage-{stage.id}.log"
    stage_path(work, stage.id).unlink(missing_ok=True)
    started = time.monotonic()
    # Tagged as the runner tags its runs, so that whatever a stage left running can be found.
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               TRAINPERF_RUN_ID=str(work.resolve() / f"stage-{stage.id}"),
               TRAINPERF_GPUCHECK_CAP_S=f"{cap_s:.0f}")  # a stage may plan within its cap
    timed_out = interrupted = False
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "trainperf.gpucheck.stage", stage.id,
                                 "--mode", mode, "--work", str(work)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            while proc.poll() is None:
                if time.monotonic() - started > cap_s:
                    timed_out = True
                    kill_tree(proc)
                    break
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            interrupted = True
            kill_tree(proc)  # nothing of the stage keeps running
    elapsed = time.monotonic() - started
    record = read_stage(work, stage.id) or {"stage": stage.id, "title": stage.title,
                                            "mode": mode, "items": []}
    if interrupted:
        status, why = "interrupted", "stopped by Ctrl-C; what it measured before is kept"
    elif timed_out:
        status, why = "timeout", (f"stopped at its cap of {cap_s:.0f} s; what it measured "
                                  "before is kept")
    elif proc.returncode == 0:
        status, why = "ok", None
    else:
        status = "failed"
        why = (record.get("error") or log_tail(log_path, 1)[:400]
               or f"exited with {proc.returncode}")
    record.update(status=status, why=why, elapsed_s=elapsed, cap_s=cap_s, part=stage.part,
                  device=device, log=str(log_path))
    write_json_atomic(stage_path(work, stage.id), record)
    return record


def check_out_folder(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; give gpucheck a new or empty --out folder")


def run_check(out: Path, part: int | None, asked_mode: str, only: list[str] | None = None,
              cap_scale: float = 1.0, work: Path | None = None) -> dict:
    stages = select(part, only)
    if cap_scale <= 0:
        raise ValueError(f"--cap-scale must be > 0, got {cap_scale}")
    check_out_folder(out)
    mode, mode_note = detect_mode(asked_mode)
    name = f"part{part}" if part else "all"
    work = work or Path("gpucheck-work") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    work.mkdir(parents=True, exist_ok=True)
    meta = {"mode": mode, "part": part, "name": name, "device": device_label(mode),
            "chosen": [s.id for s in stages],
            "work": str(work.resolve()), "env": host_env(), "started": time.time(),
            "notes": [n for n in [mode_note] if n] + optional_notes()}
    print(f"gpucheck {name}: {mode} mode on {meta['device']}; stages "
          f"{', '.join(s.id for s in stages)}; work folder {work}", flush=True)
    records: list[dict] = []
    try:
        run_stages(stages, mode, work, cap_scale, meta["device"], records)
    except KeyboardInterrupt:
        meta["notes"].insert(0, "interrupted (Ctrl-C): the stages after it did not run")
        meta["elapsed_s"] = time.time() - meta["started"]
        summary.write(out, work, meta, records)
        raise
    meta["elapsed_s"] = time.time() - meta["started"]
    return summary.write(out, work, meta, records)


def run_stages(stages: list[Stage], mode: str, work: Path, cap_scale: float, device: str,
               records: list[dict]) -> None:
    """Each stage in turn, its record appended to ``records`` as it ends."""
    unused = 0.0
    for stage in stages:
        # What the stages before it left of their caps is this stage's too: the run still ends
        # within the sum of its caps, and a slow stage gets the minutes a quick one did not use.
        cap = stage.cap(mode, cap_scale) + unused
        print(f"stage {stage.id} ({stage.title}), cap {cap:.0f} s ...", flush=True)
        record = run_stage(stage, mode, work, cap, device)
        record["own_cap_s"] = stage.cap(mode, cap_scale)
        unused = max(0.0, cap - record["elapsed_s"])
        records.append(record)
        print(f"stage {stage.id}: {record['status']} in {record['elapsed_s']:.0f} s"
              + (f": {record['why']}" if record["why"] else ""), flush=True)
        if record["status"] == "interrupted":
            raise KeyboardInterrupt
