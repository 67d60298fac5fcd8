"""Per-framework environments: each framework other than torch runs from its own venv, because
each pins its own numpy (MXNet 1.9.1 needs numpy < 1.24) and none may see another's packages.

An environment lives in ``$TRAINPERF_ENV_DIR/<name>`` (default ``~/.cache/trainperf/envs``) and
holds only the framework and numpy. trainperf's own code is not installed there: each run puts a
folder holding a link to the running ``trainperf`` package on the worker's ``PYTHONPATH``, so a
worker always runs the same trainperf as the runner that started it, never a stale copy, and
sees nothing else of the runner's environment. ``trainperf-env.json`` in the folder records
what was installed, for the CPU or for CUDA, and from which package indexes; it is written
last, so a folder without it is an unfinished build.
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Sequence

from . import gpucode, gpufit
from .backends import BACKENDS, get_backend
from .backends.base import DEVICE_KINDS, Backend, SourceBuild
from .env import gpu_count

MANIFEST = "trainperf-env.json"


class NoPython(ValueError):
    """The framework's wheels exist for no Python version this machine has."""


def python_override_var(name: str) -> str:
    """The variable that points a backend at an interpreter that already holds its framework
    (a CUDA image's Python with JAX, say), instead of an environment trainperf builds: on a
    machine without network none can be built."""
    return f"TRAINPERF_{name.upper()}_PYTHON"


def env_root() -> Path:
    return Path(os.environ.get("TRAINPERF_ENV_DIR") or Path.home() / ".cache/trainperf/envs")


def env_dir(name: str) -> Path:
    return env_root() / name


def wanted_packages(backend: Backend, cuda: bool) -> list[str]:
    """What the environment is made of, as its manifest records it: pip's requirements, then
    the packages compiled in it (``EnvSpec.source_builds``)."""
    assert backend.env is not None, f"{backend.name} runs in trainperf's own interpreter"
    return [*_pip_packages(backend, cuda), *(b.requirement for b in backend.env.source_builds)]


def _pip_packages(backend: Backend, cuda: bool) -> list[str]:
    assert backend.env is not None
    return list(backend.env.cuda_packages if cuda else backend.env.packages)


def same_on_cuda(backend: Backend) -> bool:
    """The backend's CPU and CUDA builds are one and the same: the same requirements, and no
    source build that compiles otherwise where there is CUDA. OneFlow's is (its PyPI wheel is
    the CUDA 11.7 build, which runs on a CPU too); MXNet's is not, even apart from its wheels,
    since Horovod compiles NCCL in only on a CUDA build (``SourceBuild.cuda_env``)."""
    assert backend.env is not None
    spec = backend.env
    return spec.packages == spec.cuda_packages and not any(
        b.cuda_env or b.cuda_links or b.cuda_home_var for b in spec.source_builds)


def serves_cuda(backend: Backend, manifest: dict) -> bool:
    """Whether the build a manifest records runs CUDA runs: it was built for CUDA, or the
    backend builds one way only (``same_on_cuda``). The one answer the environment's state,
    ``create`` and ``interpreter`` all go by."""
    return bool(manifest.get("cuda")) or same_on_cuda(backend)


def _gpus_text(n: int) -> str:
    return f"{n} GPU{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class EnvState:
    name: str
    state: str
    """``built-in`` (trainperf's own interpreter), ``ready``, ``external`` (the interpreter
    ``TRAINPERF_<NAME>_PYTHON`` names), ``missing``, ``outdated`` (built for other packages
    than this trainperf asks for, or for the CPU on a machine with GPUs) or ``broken``."""
    path: str
    versions: dict
    detail: str = ""
    runs: tuple[str, ...] = ()
    """The device kinds (``cpu``, ``cuda``) a run may take this interpreter for as it is: both
    for trainperf's own and the user's; for a build of trainperf's, the CPU where it is ready
    or only lacks the CUDA this machine's GPUs want, and CUDA where it serves CUDA."""
    cuda: bool | None = None
    """The build serves CUDA (``serves_cuda``); None where trainperf built none (``built-in``,
    ``external``, nothing finished)."""
    packages: tuple[str, ...] = ()
    """What the manifest says was installed (``wanted_packages`` at build time)."""
    indexes: tuple[str, ...] | None = None
    """Where the packages came from (``package_indexes`` at build time); None where the
    manifest predates its recording them."""

    @property
    def python(self) -> str:
        """The interpreter itself (``path`` is the environment's folder for a build of
        trainperf's)."""
        if self.state in ("built-in", "external"):
            return self.path
        return str(Path(self.path) / "bin" / "python")


def _read_manifest(path: Path) -> dict | None:
    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _own_versions(backend: Backend) -> dict:
    """Versions in trainperf's own environment, read without importing the framework."""
    out = {}
    for dist in (backend.name, "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def state(name: str) -> EnvState:
    """Where the backend's interpreter stands. On a machine with GPUs a build without CUDA is
    ``outdated``: `trainperf env create NAME` rebuilds it, though it still runs CPU runs."""
    backend = get_backend(name)
    if backend.env is None:
        return EnvState(name, "built-in", sys.executable, _own_versions(backend),
                        "trainperf's own interpreter", runs=DEVICE_KINDS)
    external = os.environ.get(python_override_var(name))
    if external:
        if not (os.path.isfile(external) and os.access(external, os.X_OK)):
            return EnvState(name, "broken", external, {},
                            f"{python_override_var(name)} names no interpreter")
        return EnvState(name, "external", external, {}, f"from {python_override_var(name)}",
                        runs=DEVICE_KINDS)
    path = env_dir(name)
    manifest = _read_manifest(path)
    if manifest is None:
        what = "unfinished build" if path.exists() else "not created"
        return EnvState(name, "missing", str(path), {}, what)
    cuda = serves_cuda(backend, manifest)
    indexes = manifest.get("indexes")
    built = {"cuda": cuda, "packages": tuple(manifest.get("packages") or ()),
             "indexes": None if indexes is None else tuple(indexes)}
    if not os.access(path / "bin" / "python", os.X_OK):
        return EnvState(name, "broken", str(path), {}, "no interpreter in the folder", **built)
    versions = manifest.get("versions", {})
    if manifest.get("packages") != wanted_packages(backend, manifest.get("cuda", False)):
        return EnvState(name, "outdated", str(path), versions,
                        f"built with {manifest.get('packages')}", **built)
    gpus = gpu_count()
    if gpus and not cuda:
        return EnvState(name, "outdated", str(path), versions,
                        f"built for the CPU; this machine has {_gpus_text(gpus)}", runs=("cpu",),
                        **built)
    return EnvState(name, "ready", str(path), versions, runs=DEVICE_KINDS if cuda else ("cpu",),
                    **built)


def interpreter(name: str, device_kind: str = "cpu") -> str:
    """The Python that runs this backend's workers on ``device_kind`` (``cpu`` or ``cuda``,
    as ``plan_model.device_kind`` resolves it): a CPU run takes any finished build of the
    packages asked for, a CUDA run only one that serves CUDA, so that no GPU run goes on with
    a CPU build. The user's own interpreter (``TRAINPERF_<NAME>_PYTHON``) is taken for either:
    what it holds is theirs to say, and its worker refuses a device it has no build for. A
    one-line ValueError naming the command that fixes it otherwise, before any run starts."""
    st = state(name)
    if device_kind in st.runs:
        return st.python
    if st.runs:  # a CPU build asked for a CUDA run
        gpus = gpu_count()
        fix = (f"run `trainperf env create {name}` (it rebuilds it for this machine's "
               f"{_gpus_text(gpus)})" if gpus else
               f"`trainperf env create {name}` builds it on a machine with an NVIDIA GPU (this "
               "one has none)")
        raise ValueError(f"the {name} environment is built for the CPU, and a CUDA run "
                         f"(--device cuda, or auto on a GPU machine) needs its CUDA build: {fix}")
    raise ValueError(f"the {name} environment is {st.state} ({st.detail}); create it with "
                     f"`trainperf env create {name}`")


def _pip_index_args() -> list[str]:
    """pip's index settings for uv, which does not read pip's configuration."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout
    args = []
    flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
             "find-links": "--find-links"}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        option = flags.get(key.rsplit(".", 1)[-1])
        if option:
            for v in value.strip().strip("'\"").split():
                args += [option, v]
    if "--extra-index-url" in args:
        # pip takes the best version from every index; uv, unless told, only looks at the
        # first index that has the package at all.
        args += ["--index-strategy", "unsafe-best-match"]
    return args


INDEX_OPTIONS = ("--index-url", "--extra-index-url", "--find-links")
PYPI = "https://pypi.org/simple"


def package_indexes(packages: Sequence[str]) -> list[str]:
    """Where a build's packages come from, as its manifest records them: the indexes of pip's
    configuration (``_pip_index_args``, what uv is given) and those the requirements name
    themselves (Paddle's CUDA wheels are on Paddle's own index), the main index first: PyPI
    unless one replaces it. A find-links folder is written ``PATH (find-links)``."""
    given = _pip_index_args()
    pairs = list(zip(given[::2], given[1::2]))
    for item in packages:
        option, eq, value = item.partition("=")
        if eq and option in INDEX_OPTIONS:
            pairs.append((option, value))
    main = [v for o, v in pairs if o == "--index-url"][-1:]
    if not main and _uv():
        # uv's own variables name its main index where pip's configuration does not.
        main = [v for v in (os.environ.get("UV_DEFAULT_INDEX"), os.environ.get("UV_INDEX_URL"))
                if v][:1]
    out = main or [PYPI]
    for option, value in pairs:
        shown = f"{value} (find-links)" if option == "--find-links" else value
        if option in INDEX_OPTIONS[1:] and shown not in out:
            out.append(shown)
    return out


def disk_bytes(path: Path) -> int:
    """What the folder takes on disk: every file's allocated blocks, links not followed, a
    file hard-linked more than once within it counted once. (uv may hard-link a venv's files
    from its cache: those count in full here, though deleting the folder alone frees none.)"""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
            elif st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def base_python(backend: Backend) -> str:
    """The interpreter the environment is made from: trainperf's own, or the first of the
    framework's Python versions found on PATH; a one-line ValueError when there is none."""
    assert backend.env is not None
    wanted = backend.env.pythons
    if not wanted or sys.version.split()[0].rsplit(".", 1)[0] in wanted:
        return sys.executable
    for version in wanted:
        for found in _interpreters(version):
            return found
    raise NoPython(f"the {backend.name} environment needs Python {' or '.join(wanted)} "
                     f"(its wheels exist for no other), and none is on PATH; install one "
                     f"(e.g. `uv python install {wanted[0]}` or your distribution's "
                     f"python{wanted[0]}) and run again")


def _interpreters(version: str) -> list[str]:
    """Interpreters of Python ``version`` that start: on PATH, or installed by pyenv (whose
    shims on PATH refuse to run a version that is not selected)."""
    pyenv_root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    candidates = [shutil.which(f"python{version}")]
    candidates += [str(p) for p in sorted(pyenv_root.glob(f"versions/{version}.*/bin/"
                                                          f"python{version}"), reverse=True)]
    out = []
    for exe in filter(None, candidates):
        ok = subprocess.run([exe, "-c", "import venv"], capture_output=True).returncode == 0
        if ok:
            out.append(exe)
    return out


def _uv() -> str | None:
    """The uv installed beside this interpreter (the ``envs`` extra), else one on PATH."""
    return shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")


def pip_install(python: str, packages: list[str], flags: Sequence[str] = (),
                target: str | None = None, log=None, env: dict[str, str] | None = None,
                fresh: bool = False) -> None:
    """Install ``packages`` for the interpreter ``python`` (into ``target`` if given) with uv
    where it is installed, else pip; ``fresh``: build and download without the cache, and
    leave nothing in it. CalledProcessError when it fails."""
    where = ["--target", target] if target else []
    uv = _uv()
    if uv:
        argv = [uv, "pip", "install", "--quiet", "--python", python, *_pip_index_args(),
                *where, *(["--no-cache"] if fresh else []), *flags, *packages]
    else:
        argv = [python, "-m", "pip", "install", "--quiet", *where,
                *(["--no-cache-dir"] if fresh else []), *flags, *packages]
    subprocess.run(argv, check=True, stdout=log, stderr=log, env=env)


def _build(path: Path, python: str, packages: list[str], no_deps: list[str], log) -> None:
    steps = [(packages, [])] + ([(no_deps, ["--no-deps"])] if no_deps else [])
    uv = _uv()
    if uv:
        # uv creates and fills a venv several times faster than pip and shares one wheel
        # cache. Seeded: some frameworks import setuptools without declaring it, and a venv
        # made by Python's own ``venv`` holds it.
        subprocess.run([uv, "venv", "--quiet", "--seed", "--python", python, str(path)],
                       check=True, stdout=log, stderr=log)
    else:
        subprocess.run([python, "-m", "venv", str(path)], check=True, stdout=log, stderr=log)
    for wanted, flags in steps:
        pip_install(str(path / "bin/python"), wanted, flags, log=log)


CUDA_HOMES = ("HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")
"""Variables that name a CUDA toolkit's folder."""


def cuda_home(headers: Sequence[str] = ("cuda_runtime.h",)) -> Path | None:
    """The CUDA toolkit a CUDA build compiles with: the first folder holding ``bin/nvcc`` and
    every one of ``headers`` in ``include`` of those the variables name, the one whose
    ``nvcc`` is on PATH, and ``/usr/local/cuda``. (An ``nvcc`` on PATH may be a wrapper outside
    its toolkit; CMake then finds no headers beside it.)"""
    on_path = shutil.which("nvcc")
    candidates = [os.environ.get(v) for v in CUDA_HOMES]
    candidates += [str(Path(os.path.realpath(on_path)).parent.parent) if on_path else None,
                   "/usr/local/cuda"]
    for home in filter(None, candidates):
        root = Path(home)
        if os.access(root / "bin" / "nvcc", os.X_OK) and all(
                (root / "include" / h).is_file() for h in headers):
            return root
    return None


def _tool_path(tool: str, build: SourceBuild | None = None) -> str | None:
    """Where ``tool`` is: on PATH, or (``nvcc``) in a CUDA toolkit that has the headers
    ``build`` needs (``cuda_home``)."""
    if tool != "nvcc":
        return shutil.which(tool)
    home = cuda_home(build.cuda_headers if build else ("cuda_runtime.h",))
    return str(home / "bin" / "nvcc") if home else None


def site_packages(python: str) -> Path:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                          "['purelib'])"], capture_output=True, text=True, check=True).stdout
    return Path(out.strip())


def _tools(build: SourceBuild, cuda: bool) -> list[str]:
    return [*build.tools, *(["nvcc"] if cuda and build.cuda_env else [])]


def check_tools(build: SourceBuild, cuda: bool) -> None:
    """ValueError naming the programs ``build`` needs that this machine lacks (before anything
    is built)."""
    missing = [tool for tool in _tools(build, cuda) if _tool_path(tool, build) is None]
    if missing:
        where = (f" (nvcc: a CUDA toolkit with {', '.join(build.cuda_headers)}, in "
                 f"${', $'.join(CUDA_HOMES)}, on PATH or in /usr/local/cuda)"
                 if "nvcc" in missing else "")
        raise ValueError(f"building {build.requirement} needs {', '.join(missing)}{where}; "
                         f"install {'them' if len(missing) > 1 else 'it'} and run again")


def nvcc_release(nvcc: str) -> tuple[int, int] | None:
    """The CUDA release of an nvcc, from ``nvcc --version`` (``release 11.7, V11.7.99``)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return (int(found[1]), int(found[2])) if found else None


def check_nvcc(build: SourceBuild, cuda: str, framework: str) -> None:
    """ValueError, before anything is built, where the nvcc a CUDA source build would compile
    with is of another CUDA major version than the framework's CUDA build (``EnvSpec.cuda``).
    The major is what must agree: the CUDA runtime is one library per major version
    (``libcudart.so.11.0`` serves every 11.x), so an extension compiled by nvcc 11.8 shares
    MXNet 11.7's runtime, while one compiled by 12.x loads a second runtime beside it. A
    missing nvcc is ``check_tools``'s to name."""
    nvcc = _tool_path("nvcc", build)
    if not nvcc or not cuda:
        return
    want = gpufit.cuda_release(cuda)
    got = nvcc_release(nvcc)
    home = f"${build.cuda_home_var or 'CUDA_HOME'}"
    if got is None:
        raise ValueError(f"`{nvcc} --version` names no CUDA release; building "
                         f"{build.requirement} for {framework}'s CUDA {cuda} build needs a "
                         f"CUDA {want[0]}.x toolkit's nvcc: point {home} at one")
    if got[0] != want[0]:
        raise ValueError(f"{nvcc} is CUDA {got[0]}.{got[1]}, and {framework}'s CUDA build is "
                         f"CUDA {cuda}: building {build.requirement} for it needs a CUDA "
                         f"{want[0]}.x toolkit's nvcc; point {home} at one")


def build_env(build: SourceBuild, cuda: bool, site: Path) -> dict[str, str]:
    """The variables ``build`` compiles under: this process's, the build's own, one compile
    job per core unless MAKEFLAGS says otherwise, and on a CUDA machine the CUDA ones, with the
    toolkit's ``bin`` first on PATH and named by the build's own variable."""
    check_tools(build, cuda)
    env = dict(os.environ, **build.env)
    env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 1}")
    if cuda:
        env.update({k: v.format(site=site) for k, v in build.cuda_env.items()})
        nvcc = _tool_path("nvcc", build) if "nvcc" in _tools(build, cuda) else None
        if nvcc:
            env["PATH"] = f"{Path(nvcc).parent}{os.pathsep}{env.get('PATH', '')}"
            if build.cuda_home_var:
                env[build.cuda_home_var] = str(Path(nvcc).parent.parent)
    return env


def build_from_source(path: Path, build: SourceBuild, cuda: bool, log) -> None:
    """Compile ``build`` in the environment at ``path`` against what it holds
    (``base.SourceBuild``), on this machine's compilers."""
    python = str(path / "bin/python")
    site = site_packages(python)
    env = build_env(build, cuda, site)
    if build.build_packages:
        pip_install(python, list(build.build_packages), log=log)
    if cuda:
        for link, target in build.cuda_links.items():
            where = Path(link.format(site=site))
            if not where.exists():
                where.symlink_to(target)
    print(f"compiling {build.requirement} in the environment (minutes)", file=log, flush=True)
    pip_install(python, [build.requirement], ["--no-build-isolation"], log=log, env=env,
                fresh=True)


def compile_bytecode(python: str, folder: Path) -> None:
    """Compile every module under ``folder`` for ``python``. uv installs without doing it, and
    where ``PYTHONDONTWRITEBYTECODE`` is set (as it was on the 2-core VM this was measured on)
    nothing ever writes the cache: every worker compiled its framework from source at each
    start (TensorFlow's import took 8.3 s of CPU instead of 2.6 s). A file that does not
    compile (test data some packages ship) keeps only its source: that is no error."""
    subprocess.run([python, "-m", "compileall", "-q", "-j", "0", str(folder)], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _write_manifest(path: Path, manifest: dict) -> None:
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path / MANIFEST)


def needs_build(current: EnvState, cuda: bool, force: bool = False) -> bool:
    """Whether ``create`` builds over ``current``: when forced, or when it does not run what the
    build is for, CUDA runs where ``cuda`` and CPU runs otherwise. Any ready build runs CPU
    runs, a CUDA one too: a CPU build asked for (``--cpu``, as `make test` does) never
    replaces a user's CUDA build."""
    return force or ("cuda" if cuda else "cpu") not in current.runs


def create(name: str, force: bool = False, cuda: bool | None = None, log=None) -> EnvState:
    """Build (or rebuild) the environment of backend ``name``; returns its state. ``cuda``:
    None builds for this machine (CUDA where it has a GPU, and a CPU build there is rebuilt);
    False asks for no more than a CPU build and keeps any build that runs CPU runs; True asks
    for CUDA (``needs_build``). Several processes asking at once build it once (a lock file
    beside it)."""
    backend = get_backend(name)
    if backend.env is None or os.environ.get(python_override_var(name)):
        return state(name)  # nothing for trainperf to build
    cuda = gpu_count() > 0 if cuda is None else cuda
    packages = _pip_packages(backend, cuda)
    python = base_python(backend)
    root = env_root()
    root.mkdir(parents=True, exist_ok=True)
    log = log or sys.stderr
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        current = state(name)
        path = env_dir(name)
        if not needs_build(current, cuda, force):
            manifest = _read_manifest(path)
            if not manifest.get("bytecode"):  # built before environments were compiled
                print(f"compiling the {name} environment's modules (once)", file=log, flush=True)
                compile_bytecode(str(path / "bin/python"), path / "lib")
                _write_manifest(path, {**manifest, "bytecode": True})
            return current
        for build in backend.env.source_builds:
            check_tools(build, cuda)
            if cuda and build.cuda_env:
                check_nvcc(build, backend.env.cuda, name)
        if cuda:
            check_gpus(name, log)
        indexes = package_indexes(packages)
        shutil.rmtree(path, ignore_errors=True)
        started = time.monotonic()
        print(f"creating the {name} environment in {path}: {' '.join(packages)}", file=log,
              flush=True)
        try:
            _build(path, python, packages, list(backend.env.no_deps_packages), log)
            for build in backend.env.source_builds:
                build_from_source(path, build, cuda, log)
            compile_bytecode(str(path / "bin/python"), path / "lib")
            probe = subprocess.run([str(path / "bin/python"), "-c", backend.env.probe],
                                   capture_output=True, text=True, check=True)
        except subprocess.CalledProcessError as exc:
            raise ValueError(f"building the {name} environment failed ({exc.cmd[0]} exited "
                             f"with {exc.returncode}): {(exc.stderr or '').strip()[-300:]}"
                             ) from None
        manifest = {"backend": name, "packages": wanted_packages(backend, cuda), "cuda": cuda,
                    "indexes": indexes, "python": python,
                    "versions": json.loads(probe.stdout.strip().splitlines()[-1]),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "bytecode": True,
                    "build_s": round(time.monotonic() - started)}
        _write_manifest(path, manifest)
    return state(name)


def states() -> list[EnvState]:
    return [state(name) for name in BACKENDS]


def package_link_dir(where: Path) -> Path:
    """A folder holding only a link named ``trainperf`` to the running package: put on a
    worker's PYTHONPATH, it gives the worker this trainperf and nothing else of this
    environment."""
    import trainperf

    package = Path(trainperf.__file__).resolve().parent
    folder = where / ".pythonpath"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "trainperf"
    if not (link.is_symlink() and link.resolve() == package):
        link.unlink(missing_ok=True)
        link.symlink_to(package, target_is_directory=True)
    return folder


# --- Each CUDA build against this machine's GPUs and driver --------------------------------

WHEEL_DIR_VAR = "TRAINPERF_WHEEL_DIR"
GPU_CODE = ".{name}.gpucode.json"
"""Beside the environments: what the installed build's libraries hold, read once per build."""


def wheel_root() -> Path:
    """Where the CUDA builds' wheels are downloaded to be read, with what was read of each
    (``gpucode.read_wheel``); they are never installed from here."""
    return Path(os.environ.get(WHEEL_DIR_VAR) or Path.home() / ".cache/trainperf/wheels")


def wheel_python(backend: Backend) -> str:
    """The Python version whose wheels the environment takes: trainperf's own where the
    framework has wheels for it, else the first it has (a build's device code is the same in
    each Python's wheel)."""
    assert backend.env is not None
    own = f"{sys.version_info[0]}.{sys.version_info[1]}"
    wanted = backend.env.pythons
    return own if not wanted or own in wanted else wanted[0]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _name_and_version(requirement: str) -> tuple[str, str]:
    name, eq, version = requirement.partition("==")
    if not eq:
        raise ValueError(f"{requirement}: a wheel to read is named as NAME==VERSION")
    return name.split("[", 1)[0].strip(), version.strip()


def cached_wheel(requirement: str, python: str) -> Path | None:
    """The wheel of ``requirement`` (``name==version``) for Python ``python`` and this
    machine's processor in ``wheel_root()``, if one was downloaded."""
    name, version = _name_and_version(requirement)
    cp = "cp" + python.replace(".", "")
    for path in sorted(wheel_root().glob("*.whl")):
        parts = path.name[:-4].split("-")
        if len(parts) < 5 or _normal(parts[0]) != _normal(name) or parts[1] != version:
            continue
        tags = parts[-3].split(".")
        if any(t in (cp, "py3") for t in tags) and platform.machine() in parts[-1]:
            return path
    return None


def fetch_wheel(requirement: str, python: str, options: Sequence[str] = (), log=None) -> Path:
    """The wheel of ``requirement``, downloaded into ``wheel_root()`` by pip (without its
    dependencies, for Python ``python``) unless it is there; ``options``: index options the
    build's requirements name. A one-line ValueError where pip cannot get it."""
    found = cached_wheel(requirement, python)
    if found:
        return found
    root = wheel_root()
    root.mkdir(parents=True, exist_ok=True)
    print(f"downloading {requirement} to read its GPU code (into {root})", file=log or sys.stderr,
          flush=True)
    out = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                          "--only-binary=:all:", "--python-version", python, "--dest", str(root),
                          *options, requirement], capture_output=True, text=True)
    found = cached_wheel(requirement, python)
    if out.returncode or not found:
        lines = out.stderr.strip().splitlines()
        why = lines[-1] if lines else "pip saved no wheel for this machine"
        # pip says last only that it found no such version; that an index it was given
        # could not be reached is in its retries' warnings.
        broken = [line for line in lines if "connection broken by" in line]
        if broken:
            cause = re.search(r"Failed to establish a new connection: ([^'\")]+)", broken[-1])
            why += f" (an index could not be reached: {cause[1] if cause else 'connection broken'})"
        raise ValueError(f"could not download {requirement}: {why}")
    return found


@dataclass(frozen=True)
class GpuCode:
    """What a CUDA build's libraries hold, and where it was read."""

    libraries: dict[str, gpucode.LibraryCode]
    main: str
    """The key of the framework's own library (``EnvSpec.gpu_library``)."""
    source: str


def _main_library(libraries: dict, pattern: str, where: str) -> str:
    for path in sorted(libraries):
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, "*/" + pattern):
            return path
    raise ValueError(f"no library matching {pattern} holds device code in {where}")


def _installed_gpu_code(name: str) -> GpuCode | None:
    """What the installed build of trainperf's holds, where it serves CUDA; read once and kept
    beside the environments, keyed by the build's time."""
    backend = get_backend(name)
    st = state(name)
    if st.state not in ("ready", "outdated") or not st.cuda:
        return None
    path = env_dir(name)
    created = (_read_manifest(path) or {}).get("created")
    cache = env_root() / GPU_CODE.format(name=name)
    try:
        doc = json.loads(cache.read_text(encoding="utf-8"))
        if doc.get("created") != created or doc.get("format") != gpucode.SUMMARY_FORMAT:
            doc = None
    except (OSError, json.JSONDecodeError):
        doc = None
    if doc is None:
        libraries = gpucode.tree_code(path)
        doc = {"format": gpucode.SUMMARY_FORMAT, "created": created,
               "libraries": {k: v.to_json() for k, v in sorted(libraries.items())}}
        _write_json(cache, doc)
    libraries = gpucode.libraries_of(doc)
    assert backend.env is not None
    where = f"the installed environment {path}"
    return GpuCode(libraries, _main_library(libraries, backend.env.gpu_library, where), where)


def _write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def gpu_code(name: str, fetch: bool = False, log=None) -> GpuCode | None:
    """What the backend's CUDA build holds: from its wheels (``EnvSpec.gpu_wheels``) where
    they were downloaded, else from its installed CUDA build, else, with ``fetch``, from its
    wheels downloaded now. None: not read (or no CUDA build declared). ValueError where a
    wheel cannot be had or read."""
    backend = get_backend(name)
    spec = backend.env
    if spec is None or not spec.gpu_wheels:
        return None
    python = wheel_python(backend)
    wheels = [cached_wheel(r, python) for r in spec.gpu_wheels]
    if not all(wheels):
        installed = _installed_gpu_code(name)
        if installed is not None or not fetch:
            return installed
        options = [p for p in spec.cuda_packages if p.startswith("--")]
        wheels = [fetch_wheel(r, python, options, log) for r in spec.gpu_wheels]
    libraries: dict[str, gpucode.LibraryCode] = {}
    for wheel in wheels:
        assert wheel is not None
        libraries.update(gpucode.libraries_of(gpucode.read_wheel(wheel)))
    names = ", ".join(w.name for w in wheels if w is not None)
    return GpuCode(libraries, _main_library(libraries, spec.gpu_library, names),
                   f"its wheels in {wheel_root()}")


def cuda_build_text(backend: Backend) -> str:
    """``mxnet-cu117==1.9.1, nvidia-nccl-cu11==2.21.5 (CUDA 11.7)``."""
    assert backend.env is not None
    return f"{', '.join(backend.env.gpu_wheels)} (CUDA {backend.env.cuda})"


def gpu_text(gpus: Sequence[gpufit.Gpu]) -> str:
    """This machine's GPUs in a line: their compute capabilities and the driver."""
    caps = sorted({g.capability for g in gpus})
    driver = next((g.driver for g in gpus if g.driver), None)
    standin = f" (a stand-in: ${gpufit.STANDIN_VAR})" if any(g.standin for g in gpus) else ""
    return (f"compute capability {', '.join(f'{a}.{b}' for a, b in caps)}, "
            f"driver {driver or 'not known'}{standin}")


def gpu_fits(name: str, gpus: Sequence[gpufit.Gpu], code: GpuCode) -> list[gpufit.BuildFit]:
    """The backend's CUDA build on each compute capability among ``gpus``."""
    backend = get_backend(name)
    assert backend.env is not None
    seen: dict[tuple[int, int], gpufit.BuildFit] = {}
    for gpu in gpus:
        if gpu.capability not in seen:
            seen[gpu.capability] = gpufit.build_fit(code.libraries, code.main,
                                                    backend.env.cuda, gpu)
    return list(seen.values())


def instead_text(name: str) -> str:
    backend = get_backend(name)
    assert backend.env is not None
    return backend.env.cuda_instead or f"trainperf declares no other CUDA build of {name}"


def gpu_line(name: str, gpus: Sequence[gpufit.Gpu], fetch: bool = False, log=None
             ) -> str | None:
    """One line on the backend's CUDA build on these GPUs (None for trainperf's own
    interpreter, whose torch is the user's): whether it has code for each, the driver, and
    what to use instead where it cannot run; or why it was not read."""
    backend = get_backend(name)
    if backend.env is None or not backend.env.gpu_wheels:
        return None
    head = f"{name}: {cuda_build_text(backend)}"
    try:
        code = gpu_code(name, fetch=fetch, log=log)
    except (ValueError, OSError, gpucode.FatbinError) as exc:
        return f"{head}: not read: {exc}"
    if code is None:
        return (f"{head}: not read: its wheels are not in {wheel_root()} and no CUDA build is "
                f"installed (`trainperf env create {name}` reads them on a GPU machine before "
                "it builds)")
    fits = gpu_fits(name, gpus, code)
    text = " | ".join(f.line for f in fits)
    if not all(f.runs for f in fits):
        text += f"; cannot run here; instead: {instead_text(name)}"
    return f"{head}, read from {code.source}: {text}"


def check_gpus(name: str, log=None) -> None:
    """Before a CUDA build is made: a one-line ValueError where it cannot run on this
    machine's GPUs (no code for one of them, or a driver too old), naming what to use
    instead (`trainperf env create` prints what it found once the build is made). Nothing is
    checked where no GPU's compute capability is known; a build whose code cannot be read is
    built all the same, with a line saying so."""
    found = gpufit.gpus()
    if not found:
        return
    log = log or sys.stderr
    backend = get_backend(name)
    try:
        code = gpu_code(name, fetch=True, log=log)
    except (ValueError, OSError, gpucode.FatbinError) as exc:
        print(f"{name}: the CUDA build's GPU code was not read ({exc}); building without that "
              "check", file=log, flush=True)
        return
    if code is None:
        return
    fits = gpu_fits(name, found, code)
    bad = [f for f in fits if not f.runs]
    if bad:
        raise ValueError(f"the {name} CUDA build, {cuda_build_text(backend)}, cannot run on "
                         f"this machine's GPUs ({gpu_text(found)}): {bad[0].line}; instead: "
                         f"{instead_text(name)}")
