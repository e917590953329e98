"""The performance lessons' sizes by device: small on a CPU, and on a GPU the largest rung of each lesson's ladder
whose estimated peak memory fits the free memory (`sizes_for`); the estimate by part (`memory_parts`,
`estimate_bytes`); and what a notebook prints and fills from them (`describe_sizes`, `fill_sizes`).
"""

from __future__ import annotations

import torch

from .checks import check_int
from .devices import pick_device
from .memory import format_bytes

# The performance lessons' default sizes, by device. On a 2-core CPU: small enough that a notebook runs in about a
# minute (06's large enough that a CPU with native bfloat16 shows it faster; 10's narrow with a wide batch, so its
# activations outweigh weights, gradients and Adam's moments there too, about 8 to 1). On a CUDA GPU: the sizes where
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
        "WIDTH": {"cpu": 32, "cuda": 1024},
        "BATCH_SIZE": {"cpu": 1024, "cuda": 8192},
    },
    "inference": {"MAX_BATCH_SIZE": {"cpu": 256, "cuda": 4096}},
    # 14's MLP: on a CPU 8 x 128 at batch 1024, deep enough for checkpointing to save and a batch about 10 times
    # 16 bits' break-even, so every way out lowers the bytes saved for backward; on CUDA 06's sizes
    "gpu_memory": {
        "WIDTH": {"cpu": 128, "cuda": 4096},
        "DEPTH": {"cpu": 8, "cuda": 8},
        "BATCH_SIZE": {"cpu": 1024, "cuda": 16384},
    },
    "faster": {
        "CHANNELS": {"cpu": 8, "cuda": 128},
        "BATCH_SIZE": {"cpu": 64, "cuda": 1024},
        "COPIES": {"cpu": 1, "cuda": 16},
    },
    # 16's GPT (helpers.gpt): on a 2-core CPU about 0.8M parameters at context 128, batch 16, so its training takes
    # about a minute; on CUDA GPT-2 small's shape (85M parameters) at context 1024, where matrix products are large
    # enough for tensor cores to run near their peak
    "capstone": {
        "N_LAYER": {"cpu": 4, "cuda": 12},
        "N_EMBD": {"cpu": 128, "cuda": 768},
        "HEAD_SIZE": {"cpu": 32, "cuda": 64},
        "BLOCK_SIZE": {"cpu": 128, "cuda": 1024},
        "BATCH_SIZE": {"cpu": 16, "cuda": 16},
    },
}

# Each lesson's CUDA sizes, largest estimated peak first (estimate_bytes, with 70% of the free memory it must fit
# in): sizes_for takes the first that fits. Every rung keeps the lesson's effect: 06's products stay at least
# 2048 wide on batches of at least 8192, with activations well above the weights. 10's and 15's top rungs need
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
    "gpu_memory": [  # 06's rungs: the same MLP, four ways of one step side by side
        {"WIDTH": 4096, "DEPTH": 8, "BATCH_SIZE": 16384},
        {"WIDTH": 4096, "DEPTH": 8, "BATCH_SIZE": 8192},
        {"WIDTH": 2048, "DEPTH": 8, "BATCH_SIZE": 32768},
        {"WIDTH": 2048, "DEPTH": 8, "BATCH_SIZE": 16384},
        {"WIDTH": 2048, "DEPTH": 8, "BATCH_SIZE": 8192},
    ],
    "inference": [{"MAX_BATCH_SIZE": 4096}],  # ~0.2 GiB
    # 13's CNN on 28x28 digits: 128 channels make its second convolution ~1.4 GFLOP per image (forward and
    # backward), so a batch of 1024 keeps even an H100 busy for tens of ms per step in float32; COPIES of the
    # 1,347 training digits keep 21 optimizer steps per epoch at every rung (BATCH_SIZE / 64 copies).
    "faster": [
        {"CHANNELS": 128, "BATCH_SIZE": 1024, "COPIES": 16},  # ~3.9 GiB, from ~5.6 GiB free: 8 GB cards and up
        {"CHANNELS": 128, "BATCH_SIZE": 512, "COPIES": 8},  # ~2.0 GiB, from ~2.8 GiB free: 4 and 6 GB
        {"CHANNELS": 64, "BATCH_SIZE": 256, "COPIES": 4},  # ~0.5 GiB: less
    ],
    # 16's GPT, float32 activations (the ladder's first rung) of the whole batch at once
    "capstone": [
        {"N_LAYER": 12, "N_EMBD": 768, "HEAD_SIZE": 64, "BLOCK_SIZE": 1024, "BATCH_SIZE": 16},  # ~19 GiB: 32 GB and up
        {"N_LAYER": 12, "N_EMBD": 768, "HEAD_SIZE": 64, "BLOCK_SIZE": 512, "BATCH_SIZE": 16},  # ~14 GiB: 24 GB
        {"N_LAYER": 8, "N_EMBD": 512, "HEAD_SIZE": 64, "BLOCK_SIZE": 512, "BATCH_SIZE": 16},  # ~5 GiB: 8 and 16 GB
        {"N_LAYER": 6, "N_EMBD": 384, "HEAD_SIZE": 64, "BLOCK_SIZE": 512, "BATCH_SIZE": 8},  # ~1.8 GiB: 6 GB, less
    ],
}
FREE_MEMORY_SHARE = 0.7  # the share of the free GPU memory a lesson's estimated peak may take (the rest: the
# allocator's fragmentation, cuBLAS workspaces, what the estimate leaves out)

_FLOAT = 4  # bytes of a float32
_DIGIT_PIXELS = 28 * 28  # 11 trains on the digits upscaled to MNIST's size
_POST_MODEL_PARAMETERS = 71 * (1000 * 1000 + 1000) + 1000 * 100 + 100  # 10's 72-layer model of the post


def _check_lesson(lesson: object) -> str:
    if not isinstance(lesson, str) or lesson not in LESSON_SIZES:
        raise ValueError(f"lesson must be one of {sorted(LESSON_SIZES)}, got {lesson!r}")
    return lesson


def mlp_parameters(width: int, depth: int, inputs: int = 64, classes: int = 10) -> int:
    """Parameters of `helpers.models.MLP(inputs, (width,) * depth, classes)`: weights and biases of its Linears."""
    return inputs * width + width + (depth - 1) * (width * width + width) + width * classes + classes


def gpt_parameters(layers: int, width: int, context: int, vocab: int = 256) -> int:
    """Parameters of `helpers.gpt.GPT`: token and position embeddings (the output matrix tied to the first), per
    block two LayerNorms, the attention's qkv and output projections and the MLP's two Linears, and the final
    LayerNorm."""
    return vocab * width + context * width + layers * (12 * width * width + 13 * width) + 2 * width


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
    if lesson in ("mixed_precision", "gpu_memory"):  # the same MLP 64 -> WIDTH x DEPTH -> 10
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
    elif lesson == "capstone":
        layers, width, context, batch = (sizes[name] for name in ("N_LAYER", "N_EMBD", "BLOCK_SIZE", "BATCH_SIZE"))
        # HEAD_SIZE moves no bytes: the fused attention saves its output and a log-sum-exp per head and position
        weights = _FLOAT * gpt_parameters(layers, width, context)
        # per token: each block saves about 17 values per channel for backward (its two LayerNorms' inputs and
        # outputs, q, k, v, attention's output, the projection's input, the MLP's 4x-wide input and GELU output),
        # and the head its 256 logits three times over (logits, their float32 copy, softmax's gradient)
        activations = batch * context * _FLOAT * (17 * width * layers + 2 * width + 3 * 256)
        transient = 2 * batch * context * 4 * width * _FLOAT  # two gradients of an MLP's wide activations
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


# How many copies of the weights a lesson holds at once at its peak: 05 times up to four replicas side by side
# (fp32, tf32, bf16, fp16) next to the model they were copied from; 12 four (float32, 16-bit, micro-batches,
# checkpointed).
# 11 holds many small CNNs at once: the ladder's 8 rungs (weights and AdamW's two moments each), section 2's
# model with its gradients and two copies of them, section 3's 3 AdamW replicas (weights, gradients, moments)
# and their made-up gradients: 42 weight-sized tensors, of which gradients and optimizer_state count 3.
# 16 holds the trained GPT and the ladder's rungs (up to 7 models with their gradients and AdamW moments): 7 copies
# of weights, gradients and moments alike, of which gradients and optimizer_state count 1.
_WEIGHT_COPIES = {
    "mixed_precision": 5,
    "gpu_memory": 5,
    "checkpointing": 1,
    "inference": 1,
    "faster": 39,
    "capstone": 25,
}


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
    `device` (a device, or a DEVICE knob's value such as 'auto': helpers.devices.pick_device); return the ones it
    set. A parameter given a value keeps it."""
    chosen = {}
    for name, size in sizes_for(lesson, pick_device() if device == "auto" else device).items():
        if namespace.get(name) is None:
            namespace[name] = chosen[name] = size
    return chosen
