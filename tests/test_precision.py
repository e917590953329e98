import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.memory import saved_tensors_meter
from helpers.models import MLP, SmallCNN
from helpers.precision import cpu_low_precision_flags, per_sample_and_fixed_bytes, record_output_dtypes


def test_record_output_dtypes_under_cpu_bf16_autocast():
    model = MLP(64, (32,), 10)  # Flatten, Linear, ReLU, Linear
    x = torch.randn(4, 1, 8, 8)
    with record_output_dtypes(model) as records:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
    assert [r["type"] for r in records] == ["Flatten", "Linear", "ReLU", "Linear"]
    assert [r["dtype"] for r in records] == [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert records[1]["name"] == "1"
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stay float32


def test_record_output_dtypes_without_autocast_is_float32_and_removes_its_hooks():
    model = SmallCNN()
    with record_output_dtypes(model) as records:
        model(torch.randn(2, 1, 8, 8))
    assert records and all(r["dtype"] == torch.float32 for r in records)
    assert "Conv2d" in {r["type"] for r in records}
    count = len(records)
    model(torch.randn(2, 1, 8, 8))
    assert len(records) == count
    assert all(not m._forward_hooks for m in model.modules())


def test_record_output_dtypes_containers_too():
    model = MLP(64, (8,), 10)
    with record_output_dtypes(model, leaves_only=False) as records:
        model(torch.randn(2, 64))
    assert records[-1]["name"] == "(model)" and records[-1]["type"] == "MLP"


def test_record_output_dtypes_rejects_a_non_module():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        with record_output_dtypes("model"):
            pass


def test_cpu_low_precision_flags_reads_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512_bf16 amx_bf16\n")
    assert cpu_low_precision_flags(info) == ["avx512_bf16", "amx_bf16"]
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2\n")
    assert cpu_low_precision_flags(info) == []
    assert cpu_low_precision_flags(tmp_path / "missing") is None
    here = cpu_low_precision_flags()
    assert here is None or isinstance(here, list)


@pytest.mark.parametrize("amp", [False, True])
def test_per_sample_and_fixed_bytes_on_a_real_meter(amp):
    torch.manual_seed(0)
    model = MLP(64, (32, 32), 10)

    def saved(batch: int) -> int:
        x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
        with saved_tensors_meter(exclude=model) as meter:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        return meter.bytes

    per_sample, fixed = per_sample_and_fixed_bytes({b: saved(b) for b in (4, 8, 20)})
    element = 2 if amp else 4
    # input (64), two ReLU outputs (32 each) in the compute dtype; log-probabilities (10 x fp32), target (int64)
    assert per_sample == (64 + 2 * 32) * element + 10 * 4 + 8
    # under autocast the bf16 copies of the weights that a backward needs are saved too (not the first
    # layer's: nothing asks for the gradient of the input)
    copies = (32 * 32 + 10 * 32) * 2 if amp else 0
    assert fixed - copies < 64  # plus a few scalars


def test_per_sample_and_fixed_bytes_checks_its_input():
    assert per_sample_and_fixed_bytes({1: 14, 3: 34}) == (10.0, 4.0)
    with pytest.raises(ValueError, match="at least two"):
        per_sample_and_fixed_bytes({1: 10})
    with pytest.raises(ValueError, match="not linear"):
        per_sample_and_fixed_bytes({1: 10, 2: 25, 3: 30})
    with pytest.raises(ValueError, match="positive int"):
        per_sample_and_fixed_bytes({0: 10, 2: 20})
    with pytest.raises(ValueError, match="number >= 0"):
        per_sample_and_fixed_bytes({1: -1, 2: 20})


# The mixed-precision claims of notebook 04, pinned down on small inputs (float16 autocast works on the CPU).

def test_helpers_loop_fp16_epoch_equals_the_hand_written_amp_step():
    from torch.utils.data import TensorDataset

    from helpers.data import make_loader
    from helpers.loop import train_epoch

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(80, 64, generator=generator), torch.randint(0, 10, (80,), generator=generator))

    def fresh():
        torch.manual_seed(0)
        model = MLP(64, (32,), 10)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), make_loader(data, batch_size=16,
                                                                                              shuffle=True, seed=1)

    by_hand, optimizer, loader = fresh()
    scaler = torch.amp.GradScaler("cpu")
    for inputs, targets in loader:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(by_hand(inputs), targets)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(by_hand.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    with_helper, optimizer, loader = fresh()
    train_epoch(with_helper, loader, optimizer, F.cross_entropy, device="cpu", amp="fp16", max_grad_norm=1.0,
                progress=False)
    assert all(torch.equal(p, q) for p, q in zip(by_hand.parameters(), with_helper.parameters()))


def test_grad_scaler_on_cpu_skips_an_inf_step_and_halves_the_scale():
    torch.manual_seed(0)
    net = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = net(torch.randn(4, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    net.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in net.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(b, p) for b, p in zip(before, net.parameters()))
    assert scaler.get_scale() == 2.0 ** 15


def test_float16_underflow_and_loss_scaling():
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    x = torch.randn(8, 16)

    def gradient(scale: float, amp: bool) -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            out = layer(x)
        (out.float().sum() * 1e-9 * scale).backward()
        return layer.weight.grad / scale

    reference = gradient(1.0, amp=False)
    assert not gradient(1.0, amp=True).any()
    assert ((gradient(2.0 ** 16, amp=True) - reference).norm() / reference.norm()) < 1e-2


def test_fp16_accumulation_with_one_scaler_matches_the_fp32_batch_gradient():
    from helpers.grads import batch_gradient, flat_grad

    torch.manual_seed(0)
    model = MLP(64, (32,), 10)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    reference = batch_gradient(model, F.cross_entropy, x, y)
    scaler = torch.amp.GradScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for micro_x, micro_y in zip(x.chunk(4), y.chunk(4)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(micro_x), micro_y) / 4
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    assert ((flat_grad(model) - reference).norm() / reference.norm()) < 1e-2
