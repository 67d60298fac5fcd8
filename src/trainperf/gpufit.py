"""Whether a CUDA build runs on the GPUs and the driver at hand: the GPU's compute capability
against the code the build carries (``trainperf.gpucode``), and the driver's version against
the CUDA the build was made with.

**Code.** A library runs on a GPU of compute capability X.Y when it holds

- a cubin for ``sm_XZ`` with Z <= Y: SASS runs on GPUs of the same major version and the same
  or a higher minor one, never across majors (the CUDA C++ Programming Guide's "binary
  compatibility"); or
- PTX for ``compute_AB`` with A.B <= X.Y, which the driver compiles for the GPU when the
  library is loaded (just in time), given a driver that knows that PTX ISA version.

A cubin is preferred over PTX, as the CUDA runtime prefers it. The arch-specific variants
(``sm_90a``) are stored under the same number and are taken as cubins of it.

**Driver.** NVIDIA's CUDA Toolkit release notes (section "CUDA Driver", CUDA 13.1 edition)
give, per toolkit release, the Linux x86_64 driver it needs (their Table 3, ``DRIVERS`` below),
and the drivers from which a build of the same CUDA major version runs by minor version
compatibility (``MINOR_FLOOR``; for CUDA 11.x the footnote's 450.80.02). Under minor version
compatibility the runtime starts but the driver cannot compile PTX of an ISA newer than its
own (CUDA Compatibility guide): so a build that needs just-in-time compilation on this GPU
needs the driver of the toolkit that introduced the PTX's ISA version (``PTX_CUDA``, from the
PTX ISA's release history), and a build that has a cubin for it needs only the floor.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterable, Mapping

from .gpucode import LibraryCode, sm_text

STANDIN_VAR = "TRAINPERF_STANDIN_GPU"
"""For tests only: ``9.0`` or ``9.0,550.54.15`` (compute capability, then the driver's
version) stands for a GPU where ``nvidia-smi`` finds none. A GPU that nvidia-smi reports
always wins over it."""

# CUDA Toolkit release notes, "CUDA Toolkit and Corresponding Driver Versions" (Table 3 of
# https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html, CUDA 13.1 edition),
# Linux x86_64: the GA row of each minor release. A wheel does not say which update of its
# release built it, and an update's row only ever asks for a newer driver than the GA's, so
# the GA row is the least every build of that release needs. (12.7 was never released; PTX
# ISA 8.6, its ISA, is first loaded by 12.8's driver.)
DRIVERS: dict[tuple[int, int], str] = {
    (11, 0): "450.51.05", (11, 1): "455.23", (11, 2): "460.27.03", (11, 3): "465.19.01",
    (11, 4): "470.42.01", (11, 5): "495.29.05", (11, 6): "510.39.01", (11, 7): "515.43.04",
    (11, 8): "520.61.05",
    (12, 0): "525.60.13", (12, 1): "530.30.02", (12, 2): "535.54.03", (12, 3): "545.23.06",
    (12, 4): "550.54.14", (12, 5): "555.42.02", (12, 6): "560.28.03", (12, 8): "570.26",
    (12, 9): "575.51.03",
    (13, 0): "580.65.06", (13, 1): "590.44.01",
}
# The same notes' table of minor version compatibility: a build of CUDA 11.x runs from driver
# 450.80.02 (footnote: "by upgrading to ... 450.80.02 (Linux) ... minor version compatibility
# is possible across the CUDA 11.x family"), 12.x from R525 (12.0 GA's 525.60.13), 13.x from
# R580 (13.0 GA's 580.65.06).
MINOR_FLOOR: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# The PTX ISA's release history (PTX ISA documentation, "Release Notes"): the CUDA release
# that introduced each ISA version, whose driver is the first to compile it.
PTX_CUDA: dict[tuple[int, int], tuple[int, int]] = {
    (7, 0): (11, 0), (7, 1): (11, 1), (7, 2): (11, 2), (7, 3): (11, 3), (7, 4): (11, 4),
    (7, 5): (11, 5), (7, 6): (11, 6), (7, 7): (11, 7), (7, 8): (11, 8),
    (8, 0): (12, 0), (8, 1): (12, 1), (8, 2): (12, 2), (8, 3): (12, 3), (8, 4): (12, 4),
    (8, 5): (12, 5), (8, 6): (12, 7), (8, 7): (12, 8), (8, 8): (12, 9),
    (9, 0): (13, 0), (9, 1): (13, 1),
}


def version(text: str) -> tuple[int, ...]:
    """``550.54.15`` as (550, 54, 15), to compare driver versions part by part."""
    return tuple(int(p) for p in text.strip().split("."))


def cuda_release(text: str) -> tuple[int, int]:
    """``11.7`` as (11, 7)."""
    major, minor = version(text)[:2]
    return major, minor


@dataclass(frozen=True)
class Gpu:
    capability: tuple[int, int]
    """Compute capability: (9, 0) for an H100."""
    driver: str | None
    """The driver's version (``550.54.15``); None where not known."""
    name: str = ""
    standin: bool = False
    """Named by ``TRAINPERF_STANDIN_GPU`` (tests), not found by nvidia-smi."""

    @property
    def sm(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


def _nvidia_smi(*args: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def real_gpus() -> list[Gpu] | None:
    """The GPUs nvidia-smi reports; [] where it lists GPUs but cannot give their compute
    capability (a driver older than the ``compute_cap`` field answers an error); None where
    there is no nvidia-smi or it lists no GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = _nvidia_smi("--query-gpu=compute_cap,driver_version,name", "--format=csv,noheader")
    gpus = []
    for line in (out or "").splitlines():
        fields = [f.strip() for f in line.split(",", 2)]
        try:
            cap = cuda_release(fields[0])
        except (ValueError, IndexError):
            gpus = []  # "[N/A]": this driver cannot say
            break
        gpus.append(Gpu(cap, fields[1] if len(fields) > 1 and fields[1] else None,
                        fields[2] if len(fields) > 2 else ""))
    if gpus:
        return gpus
    listed = _nvidia_smi("-L") or ""
    return [] if any(line.startswith("GPU ") for line in listed.splitlines()) else None


def parse_standin(text: str) -> Gpu:
    """``9.0`` or ``9.0,550.54.15``; ValueError naming the variable otherwise."""
    cap, _, driver = text.partition(",")
    try:
        capability = cuda_release(cap)
        if driver.strip():
            version(driver)
    except ValueError:
        raise ValueError(f"{STANDIN_VAR}={text!r}: give a compute capability and, if wanted, "
                         "a driver version, as 9.0 or 9.0,550.54.15") from None
    return Gpu(capability, driver.strip() or None, "stand-in GPU", standin=True)


def gpus() -> list[Gpu]:
    """This machine's GPUs as nvidia-smi reports them (none where it cannot say their compute
    capability); where it lists no GPU, the stand-in of ``TRAINPERF_STANDIN_GPU`` (tests);
    else none."""
    found = real_gpus()
    if found is not None:
        return found  # a real GPU, even of a capability nvidia-smi cannot say, wins
    standin = os.environ.get(STANDIN_VAR)
    return [parse_standin(standin)] if standin else []


@dataclass(frozen=True)
class CodeFit:
    """What of a library runs on one GPU."""

    kind: str
    """``cubin``, ``ptx`` (compiled just in time) or ``none``."""
    sm: int = 0
    ptx_isa: str = ""

    def text(self, code: LibraryCode) -> str:
        if self.kind == "cubin":
            return f"yes (cubin sm_{self.sm})"
        if self.kind == "ptx":
            return f"PTX compute_{self.sm} (ISA {self.ptx_isa}), compiled just in time"
        ptx = sm_text((sm for sm, _ in code.ptx), "compute_")
        return f"no (cubins {sm_text(code.cubins)}; {'PTX ' + ptx if code.ptx else 'no PTX'})"


def code_fit(code: LibraryCode, capability: tuple[int, int]) -> CodeFit:
    """The rule of the module's docstring: a cubin of the same major and a minor no higher
    (the highest such), else PTX of a capability no higher (the highest), else none."""
    major, minor = capability
    cubins = [sm for sm in code.cubins if sm // 10 == major and sm % 10 <= minor]
    if cubins:
        return CodeFit("cubin", max(cubins))
    ptx = [(sm, isa) for sm, isa in code.ptx if (sm // 10, sm % 10) <= capability]
    if ptx:
        sm, isa = max(ptx)
        return CodeFit("ptx", sm, isa)
    return CodeFit("none")


def driver_for(release: tuple[int, int]) -> str | None:
    """The driver the release notes give for a CUDA release (its first later release's where
    it was never released, as 12.7); None beyond the table."""
    later = sorted(r for r in DRIVERS if r >= release)
    return DRIVERS[later[0]] if later else None


@dataclass(frozen=True)
class DriverFit:
    ok: bool
    text: str


def driver_fit(cuda: str, driver: str | None, jit_isas: Iterable[str] = ()) -> DriverFit:
    """Whether ``driver`` runs a build of CUDA ``cuda`` (``11.7``) that compiles PTX of
    ``jit_isas`` just in time on this GPU (none: it has cubins for it)."""
    release = cuda_release(cuda)
    full = driver_for(release)
    floor = MINOR_FLOOR.get(release[0])
    if driver is None:
        return DriverFit(True, f"driver not known; CUDA {cuda} wants {full} or newer"
                               + (f" ({release[0]}.x runs from {floor})" if floor else ""))
    have = version(driver)
    needs = [(isa, driver_for(PTX_CUDA.get(cuda_release(isa), (99, 0)))) for isa in jit_isas]
    unknown = [isa for isa, d in needs if d is None]
    if unknown:
        return DriverFit(False, f"PTX ISA {', '.join(unknown)} is newer than any CUDA release "
                                "trainperf knows the driver of")
    short = [(isa, d) for isa, d in needs if have < version(d)]
    if short:
        isa, d = max(short, key=lambda p: version(p[1]))
        return DriverFit(False, f"driver {driver} cannot compile PTX ISA {isa} just in time: "
                                f"that needs {d} or newer")
    if full and have >= version(full):
        return DriverFit(True, f"driver {driver}: new enough for CUDA {cuda} ({full} or newer)")
    if floor and have >= version(floor):
        return DriverFit(True, f"driver {driver}: older than CUDA {cuda}'s {full}; runs by "
                               f"minor version compatibility (CUDA {release[0]}.x from {floor})")
    need = floor or full
    return DriverFit(False, f"driver {driver} is too old for CUDA {cuda}: it needs {need} or "
                            "newer")


@dataclass(frozen=True)
class BuildFit:
    """One CUDA build against one GPU."""

    runs: bool
    line: str
    """``has code for sm_90: ...; driver ...``, one line."""


def library_label(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def build_fit(libraries: Mapping[str, LibraryCode], main: str, cuda: str, gpu: Gpu
              ) -> BuildFit:
    """The build whose libraries carry ``libraries`` (path: code) on ``gpu``. Its main library
    (``main``: the framework's own kernels) decides: it runs where that library has code for
    the GPU and the driver runs it (the CUDA release's floor, and the PTX's own driver where
    it compiles just in time). The other libraries are named where they compile just in time,
    where they have no code for the GPU (NCCL without it fails only collectives, cuFFT only
    FFTs...) and where the driver cannot compile their PTX."""
    sm = f"sm_{gpu.sm}"
    fits = {path: code_fit(code, gpu.capability) for path, code in libraries.items()}
    main_fit = fits[main]
    parts = [f"{library_label(main)} has code for {sm}: {main_fit.text(libraries[main])}"]
    jit = {p: f for p, f in fits.items() if p != main and f.kind == "ptx"}
    if jit:
        parts.append("compiled just in time: " + ", ".join(
            sorted(f"{library_label(p)} (compute_{f.sm})" for p, f in jit.items())))
    lacking = sorted(library_label(p) for p, f in fits.items() if p != main and f.kind == "none")
    if lacking:
        parts.append(f"no code for it in {', '.join(lacking)}")
    drv = driver_fit(cuda, gpu.driver, [main_fit.ptx_isa] if main_fit.kind == "ptx" else ())
    parts.append(drv.text)
    if gpu.driver and drv.ok:
        short = sorted(library_label(p) for p, f in jit.items()
                       if not driver_fit(cuda, gpu.driver, [f.ptx_isa]).ok)
        if short:
            parts.append(f"the driver cannot compile the PTX of {', '.join(short)}")
    return BuildFit(main_fit.kind != "none" and drv.ok, "; ".join(parts))
