"""Debian packages some tests need (Slurm, a browser), installed by ``make test`` where apt can:
best effort, since a test whose program is missing skips and says why."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable


def install(who: str, packages: tuple[str, ...], missing: Callable[[], list[str]],
            skipping: str) -> int:
    """Install ``packages`` where ``missing()`` names a program and apt can; always 0.
    ``who`` starts each line printed, ``skipping`` says what skips if it fails."""
    lacking = missing()
    if not lacking:
        print(f"{who}: {' '.join(packages)} installed")
        return 0
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(f"{who}: missing {', '.join(lacking)}; installing needs root and apt-get "
              f"({skipping} will skip)")
        return 0
    started = time.monotonic()
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install_cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    with _no_service_starts(who):
        ok = _apt(who, install_cmd, env)
        if not ok:  # a stale package list is the usual cause
            ok = _apt(who, ["apt-get", "update", "-q"], env) and _apt(who, install_cmd, env)
    took = time.monotonic() - started
    if ok and not missing():
        print(f"{who}: installed {' '.join(packages)} in {took:.0f} s")
    else:
        print(f"{who}: could not install {' '.join(packages)} ({skipping} will skip)")
    return 0


def _apt(who: str, argv: list[str], env: dict[str, str]) -> bool:
    try:
        return subprocess.run(argv, env=env, timeout=900).returncode == 0
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"{who}: {' '.join(argv[:2])}: {exc}")
        return False


class _no_service_starts:
    """Debian's packages start their daemons on installation unless policy-rc.d says no; the
    tests start their own, and a host must not be left running a daemon nobody asked for."""

    path = Path("/usr/sbin/policy-rc.d")

    def __init__(self, who: str):
        self.who = who

    def __enter__(self):
        self.created = False
        if not self.path.exists():
            try:
                self.path.write_text(f"#!/bin/sh\n# trainperf tests ({self.who}): installing\n"
                                     "exit 101\n")
                self.path.chmod(0o755)
                self.created = True
            except OSError:
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self.created:
            self.path.unlink(missing_ok=True)
