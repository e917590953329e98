"""The mixed-precision claims of notebook 06, pinned down on small inputs (float16 autocast works on the CPU)."""

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.grads import batch_gradient, flat_grad
from helpers.models import MLP


def test_helpers_loop_fp16_epoch_equals_the_hand_written_amp_step():
    from torch.utils.data import TensorDataset

    from helpers.data import make_loader
    from helpers.loop import train_epoch

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(80, 64, generator=generator), torch.randint(0, 10, (80,), generator=generator))

    def fresh():
        torch.manual_seed(0)
        model = MLP(64, (32,), 10)
        batches = list(make_loader(data, batch_size=16, shuffle=True, seed=1))  # the same batches for both
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), batches

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
    train_epoch(
        with_helper, loader, optimizer, F.cross_entropy, device="cpu", amp="fp16", max_grad_norm=1.0, progress=False
    )
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
    assert scaler.get_scale() == 2.0**15


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
    assert ((gradient(2.0**16, amp=True) - reference).norm() / reference.norm()) < 1e-2


def test_fp16_accumulation_with_one_scaler_matches_the_fp32_batch_gradient():
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


def test_float16_rounds_to_zero_below_2_to_the_minus_25_and_loses_digits_below_its_smallest_normal():
    smallest_subnormal, smallest_normal = 2.0**-24, torch.finfo(torch.float16).tiny
    assert smallest_normal == 2.0**-14 and abs(smallest_normal - 6.1e-5) < 1e-6
    assert torch.tensor(0.99 * 2.0**-25).half() == 0 and torch.tensor(2.0**-25).half() == 0  # a tie rounds to even: 0
    assert torch.tensor(1.01 * 2.0**-25).half().float() == smallest_subnormal
    relative_error = {x: abs(torch.tensor(x).half().float().item() - x) / x for x in (1.234e-3, 1.234e-6)}
    assert relative_error[1.234e-3] <= 2.0**-11 < relative_error[1.234e-6]  # normal: 11 bits; subnormal: fewer


def test_highest_matmul_precision_leaves_cudnn_convolutions_at_tf32():
    """Notebooks 00 and 06 read the setting through helpers.compat: torch 2.9's fp32_precision, allow_tf32 before."""
    from helpers import compat

    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert compat.fp32_precision() == {"matmul": "ieee", "conv": "tf32"} and torch.backends.cudnn.allow_tf32
        torch.set_float32_matmul_precision("high")
        assert compat.fp32_precision() == {"matmul": "tf32", "conv": "tf32"}
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator's cap exists on CUDA only")
def test_a_memory_fraction_cap_forces_a_real_out_of_memory_and_can_be_restored():
    device = torch.device("cuda", torch.cuda.current_device())  # the memory-fraction calls refuse a bare "cuda"
    torch.cuda.empty_cache()
    cap, baseline = torch.cuda.get_per_process_memory_fraction(device), torch.cuda.memory_allocated(device)
    torch.cuda.set_per_process_memory_fraction((baseline + 2**28) / torch.cuda.mem_get_info(device)[1], device)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(torch.cuda.memory_reserved(device) - baseline + 2**29, dtype=torch.uint8, device=device)
    finally:
        torch.cuda.set_per_process_memory_fraction(cap, device)
    assert torch.cuda.get_per_process_memory_fraction(device) == cap
    assert torch.cuda.memory_allocated(device) == baseline


# The torch.cuda calls that refuse a device without an index (torch.cuda._utils._get_device_index(device) with
# optional=False), with the position of their device argument.
INDEXED_DEVICE_CALLS = {"get_per_process_memory_fraction": 0, "set_per_process_memory_fraction": 1}


def _scopes() -> list[tuple[str, ast.AST]]:
    """Every notebook code cell and every test function of the project: (where, its syntax tree)."""
    root = Path(__file__).resolve().parents[1]
    scopes: list[tuple[str, ast.AST]] = []
    for path in sorted(root.glob("notebooks/*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        for number, cell in enumerate(cells, 1):
            source = "".join(cell["source"])
            if any(name in source for name in INDEXED_DEVICE_CALLS):
                scopes.append((f"{path.name} code cell {number}", ast.parse(source)))
    for path in sorted(root.glob("tests/*.py")):
        tree = ast.parse(path.read_text())
        scopes += [(f"{path.name}::{f.name}", f) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)]
    return scopes


def _device_arguments(scope: ast.AST) -> list[ast.expr | None]:
    """The device argument of each index-demanding torch.cuda call in `scope` (None where it is left out)."""
    found: list[ast.expr | None] = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            position = INDEXED_DEVICE_CALLS.get(node.func.attr)
            if position is not None:
                keyword = next((k.value for k in node.keywords if k.arg == "device"), None)
                found.append(node.args[position] if len(node.args) > position else keyword)
    return found


def test_every_memory_fraction_call_gets_an_indexed_device_made_where_it_is_called(monkeypatch):
    """get/set_per_process_memory_fraction raise ValueError for torch.device("cuda") (what 06's memory section, now notebook 14's, met on an H100). Each
    call's device must be made indexed in its own cell or test, from any device the notebook picked: evaluated here
    with a bare `device` and current_device() patched, it must pass torch's own index check."""
    from torch.cuda._utils import _get_device_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    checked = 0
    for where, scope in _scopes():
        for argument in _device_arguments(scope):
            assert argument is not None, f"{where}: pass the device (an indexed one) to the memory-fraction call"
            expression = argument
            if isinstance(argument, ast.Name):  # the name's last assignment before the call, in the same cell or test
                made = [
                    n
                    for n in ast.walk(scope)
                    if isinstance(n, ast.Assign)
                    and [ast.unparse(t) for t in n.targets] == [argument.id]
                    and n.lineno < argument.lineno
                ]
                assert made, f"{where}: {argument.id} is not made in this cell or test; make it indexed here"
                expression = max(made, key=lambda n: n.lineno).value
            device = eval(ast.unparse(expression), {"torch": torch, "device": torch.device("cuda")})
            try:
                assert _get_device_index(device) == 0, (where, device)
            except ValueError as error:  # what torch raises for an index-less device
                pytest.fail(f"{where}: {ast.unparse(argument)} is {device!r}, and torch says: {error}")
            checked += 1
    assert checked >= 4  # notebook 14's out-of-memory cell and tests/test_precision.py, two calls each at least
