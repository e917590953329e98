"""The course models (a small MLP, a small CNN, a deep Linear stack for memory lessons) and their optimizers:
one chosen by name, parameter groups with their own learning rates, frozen layers; torchvision's pretrained weights."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .checks import check_choice, check_int, check_positive_number, check_range


class MLP(nn.Sequential):
    """Flatten, then Linear -> [BatchNorm] -> ReLU -> [Dropout] per hidden layer, then a Linear head."""

    def __init__(
        self,
        in_features: int = 64,
        hidden: Sequence[int] = (128, 64),
        num_classes: int = 10,
        *,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        check_int("in_features", in_features)
        check_int("num_classes", num_classes)
        for width in hidden:
            check_int("each hidden width", width)
        check_range("dropout", dropout, 0, 1, high_open=True)
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

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, *, channels: int = 16, dropout: float = 0.0
    ) -> None:
        super().__init__()
        check_int("in_channels", in_channels)
        check_int("num_classes", num_classes)
        check_int("channels", channels)
        check_range("dropout", dropout, 0, 1, high_open=True)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.BatchNorm2d(2 * channels),
            nn.ReLU(),
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
    check_int("width", width)
    check_int("depth", depth)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width, bias=bias), nn.ReLU()]
    return nn.Sequential(*layers)


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements (only those with requires_grad when `trainable_only`)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
}


def optimizer_names() -> list[str]:
    """The names `make_optimizer` accepts, sorted."""
    return sorted(OPTIMIZERS)


def _check_lr(name: str, lr) -> float:
    check_positive_number(name, lr)
    return float(lr)


def make_optimizer(name: str, params: Iterable, lr: float, **kwargs) -> torch.optim.Optimizer:
    """The torch.optim optimizer called `name` ('sgd', 'adam', ...) over `params` (tensors or param-group dicts)."""
    if not isinstance(name, str) or name.lower() not in OPTIMIZERS:
        raise ValueError(f"optimizer name must be one of {optimizer_names()}, got {name!r}")
    lr = _check_lr("lr", lr)
    params = list(params)
    if not params:
        raise ValueError(
            "params must hold at least one tensor or parameter group, got none (are all parameters frozen?)"
        )
    return OPTIMIZERS[name.lower()](params, lr=lr, **kwargs)


def _set_trainable(module: nn.Module, trainable: bool) -> int:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    params = list(module.parameters())
    for param in params:
        param.requires_grad_(trainable)
    return len(params)


def freeze(module: nn.Module) -> int:
    """Stop training `module`: requires_grad=False on its parameters; return how many tensors were frozen."""
    return _set_trainable(module, False)


def unfreeze(module: nn.Module) -> int:
    """Train `module` again: requires_grad=True on its parameters; return how many tensors were unfrozen."""
    return _set_trainable(module, True)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of `model` that require gradients (what an optimizer should get after freezing)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return [param for param in model.parameters() if param.requires_grad]


def _belongs(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def parameter_groups(model: nn.Module, lrs: Mapping[str, float], *, trainable_only: bool = True) -> list[dict]:
    """Param groups for an optimizer: one per module-name prefix in `lrs` with that lr, then one with the rest.

    Prefixes are names from `model.named_parameters()` cut at a dot ('features', 'head.2', '1'). The last
    group has no 'lr' key, so it gets the optimizer's default; each group lists its `param_names`.
    Frozen parameters are left out unless `trainable_only=False`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(lrs, Mapping) or not lrs:
        raise ValueError(f"lrs must map at least one module-name prefix to a learning rate, got {lrs!r}")
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad or not trainable_only]
    groups: list[dict] = []
    claimed: set[str] = set()
    for prefix, lr in lrs.items():
        lr = _check_lr(f"lrs[{prefix!r}]", lr)
        matched = [(name, param) for name, param in named if _belongs(name, prefix)]
        if not matched:
            raise ValueError(
                f"prefix {prefix!r} in lrs matches no {'trainable ' if trainable_only else ''}parameter; "
                f"names start with {sorted({name.split('.')[0] for name, _ in named})}"
            )
        overlap = [name for name, _ in matched if name in claimed]
        if overlap:
            raise ValueError(f"prefix {prefix!r} in lrs claims parameters already in another group: {overlap}")
        claimed.update(name for name, _ in matched)
        groups.append(
            {"params": [param for _, param in matched], "lr": lr, "param_names": [name for name, _ in matched]}
        )
    rest = [(name, param) for name, param in named if name not in claimed]
    if rest:
        groups.append({"params": [param for _, param in rest], "param_names": [name for name, _ in rest]})
    return groups


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """The current learning rate of each parameter group."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return [group["lr"] for group in optimizer.param_groups]


def load_pretrained(name: str = "resnet18") -> nn.Module:
    """The torchvision model `name` with its default pretrained weights, downloaded once into the torch hub cache.

    Online, the first call downloads the weights into `torch.hub.get_dir()/checkpoints`; later calls read them
    from there. Offline with no cached file it raises ConnectionError naming the file, the cache folder and what
    to do (connect, or copy the file there).
    """
    import pickle
    from pathlib import Path
    from urllib.error import URLError
    from urllib.parse import urlparse

    from torchvision import models

    if not isinstance(name, str) or name not in models.list_models():
        raise ValueError(f"name must be a torchvision model name such as 'resnet18', got {name!r}")
    weights = models.get_model_weights(name).DEFAULT
    cache = Path(torch.hub.get_dir()) / "checkpoints"
    cached = cache / Path(urlparse(weights.url).path).name
    try:
        return models.get_model(name, weights=weights)
    except (URLError, OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:  # offline, or a bad file
        if cached.exists():
            raise RuntimeError(
                f"the cached weights {cached} could not be loaded ({type(error).__name__}: {error}); "
                "delete the file and run again to download it anew"
            ) from error
        raise ConnectionError(
            f"could not download the pretrained weights for {name} from {weights.url} "
            f"({type(error).__name__}: {error}). They would be cached as {cached} (torch.hub.get_dir() is "
            f"{torch.hub.get_dir()}). Connect to the internet and run again, or copy {cached.name} into {cache} "
            "from a machine that has it."
        ) from error


def optimizer_after_move(
    model: nn.Module,
    move: Callable[[nn.Module], object],
    name: str,
    options: Mapping[str, object] | None = None,
    load: str | None = None,
    *,
    batch: tuple[torch.Tensor, torch.Tensor],
    checkpoint: dict[str, Any] | None = None,
) -> dict[str, object]:
    """Build optimizer `name` over `model`, run `move(model)` (a `.to(...)`), then one step on `batch`: whether
    the move kept the Parameter objects, whether the optimizer held state as built, how its first step went, and
    whether per-element state was left on another dtype or device than the parameters. With `load` 'before' or
    'after', `checkpoint` (an optimizer state_dict) is loaded before or after the move."""
    check_choice("load", load, [None, "before", "after"])
    if load is not None and checkpoint is None:
        raise ValueError(f"load={load!r} needs a checkpoint: an optimizer state_dict to load")
    built = make_optimizer(name, model.parameters(), lr=0.01, **(options or {}))
    parameters, state_at_build = list(model.parameters()), len(built.state) > 0
    if load == "before" and checkpoint is not None:
        built.load_state_dict(checkpoint)
    move(model)
    if load == "after" and checkpoint is not None:
        built.load_state_dict(checkpoint)
    kept = all(a is b for a, b in zip(parameters, model.parameters()))
    first, (inputs, targets) = parameters[0], batch
    nn.functional.cross_entropy(model(inputs.to(first.device, first.dtype)), targets.to(first.device)).backward()
    try:
        built.step()
        outcome = "ok"
    except RuntimeError as error:
        outcome = f"RuntimeError: {str(error)[:40]}"
    state = [t for t in built.state[first].values() if t.dim() > 0]  # per-element state, not the step count
    behind = any(t.dtype != first.dtype or t.device != first.device for t in state)
    row = {"same Parameters": kept, "state at build": state_at_build, "first step": outcome}
    return row | {"state left behind": behind}
