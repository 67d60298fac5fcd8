"""Dense peak FLOP/s of known accelerators, for model-FLOPs utilisation (MFU).

Only devices listed here get an MFU; an unknown device prints none rather than a guess. Figures
are the vendors' dense (no sparsity) tensor-core peaks of the SXM parts unless named otherwise.
fp32 training on Ampere and later runs its convolutions in TF32 by default (cuDNN), so fp32 MFU
uses the TF32 peak there when the run recorded TF32 as enabled, and the plain fp32 peak if not.
"""

from __future__ import annotations

TFLOPS = 1e12

# (substring of the device name, {basis: peak FLOP/s}); the first match wins, so specific
# names come before general ones.
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


def peak_flops(device_name: str | None, precision: str, tf32: bool | None = None) -> float | None:
    """Peak FLOP/s of one device for a training precision, or None if unknown."""
    if not device_name:
        return None
    for key, peaks in PEAKS:
        if key.lower() in device_name.lower():
            basis = precision
            if precision == "fp32" and tf32 and "tf32" in peaks:
                basis = "tf32"
            return peaks.get(basis)
    return None
