"""Dense peak FLOP/s of known accelerators, and the peak a run's work actually ran at (for
model-FLOPs utilisation, MFU).

Only devices listed here get an MFU; an unknown device gets none rather than a guess. Figures are
the vendors' dense (no sparsity) tensor-core peaks of the SXM parts unless named otherwise.

In an fp32 run on Ampere and later, convolutions and matrix products each run in TF32 or in full
fp32 (``Tuning.tf32``; every worker records ``tf32_cudnn`` and ``tf32_matmul``), at peaks 7x
apart. MFU therefore divides by the peak the whole step would reach if each engine ran its own
FLOPs at its own peak: total FLOPs / sum(FLOPs_op / peak_op). An fp32 run on a device with TF32
units that did not record its flags gets no MFU.
"""

from __future__ import annotations

TFLOPS = 1e12

# (substring of the device name, {basis: peak FLOP/s}); the first match wins, so specific
# names come before general ones. A device without a "tf32" entry has no TF32 units (V100):
# its fp32 work runs at the fp32 peak whatever the flags say.
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756 * TFLOPS, "fp16": 756 * TFLOPS, "tf32": 378 * TFLOPS,
                   "fp32": 51 * TFLOPS}),
    ("H100", {"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "tf32": 495 * TFLOPS,
              "fp32": 67 * TFLOPS}),
    ("H200", {"bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "tf32": 495 * TFLOPS,
              "fp32": 67 * TFLOPS}),
    ("A100", {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS,
              "fp32": 19.5 * TFLOPS}),
    ("V100", {"fp16": 125 * TFLOPS, "fp32": 15.7 * TFLOPS}),
]


# Memory bandwidth (bytes/s) from the same datasheets, for the device-to-device copy's ceiling.
BANDWIDTHS: list[tuple[str, float]] = [
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("H200", 4.8e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("V100", 0.9e12),
]


def _lookup(table: list, device_name: str | None):
    """The first entry whose key is part of the device's name (None: unknown device)."""
    if not device_name:
        return None
    for key, value in table:
        if key.lower() in device_name.lower():
            return value
    return None


def device_bandwidth(device_name: str | None) -> float | None:
    return _lookup(BANDWIDTHS, device_name)


def device_peaks(device_name: str | None) -> dict[str, float] | None:
    return _lookup(PEAKS, device_name)


def op_bases(precision: str, tf32_conv: bool | None, tf32_matmul: bool | None,
             peaks: dict[str, float]) -> dict[str, str]:
    """The number format each engine ran in."""
    if precision in ("fp16", "bf16"):
        return {"conv": precision, "matmul": precision}
    has_tf32 = bool(peaks.get("tf32"))
    return {"conv": "tf32" if tf32_conv and has_tf32 else "fp32",
            "matmul": "tf32" if tf32_matmul and has_tf32 else "fp32"}


def mfu_peak(device_name: str | None, precision: str, flops_by_op: dict[str, float] | None,
             tf32_conv: bool | None = None, tf32_matmul: bool | None = None
             ) -> tuple[float | None, str | None]:
    """(peak FLOP/s of one device for this work, a line saying which peaks went in), or
    (None, None) where the device or a needed peak is unknown."""
    return effective_peak(device_peaks(device_name), precision, flops_by_op, tf32_conv,
                          tf32_matmul)


def effective_peak(peaks: dict[str, float] | None, precision: str,
                   flops_by_op: dict[str, float] | None, tf32_conv: bool | None = None,
                   tf32_matmul: bool | None = None) -> tuple[float | None, str | None]:
    """The same from any table of peaks by number format: a datasheet's, or the matrix-product
    rates measured on the device (``trainperf gpucheck``)."""
    if not peaks or not flops_by_op:
        return None, None
    work = {op: f for op, f in flops_by_op.items() if f}
    flags = {"conv": tf32_conv, "matmul": tf32_matmul}
    if precision == "fp32" and peaks.get("tf32") and any(flags[op] is None for op in work):
        # On a device with TF32 units an unrecorded flag could mean either peak, 7x apart:
        # no figure rather than one against the wrong peak.
        return None, None
    bases = op_bases(precision, tf32_conv, tf32_matmul, peaks)
    if any(not peaks.get(bases[op]) for op in work):
        return None, None
    total = sum(work.values())
    seconds_at_peak = sum(f / peaks[bases[op]] for op, f in work.items())
    effective = total / seconds_at_peak
    parts = [f"{op} {100 * f / total:.1f}% at {bases[op].upper()} "
             f"{peaks[bases[op]] / TFLOPS:g} TFLOP/s" for op, f in work.items()]
    return effective, (f"{'; '.join(parts)}: {effective / TFLOPS:.1f} TFLOP/s per device")
