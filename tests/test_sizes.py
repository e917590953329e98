"""GPU sizes by free memory: sizes_for picks the largest rung of a lesson's ladder whose estimate_bytes fits in 70%
of the free memory, and the estimate's parts match what the memory meters measure on the CPU."""

import pytest
import torch
import torch.nn.functional as F

from helpers.devices import cpu_flags
from helpers.memory import model_state_bytes, saved_tensors_meter
from helpers.models import MLP, SmallCNN, deep_linear_stack
from helpers.sizes import (
    CUDA_LADDERS,
    FREE_MEMORY_SHARE,
    LESSON_SIZES,
    describe_sizes,
    estimate_bytes,
    fill_sizes,
    memory_parts,
    mlp_parameters,
    sizes_for,
)

GIB = 2**30
CARDS = (4, 6, 8, 16, 80)  # GiB of free memory


@pytest.mark.parametrize("lesson", sorted(LESSON_SIZES))
def test_each_card_gets_sizes_whose_estimate_fits_in_70_percent_of_its_free_memory(lesson):
    chosen = {n: sizes_for(lesson, "cuda", free_bytes=n * GIB) for n in CARDS}
    estimates = [estimate_bytes(lesson, chosen[n]) for n in CARDS]
    for n, estimate in zip(CARDS, estimates):
        assert estimate <= FREE_MEMORY_SHARE * n * GIB == 0.7 * n * GIB, (lesson, n, chosen[n])
        fitting = [r for r in CUDA_LADDERS[lesson] if estimate_bytes(lesson, r) <= 0.7 * n * GIB]
        assert estimate == max(estimate_bytes(lesson, r) for r in fitting)  # the largest that fits
    assert estimates == sorted(estimates)  # never smaller on a bigger card


def test_mixed_precision_grows_with_every_card_up_to_the_top_of_its_ladder():
    estimates = [
        estimate_bytes("mixed_precision", sizes_for("mixed_precision", "cuda", free_bytes=n * GIB)) for n in CARDS
    ]
    assert estimates[0] < estimates[1] < estimates[2] < estimates[3] == estimates[4]
    assert sizes_for("mixed_precision", "cuda", free_bytes=80 * GIB) == CUDA_LADDERS["mixed_precision"][0]


@pytest.mark.parametrize("lesson", sorted(LESSON_SIZES))
def test_ladders_run_from_the_cuda_default_down_with_the_lessons_sizes(lesson):
    ladder = CUDA_LADDERS[lesson]
    assert ladder[0] == {name: by_kind["cuda"] for name, by_kind in LESSON_SIZES[lesson].items()}
    assert all(set(rung) == set(LESSON_SIZES[lesson]) for rung in ladder)
    estimates = [estimate_bytes(lesson, rung) for rung in ladder]
    assert estimates == sorted(estimates, reverse=True) and len(set(estimates)) == len(estimates), estimates


@pytest.mark.parametrize("lesson", sorted(LESSON_SIZES))
def test_cpu_sizes_do_not_depend_on_free_memory(lesson):
    cpu = {name: by_kind["cpu"] for name, by_kind in LESSON_SIZES[lesson].items()}
    assert sizes_for(lesson, "cpu") == cpu
    assert all(sizes_for(lesson, "cpu", free_bytes=n * GIB) == cpu for n in (0, *CARDS))
    assert sizes_for(lesson, "meta", free_bytes=GIB) == cpu


def test_too_little_memory_gives_the_smallest_rung():
    for lesson, ladder in CUDA_LADDERS.items():
        assert sizes_for(lesson, "cuda", free_bytes=0) == ladder[-1]


def test_free_memory_is_read_from_the_gpu_when_not_given(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: asked.append(device) or (6 * GIB, 8 * GIB))
    assert sizes_for("mixed_precision", "cuda:0") == sizes_for("mixed_precision", "cuda", free_bytes=6 * GIB)
    assert asked == [torch.device("cuda:0")]
    namespace = {"WIDTH": None, "DEPTH": None, "BATCH_SIZE": 128}
    assert fill_sizes(namespace, "mixed_precision", "cuda") == {"WIDTH": 2048, "DEPTH": 8}  # the 6 GiB rung


def test_without_cuda_to_ask_the_cuda_sizes_are_the_top_rung(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for lesson, ladder in CUDA_LADDERS.items():
        assert sizes_for(lesson, "cuda") == ladder[0]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sizes_for("amp", "cuda", free_bytes=GIB), "lesson must be one of"),
        (lambda: sizes_for("mixed_precision", "cuda", free_bytes=-1), "free_bytes must be .*got -1"),
        (lambda: sizes_for("mixed_precision", "cuda", free_bytes=1.5), "free_bytes must be"),  # type: ignore[arg-type]
        (lambda: sizes_for("mixed_precision", "cpu", free_bytes=-1), "free_bytes must be"),
        (lambda: estimate_bytes("amp", {"WIDTH": 8}), "lesson must be one of"),
        (lambda: estimate_bytes("mixed_precision", {"WIDTH": 8}), "sizes must be a dict with exactly the keys"),
        (lambda: estimate_bytes("inference", {"MAX_BATCH_SIZE": 0}), r"sizes\['MAX_BATCH_SIZE'\] must be a positive"),
    ],
)
def test_bad_inputs_name_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_estimate_is_the_parts_with_the_lessons_copies_of_the_weights():
    sizes = {"WIDTH": 128, "DEPTH": 3, "BATCH_SIZE": 64}
    parts = memory_parts("mixed_precision", sizes)
    assert estimate_bytes("mixed_precision", sizes) == 5 * parts["weights"] + sum(parts.values()) - parts["weights"]
    doubled = memory_parts("mixed_precision", sizes | {"BATCH_SIZE": 128})
    assert doubled["activations"] == 2 * parts["activations"] and doubled["weights"] == parts["weights"]


# The parts against the meters, on the CPU. Tolerance: 1% (AdamW's step counters, 4 bytes per parameter tensor,
# are the only bytes the estimate leaves out of the measured state; activations and weights match exactly).
TOLERANCE = 0.01


@pytest.mark.parametrize("width, depth, batch", [(64, 1, 16), (96, 3, 40), (256, 2, 64)])
def test_mixed_precision_parts_match_the_meters(width, depth, batch):
    torch.manual_seed(0)
    model = MLP(64, (width,) * depth, 10)
    assert sum(p.numel() for p in model.parameters()) == mlp_parameters(width, depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    with saved_tensors_meter() as meter:
        F.cross_entropy(model(x), y).backward()
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    parts = memory_parts("mixed_precision", {"WIDTH": width, "DEPTH": depth, "BATCH_SIZE": batch})
    assert parts["weights"] == measured["parameters"] and parts["gradients"] == measured["gradients"]
    assert abs(parts["optimizer_state"] - measured["optimizer_state"]) <= TOLERANCE * measured["optimizer_state"]
    assert abs(parts["activations"] - meter.peak_bytes) <= TOLERANCE * meter.peak_bytes, (parts, meter.peak_bytes)


CPU_STACK = sizes_for("checkpointing", "cpu")


@pytest.mark.parametrize(
    "width, depth, batch", [(32, 4, 8), (64, 10, 16), (CPU_STACK["WIDTH"], CPU_STACK["DEPTH"], CPU_STACK["BATCH_SIZE"])]
)
def test_checkpointing_parts_match_the_meters(width, depth, batch):
    stack = deep_linear_stack(width, depth)
    adam = torch.optim.Adam(stack.parameters(), lr=0.0)
    with saved_tensors_meter() as meter:
        stack(torch.randn(batch, width)).sum().backward()
    adam.step()
    measured = model_state_bytes(stack, adam)
    parts = memory_parts("checkpointing", {"DEPTH": depth, "WIDTH": width, "BATCH_SIZE": batch})
    assert parts["weights"] == measured["parameters"] and parts["gradients"] == measured["gradients"]
    assert abs(parts["optimizer_state"] - measured["optimizer_state"]) <= TOLERANCE * measured["optimizer_state"]
    assert parts["activations"] == meter.peak_bytes


@pytest.mark.parametrize("sizes", [CPU_STACK, *CUDA_LADDERS["checkpointing"]], ids=lambda sizes: str(sizes))
def test_checkpointing_sizes_let_activations_dominate_on_every_device(sizes):
    """10's lesson needs activations well above weights + gradients + Adam's moments, or checkpointing barely moves
    the total: at least twice the rest at every default size (the CPU's about 8 times, the CUDA rung's about 2)."""
    parts = memory_parts("checkpointing", sizes)
    rest = parts["weights"] + parts["gradients"] + parts["optimizer_state"]
    assert parts["activations"] >= 2 * rest, (sizes, parts["activations"] / rest)


@pytest.mark.parametrize("batch", [1, 32])
def test_inference_parts_bound_every_output_of_one_forward(batch):
    model = SmallCNN(channels=16, dropout=0.3).eval()
    outputs = []
    for module in model.modules():
        if next(module.children(), None) is None:
            module.register_forward_hook(lambda m, args, out: outputs.append(out.numel() * out.element_size()))
    images = torch.rand(batch, 1, 8, 8)
    with torch.no_grad():
        model(images)
    parts = memory_parts("inference", {"MAX_BATCH_SIZE": batch})
    assert parts["weights"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert parts["activations"] == sum(outputs) + images.numel() * images.element_size()


def test_describe_sizes_says_what_runs_and_why():
    ladder = CUDA_LADDERS["mixed_precision"]
    six = describe_sizes("mixed_precision", "cuda", ladder[2], free_bytes=6 * GIB)
    assert six.startswith("WIDTH 2048, DEPTH 8, BATCH_SIZE 32768: estimated GPU peak 3.39 GiB; 6.00 GiB free")
    assert "the largest sizes that fit: these" in six and "BATCH_SIZE 16384, need 6.01 GiB" in six
    by_hand = describe_sizes("mixed_precision", "cuda", ladder[0], free_bytes=6 * GIB)
    assert "the largest sizes that fit: WIDTH 2048, DEPTH 8, BATCH_SIZE 32768" in by_hand and "need" not in by_hand
    cpu = sizes_for("checkpointing", "cpu")
    assert describe_sizes("checkpointing", "cpu", cpu).endswith("the cpu sizes are these")
    assert describe_sizes("checkpointing", "cpu", cpu | {"DEPTH": 7}).endswith(
        "the cpu sizes are DEPTH 100, WIDTH 32, BATCH_SIZE 1024"
    )
    with pytest.raises(ValueError, match="sizes must be a dict"):
        describe_sizes("checkpointing", "cpu", {"DEPTH": 7})


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse avx512_bf16 amx_bf16\n\nprocessor\t: 1\n"
    )
    assert cpu_flags(str(cpuinfo)) == {"fpu", "sse", "avx512_bf16", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize("channels", [1, 4, 8, 128])
def test_smallcnn_parameters_counts_the_models_parameters(channels):
    from helpers.sizes import smallcnn_parameters

    assert smallcnn_parameters(channels) == sum(p.numel() for p in SmallCNN(channels=channels).parameters())


@pytest.mark.parametrize("channels, batch", [(4, 8), (8, 16), (16, 5)])
def test_faster_parts_match_the_meters(channels, batch):
    """13's estimate: SmallCNN(channels) on 28x28 digits, float32, one AdamW step."""
    torch.manual_seed(0)
    model = SmallCNN(channels=channels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    images, labels = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    with saved_tensors_meter() as meter:
        F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    parts = memory_parts("faster", {"CHANNELS": channels, "BATCH_SIZE": batch, "COPIES": 3})
    assert parts["weights"] == measured["parameters"] and parts["gradients"] == measured["gradients"]
    assert abs(parts["optimizer_state"] - measured["optimizer_state"]) <= TOLERANCE * measured["optimizer_state"]
    # the meter also counts what BatchNorm saves besides its input (the batch's mean and 1/std, and its running
    # mean and variance: 16 bytes per channel) and the loss's 4-byte weight: under 1% of the activations
    assert abs(parts["activations"] - meter.peak_bytes) <= TOLERANCE * meter.peak_bytes, (parts, meter.peak_bytes)


def test_faster_keeps_the_same_steps_per_epoch_on_every_rung():
    """COPIES of the 1,347 training digits: each rung's epoch takes as many optimizer steps as the CPU's."""
    cpu = sizes_for("faster", "cpu")
    steps = {1347 * rung["COPIES"] // rung["BATCH_SIZE"] for rung in [cpu, *CUDA_LADDERS["faster"]]}
    assert steps == {1347 // cpu["BATCH_SIZE"]}
    assert all(rung["BATCH_SIZE"] <= 1347 * rung["COPIES"] for rung in CUDA_LADDERS["faster"])


def test_gpu_memory_is_05s_mlp_and_its_cpu_sizes_let_activations_outweigh_the_weights():
    """14 measures the MLP of 06: the same parts at the same sizes; on a CPU its activations are several times
    its weights, so each way out (micro-batches, 16 bits, checkpointing) has bytes to save."""
    cpu = sizes_for("gpu_memory", "cpu")
    assert cpu == {"WIDTH": 128, "DEPTH": 8, "BATCH_SIZE": 1024}
    for sizes in (cpu, *CUDA_LADDERS["gpu_memory"]):
        assert memory_parts("gpu_memory", sizes) == memory_parts("mixed_precision", sizes)
    parts = memory_parts("gpu_memory", cpu)
    assert parts["activations"] >= 3 * parts["weights"], parts
    assert CUDA_LADDERS["gpu_memory"] == CUDA_LADDERS["mixed_precision"]
