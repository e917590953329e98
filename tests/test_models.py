import pytest
import torch

from helpers.models import MLP, SmallCNN, count_parameters, deep_linear_stack


def test_mlp_shapes_and_options():
    model = MLP(64, (32, 16), 10, dropout=0.2, batch_norm=True)
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    kinds = [type(m).__name__ for m in model]
    assert kinds.count("BatchNorm1d") == 2 and kinds.count("Dropout") == 2
    assert "Dropout" not in [type(m).__name__ for m in MLP()]


@pytest.mark.parametrize("size", [8, 28])
def test_cnn_takes_small_and_large_images(size):
    assert SmallCNN()(torch.randn(3, 1, size, size)).shape == (3, 10)


def test_deep_linear_stack_is_sequential_of_linear_relu():
    stack = deep_linear_stack(16, 3)
    assert len(stack) == 6
    assert stack(torch.randn(2, 16)).shape == (2, 16)
    assert count_parameters(stack) == 3 * (16 * 16 + 16)
    stack[0].weight.requires_grad_(False)
    assert count_parameters(stack, trainable_only=True) == 3 * (16 * 16 + 16) - 256


@pytest.mark.parametrize("factory, message", [
    (lambda: MLP(0), "in_features"), (lambda: MLP(hidden=(4, -1)), "hidden"), (lambda: MLP(dropout=1.0), "dropout"),
    (lambda: SmallCNN(num_classes=0), "num_classes"), (lambda: SmallCNN(dropout=-0.1), "dropout"),
    (lambda: deep_linear_stack(0, 2), "width"), (lambda: deep_linear_stack(4, 0), "depth"),
])
def test_models_reject_bad_sizes(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()
