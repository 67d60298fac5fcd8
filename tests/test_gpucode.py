"""The GPU code of CUDA builds, read from their libraries' fatbins (``trainperf.gpucode``), and
whether a build runs on a GPU and driver (``trainperf.gpufit``): the reader on hand-made
libraries for its edge cases."""

from __future__ import annotations

import stat
import zipfile

import pytest
from fatbins import container, elf, entry

from trainperf import gpucode, gpufit

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
