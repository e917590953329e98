"""The course models: a small MLP, a small CNN, and a deep Linear stack for memory lessons."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class MLP(nn.Sequential):
    """Flatten, then Linear -> [BatchNorm] -> ReLU -> [Dropout] per hidden layer, then a Linear head."""

    def __init__(self, in_features: int = 64, hidden: Sequence[int] = (128, 64), num_classes: int = 10,
                 *, dropout: float = 0.0, batch_norm: bool = False) -> None:
        _check_positive("in_features", in_features)
        _check_positive("num_classes", num_classes)
        for width in hidden:
            _check_positive("each hidden width", width)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        layers: list[nn.Module] = [nn.Flatten()]
        width_in = in_features
        for width in hidden:
            layers.append(nn.Linear(width_in, width))
            if batch_norm:
                layers.append(nn.BatchNorm1d(width))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width_in = width
        layers.append(nn.Linear(width_in, num_classes))
        super().__init__(*layers)


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks and a linear head; adaptive pooling lets it take 8x8 or 28x28 images alike."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, *, channels: int = 16,
                 dropout: float = 0.0) -> None:
        super().__init__()
        _check_positive("in_channels", in_channels)
        _check_positive("num_classes", num_classes)
        _check_positive("channels", channels)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * channels * 16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def deep_linear_stack(width: int = 256, depth: int = 16, *, bias: bool = True) -> nn.Sequential:
    """`depth` blocks of Linear(width, width) + ReLU, as one nn.Sequential (what checkpoint_sequential takes).

    With input x of shape [B, width], autograd saves B*width elements for the input and one more per
    ReLU output: (depth + 1) * B * width * element_size bytes of activations.
    """
    _check_positive("width", width)
    _check_positive("depth", depth)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements (only those with requires_grad when `trainable_only`)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
