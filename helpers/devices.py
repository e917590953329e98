"""Choosing a device, seeding every random number generator, and reporting the environment and CUDA versions.
(The lessons' sizes by device are helpers.sizes.)"""

from __future__ import annotations

import contextlib
import os
import platform
import random
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .checks import check_int

DEVICE_KINDS = ("cuda", "mps", "cpu")


def _available(kind: str) -> bool:
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return bool(mps and mps.is_available())
    return kind == "cpu"


def available_devices() -> list[str]:
    """Device kinds usable here, best first."""
    return [kind for kind in DEVICE_KINDS if _available(kind)]


def pick_device(prefer: str | None = None) -> torch.device:
    """Return the best device (cuda > mps > cpu) for `prefer` None or 'auto', or the one `prefer` names.

    A CUDA device always comes with its index (`cuda:0`, or the current device for a bare 'cuda'): several CUDA
    calls (`torch.cuda.get_per_process_memory_fraction`, DDP's `device_ids`) refuse an index-less device."""
    if prefer is None or prefer == "auto":
        return _indexed(torch.device(available_devices()[0]))
    if not isinstance(prefer, str):
        raise TypeError(f"prefer must be a str such as 'cpu' or 'cuda:0' or None, got {type(prefer).__name__}")
    try:
        device = torch.device(prefer)
    except RuntimeError as error:
        raise ValueError(f"prefer must name a device kind in {DEVICE_KINDS}, got {prefer!r}") from error
    if device.type not in DEVICE_KINDS:
        raise ValueError(f"prefer must name a device kind in {DEVICE_KINDS}, got {prefer!r}")
    if not _available(device.type):
        raise ValueError(f"prefer={prefer!r} is not available on this machine; available: {available_devices()}")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"prefer={prefer!r} names GPU {device.index}, but only {torch.cuda.device_count()} are visible"
        )
    return _indexed(device)


def _indexed(device: torch.device) -> torch.device:
    """`device` with its index: CUDA's current device for a bare 'cuda'; other kinds as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, numpy and torch (CPU and CUDA); return a torch.Generator for DataLoaders."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Run the block with torch.set_num_threads(threads) (None: leave as is); restore the old count after."""
    check_int("threads", threads, allow_none=True)
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        yield
    finally:
        torch.set_num_threads(before)


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), or the best the platform module knows."""
    cpuinfo = "/proc/cpuinfo"
    if os.path.exists(cpuinfo):
        with open(cpuinfo) as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (avx512_bf16, amx_bf16, ...) from `cpuinfo`; empty where there is none (macOS, Windows)."""
    if not os.path.exists(cpuinfo):
        return set()
    with open(cpuinfo) as handle:
        for line in handle:
            if line.startswith(("flags", "Features")):  # x86 says flags, ARM Features
                return set(line.split(":", 1)[1].split())
    return set()


def keep_freed_memory(pad_mib: int = 256) -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the OS.

    On Linux, PyTorch's CPU tensors come from malloc; a buffer of more than a few MiB (a conv layer's
    activations) is mapped fresh on every step and unmapped when freed, so every step pays page faults
    for it. Raising the mmap and trim thresholds keeps those pages, which makes CPU training steps
    faster and far less noisy. Applies to this process from now on; returns False where the C library
    is not glibc (macOS, Windows, musl), leaving things as they are. LD_PRELOAD of jemalloc or
    tcmalloc is the other common remedy.
    """
    check_int("pad_mib", pad_mib, minimum=0)
    import ctypes
    import ctypes.util

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3  # from glibc's malloc.h
    return all(
        libc.mallopt(option, value) == 1
        for option, value in (
            (m_mmap_threshold, 32 * 2**20),  # the largest glibc accepts on 64-bit systems
            (m_trim_threshold, 2**30),
            (m_top_pad, pad_mib * 2**20),
        )
    )


def parse_cudnn_version(number: int) -> tuple[int, int, int]:
    """cuDNN's version as `torch.backends.cudnn.version()` reports it, as (major, minor, patch): 8600 is 8.6.0
    (major * 1000 + minor * 100 + patch up to cuDNN 8), 90100 is 9.1.0 (major * 10000 + minor * 100 + patch since 9)."""
    if isinstance(number, bool) or not isinstance(number, int) or number < 1000:
        raise ValueError(f"number must be a cuDNN version such as 8600 or 90100, got {number!r}")
    if number >= 90000:
        return number // 10000, number // 100 % 100, number % 100
    return number // 1000, number // 100 % 10, number % 100


CUDA_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)[af]?")  # sm_80, sm_90a, compute_120: the last digit is the minor


def arch_runs_on(arch_list: Sequence[str], capability: tuple[int, int]) -> bool:
    """Whether kernels built for `arch_list` (`torch.cuda.get_arch_list()`) run on a GPU of this compute capability.

    A binary for sm_XY runs on X.Y and later minors of major X; PTX (compute_XY) is compiled at load time for
    X.Y and any later GPU. Entries of other kinds (ROCm's gfx...) never match a CUDA capability.
    """
    if isinstance(arch_list, str):
        raise TypeError(f"arch_list must be a list such as ['sm_80', 'compute_90'], got the str {arch_list!r}")
    for arch in arch_list:
        match = CUDA_ARCH.fullmatch(arch)
        if match is None:
            continue
        built = (int(match[2]), int(match[3]))
        if built <= tuple(capability) and (match[1] == "compute" or built[0] == capability[0]):
            return True
    return False


@dataclass(frozen=True)
class CudaVersions:
    """The versions that must fit together before a GPU computes, as this process finds them."""

    torch: str
    cuda: str | None  # torch.version.cuda, the runtime torch was built with; None in a CPU-only build
    cudnn: tuple[int, int, int] | None  # the cuDNN torch loaded; None where it has none
    cudnn_wheel: str | None  # version of the pip package nvidia-cudnn-cuXX for the build's CUDA major, if installed
    runtime_wheel: str | None  # version of nvidia-cuda-runtime-cuXX (CUDA 12) or nvidia-cuda-runtime (13), if installed
    arch_list: list[str]  # the GPU architectures the build has kernels for; [] in a CPU-only build
    driver: str | None  # the NVIDIA driver nvidia-smi reports; None without nvidia-smi


def cuda_versions() -> CudaVersions:
    """Read torch's CUDA and cuDNN, the nvidia-* pip packages that brought them, and the driver (from nvidia-smi)."""
    import importlib.metadata

    # package names compared as pip does (PEP 503: case and runs of -_. do not matter), and matched exactly
    packages = {
        re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower(): d.version for d in importlib.metadata.distributions()
    }
    major = torch.version.cuda.split(".")[0] if torch.version.cuda else None

    def wheel(*names: str) -> str | None:
        return next((packages[name] for name in names if name in packages), None)

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    driver, smi = None, shutil.which("nvidia-smi")
    if smi:  # one field, no header, one line per GPU: "580.65.06"
        query = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
        answer = subprocess.run(query, capture_output=True, text=True, timeout=60)
        lines = [line.strip() for line in answer.stdout.splitlines() if line.strip()]
        driver = lines[0] if answer.returncode == 0 and lines and lines[0][0].isdigit() else None
    return CudaVersions(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=parse_cudnn_version(cudnn) if cudnn else None,
        cudnn_wheel=wheel(f"nvidia-cudnn-cu{major}") if major else None,
        runtime_wheel=wheel(f"nvidia-cuda-runtime-cu{major}", "nvidia-cuda-runtime") if major else None,
        arch_list=torch.cuda.get_arch_list(),
        driver=driver,
    )


def environment_report() -> dict:
    """Versions, devices and thread counts, as a flat-ish dict ready to print."""
    import torchvision

    report = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "mps_available": _available("mps"),
        "devices": [],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            report["devices"].append(
                {
                    "name": props.name,
                    "index": index,
                    "memory_bytes": props.total_memory,
                    "capability": f"{props.major}.{props.minor}",
                }
            )
    else:
        report["devices"].append({"name": cpu_name(), "index": None, "memory_bytes": None, "capability": None})
    return report
