"""Choosing a device, seeding every random number generator, and reporting the environment and CUDA versions."""

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
from .memory import format_bytes

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


# The performance lessons' default sizes, by device. On a 2-core CPU: small enough that a notebook runs in about a
# minute (05's large enough that a CPU with native bfloat16 shows it faster). On a CUDA GPU: the sizes where
# the technique's effect is real (tensor cores busy enough for AMP to pay off; activations well above weights +
# gradients, so checkpointing moves the allocator's peak). "cuda" is the top of the lesson's CUDA_LADDERS, the size
# for a GPU with plenty of free memory. The benchmark (helpers.cli.bench) uses the same.
LESSON_SIZES: dict[str, dict[str, dict[str, int]]] = {
    "mixed_precision": {
        "WIDTH": {"cpu": 1024, "cuda": 4096},
        "DEPTH": {"cpu": 2, "cuda": 8},
        "BATCH_SIZE": {"cpu": 1024, "cuda": 16384},
    },
    "checkpointing": {
        "DEPTH": {"cpu": 100, "cuda": 32},
        "WIDTH": {"cpu": 128, "cuda": 1024},
        "BATCH_SIZE": {"cpu": 32, "cuda": 8192},
    },
    "inference": {"MAX_BATCH_SIZE": {"cpu": 256, "cuda": 4096}},
    "faster": {
        "CHANNELS": {"cpu": 8, "cuda": 128},
        "BATCH_SIZE": {"cpu": 64, "cuda": 1024},
        "COPIES": {"cpu": 1, "cuda": 16},
    },
}

# Each lesson's CUDA sizes, largest estimated peak first (estimate_bytes, with 70% of the free memory it must fit
# in): sizes_for takes the first that fits. Every rung keeps the lesson's effect: 05's products stay at least
# 2048 wide on batches of at least 8192, with activations well above the weights. 08's and 10's top rungs need
# under 2 GiB, so one rung serves every GPU of 4 GB and up.
CUDA_LADDERS: dict[str, list[dict[str, int]]] = {
    "mixed_precision": [
        {"WIDTH": 4096, "DEPTH": 8, "BATCH_SIZE": 16384},  # ~6.0 GiB, from ~8.6 GiB free: 16 GB cards and up
        {"WIDTH": 4096, "DEPTH": 8, "BATCH_SIZE": 8192},  # ~4.8 GiB, from ~6.8 GiB free: 8 GB
        {"WIDTH": 2048, "DEPTH": 8, "BATCH_SIZE": 32768},  # ~3.4 GiB, from ~4.8 GiB free: 6 GB
        {"WIDTH": 2048, "DEPTH": 8, "BATCH_SIZE": 16384},  # ~2.1 GiB, from ~3.0 GiB free: 4 GB
        {"WIDTH": 2048, "DEPTH": 8, "BATCH_SIZE": 8192},  # ~1.5 GiB: less
    ],
    "checkpointing": [{"DEPTH": 32, "WIDTH": 1024, "BATCH_SIZE": 8192}],  # ~1.6 GiB
    "inference": [{"MAX_BATCH_SIZE": 4096}],  # ~0.2 GiB
    # 11's CNN on 28x28 digits: 128 channels make its second convolution ~1.4 GFLOP per image (forward and
    # backward), so a batch of 1024 keeps even an H100 busy for tens of ms per step in float32; COPIES of the
    # 1,347 training digits keep 21 optimizer steps per epoch at every rung (BATCH_SIZE / 64 copies).
    "faster": [
        {"CHANNELS": 128, "BATCH_SIZE": 1024, "COPIES": 16},  # ~3.9 GiB, from ~5.6 GiB free: 8 GB cards and up
        {"CHANNELS": 128, "BATCH_SIZE": 512, "COPIES": 8},  # ~2.0 GiB, from ~2.8 GiB free: 4 and 6 GB
        {"CHANNELS": 64, "BATCH_SIZE": 256, "COPIES": 4},  # ~0.5 GiB: less
    ],
}
FREE_MEMORY_SHARE = 0.7  # the share of the free GPU memory a lesson's estimated peak may take (the rest: the
# allocator's fragmentation, cuBLAS workspaces, what the estimate leaves out)

_FLOAT = 4  # bytes of a float32
_DIGIT_PIXELS = 28 * 28  # 11 trains on the digits upscaled to MNIST's size
_POST_MODEL_PARAMETERS = 71 * (1000 * 1000 + 1000) + 1000 * 100 + 100  # 08's 72-layer model of the post


def _check_lesson(lesson: object) -> str:
    if not isinstance(lesson, str) or lesson not in LESSON_SIZES:
        raise ValueError(f"lesson must be one of {sorted(LESSON_SIZES)}, got {lesson!r}")
    return lesson


def mlp_parameters(width: int, depth: int, inputs: int = 64, classes: int = 10) -> int:
    """Parameters of `helpers.models.MLP(inputs, (width,) * depth, classes)`: weights and biases of its Linears."""
    return inputs * width + width + (depth - 1) * (width * width + width) + width * classes + classes


def smallcnn_parameters(channels: int, in_channels: int = 1, classes: int = 10) -> int:
    """Parameters of `helpers.models.SmallCNN(in_channels, classes, channels=channels)`: two 3x3 convolutions with
    biases, two BatchNorms (weight and bias) and the linear head on 4x4 pooled features."""
    convolutions = 9 * in_channels * channels + channels + 9 * channels * 2 * channels + 2 * channels
    return convolutions + 2 * (channels + 2 * channels) + 2 * channels * 16 * classes + classes


def memory_parts(lesson: str, sizes: dict[str, int]) -> dict[str, int]:
    """The bytes of one training step of the lesson's main model at `sizes`, in float32, by part.

    `weights`, `gradients` and `optimizer_state` (AdamW's or Adam's two moments) of one copy of the model;
    `activations`: what autograd saves for backward at the batch (`helpers.memory.saved_tensors_meter`'s peak),
    or for 'inference' every layer's output of one forward at MAX_BATCH_SIZE; `transient`: the largest
    temporaries of backward (two layer outputs' gradients) or, for 'checkpointing', the 72-layer model of
    section 3 with its gradients and Adam moments (which replaces the stack's activations while it runs).
    For 'faster' (SmallCNN(channels=CHANNELS) on 28x28 digits; COPIES changes only the data on the CPU) the
    activations are what autograd saves at BATCH_SIZE in float32, and `transient` two gradients of the second
    convolution's output.
    """
    _check_lesson(lesson)
    expected = set(LESSON_SIZES[lesson])
    if not isinstance(sizes, dict) or set(sizes) != expected:
        raise ValueError(f"sizes must be a dict with exactly the keys {sorted(expected)}, got {sizes!r}")
    for name, value in sizes.items():
        check_int(f"sizes[{name!r}]", value)
    if lesson == "mixed_precision":
        width, depth, batch = sizes["WIDTH"], sizes["DEPTH"], sizes["BATCH_SIZE"]
        weights = _FLOAT * mlp_parameters(width, depth)
        # per sample: the input, each hidden layer's ReLU output, the log-probabilities, the int64 target
        activations = batch * (_FLOAT * (64 + depth * width + 10) + 8)
        transient = 2 * batch * width * _FLOAT
    elif lesson == "checkpointing":
        depth, width, batch = sizes["DEPTH"], sizes["WIDTH"], sizes["BATCH_SIZE"]
        weights = _FLOAT * depth * (width * width + width)
        activations = (depth + 1) * batch * width * _FLOAT  # the input and each ReLU's output
        transient = max(2 * batch * width * _FLOAT, 4 * _FLOAT * _POST_MODEL_PARAMETERS - activations)
    elif lesson == "faster":
        channels, batch = sizes["CHANNELS"], sizes["BATCH_SIZE"]
        weights = _FLOAT * smallcnn_parameters(channels)
        # per image: the input, conv 1's output (saved by BatchNorm) and ReLU's, conv 2's and its ReLU's (twice
        # the channels), the pooled 4x4 features, the log-probabilities, and the int64 target
        per_image = _DIGIT_PIXELS * (1 + 2 * channels + 2 * 2 * channels) + 2 * channels * 16 + 10
        activations = batch * (_FLOAT * per_image + 8)
        transient = 2 * batch * 2 * channels * _DIGIT_PIXELS * _FLOAT
    else:  # inference: SmallCNN(channels=16) on 8x8 digits; forward outputs of every layer at the largest batch
        channels, batch = 16, sizes["MAX_BATCH_SIZE"]
        weights = _FLOAT * (10 * channels + 2 * channels + 9 * channels * 2 * channels + 2 * channels * 3)
        weights += _FLOAT * (2 * channels * 16 * 10 + 10)
        per_sample = 3 * channels * 64 + 3 * 2 * channels * 64 + 3 * 2 * channels * 16 + 10 + 64  # + the input
        activations = batch * per_sample * _FLOAT
        transient = 0
    return {
        "weights": weights,
        "gradients": weights,
        "optimizer_state": 2 * weights,
        "activations": activations,
        "transient": transient,
    }


# How many copies of the weights a lesson holds at once at its peak: 05 times four replicas side by side
# (float32, 16-bit, micro-batches, checkpointed) next to the model they were copied from.
# 11 holds many small CNNs at once: the ladder's 8 rungs (weights and AdamW's two moments each), section 2's
# model with its gradients and two copies of them, section 3's 3 AdamW replicas (weights, gradients, moments)
# and their made-up gradients: 42 weight-sized tensors, of which gradients and optimizer_state count 3.
_WEIGHT_COPIES = {"mixed_precision": 5, "checkpointing": 1, "inference": 1, "faster": 39}


def estimate_bytes(lesson: str, sizes: dict[str, int]) -> int:
    """The estimated peak GPU memory of the lesson's notebook at `sizes`: the weights (times the copies it holds at
    once), gradients, optimizer state, saved activations at the batch and backward's temporaries (memory_parts)."""
    parts = memory_parts(lesson, sizes)
    return _WEIGHT_COPIES[lesson] * parts["weights"] + sum(v for k, v in parts.items() if k != "weights")


def sizes_for(lesson: str, device: torch.device | str, *, free_bytes: int | None = None) -> dict[str, int]:
    """A lesson's default sizes on `device`: on CUDA the largest of CUDA_LADDERS[lesson] whose estimate_bytes fits
    in 70% of the free memory (`free_bytes`; None: torch.cuda.mem_get_info(), or the top rung where CUDA is not
    available to ask), the smallest rung when none fits; the CPU sizes elsewhere (mps too)."""
    _check_lesson(lesson)
    if free_bytes is not None and (isinstance(free_bytes, bool) or not isinstance(free_bytes, int) or free_bytes < 0):
        raise ValueError(f"free_bytes must be a number of bytes (an int >= 0) or None, got {free_bytes!r}")
    device = torch.device(device)
    if device.type != "cuda":
        return {name: by_kind["cpu"] for name, by_kind in LESSON_SIZES[lesson].items()}
    ladder = CUDA_LADDERS[lesson]
    if free_bytes is None:
        if not torch.cuda.is_available():
            return dict(ladder[0])
        free_bytes = torch.cuda.mem_get_info(device)[0]
    fitting = [rung for rung in ladder if estimate_bytes(lesson, rung) <= FREE_MEMORY_SHARE * free_bytes]
    return dict(fitting[0] if fitting else ladder[-1])


def describe_sizes(
    lesson: str, device: torch.device | str, sizes: dict[str, int], *, free_bytes: int | None = None
) -> str:
    """One line for a notebook: the sizes it runs and their estimated GPU peak; on CUDA also the free memory,
    sizes_for's choice for it and, when they are smaller, what the top sizes would need (`free_bytes` as in sizes_for)."""

    def shown(chosen: dict[str, int]) -> str:
        return ", ".join(f"{name} {value}" for name, value in chosen.items())

    device = torch.device(device)
    line = f"{shown(sizes)}: estimated GPU peak {format_bytes(estimate_bytes(lesson, sizes))}"
    if device.type != "cuda":
        default = sizes_for(lesson, device)
        return line + f"; the {device.type} sizes are {'these' if sizes == default else shown(default)}"
    if free_bytes is None:
        free_bytes = torch.cuda.mem_get_info(device)[0] if torch.cuda.is_available() else 0
    chosen, top = sizes_for(lesson, device, free_bytes=free_bytes), CUDA_LADDERS[lesson][0]
    line += f"; {format_bytes(free_bytes)} free, {FREE_MEMORY_SHARE:.0%} of it {format_bytes(FREE_MEMORY_SHARE * free_bytes)}"
    line += f"; the largest sizes that fit: {'these' if sizes == chosen else shown(chosen)}"
    if sizes != top:
        line += f"; the top sizes, {shown(top)}, need {format_bytes(estimate_bytes(lesson, top))}"
    return line


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
