import contextlib
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Subset, TensorDataset

from helpers.data import DigitsDataset, make_loader
from helpers.devices import seed_everything
from helpers.loop import (
    evaluate,
    fit,
    has_pending_gradients,
    make_grad_scaler,
    precision_steps,
    precisions_for,
    tf32_available,
    train_epoch,
)
from helpers.models import MLP, SmallCNN
from helpers.rig import measure

LOSS = nn.CrossEntropyLoss()


@pytest.fixture(scope="module")
def digits():
    return DigitsDataset("train"), DigitsDataset("test")


def _weights_equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


# With progress=True too: tqdm.auto's tqdm(loader) opens an extra DataLoader iterator, which would
# advance the loader's generator and change the shuffle.
@pytest.mark.parametrize("seed, progress", [(0, False), (7, True)])
def test_train_epoch_is_bit_identical_to_the_five_line_loop(digits, seed, progress):
    def trained(use_helper: bool) -> nn.Module:
        seed_everything(seed)
        model = MLP(dropout=0.2, batch_norm=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = make_loader(digits[0], batch_size=50, shuffle=True, seed=seed)
        if use_helper:
            train_epoch(model, loader, optimizer, LOSS, device="cpu", progress=progress)
        else:
            for inputs, targets in loader:
                loss = LOSS(model(inputs), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        return model

    assert _weights_equal(trained(True), trained(False))


@pytest.mark.parametrize("n, batch, k", [(64, 16, 4), (10, 3, 4), (23, 4, 3), (7, 7, 2)])
def test_accumulation_equals_the_big_batch_update_even_when_uneven(digits, n, batch, k):
    seed_everything(1)
    model = MLP()
    reference = copy.deepcopy(model)
    subset = Subset(digits[0], range(n))
    group = batch * k
    train_epoch(
        model,
        make_loader(subset, batch_size=batch),
        torch.optim.SGD(model.parameters(), lr=0.5),
        LOSS,
        device="cpu",
        accumulation_steps=k,
        progress=False,
    )
    train_epoch(
        reference,
        make_loader(subset, batch_size=group),
        torch.optim.SGD(reference.parameters(), lr=0.5),
        LOSS,
        device="cpu",
        progress=False,
    )
    assert _max_diff(model, reference) < 1e-6


def test_train_epoch_reports_counts_and_leaves_no_pending_gradients(digits):
    model = MLP()
    loader = make_loader(Subset(digits[0], range(100)), batch_size=16)  # 7 micro-batches
    result = train_epoch(
        model,
        loader,
        torch.optim.SGD(model.parameters(), lr=0.1),
        LOSS,
        device="cpu",
        accumulation_steps=3,
        progress=False,
    )
    assert result.samples == 100 and result.micro_batches == 7 and result.optimizer_steps == 3
    assert result.loss > 0 and result.samples_per_s > 0
    assert not has_pending_gradients(model)


def test_has_pending_gradients_sees_a_backward_without_a_step():
    model = MLP()
    assert not has_pending_gradients(model)
    LOSS(model(torch.randn(4, 64)), torch.tensor([0, 1, 2, 3])).backward()
    assert has_pending_gradients(model)


def test_scheduler_steps_once_per_optimizer_step(digits):
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train_epoch(
        model,
        make_loader(Subset(digits[0], range(40)), batch_size=10),
        optimizer,
        LOSS,
        device="cpu",
        scheduler=scheduler,
        accumulation_steps=2,
        progress=False,
    )
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_each_optimizer_step_runs_at_the_rate_the_scheduler_had_set_before_it(digits, monkeypatch):
    """The scheduler steps after the optimizer: the first step runs at the initial rate, not at the second one."""
    used = []
    original = torch.optim.SGD.step
    monkeypatch.setattr(
        torch.optim.SGD,
        "step",
        lambda self, *a, **k: used.append(self.param_groups[0]["lr"]) or original(self, *a, **k),
    )
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = make_loader(Subset(digits[0], range(30)), batch_size=10)
    train_epoch(model, loader, optimizer, LOSS, device="cpu", scheduler=scheduler, progress=False)
    assert used == [1.0, 0.5, 0.25]


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_on_cpu_trains_and_stays_close_to_fp32(digits, amp):
    def run(amp_mode):
        seed_everything(3)
        model = SmallCNN()
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        loader = make_loader(digits[0], batch_size=64, shuffle=True, seed=3)
        history = fit(
            model,
            loader,
            optimizer,
            LOSS,
            device="cpu",
            epochs=2,
            amp=amp_mode,
            max_grad_norm=1.0,
            val_loader=make_loader(digits[1], batch_size=256),
            progress=False,
        )
        return history[-1]

    low, full = run(amp), run(None)
    assert low["val_accuracy"] > 0.8
    assert abs(low["val_accuracy"] - full["val_accuracy"]) < 0.05


@pytest.mark.parametrize("accumulation_steps", [1, 3])
def test_bf16_epoch_is_bit_identical_to_the_hand_written_autocast_loop(digits, accumulation_steps):
    def trained(use_helper: bool) -> nn.Module:
        seed_everything(5)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = make_loader(Subset(digits[0], range(320)), batch_size=32)  # 10 micro-batches: groups 3, 3, 3, 1
        if use_helper:
            train_epoch(
                model,
                loader,
                optimizer,
                LOSS,
                device="cpu",
                amp="bf16",
                accumulation_steps=accumulation_steps,
                progress=False,
            )
            return model
        batches = list(loader)
        for first in range(0, len(batches), accumulation_steps):
            group = batches[first : first + accumulation_steps]
            for inputs, targets in group:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = LOSS(model(inputs), targets)
                (loss * (1 / len(group)) if len(group) > 1 else loss).backward()  # equal batches: share 1/len
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return model

    assert _weights_equal(trained(True), trained(False))


def test_a_skipped_fp16_step_mid_epoch_is_not_scheduled_and_a_given_scaler_carries_its_scale():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    inputs = torch.randn(10, 4)
    inputs[4:8] = float("inf")  # the second group of 2 micro-batches of 2; the last group is one batch
    data = TensorDataset(inputs, torch.zeros(10, dtype=torch.long))
    scaler = torch.amp.GradScaler("cpu")
    result = train_epoch(
        model,
        make_loader(data, batch_size=2),
        optimizer,
        LOSS,
        device="cpu",
        amp="fp16",
        accumulation_steps=2,
        scheduler=scheduler,
        scaler=scaler,
        progress=False,
    )
    assert result.optimizer_steps == 3 and result.micro_batches == 5
    assert optimizer.param_groups[0]["lr"] == 0.25  # 3 groups, 1 skipped: 2 schedule steps
    assert scaler.get_scale() == 2.0**15  # the skip halved the given scaler's scale (2**16 at first)
    assert torch.isfinite(model.weight).all()


def test_fp16_gets_a_grad_scaler_and_bf16_does_not():
    assert isinstance(make_grad_scaler(torch.device("cpu"), "fp16"), torch.amp.GradScaler)
    for amp in ("bf16", "fp32", None):  # one "no scaling": a disabled scaler that passes everything through
        scaler = make_grad_scaler(torch.device("cpu"), amp)
        probe = torch.ones(2)
        assert not scaler.is_enabled() and scaler.scale(probe) is probe


def _a_gpu(monkeypatch, capability: tuple[int, int], *, native_bf16: bool = True) -> None:
    """Make this process see one NVIDIA GPU of `capability` (no CUDA call reaches a driver)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16)
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize(
    "capability, native_bf16, with_tf32",
    [
        ((7, 0), False, ["fp32", "fp16"]),  # V100: no TF32, no native bfloat16
        ((7, 5), False, ["fp32", "fp16"]),  # T4
        ((8, 0), True, ["fp32", "tf32", "bf16", "fp16"]),  # A100
        ((9, 0), True, ["fp32", "tf32", "bf16", "fp16"]),  # H100
    ],
)
def test_precisions_for_a_gpu_add_tf32_from_ampere_on_when_asked(monkeypatch, capability, native_bf16, with_tf32):
    _a_gpu(monkeypatch, capability, native_bf16=native_bf16)
    assert precisions_for("cuda:0", tf32=True) == with_tf32
    assert precisions_for("cuda:0") == [name for name in with_tf32 if name != "tf32"]  # as before: [1] is 16-bit
    assert tf32_available("cuda:0")[0] == (capability >= (8, 0))


def test_tf32_available_says_why_not_on_a_cpu_an_older_gpu_and_rocm(monkeypatch):
    assert precisions_for("cpu", tf32=True) == precisions_for("cpu") == ["fp32", "bf16"]
    assert tf32_available("cpu") == (
        False,
        "no TF32 on cpu: it is a mode of NVIDIA tensor cores (compute capability 8.0+)",
    )
    _a_gpu(monkeypatch, (7, 5), native_bf16=False)
    assert tf32_available(torch.device("cuda", 0)) == (
        False,
        "no TF32 on Test GPU (compute capability 7.5): it needs compute capability 8.0 or newer (Ampere)",
    )
    _a_gpu(monkeypatch, (8, 6))
    assert tf32_available("cuda") == (
        True,
        "TF32 on Test GPU (compute capability 8.6): float32 products on tensor cores, 10-bit mantissas",
    )
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert tf32_available("cuda")[0] is False and "ROCm" in tf32_available("cuda")[1]


def test_clipping_bounds_the_update():
    model = nn.Linear(4, 2, bias=False)
    before = model.weight.detach().clone()
    data = TensorDataset(torch.full((8, 4), 100.0), torch.zeros(8, dtype=torch.long))
    train_epoch(
        model,
        make_loader(data, batch_size=8),
        torch.optim.SGD(model.parameters(), lr=1.0),
        LOSS,
        device="cpu",
        max_grad_norm=0.5,
        progress=False,
    )
    assert (model.weight.detach() - before).norm() <= 0.5 + 1e-6


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"accumulation_steps": 0}, ValueError, "accumulation_steps must be a positive int, got 0"),
        ({"accumulation_steps": 2.0}, ValueError, "accumulation_steps"),
        ({"amp": "fp8"}, ValueError, r"amp must be one of \[None, 'fp32', 'bf16', 'fp16'\], got 'fp8'"),
        ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
        ({"device": 3}, TypeError, "device"),
    ],
)
def test_train_epoch_bad_arguments(digits, kwargs, error, message):
    model = MLP()
    args = {"device": "cpu", "progress": False, **kwargs}
    with pytest.raises(error, match=message):
        train_epoch(
            model, make_loader(digits[1], batch_size=64), torch.optim.SGD(model.parameters(), lr=0.1), LOSS, **args
        )


def test_train_epoch_rejects_an_empty_loader():
    model = MLP()
    empty = make_loader(TensorDataset(torch.zeros(0, 64), torch.zeros(0, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match="loader"):
        train_epoch(model, empty, torch.optim.SGD(model.parameters(), lr=0.1), LOSS, device="cpu", progress=False)
    with pytest.raises(ValueError, match="loader"):
        train_epoch(model, iter([]), torch.optim.SGD(model.parameters(), lr=0.1), LOSS, device="cpu", progress=False)


def test_train_epoch_rejects_a_non_optimizer():
    with pytest.raises(TypeError, match="optimizer"):
        train_epoch(MLP(), [], "sgd", LOSS, device="cpu", progress=False)


def test_train_epoch_and_evaluate_name_a_model_left_on_another_device(digits):
    model = MLP().to("meta")  # parameters without storage: any device other than the one asked for
    with pytest.raises(ValueError, match=r"parameters are on meta; call model.to\('cpu'\) first"):
        train_epoch(
            model,
            make_loader(digits[1]),
            torch.optim.SGD(model.parameters(), lr=0.1),
            LOSS,
            device="cpu",
            progress=False,
        )
    with pytest.raises(ValueError, match=r"model.to\('cpu'\)"):
        evaluate(model, make_loader(digits[1]), LOSS, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA to put the model elsewhere")
def test_train_epoch_names_a_device_mismatch(digits):
    model = MLP()
    with pytest.raises(ValueError, match=r"model\.to"):
        train_epoch(
            model,
            make_loader(digits[1]),
            torch.optim.SGD(model.parameters(), lr=0.1),
            LOSS,
            device="cuda",
            progress=False,
        )


def test_evaluate_matches_scikit_learn_and_restores_the_mode(digits):
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    seed_everything(0)
    model = MLP(dropout=0.5)
    model.train()
    loader = make_loader(digits[1], batch_size=100)
    result = evaluate(model, loader, LOSS, device="cpu")
    assert model.training
    model.eval()
    with torch.no_grad():
        logits = model(digits[1].images)
    predictions = logits.argmax(1).numpy()
    truth = digits[1].targets.numpy()
    assert result.accuracy == pytest.approx(accuracy_score(truth, predictions))
    assert result.f1_weighted == pytest.approx(f1_score(truth, predictions, average="weighted", zero_division=0))
    assert (result.confusion_matrix == confusion_matrix(truth, predictions)).all()
    assert result.loss == pytest.approx(LOSS(logits, digits[1].targets).item(), rel=1e-5)


def test_fit_returns_history_steps_scheduler_and_learns(digits):
    seed_everything(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    seen = []
    history = fit(
        model,
        make_loader(digits[0], batch_size=32, shuffle=True, seed=0),
        optimizer,
        LOSS,
        device="cpu",
        epochs=3,
        val_loader=make_loader(digits[1], batch_size=256),
        scheduler=scheduler,
        progress=False,
        on_epoch_end=seen.append,
    )
    assert [row["epoch"] for row in history] == [1, 2, 3] and seen == history
    assert [row["lr"] for row in history] == pytest.approx([0.05, 0.025, 0.0125])
    assert history[-1]["val_accuracy"] > 0.9
    assert history[-1]["optimizer_steps"] == len(make_loader(digits[0], batch_size=32))


@pytest.mark.parametrize(
    "kwargs, message", [({"epochs": 0}, "epochs"), ({"scheduler_interval": "batch"}, "scheduler_interval")]
)
def test_fit_bad_arguments(digits, kwargs, message):
    model = MLP()
    args = {"epochs": 1, **kwargs}
    with pytest.raises(ValueError, match=message):
        fit(
            model,
            make_loader(digits[1]),
            torch.optim.SGD(model.parameters(), lr=0.1),
            LOSS,
            device="cpu",
            progress=False,
            **args,
        )


@pytest.mark.parametrize("live_plot", [True, False])
def test_fit_ends_with_a_summary_line(digits, capsys, live_plot):
    """Progress bars and the live widget are lost in a saved notebook; the last line of text keeps the result:
    fit's own (with progress), or the LivePlot's when it is fit's per-epoch callback."""
    from helpers.plots import LivePlot

    model = MLP()
    with LivePlot(["train_loss", "val_loss", "val_accuracy"]) if live_plot else contextlib.nullcontext() as plot:
        history = fit(
            model,
            make_loader(digits[1], batch_size=128),
            torch.optim.SGD(model.parameters(), lr=0.1),
            LOSS,
            device="cpu",
            epochs=2,
            val_loader=make_loader(digits[1], batch_size=256),
            on_epoch_end=plot.update if live_plot else None,
            progress=not live_plot,
        )
    last = history[-1]
    metrics = (
        f"train_loss {last['train_loss']:.4g}, val_loss {last['val_loss']:.4g}, val_accuracy {last['val_accuracy']:.4g}"
    )
    expected = f"epoch 2: {metrics}" if live_plot else f"fit: 2 epoch(s); last epoch {metrics}"
    assert len(history) == 2 and capsys.readouterr().out.strip().splitlines() == [expected]


def test_scheduler_does_not_step_when_the_grad_scaler_skips():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    before = model.weight.detach().clone()
    poisoned = TensorDataset(torch.full((4, 4), float("inf")), torch.zeros(4, dtype=torch.long))
    train_epoch(
        model,
        make_loader(poisoned, batch_size=4),
        optimizer,
        LOSS,
        device="cpu",
        amp="fp16",
        scheduler=scheduler,
        progress=False,
    )
    assert torch.equal(model.weight.detach(), before)  # the step was skipped...
    assert optimizer.param_groups[0]["lr"] == 1.0  # ...and so was the schedule
    clean = TensorDataset(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
    train_epoch(
        model,
        make_loader(clean, batch_size=4),
        optimizer,
        LOSS,
        device="cpu",
        amp="fp16",
        scheduler=scheduler,
        progress=False,
    )
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_fit_evaluates_only_when_no_gradients_are_pending(digits):
    seed_everything(0)
    model = MLP()
    seen_in_eval = []  # has_pending_gradients at every evaluation forward
    model.register_forward_pre_hook(lambda m, _: None if m.training else seen_in_eval.append(has_pending_gradients(m)))
    loader = make_loader(Subset(digits[0], range(70)), batch_size=16)  # 5 micro-batches: groups of 2, 2 and 1
    val_loader = make_loader(digits[1], batch_size=256)
    history = fit(
        model, loader, torch.optim.SGD(model.parameters(), lr=0.1), LOSS, device="cpu", epochs=2,
        val_loader=val_loader, accumulation_steps=2, progress=False,
    )  # fmt: skip
    assert len(seen_in_eval) == 2 * len(val_loader) and not any(seen_in_eval)
    assert [row["optimizer_steps"] for row in history] == [3, 3]


def _uneven_data(samples: int = 10) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 64, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def test_train_epoch_puts_the_model_in_train_mode():
    """Mistake: train_epoch without model.train(), so a model left in eval mode trains without dropout."""
    model = MLP(dropout=0.5).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    train_epoch(
        model, make_loader(_uneven_data(), batch_size=4), optimizer, F.cross_entropy, device="cpu", progress=False
    )
    assert model.training


def test_the_epoch_loss_is_weighted_by_samples_not_a_mean_of_batch_means():
    """Mistake: the epoch's loss as the mean of the batch means (4, 4 and 2 samples here)."""
    torch.manual_seed(0)
    model, data = MLP(), _uneven_data(10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay put: every batch sees the same model
    result = train_epoch(
        model, make_loader(data, batch_size=4), optimizer, F.cross_entropy, device="cpu", progress=False
    )
    with torch.no_grad():
        whole = F.cross_entropy(model(data.tensors[0]), data.tensors[1]).item()
        batch_means = [F.cross_entropy(model(x), y).item() for x, y in make_loader(data, batch_size=4)]
    assert result.loss == pytest.approx(whole, rel=1e-6)
    assert abs(np.mean(batch_means) - whole) > 1e-4  # the mistake would give a different number


def test_evaluate_leaves_a_model_in_eval_mode_in_eval_mode():
    """Mistake: evaluate ends with model.train() instead of restoring the mode it found."""
    model = MLP().eval()
    evaluate(model, make_loader(_uneven_data(), batch_size=4), F.cross_entropy, device="cpu")
    assert not model.training


def test_precision_steps_train_copies_and_leave_the_model_alone():
    torch.manual_seed(0)
    model = MLP(64, (16,), 10)
    before = [p.detach().clone() for p in model.parameters()]
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    steps = precision_steps(model, inputs, targets, precisions=["fp32", "bf16", "fp16"], device="cpu")
    measured = measure(steps, device="cpu", repeat=2, warmup=1, saved_tensors=True, exclude=model)
    assert set(measured.results) == {"fp32", "bf16", "fp16"}
    assert all(len(r.seconds) == 2 and all(s > 0 for s in r.seconds) for r in measured.results.values())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert measured["bf16"].saved_bytes < measured["fp32"].saved_bytes  # 16-bit activations
    for bad in (["fp8"], [], "fp32"):
        with pytest.raises(ValueError, match="precisions must be"):
            precision_steps(model, inputs, targets, precisions=bad, device="cpu")


def test_a_tf32_step_is_the_fp32_step_run_with_tf32_products_and_puts_the_setting_back(monkeypatch):
    """'tf32': float32 without autocast, under compat.fp32_precision_as('tf32'). On the CPU TF32 changes nothing,
    so the step is made here with tf32_available patched, to see the setting during the step and after it."""
    from helpers import compat, loop

    seen = []

    def train_epoch(*args, **kwargs):  # the steps' train_epoch, noting the float32 setting while it runs
        seen.append(compat.fp32_precision())
        return real_train_epoch(*args, **kwargs)

    real_train_epoch = loop.train_epoch
    monkeypatch.setattr(loop, "train_epoch", train_epoch)
    monkeypatch.setattr(loop, "tf32_available", lambda device: (True, "TF32 here (patched)"))
    torch.manual_seed(0)
    model = MLP(64, (16,), 10)
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    before = compat.fp32_precision()
    steps = precision_steps(model, inputs, targets, precisions=["fp32", "tf32"], device="cpu")
    fp32, tf32 = steps["fp32"](), steps["tf32"]()
    assert seen == [before, {"matmul": "tf32", "conv": "tf32"}] and compat.fp32_precision() == before
    assert fp32.loss == tf32.loss and tf32.optimizer_steps == 1  # the same float32 step, no autocast


def test_notebook_05s_table_on_a_gpu_from_ampere_on_fp32_tf32_bf16_fp16_and_autocast_against_tf32(monkeypatch):
    """06's section 4 on an H100, rehearsed on the CPU: the four rows, and the 16-bit rows against tf32."""
    from helpers import loop

    monkeypatch.setattr(loop, "tf32_available", lambda device: (True, "TF32 here (patched)"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    compared = loop.precisions_for("cuda", tf32=True)
    assert compared == ["fp32", "tf32", "bf16", "fp16"]
    torch.manual_seed(0)
    model, inputs, targets = MLP(64, (16,), 10), torch.randn(8, 64), torch.randint(0, 10, (8,))
    steps = precision_steps(model, inputs, targets, precisions=compared, device="cpu")  # the CPU stands in
    m = measure(steps, device="cpu", repeat=2, warmup=1, saved_tensors=True, labels={"fp32": "fp32 (ieee)"})
    assert [row["variant"] for row in m.rows()] == ["fp32 (ieee)", "tf32", "bf16", "fp16"]
    assert m["tf32"].saved_bytes == m["fp32"].saved_bytes  # TF32 keeps float32 storage
    for name in ("bf16", "fp16"):
        assert "tf32" in m.conclusion(name, against="tf32") and m.time_ratio(name, against="tf32") > 0


def test_precision_steps_refuse_tf32_where_there_is_none():
    model, inputs, targets = MLP(64, (16,), 10), torch.randn(8, 64), torch.randint(0, 10, (8,))
    with pytest.raises(ValueError, match="precisions names 'tf32', but no TF32 on cpu"):
        precision_steps(model, inputs, targets, precisions=["fp32", "tf32"], device="cpu")


def test_in_fp32_precision_restores_the_setting_even_when_the_step_fails():
    from helpers import compat
    from helpers.loop import in_fp32_precision

    before = compat.fp32_precision()

    def failing():
        assert compat.fp32_precision() == {"matmul": "tf32", "conv": "tf32"}
        raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        in_fp32_precision(failing, "tf32")()
    assert compat.fp32_precision() == before
    assert in_fp32_precision(lambda: 7, "ieee")() == 7
    with pytest.raises(ValueError, match="mode must be one of"):
        in_fp32_precision(failing, "bf16")


def test_precision_steps_with_accumulation_make_one_step_from_micro_batches_holding_less_for_backward():
    from helpers.memory import saved_peak_bytes

    torch.manual_seed(0)
    model = MLP(64, (16,), 10)
    inputs, targets = torch.randn(8, 64), torch.randint(0, 10, (8,))
    whole = precision_steps(model, inputs, targets, precisions=["fp32"], device="cpu")["fp32"]
    micro = precision_steps(model, inputs, targets, precisions=["fp32"], device="cpu", accumulation_steps=4)["fp32"]
    done = micro()
    assert (done.micro_batches, done.optimizer_steps, done.samples) == (4, 1, 8)
    whole()
    trained = [step.args[0] for step in (whole, micro)]  # the copies each step trains (train_epoch's model)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*(m.parameters() for m in trained)))
    assert saved_peak_bytes(micro) < saved_peak_bytes(whole)
    with pytest.raises(ValueError, match="accumulation_steps must be"):
        precision_steps(model, inputs, targets, precisions=["fp32"], device="cpu", accumulation_steps=0)


def test_step_saved_bytes_meter_one_step_and_grow_by_the_same_bytes_per_sample():
    from helpers.loop import step_saved_bytes
    from helpers.memory import saved_peak_bytes

    torch.manual_seed(0)
    model = MLP(64, (16, 16), 10)
    inputs, targets = torch.randn(3, 64), torch.randint(0, 10, (3,))
    step = precision_steps(model, inputs, targets, precisions=["bf16"], device="cpu")["bf16"]
    assert step_saved_bytes(model, 3, "bf16", device="cpu") == saved_peak_bytes(step)  # the step's own meter
    one, two, three = (step_saved_bytes(model, n, "fp32", device="cpu") for n in (1, 2, 3))
    assert three - two == two - one == (64 + 16 + 16) * 4 + 10 * 4 + 8  # input, activations, log-probs, target
    low = [step_saved_bytes(model, n, "bf16", device="cpu") for n in (2, 3)]
    assert low[1] - low[0] < three - two  # bfloat16 keeps fewer bytes per sample
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        step_saved_bytes(model, 0, "fp32", device="cpu")
    with pytest.raises(ValueError, match="precisions must be"):
        step_saved_bytes(model, 1, "fp8", device="cpu")
