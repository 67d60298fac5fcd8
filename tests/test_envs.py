"""Per-framework environments: states, the one-line error for a missing one, and how a worker
gets this trainperf on its path."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainperf import envs
from trainperf.backends import BACKENDS, get_backend
from trainperf.cli import main


@pytest.fixture
def env_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINPERF_ENV_DIR", str(tmp_path / "envs"))
    return tmp_path / "envs"


def test_torch_runs_in_trainperfs_own_interpreter(env_root):
    st = envs.state("torch")
    assert st.state == "built-in" and "torch" in st.versions


def test_missing_environment_says_how_to_create_it(env_root):
    assert envs.state("mxnet").state == "missing"
    with pytest.raises(ValueError, match=r"create it with `trainperf env create mxnet`"):
        envs.interpreter("mxnet")


def test_unfinished_and_outdated_environments_are_not_used(env_root):
    folder = env_root / "mxnet"
    (folder / "bin").mkdir(parents=True)
    assert envs.state("mxnet").detail == "unfinished build"  # no manifest: the build stopped
    python = folder / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    manifest = {"packages": ["mxnet==1.8.0"], "cuda": False, "versions": {"mxnet": "1.8.0"}}
    (folder / envs.MANIFEST).write_text(json.dumps(manifest))
    assert envs.state("mxnet").state == "outdated"
    with pytest.raises(ValueError, match="outdated"):
        envs.interpreter("mxnet")
    manifest["packages"] = envs.wanted_packages(get_backend("mxnet"), cuda=False)
    (folder / envs.MANIFEST).write_text(json.dumps(manifest))
    assert envs.interpreter("mxnet") == str(python)


def test_an_environment_built_without_bytecode_is_compiled_once(env_root, monkeypatch, gpus):
    """Environments built before they were compiled get their modules' bytecode the next time
    they are asked for, once: with ``PYTHONDONTWRITEBYTECODE`` set nothing else writes it. A
    file that does not compile is left as it is."""
    monkeypatch.setattr(envs, "base_python", lambda backend: sys.executable)
    folder = env_root / "mxnet"
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    site = folder / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "framework.py").write_text("ANSWER = 42\n")
    (site / "not_python.py").write_text("this is no module\n")
    manifest = {"packages": envs.wanted_packages(get_backend("mxnet"), cuda=False),
                "cuda": False, "versions": {"mxnet": "1.9.1"}}
    (folder / envs.MANIFEST).write_text(json.dumps(manifest))
    compiled = Path(importlib.util.cache_from_source(str(site / "framework.py")))
    assert envs.create("mxnet", cuda=False).state == "ready"
    assert compiled.exists()
    assert not list(site.glob("__pycache__/not_python.*"))
    assert json.loads((folder / envs.MANIFEST).read_text()) == {**manifest, "bytecode": True}
    compiled.unlink()
    assert envs.create("mxnet", cuda=False).state == "ready"
    assert not compiled.exists()  # recorded: never compiled again


def test_run_with_a_missing_environment_is_a_usage_error(env_root, tmp_path, capsys):
    code = main(["run", "tiny-arcface", "--framework", "torch,mxnet", "--out",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "trainperf env create mxnet" in err[0]
    assert not (tmp_path / "out").exists()  # nothing ran: every environment is checked first


def test_env_list_names_every_backend(env_root, capsys):
    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out
    for name in BACKENDS:
        assert name in out


def test_package_link_gives_this_trainperf_and_nothing_else(tmp_path):
    folder = envs.package_link_dir(tmp_path)
    assert [p.name for p in folder.iterdir()] == ["trainperf"]
    assert envs.package_link_dir(tmp_path) == folder  # a second run reuses the link
    # -I: no PYTHONPATH, no user site; the folder is the only way to trainperf.
    code = (f"import sys; sys.path.insert(0, {str(folder)!r}); import trainperf.protocol as p; "
            "print(p.__file__)")
    out = subprocess.run(["python3", "-I", "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == str(folder / "trainperf" / "protocol.py")


def test_mxnet_environment_holds_the_framework_numpy_and_horovod_built_for_it(mxnet_python):
    """Horovod compiled in the environment against its MXNet (with gloo; no NCCL on a CPU),
    recorded in the manifest; nothing of trainperf's own environment."""
    out = subprocess.run([mxnet_python, "-c", "import json, importlib.metadata as m; print("
                          "json.dumps(sorted(d.metadata['Name'].lower() for d in "
                          "m.distributions())))"], capture_output=True, text=True,
                         check=True).stdout
    installed = set(json.loads(out))
    assert {"mxnet", "numpy", "horovod"} <= installed
    assert not installed & {"torch", "trainperf", "rich"}
    manifest = json.loads((Path(mxnet_python).parents[1] / envs.MANIFEST).read_text())
    assert manifest["packages"][-1] == "horovod==0.28.1"
    assert {k: manifest["versions"][k] for k in ("horovod", "horovod_gloo", "horovod_nccl")
            } == {"horovod": "0.28.1", "horovod_gloo": True, "horovod_nccl": None}
    assert manifest["build_s"] > 0


def test_an_mxnet_environment_without_horovod_is_outdated(env_root):
    folder = env_root / "mxnet"
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)
    manifest = {"packages": ["mxnet==1.9.1", "numpy<1.24"], "cuda": False}
    (folder / envs.MANIFEST).write_text(json.dumps(manifest))
    assert envs.state("mxnet").state == "outdated"


def test_horovods_build_takes_nccl_from_the_wheel_where_there_is_cuda(monkeypatch, tmp_path):
    """The CUDA build's variables point Horovod at the NCCL wheel in the environment (its
    headers, the folder that gets the libnccl.so link, the run path); a CPU build has none of
    them. A missing compiler is said before anything is built."""
    (horovod,) = get_backend("mxnet").env.source_builds
    site = tmp_path / "site"
    monkeypatch.delenv("MAKEFLAGS", raising=False)
    monkeypatch.setattr(envs, "_tool_path", lambda tool, build=None: f"/usr/bin/{tool}")
    cpu = envs.build_env(horovod, False, site)
    assert {k: cpu[k] for k in ("HOROVOD_WITH_MXNET", "HOROVOD_WITH_GLOO",
                                "HOROVOD_WITHOUT_MPI", "HOROVOD_WITHOUT_TENSORFLOW",
                                "HOROVOD_WITHOUT_PYTORCH")} == dict.fromkeys(
        ("HOROVOD_WITH_MXNET", "HOROVOD_WITH_GLOO", "HOROVOD_WITHOUT_MPI",
         "HOROVOD_WITHOUT_TENSORFLOW", "HOROVOD_WITHOUT_PYTORCH"), "1")
    assert "HOROVOD_GPU_OPERATIONS" not in cpu and cpu["MAKEFLAGS"].startswith("-j")
    cuda = envs.build_env(horovod, True, site)
    lib = f"{site}/nvidia/nccl/lib"
    assert cuda["HOROVOD_GPU_OPERATIONS"] == "NCCL" and cuda["HOROVOD_NCCL_LINK"] == "SHARED"
    assert cuda["HOROVOD_NCCL_INCLUDE"] == f"{site}/nvidia/nccl/include"
    assert cuda["HOROVOD_NCCL_LIB"] == lib and cuda["LDFLAGS"] == f"-Wl,-rpath,{lib}"
    assert cuda["HOROVOD_CUDA_HOME"] == "/usr" and cuda["PATH"].startswith("/usr/bin:")
    assert horovod.cuda_links == {"{site}/nvidia/nccl/lib/libnccl.so": "libnccl.so.2"}
    assert any(p.startswith("nvidia-nccl-cu11==") for p in get_backend("mxnet").env.cuda_packages)
    monkeypatch.setattr(envs, "_tool_path",
                        lambda tool, build=None: None if tool == "nvcc" else tool)
    envs.check_tools(horovod, False)  # a CPU build needs no nvcc
    with pytest.raises(ValueError, match=r"building horovod==0.28.1 needs nvcc \(nvcc: a CUDA "
                       r"toolkit with cuda_runtime.h, cuda.h, cublas_v2.h, curand.h, in "):
        envs.check_tools(horovod, True)


def test_horovods_cuda_build_refuses_an_nvcc_of_another_cuda_major_before_compiling(
        env_root, monkeypatch, tmp_path):
    """MXNet's CUDA build is CUDA 11.7: an nvcc of 12.x is refused in one line before the
    environment is touched, one of 11.8 goes ahead, and a CPU build asks nothing of nvcc."""
    nvcc = tmp_path / "cuda/bin/nvcc"
    nvcc.parent.mkdir(parents=True)
    monkeypatch.setattr(envs, "_tool_path",
                        lambda tool, build=None: str(nvcc) if tool == "nvcc" else tool)
    monkeypatch.setattr(envs, "base_python", lambda backend: sys.executable)
    monkeypatch.setattr(envs.gpufit, "real_gpus", lambda: None)  # no GPU's code is checked
    monkeypatch.delenv(envs.gpufit.STANDIN_VAR, raising=False)
    started = []

    def build(path, python, packages, no_deps, log):
        started.append(packages)
        raise RuntimeError("stop: the decision is what is tested")

    monkeypatch.setattr(envs, "_build", build)

    def release(line: str) -> None:
        nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\necho '{line}'\n")
        nvcc.chmod(0o755)

    release("Cuda compilation tools, release 12.4, V12.4.131")
    with pytest.raises(ValueError) as refused:
        envs.create("mxnet", cuda=True)
    assert str(refused.value) == (
        f"{nvcc} is CUDA 12.4, and mxnet's CUDA build is CUDA 11.7: building horovod==0.28.1 "
        "for it needs a CUDA 11.x toolkit's nvcc; point $HOROVOD_CUDA_HOME at one")
    assert not envs.env_dir("mxnet").exists() and started == []
    release("Build cuda_11.8.r11.8/compiler.31833905_0")
    with pytest.raises(ValueError, match="names no CUDA release; building horovod==0.28.1 for "
                                         "mxnet's CUDA 11.7 build needs a CUDA 11.x toolkit"):
        envs.create("mxnet", cuda=True)
    release("Cuda compilation tools, release 11.8, V11.8.89")
    with pytest.raises(RuntimeError, match="stop"):
        envs.create("mxnet", cuda=True)
    release("Cuda compilation tools, release 12.4, V12.4.131")
    with pytest.raises(RuntimeError, match="stop"):
        envs.create("mxnet", cuda=False)
    assert started == [list(get_backend("mxnet").env.cuda_packages),
                       list(get_backend("mxnet").env.packages)]


def test_the_cuda_toolkit_is_one_with_every_header_the_build_includes(monkeypatch, tmp_path):
    """A wrapper ``nvcc`` on PATH outside its toolkit, or a toolkit without cuBLAS's headers
    (which a CUDA MXNet's headers include), is passed over for one that has them."""
    def toolkit(name: str, headers: tuple[str, ...]) -> Path:
        root = tmp_path / name
        (root / "bin").mkdir(parents=True)
        (root / "include").mkdir()
        (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
        (root / "bin" / "nvcc").chmod(0o755)
        for h in headers:
            (root / "include" / h).write_text("")
        return root

    wanted = ("cuda_runtime.h", "cublas_v2.h")
    slim = toolkit("slim", ("cuda_runtime.h",))
    full = toolkit("full", wanted)
    monkeypatch.setenv("PATH", str(slim / "bin"))
    for var in envs.CUDA_HOMES:
        monkeypatch.delenv(var, raising=False)
    assert envs.cuda_home(("cuda_runtime.h",)) == slim
    monkeypatch.setenv("CUDA_HOME", str(full))
    assert envs.cuda_home(wanted) == full
    monkeypatch.delenv("CUDA_HOME")
    assert envs.cuda_home(wanted) in (None, Path("/usr/local/cuda"))


def test_a_framework_tied_to_other_pythons_gets_one_or_a_one_line_error(monkeypatch, tmp_path):
    """OneFlow's wheels exist for Python 3.8-3.10 only: its environment is made from such an
    interpreter when one starts (on PATH, or installed by pyenv), and otherwise the user is told
    in one line, before anything is built."""
    from dataclasses import replace

    backend = get_backend("oneflow")
    here = ".".join(sys.version.split()[0].split(".")[:2])
    assert envs.base_python(replace(backend, env=replace(backend.env, pythons=(here,)))) \
        == sys.executable
    monkeypatch.setenv("PATH", str(tmp_path))  # no interpreter of any version on PATH
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    with pytest.raises(ValueError, match=r"needs Python 3.10 or 3.9 or 3.8 .* none is on PATH"):
        envs.base_python(backend)
    # A pyenv install of a wanted version is found although its shim is not on PATH.
    fake = tmp_path / "no-pyenv" / "versions" / "3.9.1" / "bin" / "python3.9"
    fake.parent.mkdir(parents=True)
    fake.symlink_to(sys.executable)
    assert envs.base_python(backend) == str(fake)


def test_the_frameworks_environments_hold_their_own_numpy(paddle_python, jax_python, tf_python):
    """Each framework pins its own numpy; the environments keep them apart and hold no torch."""
    for python, framework in ((paddle_python, "paddlepaddle"), (jax_python, "jax"),
                              (tf_python, "tensorflow-cpu")):
        out = subprocess.run([python, "-c", "import json, importlib.metadata as m; print("
                              "json.dumps(sorted(d.metadata['Name'].lower() for d in "
                              "m.distributions())))"], capture_output=True, text=True,
                             check=True).stdout
        installed = {name.replace("_", "-") for name in json.loads(out)}
        assert {framework, "numpy"} <= installed
        assert not installed & {"torch", "trainperf", "mxnet"}
        # Compiled: no worker compiles its framework from source at each start.
        out = subprocess.run([python, "-c", "import importlib.util, numpy; print(importlib.util"
                              ".cache_from_source(numpy.__file__))"], capture_output=True,
                             text=True, check=True).stdout
        assert Path(out.strip()).is_file(), (python, out)


def fake_env(root: Path, name: str, cuda: bool, **manifest) -> Path:
    """A finished environment of ``name`` built for CUDA or the CPU: its manifest and an
    interpreter that leaves a mark each time it starts (a run that launched a worker)."""
    folder = root / name
    (folder / "bin").mkdir(parents=True)
    python = folder / "bin" / "python"
    python.write_text(f"#!/bin/sh\ntouch {folder / 'started'}\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    doc = {"packages": envs.wanted_packages(get_backend(name), cuda), "cuda": cuda,
           "versions": {name: "1.0"}, "bytecode": True, **manifest}
    (folder / envs.MANIFEST).write_text(json.dumps(doc))
    return folder


@pytest.fixture
def gpus(monkeypatch):
    """Sets how many GPUs this machine has, as the environments see it."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(envs, "gpu_count", lambda: n)

    set_count(0)
    return set_count


def test_a_cpu_build_is_outdated_on_a_machine_with_gpus(env_root, gpus):
    """Nothing but the GPUs changed: the CPU build is ready without them and outdated with
    them, saying why in one line, yet it still runs CPU runs; a CUDA build is ready on both."""
    fake_env(env_root, "paddle", cuda=False)
    st = envs.state("paddle")
    assert (st.state, st.cuda, st.runs, st.detail) == ("ready", False, ("cpu",), "")
    gpus(8)
    st = envs.state("paddle")
    assert (st.state, st.runs) == ("outdated", ("cpu",))
    assert st.detail == "built for the CPU; this machine has 8 GPUs"
    fake_env(env_root, "jax", cuda=True)
    assert (envs.state("jax").state, envs.state("jax").runs) == ("ready", ("cpu", "cuda"))
    gpus(0)
    assert envs.state("jax").state == "ready"  # a CUDA build runs on the CPU too


def test_oneflows_one_build_serves_cuda_and_mxnets_cpu_build_does_not(env_root, gpus):
    """OneFlow builds one way (its PyPI wheel is the CUDA build): a manifest saying ``cuda:
    false`` is as good as CUDA. MXNet's CPU manifest is not, its Horovod compiling otherwise."""
    assert envs.same_on_cuda(get_backend("oneflow"))
    assert not envs.same_on_cuda(get_backend("mxnet"))
    assert envs.serves_cuda(get_backend("oneflow"), {"cuda": False})
    assert not envs.serves_cuda(get_backend("mxnet"), {"cuda": False})
    gpus(8)
    folder = fake_env(env_root, "oneflow", cuda=False)
    assert envs.state("oneflow").state == "ready"
    assert envs.interpreter("oneflow", "cuda") == str(folder / "bin" / "python")
    fake_env(env_root, "mxnet", cuda=False)
    assert envs.state("mxnet").state == "outdated"


def test_a_cuda_run_with_a_cpu_build_is_refused_before_anything_starts(env_root, tmp_path,
                                                                      gpus, capsys):
    """Every plan's environment is checked before the first run: torch's plan, checked first,
    starts nothing either, no results folder is written, and Paddle's interpreter never
    starts. The line names the command that fixes it. A machine without GPUs does not refuse
    ``--device cuda`` earlier (the worker would, once started): the same check refuses it."""
    folder = fake_env(env_root, "paddle", cuda=False)
    for count, fix in ((8, "run `trainperf env create paddle` (it rebuilds it for this "
                           "machine's 8 GPUs)"),
                       (0, "`trainperf env create paddle` builds it on a machine with an "
                           "NVIDIA GPU (this one has none)")):
        gpus(count)
        out = tmp_path / f"out{count}"
        code = main(["run", "tiny-arcface", "--framework", "torch,paddle", "--device", "cuda",
                     "--out", str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err == [
            "trainperf: error: the paddle environment is built for the CPU, and a CUDA run "
            f"(--device cuda, or auto on a GPU machine) needs its CUDA build: {fix}"]
        assert not out.exists() and not (folder / "started").exists()


def test_a_cpu_run_takes_the_cpu_build_on_a_machine_with_gpus(env_root, tmp_path, gpus):
    """Outdated only for want of CUDA, the build still runs CPU runs: the runner takes it (and
    starts nothing on being made)."""
    from trainperf.config import Measure, Topology, Tuning
    from trainperf.plans import throughput_plans
    from trainperf.runner import Runner

    folder = fake_env(env_root, "paddle", cuda=False)
    gpus(8)
    python = str(folder / "bin" / "python")
    assert envs.interpreter("paddle", "cpu") == python
    assert envs.interpreter("paddle") == python  # a CPU run unless told
    (plan,) = throughput_plans("tiny-arcface", {}, None, [1], Measure(), Tuning(),
                               Topology(1, device="cpu"), ["paddle"], tmp_path / "out")
    assert Runner(plan).launcher.python == python
    assert not (folder / "started").exists()


def test_create_rebuilds_a_cpu_build_for_the_gpus_and_cpu_enough_keeps_any(env_root, gpus,
                                                                            monkeypatch):
    """On a GPU machine `trainperf env create` rebuilds a CPU build for CUDA; ``--cpu`` (a CPU
    build is enough) keeps it, and never replaces a CUDA build with a CPU one."""
    built = []

    def build(path, python, packages, no_deps, log):
        built.append(packages)
        raise RuntimeError("stop: the decision is what is tested")

    monkeypatch.setattr(envs, "_build", build)
    monkeypatch.setattr(envs, "base_python", lambda backend: sys.executable)
    monkeypatch.setattr(envs, "_pip_index_args", lambda: [])
    fake_env(env_root, "paddle", cuda=False)
    fake_env(env_root, "jax", cuda=True)
    gpus(8)
    assert envs.needs_build(envs.state("paddle"), cuda=True)
    assert not envs.needs_build(envs.state("paddle"), cuda=False)
    assert not envs.needs_build(envs.state("jax"), cuda=False)
    assert envs.needs_build(envs.state("jax"), cuda=False, force=True)
    assert envs.create("paddle", cuda=False).state == "outdated"  # kept: it runs CPU runs
    assert envs.create("jax", cuda=False).state == "ready"  # the CUDA build stays
    assert envs.create("jax").state == "ready"
    assert built == []
    with pytest.raises(RuntimeError, match="stop"):
        envs.create("paddle")
    assert built == [list(get_backend("paddle").env.cuda_packages)]
    gpus(0)
    fake_env(env_root / "elsewhere", "paddle", cuda=False)
    monkeypatch.setenv("TRAINPERF_ENV_DIR", str(env_root / "elsewhere"))
    assert envs.create("paddle").state == "ready"  # no GPU: the CPU build is this machine's


def test_the_manifest_records_the_indexes_the_build_used(monkeypatch):
    """pip's configured indexes and those in the requirements (Paddle's CUDA wheels come from
    Paddle's own index), the main index first."""
    monkeypatch.setattr(envs, "_pip_index_args", lambda: [
        "--find-links", "/opt/wheels", "--extra-index-url", "file:///opt/pypi/simple",
        "--index-strategy", "unsafe-best-match"])
    monkeypatch.delenv("UV_DEFAULT_INDEX", raising=False)
    monkeypatch.delenv("UV_INDEX_URL", raising=False)
    paddle = get_backend("paddle").env
    assert envs.package_indexes(paddle.packages) == [
        envs.PYPI, "/opt/wheels (find-links)", "file:///opt/pypi/simple"]
    assert envs.package_indexes(paddle.cuda_packages) == [
        envs.PYPI, "/opt/wheels (find-links)", "file:///opt/pypi/simple",
        "https://www.paddlepaddle.org.cn/packages/stable/cu126/"]
    monkeypatch.setattr(envs, "_pip_index_args",
                        lambda: ["--index-url", "https://mirror.example/simple"])
    assert envs.package_indexes(paddle.packages) == ["https://mirror.example/simple"]


def test_env_list_shows_each_build_its_packages_indexes_and_size(env_root, gpus, capsys,
                                                                 monkeypatch):
    """A row per environment: CPU or CUDA, the packages (an index option among them shows as
    an index), where they came from ("not recorded" for a manifest older than that), the
    folder's size on disk, and why it is outdated."""
    paddle_index = "https://www.paddlepaddle.org.cn/packages/stable/cu126/"
    paddle = fake_env(env_root, "paddle", cuda=True, indexes=[envs.PYPI, paddle_index])
    (paddle / "lib").mkdir()
    (paddle / "lib" / "big.bin").write_bytes(b"\1" * 3_000_000)
    (paddle / "lib" / "again.bin").hardlink_to(paddle / "lib" / "big.bin")  # counted once
    (paddle / "lib" / "python").symlink_to(Path(sys.executable).resolve().parent)
    fake_env(env_root, "jax", cuda=False)
    gpus(8)
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["env", "list"]) == 0
    rows: dict[str, list[list[str]]] = {}
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("│"):  # a cell of several lines continues under an empty name
            name, *cells = (c.strip() for c in line.split("│")[1:-1])
            if name:
                rows[name] = [[c] if c else [] for c in cells]
            else:
                for lines, c in zip(rows[list(rows)[-1]], cells):
                    lines += [c] if c else []
    state, build, versions, packages, indexes, size, detail = rows["paddle"]
    assert (state, build, versions) == (["ready"], ["CUDA"], ["paddle 1.0"])
    assert packages == ["paddlepaddle-gpu==3.3.1", "numpy>=1.26,<3"]
    assert indexes == [envs.PYPI, paddle_index]
    assert size == ["3.0 MB"] and detail == []
    state, build, _, packages, indexes, size, detail = rows["jax"]
    assert (state, build, indexes) == (["outdated"], ["CPU"], ["not recorded"])
    assert packages == ["jax==0.10.2", "flax==0.12.8", "optax==0.2.8"]
    assert detail == ["built for the CPU; this machine has 8 GPUs"]
    assert rows["tf"][:2] == [["missing"], ["-"]] and rows["tf"][-1] == ["not created"]
    assert rows["torch"][:2] == [["built-in"], ["-"]]
    assert "".join(rows["torch"][-1]).endswith(sys.executable)  # not in the folder of builds


def test_the_users_own_interpreter_is_taken_for_either_device(env_root, gpus, monkeypatch):
    """What ``TRAINPERF_<NAME>_PYTHON`` holds is the user's to say: no build of trainperf's is
    asked of it, on a machine with GPUs or without."""
    monkeypatch.setenv(envs.python_override_var("paddle"), sys.executable)
    gpus(8)
    assert envs.interpreter("paddle", "cuda") == envs.interpreter("paddle") == sys.executable
