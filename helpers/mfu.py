"""Throughput against the hardware's limit: model FLOPs utilization (MFU), the FLOP/s a model's count says a run
did over a peak. Two peaks: the datasheet's dense figure for the precision, where the GPU is known, and a ceiling
measured here with a large matrix product in the same precision (the only one on a CPU)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from . import compat, loop
from .checks import check_choice, check_int
from .timing import median, time_call

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")

# Dense peak TFLOP/s (without 2:4 structured sparsity) by GPU model and precision, from NVIDIA's documents named
# above each row. "fp32" is the non-tensor FP32 rate, "tf32" the tensor-core TF32 rate, "bf16" and "fp16" the
# tensor-core rate with FP32 accumulate (the one PyTorch's matrix products use; GeForce cards run it at half their
# FP16-accumulate figure). A precision the GPU does not offer is absent (no TF32 or bf16 before Ampere).
# Where a datasheet prints a tensor-core row only with sparsity (its "*" footnote), the dense figure is that
# number halved, written out as `1979 / 2`; the whitepapers print "dense/sparse" pairs and give the first.
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    # "NVIDIA H100 Tensor Core GPU" datasheet, H100 SXM and H100 PCIe columns (tensor rows with sparsity)
    "H100 SXM": {"fp32": 67, "tf32": 989 / 2, "bf16": 1979 / 2, "fp16": 1979 / 2},
    "H100 PCIe": {"fp32": 51, "tf32": 756 / 2, "bf16": 1513 / 2, "fp16": 1513 / 2},
    # "NVIDIA H200 Tensor Core GPU" datasheet, H200 SXM column (tensor rows with sparsity)
    "H200": {"fp32": 67, "tf32": 989 / 2, "bf16": 1979 / 2, "fp16": 1979 / 2},
    # "NVIDIA A100 Tensor Core GPU" datasheet (SXM and PCIe print the same dense figures)
    "A100": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
    # "NVIDIA A10 Tensor Core GPU" datasheet
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125, "fp16": 125},
    # "NVIDIA A40" datasheet (also in the GA102 whitepaper below)
    "A40": {"fp32": 37.4, "tf32": 74.8, "bf16": 149.7, "fp16": 149.7},
    # "NVIDIA L4 Tensor Core GPU" datasheet (tensor rows with sparsity)
    "L4": {"fp32": 30.3, "tf32": 120 / 2, "bf16": 242 / 2, "fp16": 242 / 2},
    # "NVIDIA T4 Tensor Core GPU" datasheet ("Mixed Precision (FP16/FP32)"): Turing, no TF32 or bf16
    "T4": {"fp32": 8.1, "fp16": 65},
    # "NVIDIA V100 Tensor Core GPU" datasheet ("Tensor Performance"): Volta, no TF32 or bf16
    "V100 SXM2": {"fp32": 15.7, "fp16": 125},
    "V100 PCIe": {"fp32": 14, "fp16": 112},
    "V100S PCIe": {"fp32": 16.4, "fp16": 130},
    # "NVIDIA Ampere GA102 GPU Architecture" whitepaper (Founders Edition; the RTX 3080 row is the 10 GB card's,
    # the 12 GB card reports the same name with 3% more SMs)
    "RTX 3080": {"fp32": 29.8, "tf32": 29.8, "bf16": 59.5, "fp16": 59.5},
    "RTX 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71},
    # "NVIDIA Ada GPU Architecture" whitepaper (RTX 4080 16 GB)
    "RTX 4080": {"fp32": 48.7, "tf32": 48.7, "bf16": 97.5, "fp16": 97.5},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
}

# torch.cuda.get_device_name's names, lower case, without the leading "NVIDIA", "Tesla" or "GeForce": a name must
# match a pattern whole, so "L40S" is not an "L4", and a laptop part, a MIG slice ("A100-SXM4-40GB MIG 1g.5gb") or
# an H100 NVL is no known model.
_NAME_PATTERNS = (
    ("H100 SXM", r"h100 (80gb hbm3|sxm5 80gb)"),
    ("H100 PCIe", r"h100( \d+gb)? pcie"),
    ("H200", r"h200( \d+gb hbm3e)?"),
    ("A100", r"a100([- ]sxm4?[- ]\d+gb|-pcie-\d+gb| \d+gb (pcie|sxm4?))?"),
    ("A10", r"a10"),
    ("A40", r"a40"),
    ("L4", r"l4"),
    ("T4", r"t4"),
    ("V100 SXM2", r"v100-sxm2-\d+gb"),
    ("V100 PCIe", r"v100-pcie-\d+gb"),
    ("V100S PCIe", r"v100s-pcie-\d+gb"),
    ("RTX 3080", r"rtx 3080"),
    ("RTX 3090", r"rtx 3090"),
    ("RTX 4080", r"rtx 4080"),
    ("RTX 4090", r"rtx 4090"),
)

MEASURED_HERE = "MFU is taken against the matmul ceiling measured here"
MIN_CALL_SECONDS = 0.01  # a timed call runs products until it lasts about this long, well above the clock's jitter
MAX_PRODUCTS_PER_CALL = 10_000


def _device(device: Any) -> torch.device:
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"device must name a device such as 'cpu' or 'cuda:0', got {device!r}") from error
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device or a str such as 'cpu', got {type(device).__name__}")
    return device


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _check_rate(name: str, value: Any, *, allow_zero: bool = False) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (number and (value >= 0 if allow_zero else value > 0)):
        allowed = "a finite number >= 0" if allow_zero else "a finite number above 0"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def gpu_model(name: str) -> str | None:
    """The DATASHEET_TFLOPS key for a CUDA device name as torch.cuda.get_device_name reports it, or None.

    "NVIDIA H100 80GB HBM3" -> "H100 SXM", "NVIDIA H100 PCIe" -> "H100 PCIe", "NVIDIA A100-SXM4-40GB" and
    "NVIDIA A100 80GB PCIe" -> "A100", "Tesla T4" -> "T4", "NVIDIA GeForce RTX 4090" -> "RTX 4090". None for a
    name the table does not know, and for near misses whose figures differ: "NVIDIA L40S" (not an L4), laptop
    parts ("... RTX 4090 Laptop GPU"), the "H100 NVL" and "H200 NVL" boards (left out: their own power limits and
    clocks give figures of their own, not checked for the table; the measured ceiling stands in) and MIG slices
    ("... MIG 1g.5gb", a fraction of the GPU's SMs).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str such as 'NVIDIA A100-SXM4-40GB', got {type(name).__name__}")
    plain = re.sub(r"\s+", " ", name.strip().lower())
    plain = re.sub(r"^((nvidia|tesla|geforce) )+", "", plain)
    for model, pattern in _NAME_PATTERNS:
        if re.fullmatch(pattern, plain):
            return model
    return None


def _tflops_text(flops: float) -> str:
    return f"{flops / 1e12:,.4g} TFLOP/s"


def datasheet_flops(device: torch.device | str, precision: str) -> tuple[float | None, str]:
    """The datasheet's dense peak in FLOP/s for `precision` on `device`, and one line saying whose figure it is
    ("H100 SXM datasheet, dense bf16: 989.5 TFLOP/s") or why there is none (a CPU, an unknown GPU, a precision
    this GPU does not offer)."""
    check_choice("precision", precision, PRECISIONS)
    device = _device(device)
    if device.type == "cpu":
        return None, f"no datasheet peak for a CPU: {MEASURED_HERE}"
    if device.type != "cuda":
        return None, f"no datasheet peak for {device.type} devices: {MEASURED_HERE}"
    if not torch.cuda.is_available():
        return None, f"no datasheet peak for {device}: CUDA is not available here"
    name = torch.cuda.get_device_name(_indexed(device))
    model = gpu_model(name)
    if model is None:
        known = ", ".join(DATASHEET_TFLOPS)
        return None, f"no datasheet peak for {name} (the table knows {known}): {MEASURED_HERE}"
    figures = DATASHEET_TFLOPS[model]
    if precision not in figures:
        offered = ", ".join(figures)
        return None, f"no {precision} on the {model} datasheet (it lists {offered}): {MEASURED_HERE}"
    peak = figures[precision] * 1e12
    return peak, f"{model} datasheet, dense {precision}: {_tflops_text(peak)}"


def matmul_dtype(precision: str) -> torch.dtype:
    """The tensors' dtype for `precision`: float32 for 'fp32' and 'tf32', bfloat16 for 'bf16', float16 for 'fp16'."""
    check_choice("precision", precision, PRECISIONS)
    return torch.float32 if precision == "tf32" else loop.PRECISIONS[precision]


def default_matmul_size(device: torch.device | str) -> int:
    """The side of the square matrices matmul_flops multiplies on `device`: 1024 on a CPU (a second or less on two
    cores), 8192 on CUDA (4096 with less than 4 GiB free), 2048 elsewhere (mps)."""
    device = _device(device)
    if device.type == "cpu":
        return 1024
    if device.type != "cuda":
        return 2048
    if torch.cuda.is_available() and torch.cuda.mem_get_info(_indexed(device))[0] < 4 * 2**30:
        return 4096
    return 8192


def matmul_flops(
    device: torch.device | str,
    precision: str,
    *,
    size: int | None = None,
    repeat: int = 5,
    threads: int | None = None,
) -> float:
    """The ceiling measured here: FLOP/s of a `size` x `size` matrix product in `precision` (2 * size**3 per product).

    The median of `repeat` timed calls after a warm-up, synchronized on CUDA; a call runs several products when
    one takes under MIN_CALL_SECONDS. 'tf32' runs with TF32 switched on for the call, 'fp32' with it off.
    `threads` sets torch's CPU threads for the call (None: as set), restored after it. `size` None:
    default_matmul_size(device).
    """
    device = _device(device)
    check_choice("precision", precision, PRECISIONS)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device is {device} but CUDA is not available here")
    offered = loop.precisions_for(device, tf32=True)
    if precision not in offered:
        raise ValueError(f"precision must be one of {offered} on {device.type} (what it offers), got {precision!r}")
    check_int("size", size, allow_none=True)
    check_int("repeat", repeat)
    check_int("threads", threads, allow_none=True)
    side = default_matmul_size(device) if size is None else size
    device = _indexed(device)
    dtype = matmul_dtype(precision)
    left = torch.randn(side, side, device=device, dtype=dtype)
    right = torch.randn(side, side, device=device, dtype=dtype)
    product = torch.empty(side, side, device=device, dtype=dtype)
    threads_before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        with compat.fp32_precision_as("tf32" if precision == "tf32" else "ieee"):
            one = median(time_call(lambda: torch.mm(left, right, out=product), repeat=1, warmup=1, device=device))
            products = min(MAX_PRODUCTS_PER_CALL, max(1, math.ceil(MIN_CALL_SECONDS / max(one, 1e-9))))

            def call() -> None:
                for _ in range(products):
                    torch.mm(left, right, out=product)

            seconds = median(time_call(call, repeat=repeat, warmup=0, device=device))
    finally:
        torch.set_num_threads(threads_before)
    return 2 * side**3 * products / seconds


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization: the FLOP/s the model's count says were done, tokens_per_s * flops_per_token, over
    `peak_flops`."""
    _check_rate("tokens_per_s", tokens_per_s, allow_zero=True)
    _check_rate("flops_per_token", flops_per_token)
    _check_rate("peak_flops", peak_flops)
    return tokens_per_s * flops_per_token / peak_flops


def _flops_unit(flops: float) -> tuple[float, str]:
    for scale, unit in ((1e12, "TFLOP/s"), (1e9, "GFLOP/s")):
        if flops >= scale:
            return scale, unit
    return 1e6, "MFLOP/s"


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 1:
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return f"{value:.2g}"


def _fraction(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"


def utilization_line(
    tokens_per_s: float, flops_per_token: float, *, measured: float, datasheet: float | None, precision: str
) -> str:
    """One log line: tokens/s, the model's FLOP/s and its MFU against the `precision` datasheet peak (when there is
    one) and the matmul ceiling `measured` here, all in FLOP/s, in the unit that suits the ceiling:
    "12,345 tokens/s, 2.10 TFLOP/s: MFU 0.41 of the bf16 datasheet peak (990 TFLOP/s), 0.78 of the bf16 matmul
    ceiling measured here (530 TFLOP/s)"."""
    check_choice("precision", precision, PRECISIONS)
    _check_rate("measured", measured)
    if datasheet is not None:
        _check_rate("datasheet", datasheet)
    of_measured = mfu(tokens_per_s, flops_per_token, measured)
    achieved = tokens_per_s * flops_per_token
    scale, unit = _flops_unit(max(measured, datasheet or 0.0))
    parts = []
    if datasheet is not None:
        of_datasheet = mfu(tokens_per_s, flops_per_token, datasheet)
        parts.append(
            f"{_fraction(of_datasheet)} of the {precision} datasheet peak ({_number(datasheet / scale)} {unit})"
        )
    parts.append(
        f"{_fraction(of_measured)} of the {precision} matmul ceiling measured here ({_number(measured / scale)} {unit})"
    )
    return f"{tokens_per_s:,.0f} tokens/s, {_number(achieved / scale)} {unit}: MFU " + ", ".join(parts)
