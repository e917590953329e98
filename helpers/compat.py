"""What differs between the torch releases and builds the course runs on, in one place.

The course supports torch from FLOOR (the lowest release `pyproject.toml` allows) to the newest, on builds with and
without CUDA and NCCL (PyPI's macOS and Windows wheels have no NCCL). Each function here hides one such difference
and names the release or build it depends on; CI runs the whole suite on the floor and on the newest torch, so each
branch runs on one side of that matrix, and the tests make a process see the other builds.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

from .checks import check_choice

FLOOR = (2, 6)  # the oldest torch the course declares: the first with the public FSDP2 fully_shard
FORWARD_SYNC_BUFFERS = (2, 13)  # DistributedDataParallel(forward_sync_buffers=...) replaced broadcast_buffers
FSDP2_ON_CPU = (2, 7)  # torch.cpu.Stream.record_event: FSDP2 on CPU tensors (gloo ranks)
FP32_PRECISION_API = (2, 9)  # torch.backends.cuda.matmul.fp32_precision = "ieee" | "tf32" (before: allow_tf32)

FP32_MODES = ("ieee", "tf32")


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.6.0+cu124' or '2.15.0.dev20261101' (None: this torch)."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise ValueError(f"version must look like '2.6.0', got {text!r}")
    return int(match[1]), int(match[2])


def at_least(release: tuple[int, int], version: str | None = None) -> bool:
    """Whether this torch (or `version`) is `release` or newer."""
    return torch_version(version) >= release


def release_name(release: tuple[int, int]) -> str:
    """'2.13' for (2, 13)."""
    return ".".join(map(str, release))


# ---------------------------------------------------------------- DistributedDataParallel's buffers


def ddp_buffer_sync(sync: bool, *, version: str | None = None) -> dict[str, Any]:
    """DistributedDataParallel's keyword for broadcasting rank 0's buffers before every forward.

    torch 2.13 named it `forward_sync_buffers` and deprecated `broadcast_buffers` (which still works, with a
    FutureWarning). The two differ at the wrap: `broadcast_buffers=False` also leaves out the buffers from the
    wrap's broadcast, `forward_sync_buffers=False` does not (see ddp_syncs_buffers_at_wrap).
    """
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True or False, got {sync!r}")
    return {"forward_sync_buffers": sync} if at_least(FORWARD_SYNC_BUFFERS, version) else {"broadcast_buffers": sync}


def ddp_syncs_buffers_at_wrap(sync: bool, *, version: str | None = None) -> bool:
    """Whether DDP broadcasts rank 0's buffers at the wrap when built with ddp_buffer_sync(sync)."""
    return sync or at_least(FORWARD_SYNC_BUFFERS, version)


# ---------------------------------------------------------------- FSDP2 on the CPU


def fsdp2_runs_on(device_type: str, *, version: str | None = None) -> tuple[bool, str]:
    """Whether FSDP2 (`fully_shard`) trains a model on `device_type` ('cuda', 'cpu', ...) with this torch, and why.

    On GPUs (nccl ranks) FSDP2 works from torch 2.6. On the CPU (gloo ranks) it needs torch 2.7, whose CPU stream
    gained the `record_event` that FSDP2's all-gather calls: torch 2.6 fails inside the first forward.
    """
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {type(device_type).__name__}")
    this = version or torch.__version__
    if device_type != "cpu" or at_least(FSDP2_ON_CPU, version):
        return True, f"FSDP2 shards {device_type} tensors with torch {this}"
    return False, (
        f"FSDP2 on CPU ranks (gloo) needs torch {release_name(FSDP2_ON_CPU)} or newer; this is torch {this}, "
        "which shards on GPUs only (nccl): upgrade torch (pip install -U torch), or run with a GPU per rank"
    )


# ---------------------------------------------------------------- float32 products: true float32 or TF32


def fp32_precision() -> dict[str, str]:
    """How CUDA computes float32 products now: {'matmul': 'ieee' | 'tf32', 'conv': 'ieee' | 'tf32'}.

    'ieee' is true float32; 'tf32' lets Ampere and newer GPUs use tensor cores with 10-bit mantissas. Read from
    `torch.backends.cuda.matmul.fp32_precision` / `torch.backends.cudnn.conv.fp32_precision` (torch 2.9 and newer)
    or from the older `allow_tf32` flags.
    """
    if _has_fp32_precision_api():
        overall = getattr(torch.backends, "fp32_precision", "none")  # 'none' below it: inherit from here

        def mode(setting: str) -> str:
            return "tf32" if (overall if setting == "none" else setting) == "tf32" else "ieee"

        return {"matmul": mode(torch.backends.cuda.matmul.fp32_precision), "conv": mode(_cudnn_conv().fp32_precision)}
    return {
        "matmul": "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        "conv": "tf32" if torch.backends.cudnn.allow_tf32 else "ieee",
    }


def set_fp32_precision(matmul: str | None = None, conv: str | None = None) -> None:
    """Set how CUDA computes float32 matrix products (`matmul`) and cuDNN convolutions (`conv`): 'ieee' or 'tf32'
    (None: leave it).

    It sets the `allow_tf32` flags, which every release has: on torch 2.9 and newer they also set the new
    `fp32_precision` settings, so both views agree. Setting only the new ones after the old ones were used (as
    `torch.set_float32_matmul_precision` does) leaves a mix in which the old getters raise, and torch.compile reads
    them."""
    for name, mode in (("matmul", matmul), ("conv", conv)):
        check_choice(name, mode, (*FP32_MODES, None))
    if matmul is not None:
        torch.backends.cuda.matmul.allow_tf32 = matmul == "tf32"
    if conv is not None:
        torch.backends.cudnn.allow_tf32 = conv == "tf32"


@contextlib.contextmanager
def fp32_precision_as(mode: str) -> Iterator[None]:
    """Run the block with CUDA float32 products and convolutions in `mode` ('ieee' or 'tf32'); restore after."""
    before = fp32_precision()
    set_fp32_precision(matmul=mode, conv=mode)
    try:
        yield
    finally:
        set_fp32_precision(**before)


def _has_fp32_precision_api() -> bool:
    return at_least(FP32_PRECISION_API) and hasattr(torch.backends.cudnn, "conv")


def _cudnn_conv() -> Any:
    return torch.backends.cudnn.conv  # type: ignore[attr-defined]  # torch 2.9+, absent from its type stubs


# ---------------------------------------------------------------- builds with or without NCCL


def default_timeouts() -> dict[str, timedelta | None]:
    """How long `init_process_group(timeout=None)` lets a collective wait, by backend.

    NCCL's default (10 minutes) exists only in builds with NCCL: PyPI's macOS and Windows wheels and CPU-only
    builds have none, and torch sets it to None there.
    """
    from torch.distributed import constants

    return {
        "nccl": constants.default_pg_nccl_timeout,
        "gloo": constants.default_pg_timeout,
        "mpi": constants.default_pg_timeout,
    }


# ---------------------------------------------------------------- torch.compile: Dynamo's settings, inductor's CPU kernels

RECOMPILE_LIMIT = (2, 7)  # torch._dynamo.config.recompile_limit (before: cache_size_limit, kept as an alias)
CHUNKED_CPU_STATISTICS = (2, 10)  # inductor's C++ kernels sum every mean and variance in chunks (2.8: vector loops)
GPT_EMBEDDING_GRADIENT = (2, 7)  # inductor's CPU kernels give helpers.gpt.GPT's token embedding its true gradient


def recompile_limit_name(*, version: str | None = None) -> str:
    """The name of Dynamo's setting for how often one function may be compiled again before it runs eagerly.

    torch 2.7 renamed `torch._dynamo.config.cache_size_limit` to `recompile_limit` (the old name stays as an
    alias); torch 2.6 knows only `cache_size_limit`. Read it with `getattr(torch._dynamo.config, name)`.
    """
    return "recompile_limit" if at_least(RECOMPILE_LIMIT, version) else "cache_size_limit"


def compiled_statistics_accurate(
    device_type: str, backend: str = "inductor", *, version: str | None = None
) -> tuple[bool, str]:
    """Whether torch.compile computes a mean and variance (BatchNorm's, LayerNorm's) on `device_type` about as
    accurately as eager mode, and why, in one line.

    Before torch 2.10, inductor's CPU (C++) kernels update one running float32 mean and variance over all n values
    of a channel, so the rounding grows with n: BatchNorm over a batch of 512 28x28 images (n = 401,408) can lose
    two of float32's seven digits in the gradients (pytorch/pytorch#141541). torch 2.8 sums in chunks of 4096,
    combined pairwise as eager mode does, in its vectorized loops, 2.10 in all. GPU kernels reduce in a tree;
    other backends (aot_eager) run eager mode's kernels.
    """
    if device_type != "cpu" or backend != "inductor" or at_least(CHUNKED_CPU_STATISTICS, version):
        return True, f"torch.compile ({backend}) computes means and variances on {device_type} as accurately as eager"
    return False, (
        f"torch {version or torch.__version__}'s CPU compiler sums BatchNorm's statistics in one running float32 "
        f"update over all values (in chunks from torch {release_name(CHUNKED_CPU_STATISTICS)}): its gradients lose digits"
    )


def compiled_gpt_gradients_right(device_type: str, *, version: str | None = None) -> tuple[bool, str]:
    """Whether torch.compile (inductor) gives helpers.gpt.GPT the gradients eager mode gives on `device_type`, and
    why, in one line.

    On a CPU, torch 2.6's compiled GPT step gets its token embedding's gradient (the matrix the output layer shares)
    about 21% off eager mode's; torch 2.7 and newer agree with eager mode to float32 rounding, as every other
    parameter does on 2.6 too (measured on a 2-layer GPT: tests/test_gpt.py holds the check). GPUs were not
    measured on 2.6.
    """
    if device_type != "cpu" or at_least(GPT_EMBEDDING_GRADIENT, version):
        return True, f"torch.compile gives the GPT eager mode's gradients on {device_type}"
    return False, (
        f"torch {version or torch.__version__}'s compiler gets the GPT's token-embedding gradient wrong on a CPU (about "
        f"21% off eager mode's; right from torch {release_name(GPT_EMBEDDING_GRADIENT)}): upgrade torch to compile it"
    )
