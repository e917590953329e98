"""Choosing a device, seeding every random number generator, and reporting the environment."""

from __future__ import annotations

import contextlib
import os
import platform
import random
from collections.abc import Iterator

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
    """Return the best device (cuda > mps > cpu), or the one named by `prefer`."""
    if prefer is None:
        return torch.device(available_devices()[0])
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
    return device


# The performance lessons' default sizes, by device. On a 2-core CPU: small, so a notebook runs in about a
# minute. On a CUDA GPU: the sizes where the technique's effect is real (tensor cores busy enough for AMP to
# pay off; activations well above weights + gradients, so checkpointing moves the allocator's peak), yet
# within a few GiB of GPU memory. The benchmark (helpers.cli.bench) uses the same.
LESSON_SIZES: dict[str, dict[str, dict[str, int]]] = {
    "mixed_precision": {
        "WIDTH": {"cpu": 256, "cuda": 4096},
        "DEPTH": {"cpu": 2, "cuda": 8},
        "BATCH_SIZE": {"cpu": 64, "cuda": 16384},
    },
    "checkpointing": {
        "DEPTH": {"cpu": 100, "cuda": 32},
        "WIDTH": {"cpu": 128, "cuda": 1024},
        "BATCH_SIZE": {"cpu": 32, "cuda": 8192},
    },
    "inference": {"MAX_BATCH_SIZE": {"cpu": 256, "cuda": 4096}},
}


def sizes_for(lesson: str, device: torch.device | str) -> dict[str, int]:
    """A lesson's default sizes on `device`: the CUDA sizes on a CUDA device, the CPU sizes elsewhere (mps too)."""
    if lesson not in LESSON_SIZES:
        raise ValueError(f"lesson must be one of {sorted(LESSON_SIZES)}, got {lesson!r}")
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    return {name: by_kind[kind] for name, by_kind in LESSON_SIZES[lesson].items()}


def fill_sizes(namespace: dict, lesson: str, device: torch.device | str) -> dict[str, int]:
    """Set each of the lesson's parameters that is None in `namespace` (a notebook's globals()) to its size on
    `device`; return the ones it set. A parameter given a value keeps it."""
    chosen = {}
    for name, size in sizes_for(lesson, device).items():
        if namespace.get(name) is None:
            namespace[name] = chosen[name] = size
    return chosen


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
