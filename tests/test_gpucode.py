"""The GPU code of CUDA builds, read from their libraries' fatbins (``trainperf.gpucode``), and
whether a build runs on a GPU and driver (``trainperf.gpufit``): the reader on hand-made
libraries for its edge cases, then on the MXNet and JAX CUDA builds' own wheels, downloaded
from PyPI once into ``~/.cache/trainperf/wheels`` (657 MB and 183 MB; the other builds' are
read by ``benchmarks/gpucode_wheels.py``)."""

from __future__ import annotations

import json
import os
import stat
import sys
import zipfile

import pytest
from fatbins import container, elf, entry

from trainperf import envs, gpucode, gpufit
from trainperf.backends import get_backend
from trainperf.cli import main

PTX, CUBIN = gpucode.KIND_PTX, gpucode.KIND_CUBIN


def test_a_library_with_several_sections_and_containers():
    """Two containers back to back (zeros between them) in .nv_fatbin, a compressed PTX
    entry, a 96-byte header (sm_100), a PTX-only container, relocatable code in
    __nv_relfatbin, a fatbin kept as data in .rodata after a stray copy of the magic, and a
    .bss that takes no room in the file."""
    first = container(entry(CUBIN, 80, payload=b"sass" * 5),
                      entry(PTX, 80, (7, 7), payload=b"lz" * 9, compressed=True, expanded=400),
                      entry(CUBIN, 100, header=96))
    ptx_only = container(entry(PTX, 90, (8, 0), payload=b".version 8.0\n"))
    stray = gpucode.MAGIC_BYTES + b"\x07\x00\x10\x00" + bytes(8)
    data = elf([(".text", b"\x90" * 100), (".nv_fatbin", first + bytes(8) + ptx_only),
                ("__nv_relfatbin", container(entry(CUBIN, 70))),
                (".rodata", b"tables" + stray + container(entry(CUBIN, 86)) + b"more")],
               bss=1 << 20)
    code = gpucode.library_code(data)
    assert code == gpucode.LibraryCode(cubins=(70, 80, 86, 100), ptx=((80, "7.7"), (90, "8.0")),
                                       other=0, entries=6, containers=4, compressed=1,
                                       embedded=1)


def test_ptx_only_and_the_newest_isa_of_an_architecture():
    data = elf([(".nv_fatbin", container(entry(PTX, 80, (7, 0)), entry(PTX, 80, (7, 8)),
                                         entry(PTX, 52, (7, 0)), entry(8, 80)))])
    code = gpucode.library_code(data)
    assert (code.cubins, code.ptx, code.other) == ((), ((52, "7.0"), (80, "7.8")), 1)


def test_libraries_without_device_code_and_files_that_are_not_libraries(tmp_path):
    plain = tmp_path / "libplain.so"
    plain.write_bytes(elf([(".text", b"\x90" * 64), (".rodata", b"no magic here")]))
    script = tmp_path / "notes.so.txt"
    script.write_bytes(b"#!/bin/sh\n" + bytes(100))
    assert gpucode.file_code(plain) is None and gpucode.file_code(script) is None
    with pytest.raises(gpucode.FatbinError, match="64-bit little-endian"):
        gpucode.library_code(elf([(".nv_fatbin", container(entry(CUBIN, 80)))], bits=32))


@pytest.mark.parametrize("bad, why", [
    (container(entry(CUBIN, 80))[:-8], "runs 8 bytes past its section"),
    (container(entry(CUBIN, 80, header=32)), "header 32 bytes"),
    (container(entry(CUBIN, 80)[:16] + b"\xe7\x03" + entry(CUBIN, 80)[18:]),
     "payload 999 of 8"),
    (b"\1\2\3\4" + bytes(12), "no fatbin magic"),
])
def test_a_fatbin_section_that_does_not_parse_is_an_error(bad, why):
    with pytest.raises(gpucode.FatbinError, match=why):
        gpucode.library_code(elf([(".nv_fatbin", bad)]))


def _wheel(path, libraries: dict[str, bytes]):
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in libraries.items():
            zf.writestr(name, data)
    return path


def test_a_wheels_summary_is_kept_beside_it_and_read_again_only_when_it_changes(tmp_path,
                                                                              monkeypatch):
    wheel = _wheel(tmp_path / "fw_cu99-1.0-py3-none-manylinux2014_x86_64.whl", {
        "fw/libfw.so": elf([(".nv_fatbin", container(entry(CUBIN, 75), entry(PTX, 75, (7, 7))))]),
        "fw/libhelper.so.1": elf([(".text", b"\x90" * 64)]),
        "fw/_native.so": b"not an ELF file at all, though named like one",
        "fw/__init__.py": b""})
    doc = gpucode.read_wheel(wheel)
    assert doc["libraries"] == {"fw/libfw.so": {
        "cubin": [75], "ptx": [[75, "7.7"]], "other": 0, "entries": 2, "containers": 1,
        "compressed": 0, "embedded": 0}}
    assert gpucode.summary_path(wheel).is_file()
    with monkeypatch.context() as m:
        m.setattr(gpucode, "wheel_code", lambda wheel: pytest.fail("read again"))
        assert gpucode.read_wheel(wheel) == doc
    _wheel(wheel, {"fw/libfw.so": elf([(".nv_fatbin", container(entry(CUBIN, 90)))])})
    assert gpucode.read_wheel(wheel)["libraries"]["fw/libfw.so"]["cubin"] == [90]
    _wheel(wheel, {"fw/libfw.so": elf([(".nv_fatbin", container(entry(CUBIN, 90))[:-8])])})
    with pytest.raises(gpucode.FatbinError, match=f"{wheel.name}: fw/libfw.so: .* past"):
        gpucode.read_wheel(wheel)


def _code(cubins=(), ptx=()):
    return gpucode.LibraryCode(tuple(cubins), tuple(ptx))


@pytest.mark.parametrize("cubins, ptx, cap, kind, sm", [
    ((80,), (), (8, 6), "cubin", 80),       # a cubin runs on a higher minor of its major
    ((86,), (), (8, 0), "none", 0),         # never on a lower one
    ((80, 86), (), (9, 0), "none", 0),      # nor on another major
    ((80, 86), ((80, "7.7"),), (9, 0), "ptx", 80),  # PTX of a lower capability compiles
    ((), ((90, "8.0"),), (8, 9), "none", 0),        # PTX of a higher one does not
    ((70, 90), ((90, "8.0"),), (9, 0), "cubin", 90),  # a cubin before PTX
    ((80, 86), (), (8, 9), "cubin", 86),    # the highest minor that fits
])
def test_which_code_of_a_library_runs_on_a_gpu(cubins, ptx, cap, kind, sm):
    fit = gpufit.code_fit(_code(cubins, ptx), cap)
    assert (fit.kind, fit.sm) == (kind, sm)


@pytest.mark.parametrize("cuda, driver, jit, ok, words", [
    ("11.7", "550.54.15", (), True, "new enough for CUDA 11.7 (515.43.04 or newer)"),
    ("11.7", "470.82.01", (), True, "runs by minor version compatibility (CUDA 11.x from "
                                    "450.80.02)"),
    ("11.7", "450.51.06", (), False, "too old for CUDA 11.7: it needs 450.80.02"),
    ("11.7", "470.82.01", ("7.7",), False, "cannot compile PTX ISA 7.7 just in time: that "
                                           "needs 515.43.04"),
    ("12.9", "560.35.05", ("8.8",), False, "cannot compile PTX ISA 8.8 just in time: that "
                                           "needs 575.51.03"),
    ("12.9", "560.35.05", (), True, "minor version compatibility (CUDA 12.x from 525.60.13)"),
    ("12.5", "520.61.05", (), False, "too old for CUDA 12.5: it needs 525.60.13"),
    ("12.8", "570.26", ("8.6",), True, "new enough for CUDA 12.8"),  # 12.7's ISA: 12.8's driver
    ("11.7", None, (), True, "driver not known; CUDA 11.7 wants 515.43.04 or newer (11.x runs "
                             "from 450.80.02)"),
])
def test_whether_the_driver_runs_a_build(cuda, driver, jit, ok, words):
    fit = gpufit.driver_fit(cuda, driver, jit)
    assert fit.ok == ok and words in fit.text


def _fake_nvidia_smi(folder, query_out: str, query_rc: int = 0, listing: str = ""):
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n"
                      f'if [ "$1" = "-L" ]; then printf "%s" "{listing}"; exit 0; fi\n'
                      f'printf "%s" "{query_out}"; exit {query_rc}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_a_real_gpu_always_wins_over_the_stand_in(tmp_path, monkeypatch):
    monkeypatch.setenv(gpufit.STANDIN_VAR, "9.0,550.54.15")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    (tmp_path / "bin").mkdir()
    assert gpufit.gpus() == [gpufit.Gpu((9, 0), "550.54.15", "stand-in GPU", standin=True)]
    _fake_nvidia_smi(tmp_path / "bin", "8.0, 535.104.05, NVIDIA A100-SXM4-80GB\n"
                                       "8.0, 535.104.05, NVIDIA A100-SXM4-80GB\n")
    assert gpufit.gpus() == [gpufit.Gpu((8, 0), "535.104.05", "NVIDIA A100-SXM4-80GB")] * 2
    # A driver that cannot say the compute capability: real GPUs all the same, none checked.
    _fake_nvidia_smi(tmp_path / "bin", 'Field \\"compute_cap\\" is not a valid field', 2,
                     "GPU 0: Tesla V100-SXM2-16GB (UUID: GPU-1)\n")
    assert gpufit.gpus() == []
    _fake_nvidia_smi(tmp_path / "bin", "No devices were found", 6)  # a driver, no GPU
    assert gpufit.gpus()[0].standin
    monkeypatch.setenv(gpufit.STANDIN_VAR, "sm_90")
    with pytest.raises(ValueError, match="TRAINPERF_STANDIN_GPU='sm_90': give a compute"):
        gpufit.gpus()


# --- The MXNet and JAX CUDA builds' own wheels ------------------------------------------------

READ = ("mxnet", "jax")


@pytest.fixture(scope="module")
def builds():
    """What the MXNet and JAX CUDA builds hold, from their wheels: downloaded once into the
    wheel cache (``TRAINPERF_WHEEL_DIR``, by default ~/.cache/trainperf/wheels) and read once
    (the summary kept beside each)."""
    out = {}
    for name in READ:
        code = envs.gpu_code(name, fetch=True, log=sys.stderr)
        assert code is not None and code.source.startswith("its wheels"), name
        out[name] = code
    return out


def _short(code: envs.GpuCode) -> dict:
    return {gpufit.library_label(p): (c.cubins, c.ptx) for p, c in code.libraries.items()}


def test_the_mxnet_cuda_builds_wheels_have_no_code_for_sm_90(builds):
    """MXNet 1.9.1's cu117 build predates sm_90: cubins up to sm_86 and no PTX to compile
    for anything newer. Its NCCL (2.21.5 for CUDA 11, built with CUDA 11.0: PTX ISA 7.0)
    carries PTX of compute_80."""
    code = builds["mxnet"]
    assert code.main.endswith("mxnet/libmxnet.so")
    assert _short(code) == {"libmxnet.so": ((50, 60, 70, 80, 86), ()),
                            "libnccl.so.2": ((35, 50, 60, 61, 70, 80), ((80, "7.0"),))}
    assert code.libraries[code.main].compressed == code.libraries[code.main].entries == 985


def test_the_jax_cuda_builds_wheels_have_cubins_for_sm_90_and_ptx_of_cuda_12_9(builds):
    code = builds["jax"]
    assert code.main.endswith("jax_plugins/xla_cuda12/xla_cuda_plugin.so")
    every = (50, 60, 70, 80, 90, 100, 101, 120)
    assert _short(code) == {name: (every, ((120, "8.8"),)) for name in (
        "xla_cuda_plugin.so", "_linalg.so", "_prng.so", "_solver.so")}


@pytest.mark.parametrize("name", READ)
def test_no_library_of_a_build_is_of_a_newer_cuda_than_it_declares(builds, name):
    """The driver a build is checked against follows from its declared CUDA release: no PTX
    in its wheels may come from a newer one (it would need a newer driver to compile)."""
    declared = gpufit.cuda_release(get_backend(name).env.cuda)
    isas = {isa for c in builds[name].libraries.values() for _, isa in c.ptx}
    assert all(gpufit.PTX_CUDA[gpufit.cuda_release(isa)] <= declared for isa in isas)


def test_env_list_on_a_stand_in_gpu_of_9_0_says_which_builds_have_code_for_it(
        builds, tmp_path, monkeypatch, capsys):
    """The issue's done-when line: on a machine without a GPU, the stand-in of compute
    capability 9.0 and driver 550.54.15, with no environment built."""
    monkeypatch.setattr(gpufit, "real_gpus", lambda: None)
    monkeypatch.setenv(gpufit.STANDIN_VAR, "9.0,550.54.15")
    monkeypatch.setenv("TRAINPERF_ENV_DIR", str(tmp_path / "envs"))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["env", "list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(":", 1)[0]: line for line in out.splitlines()[-5:]}
    assert out.splitlines()[-6] == ("GPUs: compute capability 9.0, driver 550.54.15 (a "
                                    "stand-in: $TRAINPERF_STANDIN_GPU)")
    assert ("libmxnet.so has code for sm_90: no (cubins sm_50, sm_60, sm_70, sm_80, sm_86; no "
            "PTX); compiled just in time: libnccl.so.2 (compute_80); driver 550.54.15: new "
            "enough for CUDA 11.7 (515.43.04 or newer); cannot run here; instead: none: 1.9.1 "
            "is MXNet's last release") in lines["mxnet"]
    assert lines["jax"].endswith("xla_cuda_plugin.so has code for sm_90: yes (cubin sm_90); "
                                 "driver 550.54.15: older than CUDA 12.9's 575.51.03; runs by "
                                 "minor version compatibility (CUDA 12.x from 525.60.13)")
    assert set(lines) == {"mxnet", "paddle", "jax", "tf", "oneflow"}


def test_env_create_refuses_a_cuda_build_without_code_for_the_gpu_before_building(
        builds, tmp_path, monkeypatch):
    """One line naming what to use instead, before the environment's folder is touched or
    Horovod compiled."""
    monkeypatch.setattr(gpufit, "real_gpus", lambda: None)
    monkeypatch.setenv(gpufit.STANDIN_VAR, "9.0,550.54.15")
    monkeypatch.setenv("TRAINPERF_ENV_DIR", str(tmp_path / "envs"))
    nvcc = tmp_path / "cuda/bin/nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    nvcc.chmod(0o755)
    monkeypatch.setattr(envs, "_tool_path",
                        lambda tool, build=None: str(nvcc) if tool == "nvcc" else tool)
    monkeypatch.setattr(envs, "base_python", lambda backend: sys.executable)
    monkeypatch.setattr(envs, "_build", lambda *a: pytest.fail("built"))
    with pytest.raises(ValueError) as refused:
        envs.create("mxnet", cuda=True)
    text = str(refused.value)
    assert "\n" not in text and text.startswith(
        "the mxnet CUDA build, mxnet-cu117==1.9.1, nvidia-nccl-cu11==2.21.5 (CUDA 11.7), "
        "cannot run on this machine's GPUs (compute capability 9.0, driver 550.54.15")
    assert text.endswith("instead: none: 1.9.1 is MXNet's last release and cu117 its newest "
                         "CUDA build (PyPI has no mxnet-cu118 or later); its CPU build runs "
                         "anywhere (`trainperf env create mxnet --cpu`, `--device cpu`)")
    assert not envs.env_dir("mxnet").exists()
    # On an A100 it has code: the build goes ahead (here, to the stand-in for building).
    monkeypatch.setenv(gpufit.STANDIN_VAR, "8.0,550.54.15")

    def build(*args):
        raise RuntimeError("building")

    monkeypatch.setattr(envs, "_build", build)
    with pytest.raises(RuntimeError, match="building"):
        envs.create("mxnet", cuda=True)


def test_reading_the_wheels_again_takes_their_summaries(builds, monkeypatch):
    monkeypatch.setattr(gpucode, "wheel_code", lambda wheel: pytest.fail("read again"))
    for name in READ:
        again = envs.gpu_code(name)
        assert again is not None and again.libraries == builds[name].libraries
    wheels = [envs.cached_wheel(r, envs.wheel_python(get_backend(n)))
              for n in READ for r in get_backend(n).env.gpu_wheels]
    assert all(w is not None and os.path.getsize(w) > 1e6 for w in wheels)


def test_an_installed_cuda_build_is_read_where_its_wheels_are_not(tmp_path, monkeypatch):
    """A CUDA build made elsewhere (a folder every node mounts): its installed libraries are
    read once, links not followed, and kept beside the environments until it is rebuilt. Its
    own library here has PTX only for sm_90: compiled just in time, by a driver that knows
    PTX ISA 8.5 (CUDA 12.5's)."""
    monkeypatch.setenv("TRAINPERF_ENV_DIR", str(tmp_path / "envs"))
    monkeypatch.setenv(envs.WHEEL_DIR_VAR, str(tmp_path / "no-wheels"))
    folder = tmp_path / "envs" / "tf"
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").symlink_to(sys.executable)

    def manifest(created: str) -> None:
        (folder / envs.MANIFEST).write_text(json.dumps({
            "packages": envs.wanted_packages(get_backend("tf"), True), "cuda": True,
            "versions": {}, "created": created}))

    manifest("2026-12-07T10:00:00")
    site = folder / "lib/python3.11/site-packages"
    (site / "tensorflow").mkdir(parents=True)
    (site / "nvidia/cudnn/lib").mkdir(parents=True)
    (site / "tensorflow/libtensorflow_cc.so.2").write_bytes(
        elf([(".nv_fatbin", container(entry(CUBIN, 80), entry(PTX, 80, (8, 5))))]))
    (site / "tensorflow/libtensorflow_cc.so").symlink_to("libtensorflow_cc.so.2")
    (site / "nvidia/cudnn/lib/libcudnn_ops.so.9").write_bytes(
        elf([(".nv_fatbin", container(entry(CUBIN, 90)))]))
    code = envs.gpu_code("tf")
    assert code.source == f"the installed environment {folder}"
    assert code.main == "lib/python3.11/site-packages/tensorflow/libtensorflow_cc.so.2"
    assert sorted(gpufit.library_label(p) for p in code.libraries) == [
        "libcudnn_ops.so.9", "libtensorflow_cc.so.2"]
    h100 = envs.gpu_fits("tf", [gpufit.parse_standin("9.0,560.35.05")], code)[0]
    assert h100.runs and h100.line.startswith(
        "libtensorflow_cc.so.2 has code for sm_90: PTX compute_80 (ISA 8.5), compiled just in "
        "time; driver 560.35.05: new enough for CUDA 12.5")
    older = envs.gpu_fits("tf", [gpufit.parse_standin("9.0,550.54.15")], code)[0]
    assert not older.runs and older.line.endswith(
        "driver 550.54.15 cannot compile PTX ISA 8.5 just in time: that needs 555.42.02 or "
        "newer")
    with monkeypatch.context() as m:
        m.setattr(gpucode, "tree_code", lambda folder: pytest.fail("read again"))
        assert envs.gpu_code("tf").libraries == code.libraries
    manifest("2026-12-08T10:00:00")  # rebuilt: read again
    (site / "tensorflow/libtensorflow_cc.so.2").write_bytes(
        elf([(".nv_fatbin", container(entry(CUBIN, 90)))]))
    assert envs.gpu_code("tf").libraries[code.main].cubins == (90,)
