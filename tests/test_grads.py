import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from helpers.grads import batch_gradient, flat_grad, gradient_error, gradient_of, max_abs_diff
from helpers.models import MLP

LOSS = nn.CrossEntropyLoss()


def _data(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def test_flat_grad_concatenates_in_parameter_order_and_fills_none_with_zeros():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model[0].weight.grad = torch.ones(2, 3)
    model[1].bias.grad = torch.full((1,), 5.0)
    vector = flat_grad(model)
    assert vector.shape == (6 + 2 + 2 + 1,)
    assert torch.equal(vector, torch.tensor([1.0] * 6 + [0.0] * 2 + [0.0] * 2 + [5.0]))
    assert torch.equal(flat_grad([model[1].bias]), torch.tensor([5.0]))


def test_flat_grad_bad_inputs():
    with pytest.raises(TypeError, match="single tensor"):
        flat_grad(torch.zeros(3))
    with pytest.raises(TypeError, match="model_or_params"):
        flat_grad(3)
    with pytest.raises(TypeError, match="model_or_params"):
        flat_grad([torch.zeros(1), "x"])
    with pytest.raises(ValueError, match="no parameters"):
        flat_grad(nn.ReLU())


def test_max_abs_diff():
    assert max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 1.0])) == 1.0
    assert max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        max_abs_diff(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="tensors"):
        max_abs_diff([1.0], torch.zeros(1))


def test_batch_gradient_clears_before_and_after():
    torch.manual_seed(0)
    model = MLP()
    x, y = _data(32)
    first = batch_gradient(model, LOSS, x, y)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(batch_gradient(model, LOSS, x, y), first)  # did not add up
    model.zero_grad(set_to_none=True)
    LOSS(model(x), y).backward()
    assert torch.allclose(flat_grad(model), first)


@pytest.mark.parametrize("batch, micro", [(64, 16), (64, 64), (48, 1), (60, 16), (10, 3)])
def test_sample_weighting_equals_the_big_batch_gradient(batch, micro):
    torch.manual_seed(batch + micro)
    model = MLP()
    x, y = _data(batch, seed=micro)
    full = batch_gradient(model, LOSS, x, y)
    accumulated = batch_gradient(model, LOSS, x, y, micro_batch_size=micro)
    assert torch.allclose(accumulated, full, rtol=1e-4, atol=1e-6), max_abs_diff(accumulated, full)
    assert all(p.grad is None for p in model.parameters())
    if micro < batch:  # the weights n_j / N matter: dividing by the number of micro-batches differs when uneven
        unweighted = [LOSS(model(a), b) for a, b in zip(x.split(micro), y.split(micro))]
        torch.stack(unweighted).mean().backward()
        naive = flat_grad(model)
        model.zero_grad(set_to_none=True)
        assert torch.allclose(naive, full, rtol=1e-4, atol=1e-6) == (batch % micro == 0)


def test_tuple_inputs_travel_together_into_each_micro_batch():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(64, 10)

        def forward(self, x, mask):
            return self.linear(x * mask)

    torch.manual_seed(0)
    model = Masked()
    x, y = _data(40)
    mask = (torch.rand(40, 64) > 0.5).float()
    full = batch_gradient(model, LOSS, (x, mask), y)
    accumulated = batch_gradient(model, LOSS, (x, mask), y, micro_batch_size=16)
    assert torch.allclose(accumulated, full, rtol=1e-4, atol=1e-6)


def test_batch_gradient_bad_inputs():
    model = MLP()
    x, y = _data(8)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int"):
        batch_gradient(model, LOSS, x, y, micro_batch_size=0)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int"):
        batch_gradient(model, LOSS, x, y, micro_batch_size=2.0)
    with pytest.raises(ValueError, match="same length"):
        batch_gradient(model, LOSS, x, y[:4], micro_batch_size=4)
    with pytest.raises(ValueError, match="at least one sample"):
        batch_gradient(model, LOSS, x[:0], y[:0], micro_batch_size=4)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        batch_gradient("model", LOSS, x, y, micro_batch_size=4)
    with pytest.raises(TypeError, match="inputs must be a tensor"):
        batch_gradient(model, LOSS, [x, 3], y)
    with pytest.raises(TypeError, match="targets must be a tensor"):
        batch_gradient(model, LOSS, x, [0] * 8)


def test_gradient_of_reads_what_run_left_in_grad_and_clears_before_and_after():
    torch.manual_seed(0)
    model = MLP()
    x, y = _data(12)
    LOSS(model(x), y).backward()  # a stale gradient: cleared before run
    twice = gradient_of(model, lambda: (LOSS(model(x), y).backward(), LOSS(model(x), y).backward()))
    assert all(p.grad is None for p in model.parameters())
    assert torch.allclose(twice, 2 * batch_gradient(model, LOSS, x, y))


def test_gradient_of_bad_inputs():
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        gradient_of(lambda: None, lambda: None)
    with pytest.raises(TypeError, match="run must be"):
        gradient_of(MLP(), None)


def _uneven_data(samples: int = 10) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 64, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def test_batch_gradient_starts_from_clean_gradients():
    """Mistake: batch_gradient adds to whatever .grad held from before."""
    torch.manual_seed(0)
    model, (inputs, targets) = MLP(), _uneven_data(10).tensors
    clean = batch_gradient(model, F.cross_entropy, inputs, targets).clone()
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 5.0)  # left over from some earlier backward
    assert torch.equal(batch_gradient(model, F.cross_entropy, inputs, targets), clean)


def test_gradient_error_is_the_largest_difference_relative_to_the_largest_exact_gradient():
    exact = torch.tensor([4.0, -2.0, 1.0], dtype=torch.float64)
    grad = torch.tensor([4.0, -2.0, 1.2])  # float32, off by 0.2 in the last element
    assert gradient_error(grad, exact) == pytest.approx(0.2 / 4.0)  # 0.2 against the largest exact value, 4
    assert gradient_error(exact, exact) == 0.0


def test_gradient_error_of_an_all_zero_exact_gradient_is_zero_or_infinite():
    assert gradient_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert gradient_error(torch.zeros(0), torch.zeros(0)) == 0.0
    assert gradient_error(torch.tensor([0.0, 1e-9]), torch.zeros(2)) == float("inf")


def test_gradient_error_refuses_other_shapes_and_non_tensors():
    with pytest.raises(ValueError, match="same shape"):
        gradient_error(torch.ones(2), torch.ones(3))
    with pytest.raises(TypeError, match="must be tensors"):
        gradient_error([1.0, 2.0], torch.ones(2))


def test_graph_nodes_finds_every_node_behind_the_tensors_once():
    from helpers.grads import graph_nodes

    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()  # SumBackward0 <- MulBackward0 <- AccumulateGrad (w)
    names = sorted(type(node).__name__ for node in graph_nodes([loss]))
    assert names == ["AccumulateGrad", "MulBackward0", "SumBackward0"]
    other = (w * 3).sum()  # a second graph on the same leaf: its AccumulateGrad node is shared
    assert len(graph_nodes([loss, other])) == 5


def test_graph_nodes_of_floats_and_no_grad_tensors_is_empty_and_a_single_tensor_is_refused():
    from helpers.grads import graph_nodes

    w = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        guarded = (w * 2).sum()
    assert graph_nodes([guarded, 1.5, (w * 2).sum().item()]) == set()
    with pytest.raises(TypeError, match="single tensor"):
        graph_nodes((w * 2).sum())
