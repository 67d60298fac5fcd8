import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several test files run at a time on a machine of few cores, and the runs each one starts
    # take every core for their threads. OpenMP's threads then spin between parallel regions
    # on cores the other file's runs are waiting for: told to wait passively (here, before
    # torch loads OpenMP), the suite measured 8-9% faster on the 2-core VM. Benchmarks never
    # run this way: a run's own spinning is part of its framework's speed.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
# A test's own torch work takes its share of the cores: all of them, or, where xdist runs several
# files at a time, the cores over the workers.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)
                          // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)))

import pytest  # noqa: E402

SLOW_FIRST = ("test_emulated_frameworks.py", "test_jax_runs.py", "test_network_faults.py",
              "test_gpucheck.py", "test_slurm.py", "test_torch_modes.py", "test_tf_runs.py",
              "test_cli_run.py", "test_page_commands.py", "test_oneflow_runs.py",
              "test_rendezvous.py", "test_node_sweep.py", "test_mxnet_runs.py", "test_train.py",
              "test_tf_align.py", "test_search.py", "test_align.py", "test_tf_modes.py",
              "test_stall.py", "test_oneflow_align.py", "test_emulated_nodes.py",
              "test_mxnet_align.py", "test_paddle_runs.py", "test_modes.py",
              "test_rank_deaths.py", "test_mxnet_modes.py", "test_oneflow_modes.py",
              "test_commbench.py", "test_cli_data.py", "test_real_data_frameworks.py",
              "test_tf_models_heads.py", "test_step.py", "test_breakdown.py")
"""The files whose runs take longest (the suite's seconds per file in a fresh clone's `make test`
of 2026-12-07 on the 2-core VM, three files at a time), longest first: the 30 it printed,
then three more that took 25 s or more on 2026-12-02."""


def pytest_collection_modifyitems(session, config, items):
    # pytest-xdist's loadfile hands files to its workers in collection order: a long file
    # handed out last would run alone at the end while the other worker idles. Longest first
    # keeps both busy to the end; within a file the order stays as written.
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # Setup, call and teardown alike: a module's shared runs are made in its fixtures' setup.
    # Under xdist the controller gets every worker's reports here.
    FILE_SECONDS[report.nodeid.split("::")[0]] = (
        FILE_SECONDS.get(report.nodeid.split("::")[0], 0.0) + report.duration)


def pytest_terminal_summary(terminalreporter):
    """Where the suite's time goes, file by file: what SLOW_FIRST is ordered by, and where to
    look first when the suite gets slower."""
    if not FILE_SECONDS or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    ranked = sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"seconds per file (all {len(ranked)} files: "
                                    f"{sum(FILE_SECONDS.values()):.0f} s)")
    for name, seconds in ranked[:30]:
        terminalreporter.write_line(f"{seconds:8.1f}s {name}")


@pytest.fixture(scope="session", autouse=True)
def shared_torch_alignment_runs(tmp_path_factory):
    """Every framework's alignment test checks against the same torch runs (same start, same
    steps): torch runs each case once per session (``trainperf.align.CACHE_ENV``)."""
    from trainperf import align

    old = os.environ.get(align.CACHE_ENV)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist every worker's temporary folder sits in one run folder: the
        # workers share the cache there (its files are written atomically).
        folder = tmp_path_factory.getbasetemp().parent / "torch-alignment"
        folder.mkdir(exist_ok=True)
    else:
        folder = tmp_path_factory.mktemp("torch-alignment")
    os.environ[align.CACHE_ENV] = str(folder)
    yield
    if old is None:
        os.environ.pop(align.CACHE_ENV, None)
    else:
        os.environ[align.CACHE_ENV] = old


@pytest.fixture(scope="session", autouse=True)
def private_registries(tmp_path_factory):
    """What tests file (alignment verdicts, native parity ratios) stays out of the user's
    registries."""
    from trainperf import alignments, parities

    saved = {}
    for var, name in ((alignments.REGISTRY_ENV, "alignments"), (parities.REGISTRY_ENV, "parity")):
        saved[var] = os.environ.get(var)
        os.environ[var] = str(tmp_path_factory.mktemp(name))
    yield
    for var, old in saved.items():
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old


@pytest.fixture(scope="session")
def mxnet_python() -> str:
    """The MXNet environment's interpreter, built on first use and cached across sessions
    (``~/.cache/trainperf/envs``, or ``$TRAINPERF_ENV_DIR``)."""
    from trainperf import envs

    envs.create("mxnet", cuda=False)
    return envs.interpreter("mxnet")


def _framework_python(name: str) -> str:
    """A framework environment's interpreter, built on first use and cached across sessions."""
    from trainperf import envs

    envs.create(name, cuda=False)
    return envs.interpreter(name)


@pytest.fixture(scope="session")
def paddle_python() -> str:
    return _framework_python("paddle")


@pytest.fixture(scope="session")
def jax_python() -> str:
    return _framework_python("jax")


@pytest.fixture(scope="session")
def tf_python() -> str:
    return _framework_python("tf")


@pytest.fixture(scope="session")
def oneflow_python() -> str:
    """OneFlow's environment (a 3.9 GB CUDA build that also runs on a CPU), built on first use
    and cached. Its last wheels are for Python 3.8-3.10 only: on a machine without any of those
    OneFlow cannot run at all, and its tests skip saying so."""
    from trainperf import envs

    try:
        return _framework_python("oneflow")
    except envs.NoPython as exc:
        pytest.skip(str(exc))


DALI = "nvidia-dali-cuda120==2.4.0"


@pytest.fixture(scope="session")
def dali_site() -> str:
    """NVIDIA DALI (it runs CPU-only pipelines too), installed once per machine into a folder
    beside the framework environments and appended to ``sys.path``, so trainperf's own numpy
    and torch stay first. 1.1 GB; built on first use under a file lock."""
    import fcntl
    import importlib
    import shutil

    from trainperf import envs

    target = envs.env_root() / "dali-site"
    ready = target / ".ready"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "dali-site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists() or ready.read_text() != DALI:
            shutil.rmtree(target, ignore_errors=True)
            envs.pip_install(sys.executable, [DALI], target=str(target))
            ready.write_text(DALI)
        if not (target / ".compiled").exists():
            envs.compile_bytecode(sys.executable, target)
            (target / ".compiled").touch()
    if str(target) not in sys.path:
        sys.path.append(str(target))
        importlib.invalidate_caches()
    return str(target)


@pytest.fixture
def emulated_nodes():
    """Make emulated nodes: ``emulated_nodes(2, rate_bps=10**9)`` -> a made
    ``trainperf.emulated_nodes.EmulatedNodes``, removed when the test ends. Skips, saying why,
    where this machine cannot make network namespaces (no root, no iproute2)."""
    from trainperf.emulated_nodes import EmulatedNodes, missing_privilege

    why = missing_privilege()
    if why:
        pytest.skip(why)
    made = []

    def make(nodes: int = 2, rate_bps: int | None = None) -> EmulatedNodes:
        made.append(EmulatedNodes(nodes, rate_bps))
        return made[-1].make()

    yield make
    for nodes in made:
        nodes.remove()
