"""A real browser for the tests that check a page trainperf writes: Debian's ``chromium``,
headless. It loads a file, and gives back the page as the browser built it (after its scripts
ran) and every message the page wrote to the console.

    python tests/browser_host.py install   # Debian's chromium, best effort (make test)

Tests take the ``browser`` fixture; where no browser can run it skips them and says why.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = ("chromium",)
PROGRAMS = ("chromium",)
LOAD_TIMEOUT_S = 60.0
# Chromium logs each console message of the page, whatever its level, as one INFO line.
CONSOLE_LINE = re.compile(r":CONSOLE[:(]\d+\)?\] (.*)$")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


@dataclass
class Loaded:
    dom: str
    """The document after its scripts ran (``--dump-dom``)."""
    console: list[str]
    """What the page wrote to the console, uncaught errors included."""


class Browser:
    def __init__(self, program: str):
        self.program = program

    def load(self, page: Path) -> Loaded:
        with tempfile.TemporaryDirectory(prefix="trainperf-browser-") as profile:
            argv = [self.program, "--headless", "--no-sandbox", "--disable-gpu",
                    "--no-first-run", f"--user-data-dir={profile}", "--enable-logging=stderr",
                    "--v=0", "--dump-dom", page.resolve().as_uri()]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
        console = [m.group(1) for line in out.stderr.splitlines()
                   if (m := CONSOLE_LINE.search(line))]
        if out.returncode != 0 or not out.stdout.strip():
            raise RuntimeError(f"{self.program} exited {out.returncode} without a page: "
                               f"{out.stderr.strip().splitlines()[-1:]}")
        return Loaded(out.stdout, console)


@pytest.fixture(scope="session")
def browser() -> Browser:
    missing = missing_programs()
    if missing:
        pytest.skip(f"no headless browser: {', '.join(missing)} not installed "
                    "(`python tests/browser_host.py install`, run by `make test`, installs it)")
    return Browser(shutil.which(PROGRAMS[0]))


def install() -> int:
    from debian_packages import install as install_packages

    return install_packages("browser_host", PACKAGES, missing_programs, "the browser test")


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python tests/browser_host.py install")
    sys.exit(install())
