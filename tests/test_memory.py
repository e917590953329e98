import pytest
import torch
from torch import nn

from helpers.memory import format_bytes, model_state_bytes, peak_memory, saved_peak_bytes, saved_tensors_meter
from helpers.models import deep_linear_stack


@pytest.mark.parametrize("batch, width, depth", [(8, 16, 1), (32, 64, 5), (3, 100, 12)])
def test_meter_matches_the_analytic_count_to_the_byte(batch, width, depth):
    model = deep_linear_stack(width, depth)
    x = torch.randn(batch, width)
    with saved_tensors_meter(exclude=model) as meter:
        loss = model(x).sum()
    # Linear saves its input, ReLU its output; each ReLU output is the next Linear's input (one storage)
    assert meter.bytes == (depth + 1) * batch * width * 4
    assert meter.live_bytes == meter.bytes == meter.peak_bytes
    loss.backward()
    assert meter.live_bytes == 0


def test_meter_leaves_weights_out_by_default_and_counts_them_when_asked():
    model = deep_linear_stack(16, 3)
    x = torch.randn(4, 16).requires_grad_()  # now every Linear also saves weight.t() for the input grad
    with saved_tensors_meter() as default:
        model(x)
    with saved_tensors_meter(exclude=model) as excluded:
        model(x)
    with saved_tensors_meter(include_parameters=True) as everything:
        model(x)
    assert default.bytes == excluded.bytes
    assert everything.bytes - default.bytes == 3 * 16 * 16 * 4 + 4 * 16 * 4  # the weights, and x itself (a leaf)


def test_meter_leaves_out_a_convolution_weight_saved_as_itself():
    conv = nn.Conv2d(1, 2, 3)
    x = torch.randn(1, 1, 5, 5)
    with saved_tensors_meter() as default:
        conv(x)
    with saved_tensors_meter(include_parameters=True) as everything:
        conv(x)
    assert default.bytes == x.numel() * 4
    assert everything.bytes == default.bytes + conv.weight.numel() * 4


def test_meter_counts_a_weight_cast_by_autocast():
    # under autocast the bf16 copy of a weight is a new tensor, not a view of the parameter: real memory, counted
    model = deep_linear_stack(16, 2)
    x = torch.randn(4, 16).requires_grad_()
    with saved_tensors_meter() as default, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    with saved_tensors_meter(include_parameters=True) as everything, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert default.bytes == everything.bytes  # every saved tensor is a cast copy or an activation: none left out
    assert default.bytes >= 2 * 16 * 16 * 2  # the two bf16 weight copies are among them


def test_meter_peak_is_one_graph_when_backward_runs_in_between():
    model = deep_linear_stack(32, 4)
    small, big = torch.randn(4, 32), torch.randn(16, 32)
    with saved_tensors_meter(exclude=model) as meter:
        model(small).sum().backward()
        model(big).sum().backward()
    assert meter.bytes == 5 * (4 + 16) * 32 * 4
    assert meter.peak_bytes == 5 * 16 * 32 * 4


def test_meter_reads_zero_under_no_grad():
    model = deep_linear_stack(8, 2)
    with saved_tensors_meter(exclude=model) as meter, torch.no_grad():
        model(torch.randn(2, 8))
    assert meter.bytes == 0


def test_meter_rejects_bad_exclude():
    with pytest.raises(TypeError, match="exclude"):
        with saved_tensors_meter(exclude=[1, 2]):
            pass
    with pytest.raises(TypeError, match="include_parameters"):
        with saved_tensors_meter(include_parameters="yes"):
            pass


def test_model_state_bytes_splits_the_state():
    model = nn.Sequential(nn.Linear(10, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.Adam(model.parameters())
    before = model_state_bytes(model, optimizer)
    assert before["parameters"] == (10 * 4 + 4 + 4 + 4) * 4
    assert before["gradients"] == 0 and before["optimizer_state"] == 0
    assert before["buffers"] == (4 + 4) * 4 + 8  # running mean/var in float32, num_batches_tracked int64
    model(torch.randn(3, 10)).sum().backward()
    optimizer.step()
    after = model_state_bytes(model, optimizer)
    assert after["gradients"] == after["parameters"]
    assert after["optimizer_state"] >= 2 * after["parameters"]  # Adam keeps two moments per parameter
    assert after["total"] == sum(v for k, v in after.items() if k != "total")


def test_model_state_bytes_bad_inputs():
    with pytest.raises(TypeError, match="model"):
        model_state_bytes("model")
    with pytest.raises(TypeError, match="optimizer"):
        model_state_bytes(nn.Linear(2, 2), optimizer="adam")


def test_peak_memory_on_cpu_sees_a_large_allocation():
    with peak_memory("cpu") as small:
        pass
    with peak_memory("cpu") as peak:
        block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
        del block
    assert "coarse" in peak.kind
    if "reset at block start" in small.kind:  # the high-water mark was reset: the block's own peak shows
        assert peak.bytes >= small.bytes + 60 * 1024 * 1024
    else:
        assert peak.bytes >= 64 * 1024 * 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_on_cuda_uses_the_allocator():
    held = torch.ones(1024 * 1024, device="cuda")
    with peak_memory("cuda") as peak:
        block = torch.ones(1024 * 1024, device="cuda")
        del block
    assert peak.start_bytes >= held.numel() * 4 and "allocator" in peak.kind
    assert peak.bytes - peak.start_bytes >= 4 * 1024 * 1024  # the block's own peak


def test_peak_memory_rejects_other_devices():
    with pytest.raises(ValueError, match="device"):
        with peak_memory("meta"):
            pass


@pytest.mark.parametrize("value, text", [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (3 * 1024**3, "3.00 GiB")])
def test_format_bytes(value, text):
    assert format_bytes(value) == text


def test_format_bytes_rejects_non_numbers():
    with pytest.raises(TypeError, match="num_bytes"):
        format_bytes("12")


def test_meter_frees_a_graph_dropped_without_backward():
    import gc

    model = deep_linear_stack(16, 3)
    with saved_tensors_meter(exclude=model) as meter:
        output = model(torch.randn(4, 16))
        assert meter.live_bytes == 4 * 4 * 16 * 4
        del output
        gc.collect()
        assert meter.live_bytes == 0


def test_gradients_under_the_meter_equal_plain_gradients():
    torch.manual_seed(0)
    model = deep_linear_stack(8, 3)
    x = torch.randn(5, 8, requires_grad=True)
    model(x).pow(2).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    with saved_tensors_meter(exclude=model):
        model(x).pow(2).sum().backward()
    metered = [p.grad for p in model.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(plain, metered))


@pytest.mark.parametrize("device", ["tpu", "gpu0", 3.5])
def test_peak_memory_names_the_parameter_for_an_unknown_device(device):
    with pytest.raises(ValueError, match="device must be 'cuda', 'mps' or 'cpu'"), peak_memory(device):
        pass


def test_saved_peak_bytes_is_the_meters_peak_and_one_graph_when_backward_runs_in_between():
    model = deep_linear_stack(32, 4)
    small, big = torch.randn(4, 32), torch.randn(16, 32)
    one_after_the_other = saved_peak_bytes(lambda: (model(small).sum().backward(), model(big).sum().backward()))
    together = saved_peak_bytes(lambda: (model(small).sum() + model(big).sum()).backward())
    assert one_after_the_other == 5 * 16 * 32 * 4
    assert together == 5 * (4 + 16) * 32 * 4
    assert saved_peak_bytes(lambda: model(small).sum().backward(), exclude=[small]) == 4 * 4 * 32 * 4
    with pytest.raises(TypeError, match="run must be"):
        saved_peak_bytes(None)


def test_include_parameters_adds_the_weights_of_every_linear_layer_but_the_first_when_the_input_needs_no_grad():
    from helpers.models import MLP

    model = MLP(64, (128, 64), 10)
    images = torch.randn(16, 64)  # data: no gradient wanted, so the first Linear saves no weight for it

    def step():
        torch.nn.functional.cross_entropy(model(images), torch.zeros(16, dtype=torch.long)).backward()

    added = saved_peak_bytes(step, include_parameters=True) - saved_peak_bytes(step)
    assert added == model[3].weight.nbytes + model[5].weight.nbytes  # Linear 2 and 3 save weight.t() for their input


def test_process_gpu_bytes_reads_this_process_line_of_nvidia_smi_or_falls_back_to_total_minus_free(monkeypatch):
    import os
    import subprocess

    from helpers.memory import process_gpu_bytes

    listed = f"123, 7\n{os.getpid()}, 42\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=listed))
    assert process_gpu_bytes("cuda") == (42 * 2**20, "nvidia-smi, this process")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**20, 10 * 2**20))
    for stdout in ("123, 7\n", "No devices were found\n", "[N/A], [N/A]\n"):  # not listed, no GPU line, no numbers
        monkeypatch.setattr(subprocess, "run", lambda *a, stdout=stdout, **k: subprocess.CompletedProcess(a, 0, stdout))
        assert process_gpu_bytes("cuda:0") == (7 * 2**20, "mem_get_info: total - free, all processes")

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    assert process_gpu_bytes("cuda")[0] == 7 * 2**20
    with pytest.raises(ValueError, match="must be a CUDA device"):
        process_gpu_bytes("cpu")


@pytest.mark.parametrize(
    "nbytes, cost",
    [
        (0, 0),
        (1, 512),
        (4_000, 4_096),  # a 1000-float bias: rounded up to 512 bytes
        (4_000_000, 4 * 2**20),  # a 1000 x 1000 float32 tensor: five to a 20 MiB segment
        (6 * 2**20, 20 * 2**20 / 3),  # three to a segment
        (12 * 2**20, 12 * 2**20),  # 10 MiB and more: a segment of its own, no sharing
    ],
)
def test_cuda_allocator_bytes_rounds_to_512_and_shares_20_mib_segments_between_1_and_10_mib(nbytes, cost):
    from helpers.memory import cuda_allocator_bytes

    assert cuda_allocator_bytes(nbytes) == cost


@pytest.mark.parametrize("nbytes", [-1, 1.5, True, "4"])
def test_cuda_allocator_bytes_refuses_what_is_not_a_byte_count(nbytes):
    from helpers.memory import cuda_allocator_bytes

    with pytest.raises(ValueError, match="nbytes"):
        cuda_allocator_bytes(nbytes)


def test_the_posts_memory_drops_are_the_state_of_layers_the_reentrant_segments_left_untrained():
    """Notebook 10's published table: 72 Linear layers (71 of 1000 x 1000, one 1000 x 100), a data input, Adam and
    checkpoint_sequential's reentrant variant at 0 / 2 / 5 / 10 segments, 1717 / 1283 / 1043 / 959 MB. Each drop is
    the gradient and two Adam moments of the layers left without a gradient: at the CUDA allocator's cost of each
    tensor it matches to 1%; counted exactly in bytes (MiB), it falls at least 3% short."""
    import warnings

    from torch.utils.checkpoint import checkpoint_sequential

    from helpers.memory import cuda_allocator_bytes

    post_mb = {0: 1717, 2: 1283, 5: 1043, 10: 959}
    shapes = [(1000, 1000)] * 71 + [(100, 1000)]  # (out, in) of the post's layers
    narrow = nn.Sequential(*[nn.Linear(2, 2) for _ in shapes])  # which layers train does not depend on the width
    data = torch.randn(16, 2)  # no requires_grad, as from a DataLoader
    for segments, mb in post_mb.items():
        narrow.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no input requires grad
            out = checkpoint_sequential(narrow, segments, data, use_reentrant=True) if segments else narrow(data)
        out.sum().backward()
        untrained = [shapes[i] for i, layer in enumerate(narrow) if layer.weight.grad is None]
        tensors = [4 * rows * cols for rows, cols in untrained] + [4 * rows for rows, _ in untrained]  # weight, bias
        drop = post_mb[0] - mb
        at_the_allocator = sum(3 * cuda_allocator_bytes(n) for n in tensors) / 2**20
        exactly = sum(3 * n for n in tensors) / 2**20
        assert abs(at_the_allocator - drop) <= 0.01 * drop, (segments, at_the_allocator, drop)
        assert exactly <= 0.97 * drop or segments == 0, (segments, exactly, drop)


def test_one_adam_step_at_lr_0_adds_two_moments_and_leaves_the_weights():
    """Notebook 10's account of a deep stack's fixed memory: after a step and one Adam step at lr 0, the gradients
    are as large as the weights, Adam's state at least twice that (two moments and a step counter per parameter),
    and the weights have not moved."""
    model = deep_linear_stack(8, 3)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 8)).sum().backward()
    adam = torch.optim.Adam(model.parameters(), lr=0.0)
    adam.step()
    state = model_state_bytes(model, adam)
    assert state["gradients"] == state["parameters"]
    assert state["optimizer_state"] >= 2 * state["parameters"]
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
